"""linear: ``y = x @ W.T (+ b)``.

Invariance: on the ``invariant`` backend, row ``i`` of the result is bitwise the same for any number of rows M, any
other rows in the batch and any row chunking. fp32 accumulation: the K dimension is reduced in blocks of
``LINEAR_BLOCK_K`` (a pairwise tree inside a block, blocks added in K order); products of bf16 inputs are exact in
fp32. The ``fast`` backend is ``torch.nn.functional.linear`` in the input dtype, as HF and vLLM run it (bf16 in,
bf16 out, also for logits), kept as the mismatch baseline (measured on torch 2.13 CPU: its fp32 row 0 differs
between M = 1 and M >= 2).

On CUDA the invariant kernel has several forms (tiles, K splits as programs of their own) that give the same bits;
which runs is a speed choice, by shape, or timed on the running GPU: :func:`record_linears`, :func:`tune_linears` and
:func:`linear_picks` (``triton_ops/matmul_tuning.py``; the engine's ``EngineConfig.tune_linears``).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from ._backend import check_float, get_backend
from ._reduce import tree_sum
from .triton_ops import use_triton

LINEAR_BLOCK_K = 32
# The least rows of a matmul whose form is timed per shape (``triton_ops.matmul.TUNE_MIN_M``; below it the
# pointer kernel's pick by shape stands).
LINEAR_TUNE_MIN_M = 128
# Rows per step of the CPU reference; bounds the [rows, BLOCK_K, N] product buffer. Does not affect numerics.
_ROW_BUDGET = 1 << 22


def _linear_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    xf = x.float()
    wt = weight.float().t()  # [K, N]
    out = torch.empty(m, n, dtype=torch.float32)
    rows = max(1, _ROW_BUDGET // max(1, LINEAR_BLOCK_K * n))
    for r0 in range(0, m, rows):
        xr = xf[r0 : r0 + rows]
        acc = None
        for k0 in range(0, k, LINEAR_BLOCK_K):
            kb = min(LINEAR_BLOCK_K, k - k0)
            prod = xr[:, k0 : k0 + kb, None] * wt[None, k0 : k0 + kb, :]  # [rows, kb, N]
            part = tree_sum(prod, dim=1)
            acc = part if acc is None else acc + part
        out[r0 : r0 + rows] = acc
    return out


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x [..., K] @ weight[N, K].T + bias`` -> ``[..., N]`` in ``out_dtype`` (default: x's dtype)."""
    check_float("linear", "x", x)
    check_float("linear", "weight", weight)
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"linear: x has K={x.shape[-1]} but weight is {tuple(weight.shape)} (expected [N, K])")
    out_dtype = out_dtype or x.dtype
    if get_backend("linear") == "fast":
        y = F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
        return y.to(out_dtype)
    if use_triton(x, weight):
        from .triton_ops import matmul

        if weight.dtype != x.dtype:
            raise TypeError(f"linear: weight {weight.dtype} != x {x.dtype}; the invariant kernel takes one dtype")
        return matmul.linear(x, weight, bias, out_dtype)
    lead = x.shape[:-1]
    y = _linear_reference(x.reshape(-1, x.shape[-1]), weight)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype).reshape(*lead, weight.shape[0])


def record_linears(min_m: int | None = None):
    """Context manager yielding a list: the CUDA matmuls of ``linear`` run within that a per-shape pick could take,
    as ``(M, N, K, dtype, weight)``, those of at least ``min_m`` rows (default ``LINEAR_TUNE_MIN_M``)
    (``triton_ops.matmul_tuning.record_linears``)."""
    from .triton_ops import matmul_tuning

    return matmul_tuning.record_linears(min_m)


def tune_linears(calls: list) -> tuple[dict, dict]:
    """``(picks, report)``: the fastest form of each recorded shape on this GPU, timed over the recorded weights
    (``triton_ops.matmul_tuning.tune_linears``); ``{}, {}`` for no calls."""
    if not calls:
        return {}, {}
    from .triton_ops import matmul_tuning

    return matmul_tuning.tune_linears(calls)


def linear_picks(picks: dict | None):
    """Context manager: within, CUDA matmuls of a shape in ``picks`` run its picked form (the same bits)."""
    if not picks:
        return contextlib.nullcontext()
    from .triton_ops import matmul_tuning

    return matmul_tuning.linear_picks(picks)
