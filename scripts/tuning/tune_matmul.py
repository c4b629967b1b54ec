"""Sweep tile configs of the invariant matmul on the GPU (speed only: BLOCK_K, hence the bits, never changes).

python scripts/tuning/tune_matmul.py   # prints, per shape, each config's time and the best one
"""

import torch
import triton.testing

from vexact_kernels.triton_ops import matmul as mm

SHAPES = [(m, n, k) for m in (1024, 4096, 16384) for n, k in ((4096, 4096), (1024, 2048), (2048, 6144), (12288, 4096))]
CANDIDATES = [
    (bm, bn, w, s)
    for bm, bn in ((16, 16), (16, 32), (16, 64), (32, 64), (64, 64), (64, 128), (128, 128), (128, 256), (256, 128))
    for w, s in ((4, 4), (4, 6), (8, 3), (8, 4))
    if not (bm * bn >= 128 * 256 and s > 4) and not (bm <= 32 and w == 8) and bm >= 64
] + [
    (bm, bn, w, s, ws)
    for bm, bn in ((128, 128), (128, 256), (256, 128))
    for w, s in ((4, 4), (8, 3), (8, 4))
    for ws in (False, True)
    if not (bm * bn >= 128 * 256 and s > 4)
]

for m, n, k in SHAPES:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    ref = triton.testing.do_bench(lambda a=a, w=w: torch.nn.functional.linear(a, w), warmup=10, rep=40)
    res = []
    for cfg in CANDIDATES:
        try:
            t = triton.testing.do_bench(lambda cfg=cfg, a=a, w=w: mm.matmul(a, w, config=cfg), warmup=10, rep=40)
        except Exception:  # out of shared memory etc.
            continue
        res.append((t, cfg))
    res.sort()
    top = ", ".join(f"{c}:{ref / t:.2f}" for t, c in res[:3])
    print(
        f"M={m:5d} N={n:5d} K={k:5d} cublas={ref * 1e3:8.1f}us best ratio {ref / res[0][0]:.2f}  top: {top}", flush=True
    )
