from __future__ import annotations

import torch
from torch import nn

import vexact_kernels as vk


class SiluAndMul(nn.Module):
    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return vk.silu_and_mul(gate, up)
