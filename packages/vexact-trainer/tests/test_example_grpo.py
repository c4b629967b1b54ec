"""examples/getting_started/grpo.py keeps working: two GRPO steps on CPU with each rollout backend."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "getting_started"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"getting_started_{name}", EXAMPLE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("backend", ["invariant", "fast"])
def test_two_grpo_steps(tmp_path, backend):
    grpo = _load("grpo")
    out = tmp_path / f"{backend}.jsonl"
    cfg = grpo.RunConfig(device="cpu", rollout_backend=backend, steps=2, prompts_per_step=4, group_size=4, out=str(out))
    rows = grpo.run(cfg)
    logged = [json.loads(line) for line in out.read_text().splitlines()]
    assert logged == rows and [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert 0.0 <= r["reward"] <= 1.0 and r["skipped"] is None and r["grad_norm"] >= 0.0
    if backend == "invariant":
        assert all(r["k3_kl"] == 0.0 and r["mismatch_fraction"] == 0.0 for r in rows)
    else:  # the fast engine's logprobs differ from the invariant trainer's
        assert all(r["k3_kl"] > 0.0 and r["mismatch_fraction"] > 0.0 for r in rows)


def test_plot_writes_a_png(tmp_path):
    plot = _load("plot")
    rows = [{"step": i, "reward": i / 4, "k3_kl": 0.0, "mismatch_fraction": 0.0, "grad_norm": 1.0} for i in range(4)]
    png = plot.plot({"invariant": rows, "fast": rows}, tmp_path / "p.png", window=2)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
