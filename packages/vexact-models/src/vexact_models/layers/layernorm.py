from __future__ import annotations

import torch
from torch import nn

import vexact_kernels as vk


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return vk.rms_norm(x, self.weight, self.eps)


def _hooked(*modules: nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


def rms_norm_pair(norm_a: RMSNorm, a: torch.Tensor, norm_b: RMSNorm, b: torch.Tensor):
    """``(norm_a(a), norm_b(b))``, bitwise, in one kernel launch where the kernels allow it (a layer's q_norm and
    k_norm). Through the modules themselves where one has hooks of its own, the eps differ or autograd records."""
    if _hooked(norm_a, norm_b) or norm_a.eps != norm_b.eps or torch.is_grad_enabled():
        return norm_a(a), norm_b(b)
    return vk.rms_norm_pair(a, norm_a.weight, b, norm_b.weight, norm_a.eps)


def add_rms_norm(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, norm(s))`` with ``s = x + residual`` (``s = x`` where ``residual`` is None): a pre-norm block's residual
    add and the norm after it, bitwise the two ops, in one kernel launch where the kernels allow it, also under
    autograd (the trainer: ``vk.add_rms_norm`` is differentiable, the residual's gradient added inside the norm's
    backward). The add and then the module itself where the module has hooks."""
    if residual is None:
        return x, norm(x)
    if _hooked(norm):
        s = residual + x  # the stream first, as the blocks have always added (the same bits either way)
        return s, norm(s)
    return vk.add_rms_norm(x, residual, norm.weight, norm.eps)


def qk_norm_rotary(
    norm_q: RMSNorm, q: torch.Tensor, norm_k: RMSNorm, k: torch.Tensor, rotary: nn.Module, positions, kv_write=None
):
    """``rotary(positions, norm_q(q), norm_k(k))``, bitwise: a Qwen3 attention's q/k norms and rotary, in one kernel
    launch where the kernels allow it (``vexact_kernels.rms_norm_rotary_qk``). Through the modules themselves where
    one has hooks of its own, the eps differ or autograd records. ``kv_write``: ``(v, k_cache, v_cache,
    slot_mapping)``: the rotated k and ``v`` stored in the paged caches as well (``vk.write_kv_cache``; in the same
    launch where the kernels allow it)."""
    if _hooked(norm_q, norm_k, rotary) or norm_q.eps != norm_k.eps or torch.is_grad_enabled():
        q, k = rotary(positions, *rms_norm_pair(norm_q, q, norm_k, k))
        if kv_write is not None:
            vk.write_kv_cache(k, *kv_write)
        return q, k
    return vk.rms_norm_rotary_qk(
        q, norm_q.weight, k, norm_k.weight, norm_q.eps, positions, rotary.cos, rotary.sin, kv_write=kv_write
    )
