"""scripts/tuning/kernel_regs.py compiles the Triton kernels for a GPU on this CPU machine (a stand-in driver, every
launch a compile) and reads ptxas's registers and spills: run here on the fused draw, where it must show the TMA split
kernel without spills and the noise kernel; on an arch before TMA, where the same call compiles the pointer path; and on
sm_100, where the draw must compile at all."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vexact_kernels.triton_ops import triton_available

ROOT = Path(__file__).resolve().parents[1]


def _rows(arch: int) -> dict[str, tuple[int, int]]:
    """kernel -> (registers, stack bytes) of the 'logprobs: draw T=256' call."""
    srcs = [str(p) for p in sorted((ROOT / "packages").glob("*/src"))]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([*srcs, str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    cmd = ["scripts/tuning/kernel_regs.py", "--arch", str(arch), "--only", "logprobs", "--match", "draw T=256"]
    out = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = re.findall(r"\| logprobs: draw T=256 \| (\w+) \| \d+ \| \d+ \| (\d+) \| (\d+)", out.stdout)
    return {name: (int(regs), int(stack)) for name, regs, stack in rows}


@pytest.mark.skipif(not triton_available(), reason="needs triton (its ptxas)")
def test_kernel_regs_reads_ptxas_registers_and_spills_without_a_gpu():
    hopper = _rows(90)
    assert set(hopper) == {"_gumbel_noise_kernel", "_logprobs_fwd_split_kernel", "_logprobs_fwd_combine_kernel"}
    assert all(0 < regs <= 255 for regs, _ in hopper.values())
    assert hopper["_logprobs_fwd_split_kernel"][1] == 0  # the TMA draw does not spill
    ampere = _rows(80)  # no TMA: pointer tiles, another compiled kernel, which does spill at 64 draw rows
    assert ampere["_logprobs_fwd_split_kernel"][1] > 0
    # sm_100 (B200): Triton 3.6 cannot compile the tile skip's data-dependent branch there; without the skip the
    # draw compiles (before: "PassManager::run failed" and no row)
    assert set(_rows(100)) == set(hopper)
