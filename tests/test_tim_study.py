"""examples/tim_study: the sweep's cells (correction x magnitude x seed) and its figure, on CPU in a few steps."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"tim_study_{name}", ROOT / "examples" / "tim_study" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sweep_runs_every_cell_per_seed_and_magnitude_zero_is_exact(tmp_path):
    out = tmp_path / "sweep.jsonl"
    args = ["--steps", "2", "--magnitudes", "0,0.1", "--corrections", "none", "--seeds", "0,1", "--out", str(out)]
    threads = torch.get_num_threads()
    try:
        _load("sweep").main(args)  # sets one CPU thread for its runs
    finally:
        torch.set_num_threads(threads)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted({(r["logit_noise_std"], r["seed"]) for r in rows}) == [(0.0, 0), (0.0, 1), (0.1, 0), (0.1, 1)]
    assert len(rows) == 8
    assert all(r["k3_kl"] == 0.0 for r in rows if r["logit_noise_std"] == 0.0)
    assert all(r["k3_kl"] > 0.0 for r in rows if r["logit_noise_std"] == 0.1)
    png = _load("plot").plot(str(out))
    assert png.is_file() and png.stat().st_size > 10_000
