"""DeepSeek-V3 / Moonlight: MLA attention (``layers/mla.py``, expanded K/V in both drivers), pre-norm residual
blocks, the first ``first_k_dense_replace`` layers a dense SwiGLU MLP, the rest DeepSeek MoE (``DeepseekMoeBlock``:
grouped sigmoid routing with the score-correction bias, an fp32 persistent buffer as in transformers, routed
experts through ``fused_moe``, shared experts added after them).

Names are transformers' ``DeepseekV3ForCausalLM``: ``self_attn.{q_a_proj, q_a_layernorm, q_b_proj | q_proj,
kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}``, ``mlp.gate.weight``, ``mlp.gate.e_score_correction_bias``,
``mlp.experts.{gate_up_proj, down_proj}`` (stacked; published checkpoints' ``mlp.experts.{e}.gate_proj.weight`` ...
load through the loader's per-expert mapping), ``mlp.shared_experts.{gate,up,down}_proj``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import DeepseekV3Config
from ..layers import (
    DeepseekMoeBlock,
    Linear,
    MLAttention,
    RMSNorm,
    RotaryEmbedding,
    SiluAndMul,
    add_rms_norm,
    grouped_linear,
)
from .dense import DenseForCausalLM


class DeepseekV3MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, dtype):
        super().__init__()
        self.gate_proj = Linear(hidden, inter, False, dtype)
        self.up_proj = Linear(hidden, inter, False, dtype)
        self.down_proj = Linear(inter, hidden, False, dtype)
        self.act = SiluAndMul()

    def forward(self, x):
        gate, up = grouped_linear(x, (self.gate_proj, self.up_proj))
        return self.down_proj(self.act(gate, up))


def _mlp(cfg: DeepseekV3Config, i: int) -> nn.Module:
    if not cfg.is_moe_layer(i):
        return DeepseekV3MLP(cfg.hidden_size, cfg.intermediate_size, cfg.dtype)
    shared = DeepseekV3MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, cfg.dtype)
    return DeepseekMoeBlock(
        cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size, shared,
        n_group=cfg.n_group, topk_group=cfg.topk_group, norm_topk_prob=cfg.norm_topk_prob,
        routed_scaling_factor=cfg.routed_scaling_factor, scoring_func=cfg.scoring_func, dtype=cfg.dtype,
    )  # fmt: skip


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekV3Config, rotary: RotaryEmbedding, i: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.self_attn = MLAttention(cfg, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.mlp = _mlp(cfg, i)

    def forward(self, x, positions, meta, kv_cache, residual=None):
        """As :meth:`DenseDecoderLayer.forward`: the residual add left to the next norm when inferring."""
        residual, h = add_rms_norm(self.input_layernorm, x, residual)
        h = self.self_attn(h, positions, meta, kv_cache)
        residual, h = add_rms_norm(self.post_attention_layernorm, h, residual)
        h = self.mlp(h)
        return (residual + h, None) if torch.is_grad_enabled() else (h, residual)


class DeepseekV3ForCausalLM(DenseForCausalLM):
    """The dense decoder's causal-LM shell (input checks, ``logits``, ``logprobs``, tied head) around the DeepSeek-V3
    body."""

    config_class = DeepseekV3Config

    def __init__(self, cfg: DeepseekV3Config):
        super().__init__(cfg, make_layer=DeepseekV3DecoderLayer)
