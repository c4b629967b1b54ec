"""Rotary embedding: one fp32 cos/sin table per model, built once from the config (any ``rope_scaling`` folded into
its frequencies) and read by every layer in both drivers, so a token's rotation depends on its position only."""

from __future__ import annotations

import math

import torch
from torch import nn

import vexact_kernels as vk


def scaled_inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """transformers' inverse frequencies for ``rope_type`` ``linear`` and ``llama3`` (the same fp32 arithmetic)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    if scaling["rope_type"] != "llama3":
        raise ValueError(f"rope_scaling.rope_type {scaling['rope_type']!r} has no scaled frequencies here")
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)  # long waves: divided by factor
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(head_dim: int, max_position: int, theta: float, scaling: dict | None = None):
    """fp32 ``cos, sin [max_position, head_dim // 2]``. ``dynamic`` NTK scaling only changes positions beyond
    ``max_position_embeddings``, which the model refuses, so its table is the default one."""
    if scaling is None or scaling["rope_type"] == "dynamic":
        return vk.rope_cos_sin(head_dim, max_position, theta)
    freqs = torch.outer(
        torch.arange(max_position, dtype=torch.int64).float(), scaled_inv_freq(head_dim, theta, scaling)
    )
    return freqs.cos(), freqs.sin()


class RotaryEmbedding(nn.Module):
    """Holds the fp32 cos/sin table for every position up to ``max_position`` (a buffer, not a parameter)."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None = None):
        super().__init__()
        cos, sin = rope_tables(head_dim, max_position, theta, scaling)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    @classmethod
    def from_config(cls, cfg) -> RotaryEmbedding:
        return cls(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return vk.apply_rotary(q, positions, self.cos, self.sin), vk.apply_rotary(k, positions, self.cos, self.sin)
