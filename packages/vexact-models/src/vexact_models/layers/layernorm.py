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
