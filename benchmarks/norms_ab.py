"""A decode step's norm launches against another revision's, on the GPU: every output compared with
``torch.equal`` (the bits must not move without a version bump), and both timed in one run.

    git archive REV packages/vexact-kernels/src/vexact_kernels/triton_ops | tar -x -C BASE
    python benchmarks/norms_ab.py --baseline BASE/packages/vexact-kernels/src/vexact_kernels/triton_ops [--out FILE.md]

The baseline's ``triton_ops`` folder is loaded as a package of its own (``baseline_triton_ops``), so both revisions'
kernels run in one process. Compared: the residual add + RMSNorm and the plain RMSNorm (bf16, fp16, fp32 rows), the
q/k norm pair, and the q/k norm + rotary with and without the paged KV write (views of a grouped q/k/v tensor and
contiguous copies; bf16, and fp16/fp32 at three layouts), at 1-1,024 rows and the head layouts below. Times: one CUDA
graph replay per launch (median µs), bf16, the model layouts at 64-1,024 rows. Exit 1 when any output differs.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import sys
from functools import partial
from pathlib import Path

import torch

import vexact_kernels as vk
from vexact_kernels.triton_ops import rms_norm as current

EPS = 1e-6
# (name, hidden, q heads, kv heads, head_dim): Qwen3-1.7B, Qwen3-8B, Qwen3-30B-A3B, and odd ones for the bits
LAYOUTS = (
    ("1.7b", 2048, 16, 8, 128),
    ("8b", 4096, 32, 8, 128),
    ("30b-a3b", 2048, 32, 4, 128),
    ("hd64", 1024, 8, 2, 64),
    ("hd96", 1000, 6, 2, 96),
    ("hd80", 1280, 10, 2, 80),
)
TIMED = ("1.7b", "8b", "30b-a3b")
ROWS = (1, 3, 64, 128, 160, 256, 512, 1024)
PAGE = 16


def load_baseline(folder: Path):
    """The baseline revision's ``rms_norm`` module, from its ``triton_ops`` folder loaded as ``baseline_triton_ops``."""
    spec = importlib.util.spec_from_file_location(
        "baseline_triton_ops", folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    pkg = importlib.util.module_from_spec(spec)
    sys.modules["baseline_triton_ops"] = pkg
    spec.loader.exec_module(pkg)
    return importlib.import_module("baseline_triton_ops.rms_norm")


def _us(fn) -> float:
    import triton.testing

    fn()
    return triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3


def _qk_case(m, hq, hk, d, dtype, g):
    qkv = (3 * torch.randn(m, (hq + 2 * hk) * d, device="cuda", generator=g)).to(dtype)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    pages = -(-m // PAGE) + 1
    pos = torch.randint(0, 8192, (m,), device="cuda", generator=g)
    slots = torch.randperm(pages * PAGE, device="cuda", generator=g)[:m]
    if m > 2:
        slots[1] = -1  # a padding row: nothing stored
    return q.view(m, hq, d), k.view(m, hk, d), v.view(m, hk, d), pages, pos, slots


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", type=Path, required=True, help="the other revision's vexact_kernels/triton_ops")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/norms_ab.py needs a CUDA device", file=sys.stderr)
        return 2
    if not (args.baseline / "rms_norm.py").is_file():
        print(
            f"--baseline {args.baseline}: no rms_norm.py there (give the revision's triton_ops folder)", file=sys.stderr
        )
        return 2
    base = load_baseline(args.baseline)
    differ: list[str] = []

    def same(name, a, b):
        if not all(torch.equal(x, y) for x, y in zip(a, b, strict=True)):
            differ.append(name)

    lines = [
        f"# Norm launches against a baseline ({datetime.date.today().isoformat()}, {torch.cuda.get_device_name()})",
        "",
        "| layout | rows | add + norm µs, baseline / current | q/k norm + rotary + KV write µs, baseline / current |",
        "|---|---|---|---|",
    ]
    for name, h, hq, hk, d in LAYOUTS:
        g = torch.Generator(device="cuda").manual_seed(h)
        w = (1.0 + 0.1 * torch.randn(h, device="cuda", generator=g)).bfloat16()
        wq, wk = ((1.0 + 0.1 * torch.randn(d, device="cuda", generator=g)).bfloat16() for _ in range(2))
        cos, sin = (t.cuda() for t in vk.rope_cos_sin(d, 8192, 1e6))
        for m in ROWS:
            for dt in (torch.bfloat16, torch.float16, torch.float32):
                x, r = ((4 * torch.randn(m, h, device="cuda", generator=g)).to(dt) for _ in range(2))
                wd = w.to(dt)
                same(f"add {name} {m} {dt}", base._add_rms_norm(x, r, wd, EPS), current._add_rms_norm(x, r, wd, EPS))
                same(f"norm {name} {m} {dt}", base.rms_norm_fwd(x, wd, EPS, dt), current.rms_norm_fwd(x, wd, EPS, dt))
            for dt in (
                (torch.bfloat16, torch.float16, torch.float32)
                if name in ("1.7b", "hd64", "hd96")
                else (torch.bfloat16,)
            ):
                q, k, v, pages, pos, slots = _qk_case(m, hq, hk, d, dt, g)
                wqd, wkd = wq.to(dt), wk.to(dt)
                same(f"pair {name} {m} {dt}", base.rms_norm_fwd_pair(q, wqd, k, wkd, EPS, dt),
                     current.rms_norm_fwd_pair(q, wqd, k, wkd, EPS, dt))  # fmt: skip
                outs = []
                for mod in (base, current):
                    kc, vc = (torch.zeros(pages, PAGE, hk, d, device="cuda", dtype=dt) for _ in "kv")
                    written = mod.qk_norm_rotary_fwd(q, wqd, k, wkd, EPS, pos, cos, sin, (v, kc, vc, slots))
                    plain = mod.qk_norm_rotary_fwd(q, wqd, k, wkd, EPS, pos, cos, sin, None)
                    copies = mod.qk_norm_rotary_fwd(q.contiguous(), wqd, k.contiguous(), wkd, EPS, pos, cos, sin)
                    outs.append((*written, kc, vc, *plain, *copies))
                same(f"q/k {name} {m} {dt}", *outs)
            if name in TIMED and m >= 64:
                x, r = ((4 * torch.randn(m, h, device="cuda", generator=g)).bfloat16() for _ in range(2))
                q, k, v, pages, pos, slots = _qk_case(m, hq, hk, d, torch.bfloat16, g)
                kc, vc = (torch.zeros(pages, PAGE, hk, d, device="cuda", dtype=torch.bfloat16) for _ in "kv")
                write = (v, kc, vc, slots)
                add = [_us(partial(mod._add_rms_norm, x, r, w, EPS)) for mod in (base, current)]
                qk = [
                    _us(partial(mod.qk_norm_rotary_fwd, q, wq, k, wk, EPS, pos, cos, sin, write))
                    for mod in (base, current)
                ]
                lines.append(f"| {name} | {m} | {add[0]:.2f} / {add[1]:.2f} | {qk[0]:.2f} / {qk[1]:.2f} |")
                print(lines[-1], flush=True)
    verdict = "every output torch.equal to the baseline's" if not differ else f"{len(differ)} cases differ: {differ}"
    lines += ["", f"Bits: {verdict}.", ""]
    print(lines[-2])
    if args.out:
        args.out.write_text("\n".join(lines))
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
