"""silu_and_mul in Triton, forward and backward: ``silu(gate) * up``, ``silu(g) = g / (1 + exp(-g))``, fp32, cast once.

Backward, with ``sig = 1 / (1 + exp(-g))``: ``d_up = dy * silu(g)``, ``d_gate = dy * up * sig * (1 + g * (1 - sig))``.

Invariance: elementwise; every element runs the same instruction sequence whatever its place in the launch (masking
is per lane, there is no vector-body/scalar-tail split), so a row's result does not depend on the other rows.
Divisions are ``div_rn`` (correctly rounded, as torch's) and ``exp`` is Triton's; FMA contraction is off, so the only
difference from the CPU reference is the ``exp`` implementation (a few fp32 ulps).
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
