"""rms_norm: ``x * rsqrt(mean(x^2) + eps) * weight``, computed in fp32 and cast once.

Invariance: on the ``invariant`` backend each row's sum of squares is a fixed pairwise tree over the hidden size
(CPU reference) or a fixed blocked sum in one Triton program per row (CUDA, ``triton_ops/rms_norm.py``, with a
deterministic backward), so a row's output does not depend on the other rows. ``fast`` uses torch's own mean/rsqrt.
``add_rms_norm`` is a pre-norm block's residual add and the norm after it: the two ops' bits, in one launch on CUDA.
"""

from __future__ import annotations

import torch

from . import portable_math as pm
from ._backend import check_float, get_backend, invariant_device_check
from ._reduce import tree_sum
from .triton_ops import use_triton


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    check_float("rms_norm", "x", x)
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} does not match x's last dim {x.shape[-1]}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Normalise over the last dim of ``x`` (any leading shape); ``weight`` has the last dim's size."""
    _check(x, weight)
    out_dtype = out_dtype or x.dtype
    if get_backend("rms_norm") == "invariant" and use_triton(x, weight):
        from .triton_ops.rms_norm import triton_rms_norm

        return triton_rms_norm(x, weight, eps, out_dtype)
    xf = x.float()
    if get_backend("rms_norm") == "fast":
        var = xf.pow(2).mean(-1, keepdim=True)
        return (xf * torch.rsqrt(var + eps) * weight.float()).to(out_dtype)
    invariant_device_check("rms_norm", x, weight)
    var = tree_sum(xf * xf, dim=-1) / x.shape[-1]
    rstd = 1.0 / pm.sqrt(var + eps)  # correctly rounded on every CPU (portable_math)
    return (xf * rstd.unsqueeze(-1) * weight.float()).to(out_dtype)


def rms_norm_pair(
    x1: torch.Tensor,
    w1: torch.Tensor,
    x2: torch.Tensor,
    w2: torch.Tensor,
    eps: float,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x1, w1, eps), rms_norm(x2, w2, eps))``, bitwise; x1 and x2 share their last dim. On the
    ``invariant`` backend's CUDA path both in one launch (a layer's q_norm and k_norm: one kernel fewer)."""
    if x1.shape[-1] == x2.shape[-1] and get_backend("rms_norm") == "invariant" and use_triton(x1, w1, x2, w2):
        from .triton_ops.rms_norm import triton_rms_norm_pair

        _check(x1, w1)
        _check(x2, w2)
        return triton_rms_norm_pair(x1, w1, x2, w2, eps, out_dtype)
    return rms_norm(x1, w1, eps, out_dtype), rms_norm(x2, w2, eps, out_dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, rms_norm(s, weight, eps))`` with ``s = x + residual``, bitwise on every backend and device: ``s`` is
    torch's add (fp32 sum rounded once to x's dtype), the norm is :func:`rms_norm`'s. ``x`` and ``residual`` have one
    shape and dtype (no broadcast, no promotion). On the ``invariant`` backend's CUDA path both in one launch (a
    decoder layer's residual add and the norm after it: one kernel fewer), differentiable where autograd records."""
    _check(x, weight)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"add_rms_norm: residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}"
        )
    if get_backend("rms_norm") == "invariant" and use_triton(x, residual, weight):
        from .triton_ops.rms_norm import triton_add_rms_norm

        return triton_add_rms_norm(x, residual, weight, eps)
    s = x + residual
    return s, rms_norm(s, weight, eps)
