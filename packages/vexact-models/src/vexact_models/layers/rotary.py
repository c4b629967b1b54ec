from __future__ import annotations

import torch
from torch import nn

import vexact_kernels as vk


class RotaryEmbedding(nn.Module):
    """Holds the fp32 cos/sin table for every position up to ``max_position`` (a buffer, not a parameter)."""

    def __init__(self, head_dim: int, max_position: int, theta: float):
        super().__init__()
        cos, sin = vk.rope_cos_sin(head_dim, max_position, theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return vk.apply_rotary(q, positions, self.cos, self.sin), vk.apply_rotary(k, positions, self.cos, self.sin)
