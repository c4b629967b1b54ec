"""Kernel benchmark: invariant kernels vs their torch baselines, measured side by side in one run on the GPU.

    PYTHONPATH=... python benchmarks/kernels.py [--only linear,rms_norm,logprobs] [--out FILE.md]

Prints markdown tables (throughput and the ratio invariant / baseline) and writes them to --out with the date,
GPU and torch/triton versions.
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys

import torch
import triton
import triton.testing

import vexact_kernels as vk

M_VALUES = (1, 8, 64, 256, 1024, 4096, 16384)
# (name, N, K): K = N = 4096 and the projection shapes of Qwen3-1.7B (hidden 2048, 16x128 q heads, 8x128 kv heads,
# intermediate 6144) and Qwen3-8B (hidden 4096, 32x128 q heads, 8x128 kv heads, intermediate 12288).
LINEAR_SHAPES = (
    ("square 4096", 4096, 4096),
    ("1.7B q/o", 2048, 2048),
    ("1.7B k/v", 1024, 2048),
    ("1.7B gate/up", 6144, 2048),
    ("1.7B down", 2048, 6144),
    ("8B k/v", 1024, 4096),
    ("8B gate/up", 12288, 4096),
    ("8B down", 4096, 12288),
)


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100)


def bench_linear(lines: list[str]) -> None:
    lines += ["## linear (bf16): invariant Triton matmul vs cuBLAS (`F.linear`)", ""]
    lines += ["| shape | M | N | K | invariant TFLOP/s | cuBLAS TFLOP/s | ratio |", "|---|---|---|---|---|---|---|"]
    small, large = [], []
    for name, n, k in LINEAR_SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in M_VALUES:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t_inv = _ms(lambda x=x, w=w: vk.linear(x, w))
            t_ref = _ms(lambda x=x, w=w: torch.nn.functional.linear(x, w))
            flops = 2 * m * n * k
            ratio = t_ref / t_inv
            (small if m <= 64 else large if m >= 4096 else []).append(ratio)
            lines.append(
                f"| {name} | {m} | {n} | {k} | {flops / t_inv / 1e9:.1f} | {flops / t_ref / 1e9:.1f} | {ratio:.2f} |"
            )
    gm = lambda r: math.exp(sum(map(math.log, r)) / len(r))  # noqa: E731
    lines += [
        "",
        f"geometric mean ratio, M <= 64: {gm(small):.2f} (goal >= 0.85); M >= 4096: {gm(large):.2f} (goal >= 0.90); "
        f"min M <= 64: {min(small):.2f}, min M >= 4096: {min(large):.2f}",
        "",
    ]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA device", file=sys.stderr)
        return 2
    wanted = set(filter(None, args.only.split(",")))
    lines = [
        f"# Kernel benchmark ({datetime.date.today().isoformat()})",
        "",
        f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; triton {triton.__version__}; "
        "timings by triton.testing.do_bench (median ms), invariant and baseline measured side by side in one run.",
        "",
    ]
    sections = {"linear": bench_linear}
    for name in ("rms_norm", "logprobs"):
        fn = globals().get(f"bench_{name}")
        if fn is not None:
            sections[name] = fn
    print("\n".join(lines), flush=True)
    for name, fn in sections.items():
        if not wanted or name in wanted:
            start = len(lines)
            fn(lines)
            print("\n".join(lines[start:]), flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
