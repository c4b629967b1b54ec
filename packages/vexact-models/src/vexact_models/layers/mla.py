"""Multi-head Latent Attention (DeepSeek-V2/V3, Moonlight), in the expanded (non-absorbed) form, in both drivers.

Per token: ``q = q_b_proj(q_a_layernorm(q_a_proj(x)))`` (or ``q_proj(x)`` when ``q_lora_rank`` is null), split per
head into ``[q_nope | q_pe]``; ``[c_kv | k_pe] = kv_a_proj_with_mqa(x)``; ``[k_nope | v] = kv_b_proj(kv_a_layernorm(
c_kv))`` per head; ``q_pe`` and the single ``k_pe`` (shared by every head) are rotated; then ordinary multi-head
attention with ``k = [k_nope | k_pe]`` (``qk_nope_head_dim + qk_rope_head_dim`` per head) and ``v`` (``v_head_dim``
per head), through the same ``Attention`` layer as Qwen3 (packed for training, paged for the engine), with the
softmax scale (``qk_head_dim ** -0.5``, times YaRN's ``mscale(factor, mscale_all_dim)^2``) passed as the kernel's
``scale`` in both layouts. The trainer and the engine therefore run identical arithmetic: the engine's paged cache
holds exactly the expanded per-head K and V the trainer computes (``config.kv_cache_dims``).

Rotary: DeepSeek checkpoints store the rope dims interleaved (``rope_interleave``, transformers'
``apply_rotary_pos_emb_interleave``): the pairs ``(x[2i], x[2i+1])`` are first de-interleaved to ``[evens | odds]``
(a copy, exact) and then rotated in the NeoX layout by vexact-kernels' ``apply_rotary``, exactly as transformers
does; q and k are permuted alike, so the dot products are those of the interleaved rotation.

Cost of the choice, per token and layer (``H`` heads, bf16 values):

- KV cache: expanded ``H * (qk_nope + qk_rope + v_head_dim)`` values vs the latent layout's ``kv_lora_rank +
  qk_rope`` (``c_kv`` and ``k_pe``). Moonlight-16B-A3B (H=16, 128+64, v 128, rank 512): 5120 values = 10 KiB vs 576
  values = 1.1 KiB (8.9x); DeepSeek-V3 (H=128): 40960 values = 80 KiB vs 1.1 KiB (71x).
- FLOPs of one decode step at context ``L``: expanded ``2 * r * H * (qk_nope + v)`` once for the new token's
  ``kv_b_proj`` plus ``2 * H * L * (qk_nope + qk_rope + v)`` for attention (Moonlight: 10240 L); the absorbed form
  (``W_UK`` folded into q, ``W_UV`` into the output) reads only the latent but does ``2 * H * L * (2r + qk_rope)``
  (Moonlight: 34816 L) plus ``2 * H * r * (qk_nope + v)`` for the absorption. Decode is bound by the bytes it reads,
  so the expanded cache costs decode speed and memory (fewer sequences fit) at long contexts; training and prefill
  are unaffected.

The absorbed-latent cache (both drivers switched together, with a contract) is future work.
"""

from __future__ import annotations

import torch
from torch import nn

from ..attention_metadata import AttentionMetadata
from .attention import Attention
from .layernorm import RMSNorm
from .linear import Linear
from .rotary import RotaryEmbedding

# transformers builds q_a_layernorm / kv_a_layernorm with DeepseekV3RMSNorm's default eps, not config.rms_norm_eps
LORA_NORM_EPS = 1e-6


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """``[..., (d/2, 2)] -> [..., (2, d/2)]``: the evens then the odds of the last dim (a copy)."""
    *lead, d = x.shape
    return x.reshape(*lead, d // 2, 2).transpose(-1, -2).reshape(*lead, d)


class MLAttention(nn.Module):
    """MLA with transformers' ``DeepseekV3Attention`` names; ``cfg`` is a ``DeepseekV3Config``."""

    def __init__(self, cfg, rotary: RotaryEmbedding):
        super().__init__()
        dt, h, bias = cfg.dtype, cfg.num_attention_heads, cfg.attention_bias
        self.num_heads = h
        self.qk_nope_dim, self.qk_rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank, self.interleave = cfg.kv_lora_rank, cfg.rope_interleave
        qk = self.qk_nope_dim + self.qk_rope_dim
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(cfg.hidden_size, h * qk, False, dt)
        else:
            self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, bias, dt)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LORA_NORM_EPS, dt)
            self.q_b_proj = Linear(cfg.q_lora_rank, h * qk, False, dt)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, self.kv_lora_rank + self.qk_rope_dim, bias, dt)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LORA_NORM_EPS, dt)
        self.kv_b_proj = Linear(self.kv_lora_rank, h * (self.qk_nope_dim + self.v_dim), False, dt)
        self.o_proj = Linear(h * self.v_dim, cfg.hidden_size, bias, dt)
        self.rotary = rotary  # the model's shared table (non-persistent buffers: in no state_dict)
        self.attn = Attention(h, h, qk, scale=cfg.softmax_scale)

    def forward(self, x, positions, meta: AttentionMetadata, kv_cache=None):
        t, h = x.shape[0], self.num_heads
        nope, rope = self.qk_nope_dim, self.qk_rope_dim
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(t, h, nope + rope).split([nope, rope], -1)  # [T, H, *]
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, rope], -1)  # [T, r], [T, rope]
        kv = self.kv_b_proj(self.kv_a_layernorm(c_kv.contiguous())).view(t, h, nope + self.v_dim)
        k_nope, v = kv.split([nope, self.v_dim], -1)
        q_pe, k_pe = q_pe.contiguous(), k_pe.reshape(t, 1, rope).contiguous()  # kernels take dense rows
        if self.interleave:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        q_pe, k_pe = self.rotary(positions, q_pe, k_pe)
        q = torch.cat([q_nope, q_pe], -1)  # [T, H, qk]
        k = torch.cat([k_nope, k_pe.expand(t, h, rope)], -1)  # [T, H, qk]
        o = self.attn(q, k, v.contiguous(), meta, kv_cache)  # [T, H, v_dim]
        return self.o_proj(o.reshape(t, h * self.v_dim))
