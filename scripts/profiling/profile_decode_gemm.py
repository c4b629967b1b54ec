"""One decode-size linear under Nsight Compute: cuBLAS and the invariant matmul's forms, one launch each.

    ncu --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
        --section LaunchStats --section Occupancy --section SchedulerStats \
        python scripts/profiling/profile_decode_gemm.py [--rows 160] [--n 24576] [--k 4096] \
        [--forms 64x256x4x5,64x128x4x8]

The defaults are Qwen3-8B's grouped gate/up projection at 160 rows, where the invariant forms trail cuBLAS most
(``benchmarks/results/tune-decode-gemm-h200.txt``). Each kernel runs three times before the profiled range
(compiles, cuBLAS's heuristics), then once inside ``cudaProfilerStart`` / ``cudaProfilerStop``: cuBLAS first, then
each form (``BMxBNxWARPSxSTAGES``: the persistent TMA kernel's 5-value config, no warp specialisation). The launch's
name, grid, block, registers, DRAM and L2 throughput and warp stalls are ncu's; under ncu the clocks are locked, so
compare cycles, not microseconds. Needs a GPU with TMA (sm_90+).
"""

from __future__ import annotations

import argparse

import torch

from vexact_kernels.triton_ops import matmul as mm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=160, help="M: the decode step's requests")
    ap.add_argument("--n", type=int, default=24576, help="output features (8B gate_up: 2 x 12288)")
    ap.add_argument("--k", type=int, default=4096, help="input features")
    ap.add_argument("--forms", default="64x256x4x5,64x128x4x8", help="BMxBNxWARPSxSTAGES, comma-separated")
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        raise SystemExit("profile_decode_gemm.py: needs a CUDA GPU with TMA (sm_90 or newer)")
    forms = []
    for f in args.forms.split(","):
        bm, bn, warps, stages = (int(v) for v in f.split("x"))
        forms.append((bm, bn, warps, stages, False))
    torch.manual_seed(0)
    x = torch.randn(args.rows, args.k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(args.n, args.k, device="cuda", dtype=torch.bfloat16) * 0.02
    ref = mm.matmul(x, w)
    for cfg in forms:
        if not torch.equal(mm.matmul(x, w, config=cfg), ref):
            raise SystemExit(f"form {cfg} gave other bits than the default pick")

    def launches() -> None:  # cuBLAS, then each form
        torch.matmul(x, w.t())
        for cfg in forms:
            mm.matmul(x, w, config=cfg)

    for _ in range(3):
        launches()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    launches()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled: cuBLAS, then {', '.join(args.forms.split(','))} at M={args.rows}, N={args.n}, K={args.k}")


if __name__ == "__main__":
    main()
