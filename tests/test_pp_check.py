"""scripts/checks/pp_check.py, the pipeline-parallel check that runs on two or more GPUs (torchrun, NCCL; one stage per
rank), run here over gloo on CPU with the tiny shape at 2 and 4 stages, so the script itself is tested (its
comparisons, the perturbed boundary that must be caught, the sleep / wake / update_weights phase) before a multi-GPU
machine runs it. The gpu-marked twins run it on two and four GPUs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, stages: int = 2) -> subprocess.CompletedProcess:
    srcs = [str(p) for p in sorted((ROOT / "packages").glob("*/src"))]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([*srcs, str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(stages)]
    script = "scripts/checks/pp_check.py"
    return subprocess.run([*cmd, script, *args], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=900)  # fmt: skip


def _check(out: subprocess.CompletedProcess, n: int, stages: list[str] | None = None) -> None:
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    if stages is not None:
        assert f"layers per stage: {stages}" in out.stdout, out.stdout[-3000:]
    assert f"pipeline == one device (tokens and logprobs, torch.equal): {n}/{n} requests" in out.stdout
    assert "perturbed pipeline (last-bit-flipped boundary) differs from one device in 0/" not in out.stdout
    assert f"after sleep(1) + wake_up: pipeline == one device in {n}/{n} requests" in out.stdout
    assert f"one device with the new weights in {n}/{n} requests" in out.stdout and "all: True" in out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["tiny", "tiny-tied"])
def test_pp_check_passes_on_cpu_over_gloo(shape):
    _check(_run("--device", "cpu", "--shape", shape, "--prompts", "6"), 6)


@pytest.mark.slow
def test_pp_check_passes_at_four_stages_on_cpu():
    """Four stages of one layer each: three boundaries (each one perturbed) and weights sent through every stage."""
    out = _run("--device", "cpu", "--shape", "tiny", "--prompts", "3", stages=4)
    _check(out, 3, ["0-0", "1-1", "2-2", "3-3"])


@pytest.mark.gpu
def test_pp_check_passes_on_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs for a pipeline of two stages; {torch.cuda.device_count()} visible")
    _check(_run("--shape", "0.6b", "--layers", "8", "--prompts", "32"), 32)


@pytest.mark.gpu
def test_pp_check_passes_on_four_gpus():
    if torch.cuda.device_count() < 4:
        pytest.skip(f"needs 4 GPUs for a pipeline of four stages; {torch.cuda.device_count()} visible")
    _check(_run("--shape", "0.6b", "--layers", "8", "--prompts", "32", stages=4), 32, ["0-1", "2-3", "4-5", "6-7"])
