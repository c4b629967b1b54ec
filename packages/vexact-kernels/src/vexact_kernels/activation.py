"""silu_and_mul: ``silu(gate) * up`` in fp32, cast once; clamped_swiglu: gpt-oss's clamped SwiGLU, likewise.

torch's CPU ``silu``/``sigmoid`` are not position-invariant (measured on torch 2.13: the same value gives a different
result in the vector body and in the scalar tail of a launch), so the invariant path builds silu from exp and
division, whose results were measured position-invariant (see tests/test_activation.py). On CUDA the ``invariant``
backend runs the same formula as a Triton kernel (``triton_ops/activation.py``, with a backward). The ``fast`` backend
is the mismatch baseline as transformers runs it: ``F.silu(gate) * up`` in the input dtype (two roundings in bf16).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import portable_math as pm
from ._backend import check_float, get_backend, invariant_device_check
from .triton_ops import use_triton


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    check_float("silu_and_mul", "gate", gate)
    if gate.shape != up.shape:
        raise ValueError(f"silu_and_mul: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape")
    if get_backend("activation") == "fast":
        # as transformers and vLLM run it: silu rounded to the input dtype, then the product rounded again
        return F.silu(gate) * up
    if use_triton(gate, up):
        from .triton_ops.activation import triton_silu_and_mul

        return triton_silu_and_mul(gate, up)
    invariant_device_check("silu_and_mul", gate, up)
    g = gate.float()
    return (g / (1.0 + pm.exp(-g)) * up.float()).to(gate.dtype)


# gpt-oss's clamped SwiGLU constants (transformers' GptOssExperts: alpha, limit)
SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0


def clamped_swiglu_torch(
    gate: torch.Tensor, up: torch.Tensor, alpha: float = SWIGLU_ALPHA, limit: float = SWIGLU_LIMIT
) -> torch.Tensor:
    """The clamped SwiGLU as transformers' ``GptOssExperts._apply_gate`` computes it, in the input dtype (torch's own
    sigmoid): the ``fast`` backend's arithmetic, on any device."""
    g = gate.clamp(min=None, max=limit)
    u = up.clamp(min=-limit, max=limit)
    return (u + 1) * (g * torch.sigmoid(g * alpha))


def clamped_swiglu(
    gate: torch.Tensor, up: torch.Tensor, alpha: float = SWIGLU_ALPHA, limit: float = SWIGLU_LIMIT
) -> torch.Tensor:
    """gpt-oss's activation: ``gate`` clamped above at ``limit``, ``up`` to ``[-limit, limit]``, then
    ``(up + 1) * (gate * sigmoid(gate * alpha))``, in fp32 on the invariant backend (sigmoid as
    ``1 / (1 + exp(-x))`` with the portable exp), cast once; the ``fast`` backend runs transformers' ops in the input
    dtype. Differentiable (the clamps pass no gradient outside their range). On CUDA tensors the invariant backend
    runs the same formula in Triton (``triton_ops/activation.py``, Triton's ``exp``)."""
    check_float("clamped_swiglu", "gate", gate)
    if gate.shape != up.shape:
        raise ValueError(f"clamped_swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape")
    if get_backend("activation") == "fast":
        return clamped_swiglu_torch(gate, up, alpha, limit)
    if use_triton(gate, up):
        from .triton_ops.activation import triton_clamped_swiglu

        return triton_clamped_swiglu(gate, up, alpha, limit)
    invariant_device_check("clamped_swiglu", gate, up)
    g = gate.float().clamp(max=limit)
    u = up.float().clamp(min=-limit, max=limit)
    glu = g * pm.sigmoid(g * alpha)
    return ((u + 1.0) * glu).to(gate.dtype)
