"""scripts/checks/multi_gpu.sh and two_node_verl.sh refuse bad arguments up front, naming the value and what is
allowed (their GPU runs are reported by the scripts themselves; two_node_verl.sh also runs on CPU by hand:
``VERL_PLATFORM=cpu bash scripts/checks/two_node_verl.sh DIR 1 2``, about 3 minutes on 2 cores)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bash(script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", f"scripts/checks/{script}", *args], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, **env), timeout=60)  # fmt: skip


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["0"], {}, "GPUS_PER_NODE must be a positive integer, got '0'"),
        (["two"], {}, "GPUS_PER_NODE must be a positive integer, got 'two'"),
        (["1"], {"ARMS": "invariant vllm"}, "ARMS: unknown arm 'vllm' (invariant, fast)"),
        (["1"], {"ARMS": "fast"}, "ARMS must include invariant, got 'fast'"),
    ],
)
def test_two_node_verl_refuses_bad_arguments(tmp_path, args, env, message):
    out = _bash("two_node_verl.sh", str(tmp_path), *args, **env)
    assert out.returncode == 2 and message in out.stderr, out.stderr


def test_multi_gpu_refuses_an_unknown_item(tmp_path):
    out = _bash("multi_gpu.sh", str(tmp_path), "fsdp", "tp")
    assert out.returncode == 2 and "unknown item 'tp' (fsdp, pp, twonode)" in out.stderr, out.stderr
