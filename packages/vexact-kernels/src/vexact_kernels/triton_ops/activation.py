"""silu_and_mul in Triton, forward and backward: ``silu(gate) * up``, ``silu(g) = g / (1 + exp(-g))``, fp32, cast once.

Backward, with ``sig = 1 / (1 + exp(-g))``: ``d_up = dy * silu(g)``, ``d_gate = dy * up * sig * (1 + g * (1 - sig))``.

Invariance: elementwise; every element runs the same instruction sequence whatever its place in the launch (masking
is per lane, there is no vector-body/scalar-tail split), so a row's result does not depend on the other rows.
Divisions are ``div_rn`` (correctly rounded, as torch's) and ``exp`` is Triton's; FMA contraction is off, so the only
difference from the CPU reference is the ``exp`` implementation (a few fp32 ulps).

``glu_fwd``/``glu_bwd`` (the fused MoE with gpt-oss's options, and ``clamped_swiglu``): the same, or gpt-oss's clamped
SwiGLU (``gate`` clamped above at ``limit``, ``up`` to ``[-limit, limit]``, ``(up + 1) * (gate * sigmoid(gate *
alpha))``, the CPU reference's order), over gate/up columns of any stride (halves, or interleaved even/odd columns).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import cdiv

# Elementwise kernel: block size and warps only affect speed.
ACT_BLOCK = 1024
ACT_NUM_WARPS = 4


@triton.jit
def _block(n_cols, BLOCK: tl.constexpr):
    """The program's block: its row (program 0), its ``BLOCK`` columns (program 1) and their mask."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    return row, cols, cols < n_cols


