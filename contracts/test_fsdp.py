"""Contract: the FSDP2 trainer's logprobs == the unsharded model's == the engine's, torch.equal, at world sizes 1, 2,
4 and 8, before and after training steps whose bf16 weights are exported to the engine with ``update_weights``.

The checks live in ``contracts/fsdp_check.py`` (also the torchrun entry point for GPUs); here they run in-process
(world size 1) and under torchrun (gloo ranks on CPU, one GPU per rank with NCCL). On CPU the suite runs world size
2 only: world size 4 takes about 14 s a family over gloo on 2 cores (7 s at world size 2), too much for CI; run it by
hand with ``python -m torch.distributed.run --standalone --nproc_per_node=4 -m contracts.fsdp_check --device cpu ...``
(the arguments of :func:`test_fsdp_wsn_equals_ws1_and_engine`). On GPUs each world size runs when that many GPUs are
visible. ``--perturb export-fp16`` shows the contract failing. Each
family runs: Qwen3, Qwen3-MoE (the tiny MoE's stacked experts are sharded with their decoder layer and exported one
tensor per expert; at world size 2 with the router's load-balancing loss on, which no rank split may change) and
DeepSeek-V3 (MLA, grouped routing with the score-correction bias, shared experts).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from contracts import fsdp_check
from contracts.harness import skip_on_gpu

ROOT = Path(__file__).resolve().parents[1]


def _torchrun(nproc: int, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    paths = [str(p) for p in sorted(ROOT.glob("packages/*/src"))] + [str(ROOT / "src"), str(ROOT)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.environ.get("PYTHONPATH", ""), *paths]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += ["-m", "contracts.fsdp_check", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


FAMILIES = ["qwen3", "qwen3_moe", "deepseek_v3"]
# gpt-oss at world size 1 (its experts sharded with their layer and exported stacked)
WS1_FAMILIES = [*FAMILIES, "gpt_oss"]


def _model_for(device: str, family: str = "qwen3") -> str:
    # the MoE families run their tiny checkpoints on GPU too: a real MoE shape's fp32 master does not fit one device
    # at world size 1
    if family == "qwen3_moe":
        return "tiny-moe"
    if family == "deepseek_v3":
        return "tiny-ds"
    if family == "gpt_oss":
        return "tiny-gpt-oss"
    return "tiny" if device == "cpu" else "qwen3-0.6b"


@pytest.mark.parametrize("family", WS1_FAMILIES)
def test_fsdp_ws1_trainer_equals_unsharded_and_engine_through_updates(device, family, tmp_path):
    skip_on_gpu(family, device)
    summary = fsdp_check.run(model=_model_for(device, family), device=device, steps=2, out=tmp_path)
    assert summary["ok"], summary["checks"]
    assert len([k for k in summary["checks"] if k.startswith("engine == trainer")]) == 3
    assert summary["checks"]["export == the engine's checkpoint names"]


@pytest.mark.parametrize("family", WS1_FAMILIES)
def test_fsdp_contract_fails_when_the_export_rounds_differently(device, family):
    """Sending the weights rounded through fp16 (not the bf16 the forward used) breaks engine == trainer."""
    skip_on_gpu(family, device)
    summary = fsdp_check.run(model=_model_for(device, family), device=device, steps=1, perturb="export-fp16")
    checks = summary["checks"]
    assert checks["engine == trainer (round 0)"] and not checks["engine == trainer (round 1)"]
    assert not summary["ok"]


# CPU (gloo on the CI's 2 cores) runs world size 2 only; see the module docstring
CPU_WORLD_SIZES = (2,)


@pytest.mark.parametrize("ws", [2, 4, 8])
@pytest.mark.parametrize("family", FAMILIES)
def test_fsdp_wsn_equals_ws1_and_engine(device, family, ws, tmp_path):
    """N ranks (gloo on CPU, NCCL on GPU): logprobs == the world-size-1 run's, and == the engine after updates."""
    if device == "cpu" and ws not in CPU_WORLD_SIZES:
        pytest.skip(f"world size {ws} on CPU is left to a run by hand (CI keeps {CPU_WORLD_SIZES}): see the docstring")
    if device == "cuda" and torch.cuda.device_count() < ws:
        pytest.skip(f"needs {ws} GPUs for world size {ws}; {torch.cuda.device_count()} visible")
    model = "tiny-tied" if device == "cpu" and family == "qwen3" else _model_for(device, family)  # tied: one param
    aux = 0.01 if family == "qwen3_moe" else 0.0  # the MoE step also carries the router's load-balancing loss
    fsdp_check.run(model=model, device=device, steps=1, out=tmp_path, router_aux_loss_coef=aux)  # ws1: probe, step 0
    # small micro-batches: the ranks get different numbers of them (rank 0 takes 60% of the 16 rollouts, the others
    # share the rest, at least one each), and one with fewer must still take part in every FSDP gather (it replays a
    # sequence with an all-zero mask)
    args = ["--model", model, "--device", device, "--steps", "2", "--out", str(tmp_path), "--micro-batch-tokens", "48"]
    proc = _torchrun(ws, *args, "--router-aux-loss-coef", str(aux))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / f"summary-ws{ws}.json").read_text())
    assert summary["world_size"] == ws and summary["ok"], summary["checks"]
    assert summary["checks"][f"ws{ws} == ws1 (probe logprobs)"]
    assert summary["checks"][f"ws{ws} step-0 loss and grad norm ~ ws1 (rel 1e-3)"]
    if aux:
        assert summary["checks"][f"ws{ws} step-0 router aux loss ~ ws1 (rel 1e-5)"]
    for step in summary["steps"]:
        counts = [tuple(c) for c in step["micro_batches_per_rank"]]
        assert len(counts) == ws and all(own >= 1 for own, _ in counts), counts  # every rank trains on its share
        # every rank runs the busiest rank's count of passes (> 1), and at least one rank pads to it with replays
        assert len({n for _, n in counts}) == 1 and counts[0][1] > 1 and any(own < n for own, n in counts), counts
