"""Triton kernels of the ``invariant`` backend (CUDA; on CPU only under ``TRITON_INTERPRET=1``, for tests).

One kernel family per module: ``matmul`` (linear fwd/bwd), ``rms_norm``, ``rotary``, ``activation``, ``logprobs``
(the fused draw's launch in ``sample``, its noise in ``gumbel``),
``attention`` (forward; its backward in ``attention_bwd``), ``moe``, ``moe_route``. Launch parameters that affect
numerics are module constants, never autotuned per shape.
"""

from __future__ import annotations

import os

import torch


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` of host integers. Launch code calls this, not ``triton.cdiv``: that is a constexpr function,
    whose every Python call costs about 1.5 us (a matmul launch made a dozen)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The least power of two >= ``n`` (1 for ``n <= 1``), host side, like ``cdiv``."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def use_triton(*tensors: torch.Tensor | None) -> bool:
    """Whether the invariant backend runs these tensors through Triton: CUDA tensors always do."""
    if any(t is not None and t.is_cuda for t in tensors):
        if not triton_available():
            raise ImportError("the invariant backend needs triton on CUDA tensors; pip install triton")
        return True
    return False


def qk_tile_fits(q: torch.Tensor) -> bool:
    """Whether ``rms_norm.qk_norm_rotary_fwd`` takes ``q``'s head size: a row of whole 16-byte vectors (``D % 16 ==
    0``) that one warp holds (at most 32 x 16 bytes), so a row's sum of squares in the ``[heads, D]`` tile runs the
    tree of the pair kernel's ``[RMS_BLOCK]`` row (each lane's vector in order, then the lanes' butterfly; the pair
    kernel's other lanes and warps add zeros). Other head sizes take the norm and the rotary as two launches. Needs no
    triton (the public op asks it before it picks a path)."""
    d = q.shape[-1]
    return d % 16 == 0 and d * q.element_size() <= 32 * 16
