from __future__ import annotations

import torch
from torch import nn

import vexact_kernels as vk


class Linear(nn.Module):
    """``y = x @ W.T (+ b)`` on vexact-kernels; weight layout is HF's ``[out, in]``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return vk.linear(x, self.weight, self.bias)
