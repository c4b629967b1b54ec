"""Check vexact's FA4 drivers against the real flash-attn-4 on a machine WITHOUT a GPU: under torch's FakeTensorMode
FA4's Python interface runs its own asserts, picks its tile config and compiles its CuTe-DSL kernels for sm_90a
(cross-compilation), but launches nothing. What it shows: the arguments ``vexact_kernels.fa4_attention`` passes
(packed, paged decode, paged chunks; int64 engine tables and lengths; several head shapes and page sizes, page 128 =
FA4's TMA path) are accepted and compile for Hopper. What it cannot show: numerics (no kernel runs) and the backward
(its DLPack conversion needs a CUDA build of torch).

Setup on a CPU machine (any CPython; wheels for that version, installed apart from the project's venv):
    python -m pip download --no-deps --only-binary=:all: -d /tmp/fa4w flash-attn-4==4.0.0b36 \
        nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 \
        nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5 apache-tvm-ffi==0.1.15.post2 \
        torch-c-dlpack-ext==0.1.5 cuda-bindings cuda-pathfinder einops
    python -m pip install --no-index --no-deps --target /tmp/fa4cpu /tmp/fa4w/*.whl
    PYTHONPATH=/tmp/fa4cpu/nvidia_cutlass_dsl/dsl_packages:/tmp/fa4cpu:<packages' src dirs> \
        python scripts/checks/fa4_fake_check.py            # about 4 minutes (each variant compiles for 5-25 s)
"""

from __future__ import annotations

import os
import sys
import time

# FA4's cross-compilation knobs (its interface docstring): kernel family, compile target, SM count for heuristics
os.environ.setdefault("FLASH_ATTENTION_ARCH", "sm_90")
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
os.environ.setdefault("FLASH_ATTENTION_NUM_SMS", "132")

import torch  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from vexact_kernels import fa4_attention as fa  # noqa: E402

# (Hq, Hkv, head_dim, page): Qwen3-8B's shape (page 16: cp.async path; 128: TMA path), the tiny checkpoints' shape
# at the contracts' page 8, MHA, and the contracts' 6/1 GQA at page 1
CONFIGS = [(32, 8, 128, 16), (32, 8, 128, 128), (4, 2, 16, 8), (16, 16, 128, 16), (6, 1, 16, 1)]


def main() -> int:
    fa.check_device = lambda op, device, capability=None: 9  # no device here: FA4 is told SM90 by the variables
    failures = 0

    def case(name, fn):
        nonlocal failures
        t0 = time.time()
        try:
            shape = tuple(fn().shape)
            print(f"OK   {name}: out {shape} ({time.time() - t0:.1f}s)", flush=True)
        except Exception as e:
            failures += 1
            print(f"FAIL {name}: {type(e).__name__}: {str(e)[:400]}", flush=True)

    def bf(*shape):
        return torch.randn(*shape, dtype=torch.bfloat16, device="cuda")

    def i64(vals):
        return torch.tensor(vals, dtype=torch.int64, device="cuda")

    with FakeTensorMode(allow_non_fake_inputs=True):
        for hq, hkv, d, page in CONFIGS:
            tag = f"[{hq}/{hkv} d{d} page {page}]"
            q, k, v = bf(138, hq, d), bf(138, hkv, d), bf(138, hkv, d)
            case(f"{tag} packed forward", lambda q=q, k=k, v=v: fa.attention_packed(q, k, v, i64([0, 100, 137, 138])))
            kc = torch.zeros(40, page, hkv, d, dtype=torch.bfloat16, device="cuda")
            tables = torch.zeros(3, 101 // page + 2, dtype=torch.int64, device="cuda")
            ctx = i64([100, 37, 1])
            decode_q, chunk_q = bf(3, hq, d), bf(61, hq, d)
            case(
                f"{tag} paged decode",
                lambda a=decode_q, c=kc, t=tables, x=ctx: fa.attention_paged(a, c, c, t, x, i64([0, 1, 2, 3])),
            )
            case(
                f"{tag} paged chunks",
                lambda a=chunk_q, c=kc, t=tables, x=ctx: fa.attention_paged(a, c, c, t, x, i64([0, 50, 60, 61])),
            )
    print(f"{'all passed' if not failures else f'{failures} failed'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
