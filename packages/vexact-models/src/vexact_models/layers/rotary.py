from __future__ import annotations

import math

import torch
from torch import nn

import vexact_kernels as vk


def yarn_cos_sin(head_dim: int, max_position: int, theta: float, yarn) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin tables ``[max_position, head_dim // 2]`` of YaRN rope (transformers' ``_compute_yarn_parameters``:
    inverse frequencies blended between interpolation and extrapolation, cos/sin times ``attention_factor``).
    ``yarn``: a :class:`~vexact_models.config.YarnScaling`."""
    dim, base = head_dim, theta

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (yarn.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    freqs = torch.outer(torch.arange(max_position, dtype=torch.int64).float(), inv_freq)
    return freqs.cos() * yarn.attention_factor, freqs.sin() * yarn.attention_factor


class RotaryEmbedding(nn.Module):
    """Holds the fp32 cos/sin table for every position up to ``max_position`` (a buffer, not a parameter).

    ``yarn``: a YaRN scaling (``config.YarnScaling``) or None for the default rope."""

    def __init__(self, head_dim: int, max_position: int, theta: float, yarn=None):
        super().__init__()
        self.args = (head_dim, max_position, theta, yarn)  # plain attributes: survive a meta init (see rebuilt)
        cos, sin = vk.rope_cos_sin(head_dim, max_position, theta) if yarn is None else yarn_cos_sin(*self.args)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def rebuilt(self) -> RotaryEmbedding:
        """A fresh copy with real tables (after the model was built on the meta device)."""
        return RotaryEmbedding(*self.args)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return vk.apply_rotary(q, positions, self.cos, self.sin), vk.apply_rotary(k, positions, self.cos, self.sin)
