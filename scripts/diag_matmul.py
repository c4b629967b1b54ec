"""Which matmul variants agree bitwise? (pointer-kernel tiles vs persistent TMA tiles)"""

import torch

from vexact_kernels.triton_ops import matmul as mm

VARIANTS = {
    "ptr 16x32": (16, 32, 4, 6),
    "ptr 64x64": (64, 64, 4, 6),
    "ptr 128x128": (128, 128, 8, 3),
    "ptr 128x256": (128, 256, 8, 3),
    "tma 64x64": (64, 64, 4, 4, False),
    "tma 128x128": (128, 128, 8, 3, False),
    "tma 128x256 s2": (128, 256, 8, 2, False),
    "tma 128x128 ws": (128, 128, 8, 4, True),
}
torch.manual_seed(0)
for m, k, n in [(1, 4096, 4096), (1024, 4096, 4096), (777, 2048, 1000)]:
    a = torch.randn(m, k, device="cuda").bfloat16()
    w = torch.randn(n, k, device="cuda").bfloat16()
    outs = {name: mm.matmul(a, w, out_dtype=torch.float32, config=cfg) for name, cfg in VARIANTS.items()}
    ref = a.double() @ w.double().T
    names = list(outs)
    print(f"M={m} K={k} N={n}")
    for x in names:
        same = [y for y in names if torch.equal(outs[x], outs[y])]
        err = (outs[x].double() - ref).abs().max().item()
        print(f"  {x:16s} err vs fp64 {err:.3e}  equal to: {len(same)} of {len(names)}")
