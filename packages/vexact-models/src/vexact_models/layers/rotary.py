"""Rotary embedding: one fp32 cos/sin table per model, built once from the config (any ``rope_scaling`` folded into
its frequencies) and read by every layer in both drivers, so a token's rotation depends on its position only."""

from __future__ import annotations

import math

import torch
from torch import nn

import vexact_kernels as vk


def scaled_inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """transformers' inverse frequencies for ``rope_type`` ``linear`` and ``llama3`` (the same fp32 arithmetic)."""
    inv_freq = 1.0 / vk.portable_math.pow_of(theta, torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
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


def yarn_inv_freq(head_dim: int, theta: float, yarn) -> torch.Tensor:
    """YaRN inverse frequencies (transformers' ``_compute_yarn_parameters``): blended between interpolation and
    extrapolation. ``yarn``: a :class:`~vexact_models.YarnScaling`."""
    dim, base = head_dim, theta

    def correction_dim(rotations: float) -> float:
        log = vk.portable_math.log_scalar  # not the C library's log, whose code path depends on the CPU
        return (dim * log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi))) / (2 * log(base))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = vk.portable_math.pow_of(base, torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    return (1.0 / (yarn.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_tables(head_dim: int, max_position: int, theta: float, scaling=None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``cos, sin [max_position, head_dim // 2]``, the one table builder of every family.

    ``scaling``: None (default rope), a dense family's ``{"rope_type": "linear" | "llama3" | "dynamic", ...}``, or a
    :class:`~vexact_models.YarnScaling` (cos/sin then times its ``attention_factor``, as transformers does).
    ``dynamic`` NTK scaling only changes positions beyond ``max_position_embeddings``, which the model refuses, so its
    table is the default one."""
    if scaling is None or (isinstance(scaling, dict) and scaling["rope_type"] == "dynamic"):
        return vk.rope_cos_sin(head_dim, max_position, theta)
    is_yarn = not isinstance(scaling, dict)
    inv_freq = yarn_inv_freq(head_dim, theta, scaling) if is_yarn else scaled_inv_freq(head_dim, theta, scaling)
    sin, cos = vk.portable_math.sincos(torch.outer(torch.arange(max_position, dtype=torch.int64).float(), inv_freq))
    if is_yarn:
        return cos * scaling.attention_factor, sin * scaling.attention_factor
    return cos, sin


class RotaryEmbedding(nn.Module):
    """Holds the fp32 cos/sin table for every position up to ``max_position`` (a buffer, not a parameter).

    ``scaling``: see :func:`rope_tables`."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling=None):
        super().__init__()
        self.args = (head_dim, max_position, theta, scaling)  # plain attributes: survive a meta init (see rebuilt)
        cos, sin = rope_tables(*self.args)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    @classmethod
    def from_config(cls, cfg) -> RotaryEmbedding:
        """The table of ``cfg.head_dim`` (the rotary width: MLA's ``qk_rope_head_dim``) with its rope scaling."""
        return cls(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)

    def rebuilt(self) -> RotaryEmbedding:
        """A fresh copy with real tables (after the model was built on the meta device)."""
        return RotaryEmbedding(*self.args)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return vk.apply_rotary_qk(q, k, positions, self.cos, self.sin)
