"""examples/getting_started/grpo.py run twice: the same lines (all but the step's wall time) and the same final
weights; another seed gives other lines, so the comparison can see a difference."""

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]


def run(tmp_path: Path, name: str, seed: int) -> tuple[list[dict], dict]:
    out, save = tmp_path / f"{name}.jsonl", tmp_path / name
    cmd = [sys.executable, str(ROOT / "examples/getting_started/grpo.py"), "--steps", "3", "--prompts-per-step", "4",
           "--group-size", "4", "--seed", str(seed), "--quiet", "--device", "cpu", "--out", str(out),
           "--save", str(save)]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=tmp_path, capture_output=True, text=True)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    for row in rows:
        assert row.pop("seconds") > 0
    weights = {}
    for f in sorted(save.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    assert weights, f"no weights saved in {save}"
    return rows, weights


def test_grpo_rerun_gives_the_same_lines_and_weights(tmp_path):
    a_rows, a_w = run(tmp_path, "a", seed=0)
    b_rows, b_w = run(tmp_path, "b", seed=0)
    assert len(a_rows) == 3 and a_rows == b_rows  # every logged number with ==
    assert all(row["k3_kl"] == 0.0 for row in a_rows)
    assert a_w.keys() == b_w.keys()
    for name, t in a_w.items():
        assert torch.equal(t, b_w[name]), name
    c_rows, c_w = run(tmp_path, "c", seed=1)
    assert c_rows != a_rows
    assert any(not torch.equal(t, c_w[name]) for name, t in a_w.items())
