"""Rotary position embedding (NeoX halves) in Triton, forward and backward.

``o1 = x1 * cos - x2 * sin``, ``o2 = x2 * cos + x1 * sin`` in fp32, cast once, with ``cos``/``sin`` read from the fp32
tables of :func:`vexact_kernels.rope_cos_sin` at each token's position. The backward is the same rotation by ``-sin``.

Invariance: purely elementwise per (token, head, pair); a token's output depends only on its values and its position.
``_rotary_pair_kernel`` rotates q's and k's heads in one launch (the engine's decode step) with the same per-head code.
The kernels are compiled with ``enable_fp_fusion=False`` so no multiply-add is contracted into an FMA: every product
and sum is a correctly rounded fp32 op, which makes the result bitwise equal to the CPU reference (``rotary.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from . import cdiv, next_pow2

# Heads per program; elementwise kernel, so this only affects speed.
ROPE_HEADS_BLOCK = 4
ROPE_NUM_WARPS = 4


@triton.jit
def _rotate_heads(
    x_ptr, pos_ptr, cos_ptr, sin_ptr, out_ptr, tok, hblock,
    n_heads, half, stride_xt, stride_xh, stride_ot, stride_oh, stride_tab,
    HEADS: tl.constexpr, HALF: tl.constexpr, NEG_SIN: tl.constexpr,
):  # fmt: skip
    heads = hblock * HEADS + tl.arange(0, HEADS)
    d = tl.arange(0, HALF)
    dmask = d < half
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    c = tl.load(cos_ptr + pos * stride_tab + d, mask=dmask, other=0.0)
    s = tl.load(sin_ptr + pos * stride_tab + d, mask=dmask, other=0.0)
    if NEG_SIN:
        s = -s
    mask = (heads[:, None] < n_heads) & dmask[None, :]
    x_off = tok * stride_xt + heads[:, None].to(tl.int64) * stride_xh + d[None, :]
    x1 = tl.load(x_ptr + x_off, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + x_off + half, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * c[None, :] - x2 * s[None, :]
    o2 = x2 * c[None, :] + x1 * s[None, :]
    o_off = tok * stride_ot + heads[:, None].to(tl.int64) * stride_oh + d[None, :]
    tl.store(out_ptr + o_off, o1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + o_off + half, o2.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_rn(x1, x2, c, s, INTERPRET: tl.constexpr):
    """One head's halves ``x1``, ``x2`` (fp32) rotated by ``c``, ``s`` as :func:`_rotate_heads` rotates them, for a
    kernel compiled with multiply-adds contracted (the norm before it needs that): each product and sum is an
    explicitly rounded op (libdevice's ``mul_rn`` / ``add_rn`` / ``sub_rn``, never fused), which is what the rotary
    kernels get from ``enable_fp_fusion=False``. Under the interpreter (``INTERPRET``) numpy's fp32 ops, unfused."""
    if INTERPRET:
        o1 = x1 * c - x2 * s
        o2 = x2 * c + x1 * s
    else:
        o1 = libdevice.sub_rn(libdevice.mul_rn(x1, c), libdevice.mul_rn(x2, s))
        o2 = libdevice.add_rn(libdevice.mul_rn(x2, c), libdevice.mul_rn(x1, s))
    return o1, o2


@triton.jit
def _rotary_kernel(
    x_ptr, pos_ptr, cos_ptr, sin_ptr, out_ptr,
    n_heads, half, stride_xt, stride_xh, stride_ot, stride_oh, stride_tab,
    HEADS: tl.constexpr, HALF: tl.constexpr, NEG_SIN: tl.constexpr,
):  # fmt: skip
    _rotate_heads(
        x_ptr, pos_ptr, cos_ptr, sin_ptr, out_ptr, tl.program_id(0).to(tl.int64), tl.program_id(1),
        n_heads, half, stride_xt, stride_xh, stride_ot, stride_oh, stride_tab, HEADS, HALF, NEG_SIN,
    )  # fmt: skip


@triton.jit
def _rotary_pair_kernel(
    q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, q_blocks,
    n_q_heads, n_k_heads, half, stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_tab,
    HEADS: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    """q's head blocks, then k's, in one launch: the same rotation of each head as :func:`_rotary_kernel`'s."""
    tok = tl.program_id(0).to(tl.int64)
    hblock = tl.program_id(1)
    if hblock < q_blocks:
        _rotate_heads(
            q_ptr, pos_ptr, cos_ptr, sin_ptr, qo_ptr, tok, hblock,
            n_q_heads, half, stride_qt, stride_qh, stride_qot, stride_qoh, stride_tab, HEADS, HALF, False,
        )  # fmt: skip
    else:
        _rotate_heads(
            k_ptr, pos_ptr, cos_ptr, sin_ptr, ko_ptr, tok, hblock - q_blocks,
            n_k_heads, half, stride_kt, stride_kh, stride_kot, stride_koh, stride_tab, HEADS, HALF, False,
        )  # fmt: skip


def rotary_launch(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """Rotate ``x [tokens, heads, head_dim]`` (any strides with a contiguous last dim); returns a new contiguous
    tensor in x's dtype. ``inverse`` rotates by ``-sin`` (the backward)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    tokens, n_heads, head_dim = x.shape
    half = head_dim // 2
    cos, sin, positions = cos.contiguous(), sin.contiguous(), positions.contiguous()
    out = torch.empty(tokens, n_heads, head_dim, dtype=x.dtype, device=x.device)
    if tokens and n_heads:
        grid = (tokens, cdiv(n_heads, ROPE_HEADS_BLOCK))
        _rotary_kernel[grid](
            x, positions, cos, sin, out,
            n_heads, half, x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos.stride(0),
            HEADS=ROPE_HEADS_BLOCK, HALF=next_pow2(half), NEG_SIN=inverse,
            num_warps=ROPE_NUM_WARPS, enable_fp_fusion=False,
        )  # fmt: skip
    return out


def rotary_pair_launch(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rotary_launch` of ``q [tokens, Hq, D]`` and of ``k [tokens, Hk, D]`` (same tokens, head_dim and dtype)
    in one launch; each output is bitwise what its own launch gives (the same per-element arithmetic)."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    tokens, hq, head_dim = q.shape
    hk = k.shape[1]
    half = head_dim // 2
    cos, sin, positions = cos.contiguous(), sin.contiguous(), positions.contiguous()
    qo = torch.empty(tokens, hq, head_dim, dtype=q.dtype, device=q.device)
    ko = torch.empty(tokens, hk, head_dim, dtype=k.dtype, device=k.device)
    q_blocks, k_blocks = cdiv(hq, ROPE_HEADS_BLOCK), cdiv(hk, ROPE_HEADS_BLOCK)
    if tokens and q_blocks + k_blocks:
        _rotary_pair_kernel[(tokens, q_blocks + k_blocks)](
            q, k, positions, cos, sin, qo, ko, q_blocks,
            hq, hk, half, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1), cos.stride(0),
            HEADS=ROPE_HEADS_BLOCK, HALF=next_pow2(half),
            num_warps=ROPE_NUM_WARPS, enable_fp_fusion=False,
        )  # fmt: skip
    return qo, ko


class RotaryFunction(torch.autograd.Function):
    """Autograd wrapper: the gradient of a rotation is the rotation by the opposite angle."""

    @staticmethod
    def forward(ctx, x, positions, cos, sin):
        ctx.save_for_backward(positions, cos, sin)
        return rotary_launch(x, positions, cos, sin)

    @staticmethod
    def backward(ctx, dy):
        positions, cos, sin = ctx.saved_tensors
        return rotary_launch(dy, positions, cos, sin, inverse=True), None, None, None


def _check_args(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if x.dim() != 3:
        raise ValueError(f"rotary: x must be [tokens, heads, head_dim]; got shape {tuple(x.shape)}")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise TypeError(f"rotary: cos/sin tables must be float32; got {cos.dtype} and {sin.dtype}")
    if cos.shape[-1] * 2 != x.shape[-1]:
        raise ValueError(f"rotary: table width {cos.shape[-1]} does not match head_dim {x.shape[-1]} / 2")
    if positions.shape != x.shape[:1]:
        raise ValueError(f"rotary: positions must have shape [{x.shape[0]}]; got {tuple(positions.shape)}")


def triton_apply_rotary(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary on ``x [tokens, heads, head_dim]`` with fp32 ``cos``/``sin`` tables; autograd-aware."""
    _check_args(x, positions, cos, sin)
    if torch.is_grad_enabled() and x.requires_grad:
        return RotaryFunction.apply(x, positions, cos, sin)
    return rotary_launch(x, positions, cos, sin)


def triton_apply_rotary_pair(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`triton_apply_rotary` of q and of k; one launch for both where neither records autograd and both share
    head_dim and dtype, else one each."""
    _check_args(q, positions, cos, sin)
    _check_args(k, positions, cos, sin)
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
    if grad or q.dtype != k.dtype or q.device != k.device:
        return triton_apply_rotary(q, positions, cos, sin), triton_apply_rotary(k, positions, cos, sin)
    return rotary_pair_launch(q, k, positions, cos, sin)
