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


def rms_norm_pair(norm_a: RMSNorm, a: torch.Tensor, norm_b: RMSNorm, b: torch.Tensor):
    """``(norm_a(a), norm_b(b))``, bitwise, in one kernel launch where the kernels allow it (a layer's q_norm and
    k_norm). Through the modules themselves where one has hooks of its own, the eps differ or autograd records."""
    hooked = any(m._forward_hooks or m._forward_pre_hooks for m in (norm_a, norm_b))
    if hooked or norm_a.eps != norm_b.eps or torch.is_grad_enabled():
        return norm_a(a), norm_b(b)
    return vk.rms_norm_pair(a, norm_a.weight, b, norm_b.weight, norm_a.eps)