@triton.jit
def _load_f32(ptr, row, stride, cols, mask):
    """``row``'s ``cols`` of a ``[rows, n_cols]`` tensor with row stride ``stride``, in fp32."""
    return tl.load(ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _silu_and_mul_fwd_kernel(
    g_ptr, u_ptr, o_ptr, n_cols, stride_g, stride_u, stride_o, BLOCK: tl.constexpr
):  # fmt: skip
    row, cols, mask = _block(n_cols, BLOCK)
    g = _load_f32(g_ptr, row, stride_g, cols, mask)
    u = _load_f32(u_ptr, row, stride_u, cols, mask)
    silu = tl.div_rn(g, 1.0 + tl.exp(-g))
    tl.store(o_ptr + row * stride_o + cols, (silu * u).to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_bwd_kernel(
    dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n_cols, stride_dy, stride_g, stride_u, stride_d, BLOCK: tl.constexpr
):  # fmt: skip
    row, cols, mask = _block(n_cols, BLOCK)
    dy = _load_f32(dy_ptr, row, stride_dy, cols, mask)
    g = _load_f32(g_ptr, row, stride_g, cols, mask)
    u = _load_f32(u_ptr, row, stride_u, cols, mask)
    sig = tl.div_rn(1.0, 1.0 + tl.exp(-g))
    silu = tl.div_rn(g, 1.0 + tl.exp(-g))
    du = dy * silu
    dg = dy * u * (sig * (1.0 + g * (1.0 - sig)))
    tl.store(dg_ptr + row * stride_d + cols, dg.to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + row * stride_d + cols, du.to(du_ptr.dtype.element_ty), mask=mask)


def _rows2d(t: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` -> ``[rows, n]`` with a unit last stride (a view where possible: halves of a gate_up tensor)."""
    t2 = t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _grid(rows: int, cols: int) -> tuple[int, int]:
    return rows, cdiv(cols, ACT_BLOCK)


def silu_and_mul_fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    g2, u2 = _rows2d(gate), _rows2d(up)
    rows, cols = g2.shape
    out = torch.empty(rows, cols, dtype=gate.dtype, device=gate.device)
    if out.numel():
        _silu_and_mul_fwd_kernel[_grid(rows, cols)](
            g2, u2, out, cols, g2.stride(0), u2.stride(0), out.stride(0), BLOCK=ACT_BLOCK,
            num_warps=ACT_NUM_WARPS, enable_fp_fusion=False,
        )  # fmt: skip
    return out.reshape(gate.shape)


def silu_and_mul_bwd(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d2, g2, u2 = _rows2d(dy), _rows2d(gate), _rows2d(up)
    rows, cols = g2.shape
    dg = torch.empty(rows, cols, dtype=gate.dtype, device=gate.device)
    du = torch.empty(rows, cols, dtype=up.dtype, device=up.device)
    if dg.numel():
        _silu_and_mul_bwd_kernel[_grid(rows, cols)](
            d2, g2, u2, dg, du, cols, d2.stride(0), g2.stride(0), u2.stride(0), dg.stride(0), BLOCK=ACT_BLOCK,
            num_warps=ACT_NUM_WARPS, enable_fp_fusion=False,
        )  # fmt: skip
    return dg.reshape(gate.shape), du.reshape(up.shape)


class SiluAndMulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return silu_and_mul_fwd(gate, up)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        return silu_and_mul_bwd(dy, gate, up)


def triton_silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in gate's dtype; autograd-aware."""
    if gate.device != up.device:
        raise ValueError(f"silu_and_mul: gate is on {gate.device} but up is on {up.device}")
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return SiluAndMulFunction.apply(gate, up)
    return silu_and_mul_fwd(gate, up)


@triton.jit
def _glu_fwd_kernel(
    g_ptr, u_ptr, o_ptr, n_cols, stride_g, stride_u, stride_o, col_g, col_u, alpha, limit,
    CLAMPED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """silu-and-mul or gpt-oss's clamped SwiGLU over gate/up columns of any stride (``col_g``/``col_u``: halves of a
    gate_up row at stride 1, or its even and odd columns at stride 2)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(g_ptr + row * stride_g + cols * col_g, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols * col_u, mask=mask, other=0.0).to(tl.float32)
    if CLAMPED:  # the CPU reference's order: clamps, glu = g * sigmoid(g * alpha), (u + 1) * glu
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        glu = g * tl.div_rn(1.0, 1.0 + tl.exp(-(g * alpha)))
        out = (u + 1.0) * glu
    else:
        out = tl.div_rn(g, 1.0 + tl.exp(-g)) * u
    tl.store(o_ptr + row * stride_o + cols, out.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _glu_bwd_kernel(
    dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n_cols, stride_dy, stride_g, stride_u, stride_d, col_g, col_u, alpha, limit,
    CLAMPED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """The backward of :func:`_glu_fwd_kernel`; ``dg``/``du`` written at the gate/up columns' own places. The clamps
    pass the gradient inside their range, bounds included (torch's ``clamp``)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dy = tl.load(dy_ptr + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * stride_g + cols * col_g, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols * col_u, mask=mask, other=0.0).to(tl.float32)
    if CLAMPED:
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        sig = tl.div_rn(1.0, 1.0 + tl.exp(-(gc * alpha)))
        glu = gc * sig
        du = tl.where((u >= -limit) & (u <= limit), dy * glu, 0.0)
        dg = (dy * (uc + 1.0)) * (sig + gc * alpha * sig * (1.0 - sig))
        dg = tl.where(g <= limit, dg, 0.0)
    else:
        sig = tl.div_rn(1.0, 1.0 + tl.exp(-g))
        du = dy * tl.div_rn(g, 1.0 + tl.exp(-g))
        dg = dy * u * (sig * (1.0 + g * (1.0 - sig)))
    tl.store(dg_ptr + row * stride_d + cols * col_g, dg.to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + row * stride_d + cols * col_u, du.to(du_ptr.dtype.element_ty), mask=mask)


def _gate_up_views(h: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """gate and up of a ``[rows, 2I]`` gate_up tensor: its halves, or (interleaved, gpt-oss) its even and odd
    columns."""
    inter = h.shape[1] // 2
    return (h[:, 0::2], h[:, 1::2]) if interleaved else (h[:, :inter], h[:, inter:])


def glu_fwd(h: torch.Tensor, interleaved: bool, clamped: bool, alpha: float, limit: float) -> torch.Tensor:
    """``[rows, I]`` in h's dtype from a ``[rows, 2I]`` gate_up tensor with a unit last stride: silu(gate) * up, or
    (``clamped``) the clamped SwiGLU; fp32 inside, cast once."""
    gate, up = _gate_up_views(h, interleaved)
    rows, cols = gate.shape
    out = torch.empty(rows, cols, dtype=h.dtype, device=h.device)
    if out.numel():
        _glu_fwd_kernel[_grid(rows, cols)](
            gate, up, out, cols, gate.stride(0), up.stride(0), out.stride(0), gate.stride(1), up.stride(1),
            alpha, limit, CLAMPED=clamped, BLOCK=ACT_BLOCK, num_warps=ACT_NUM_WARPS, enable_fp_fusion=False,
        )  # fmt: skip
    return out


def glu_bwd(dy: torch.Tensor, h: torch.Tensor, interleaved: bool, clamped: bool, alpha: float, limit: float):
    """``dh [rows, 2I]`` (h's layout and dtype) from ``dy [rows, I]``, the backward of :func:`glu_fwd`."""
    gate, up = _gate_up_views(h, interleaved)
    dh = torch.empty_like(h)
    dg, du = _gate_up_views(dh, interleaved)
    rows, cols = gate.shape
    dy = dy if dy.stride(-1) == 1 else dy.contiguous()
    if dh.numel():
        _glu_bwd_kernel[_grid(rows, cols)](
            dy, gate, up, dg, du, cols, dy.stride(0), gate.stride(0), up.stride(0), dh.stride(0), gate.stride(1),
            up.stride(1), alpha, limit, CLAMPED=clamped, BLOCK=ACT_BLOCK, num_warps=ACT_NUM_WARPS,
            enable_fp_fusion=False,
        )  # fmt: skip
    return dh


class ClampedSwigluFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, alpha, limit):
        h = torch.stack([gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1])], dim=2).flatten(1)
        ctx.save_for_backward(h)
        ctx.alpha, ctx.limit, ctx.shape = alpha, limit, gate.shape
        return glu_fwd(h, True, True, alpha, limit).reshape(gate.shape)

    @staticmethod
    def backward(ctx, dy):
        (h,) = ctx.saved_tensors
        dh = glu_bwd(dy.reshape(h.shape[0], -1), h, True, True, ctx.alpha, ctx.limit)
        return dh[:, 0::2].reshape(ctx.shape), dh[:, 1::2].reshape(ctx.shape), None, None


def triton_clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU in gate's dtype (fp32 inside, cast once); autograd-aware. Elementwise: a row's
    result is the same whatever else is in the launch."""
    if gate.device != up.device or gate.dtype != up.dtype:
        raise ValueError(f"clamped_swiglu: gate {gate.dtype} on {gate.device}, up {up.dtype} on {up.device}")
    return ClampedSwigluFunction.apply(gate, up, float(alpha), float(limit))
