"""benchmarks/parallel_throughput.py (one MoE replica over several GPUs: EP against PP, one GPU and vLLM) run here over
gloo on CPU with the tiny Qwen3-MoE shape at 2 ranks, so the script's wiring (the modes, the shared workload, the
token count each mode must produce, the results file) is tested before a multi-GPU machine runs it; and its refusals
of bad input."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import parallel_throughput as pt  # noqa: E402

SMOKE = ["--device", "cpu", "--model", "tiny-qwen3-moe", "--layers", "2", "--num-prompts", "5", "--prompt-len", "4",
         "9", "--gen-len", "3", "6", "--max-num-seqs", "2,4", "--max-num-batched-tokens", "32", "--num-kv-blocks",
         "64", "--block-size", "4", "--enforce-eager"]  # fmt: skip


def test_every_mode_runs_the_whole_workload_on_two_gloo_ranks(tmp_path):
    srcs = [str(p) for p in sorted((ROOT / "packages").glob("*/src"))]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([*srcs, str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    out_md = tmp_path / "parallel.md"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "benchmarks/parallel_throughput.py", *SMOKE, "--modes", "one,ep,pp,vllm", "--out", str(out_md)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    text = out_md.read_text()
    for head in ("- Date:", "- GPU: 2x CPU", "- Commit:", "- Command: `torchrun --standalone --nproc_per_node=2"):
        assert head in text
    for limit in (2, 4):
        section = text.split(f"## Batch limit {limit}")[1].split("##")[0]
        rows = {line.split("|")[1].strip(): line for line in section.splitlines() if line.startswith("| ")}
        assert {"one", "ep", "pp", "vllm"} <= rows.keys(), section
        assert "not run: vLLM needs CUDA" in rows["vllm"]
        assert rows["ep"].split("|")[2].strip() == "2" and rows["one"].split("|")[2].strip() == "1"
    # every mode produced the workload's tokens (run_mode raises otherwise); the printed runs say how many
    assert r.stdout.count('"tokens": ') == 6, r.stdout[-2000:]
    assert "ep/one at limit 4:" in text and "ep/pp at limit 4:" in text


def _check(argv: list[str], world: int = 2):
    ap = pt.arg_parser()
    return pt.check_args(ap, ap.parse_args(argv), world)


@pytest.mark.parametrize(
    "argv, world, message",
    [
        (["--model", "1.7b"], 2, "--model: '1.7b' is not a MoE shape"),
        (["--modes", "ep,tp"], 2, "--modes: unknown ['tp']"),
        (["--max-num-seqs", "256,3"], 2, "each limit must be a multiple of the 2 ranks"),
        (["--max-num-seqs", "a"], 2, "--max-num-seqs: comma-separated integers, got 'a'"),
        ([], 1, "world size is 1"),
        (["--device", "cpu"], 2, "--num-kv-blocks"),
    ],
)
def test_bad_input_is_refused_by_name(argv, world, message, capsys):
    with pytest.raises(SystemExit):
        _check(argv, world)
    assert message in capsys.readouterr().err


def test_limits_are_the_replica_totals():
    assert _check(["--max-num-seqs", "256,512"]) == [256, 512]
    assert isinstance(pt.arg_parser().parse_args([]), argparse.Namespace)
