"""The dense decoder shared by Qwen3, Qwen2/Qwen2.5, Llama 3.x and Mistral: GQA attention, NeoX rotary, SwiGLU MLP,
pre-norm residual blocks.

A family is a config (``config.py``), not a copy of this file. What differs between them:
- Qwen3: RMSNorm on each q and k head before rotary (``qk_norm``); ``attention_bias`` on all four projections.
- Qwen2: biases on q/k/v, none on o_proj; no q/k norm.
- Llama 3.x: ``attention_bias`` (all four), ``mlp_bias``, rope type ``llama3``, often tied embeddings.
- Mistral: no biases; a ``sliding_window`` the kernels honour only while a sequence fits in it.
The rotary table (any scaling folded in) is built once per model and shared by every layer and both drivers.

Inference on packed weights (``vexact_models.pack_parameters``) runs q/k/v and gate/up as one matmul each
(``layers.grouped_linear``), with the separate matmuls' bits; the trainer's forward under grad never does.

A decoder layer hands the next one its MLP output and the residual stream apart, so the next norm does the add
(``layers.add_rms_norm``: one kernel for both, with the separate ops' bits). Under grad a layer adds its MLP output to
the stream itself and hands on one tensor; only the add inside the layer (attention output + stream) goes through
``add_rms_norm``, differentiable.

Module and parameter names follow Hugging Face's, so a checkpoint maps one to one. The forward pass returns the
hidden states *before* the final norm; logits and logprobs come from :meth:`DenseForCausalLM.logits` /
:meth:`DenseForCausalLM.logprobs`, which the engine's sampler and the trainer both call.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

import vexact_kernels as vk

from ..attention_metadata import AttentionMetadata
from ..config import DenseConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config
from ..layers import (
    Attention,
    Linear,
    LMHead,
    RMSNorm,
    RotaryEmbedding,
    SiluAndMul,
    VocabEmbedding,
    add_rms_norm,
    grouped_linear,
    rms_norm_pair,
)

KVCache = tuple[torch.Tensor, torch.Tensor]


class DenseAttention(nn.Module):
    def __init__(self, cfg: DenseConfig, rotary: RotaryEmbedding):
        super().__init__()
        dt, d = cfg.dtype, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = Linear(cfg.hidden_size, self.num_heads * d, cfg.qkv_bias, dt)
        self.k_proj = Linear(cfg.hidden_size, self.num_kv_heads * d, cfg.qkv_bias, dt)
        self.v_proj = Linear(cfg.hidden_size, self.num_kv_heads * d, cfg.qkv_bias, dt)
        self.o_proj = Linear(self.num_heads * d, cfg.hidden_size, cfg.o_bias, dt)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dt) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dt) if cfg.qk_norm else None
        self.rotary = rotary  # the model's shared table (non-persistent buffers: in no state_dict)
        self.attn = Attention(self.num_heads, self.num_kv_heads, d)

    def forward(self, x, positions, meta: AttentionMetadata, kv_cache: KVCache | None):
        t = x.shape[0]
        q, k, v = grouped_linear(x, (self.q_proj, self.k_proj, self.v_proj))  # one matmul on packed weights
        q = q.view(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = rms_norm_pair(self.q_norm, q, self.k_norm, k)  # one launch for both on CUDA
        q, k = self.rotary(positions, q, k)
        o = self.attn(q, k, v, meta, kv_cache)  # [T, Hq, D]
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class DenseMLP(nn.Module):
    def __init__(self, cfg: DenseConfig):
        super().__init__()
        dt, bias = cfg.dtype, cfg.mlp_bias
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias, dt)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias, dt)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias, dt)
        self.act = SiluAndMul()

    def forward(self, x):
        gate, up = grouped_linear(x, (self.gate_proj, self.up_proj))
        return self.down_proj(self.act(gate, up))


class DenseDecoderLayer(nn.Module):
    def __init__(self, cfg: DenseConfig, rotary: RotaryEmbedding, mlp: nn.Module | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.self_attn = DenseAttention(cfg, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.mlp = mlp if mlp is not None else DenseMLP(cfg)

    def forward(self, x, positions, meta, kv_cache, residual=None):
        """``x``: the previous layer's MLP output, ``residual``: the stream it adds to (None: ``x`` is the stream).
        Returns ``(mlp output, stream before it)``, whose sum is the layer's output, for the next norm to add; under
        grad (training) ``(that sum, None)``: the layer's output one tensor, as activation checkpointing keeps it."""
        residual, h = add_rms_norm(self.input_layernorm, x, residual)
        h = self.self_attn(h, positions, meta, kv_cache)
        residual, h = add_rms_norm(self.post_attention_layernorm, h, residual)
        h = self.mlp(h)
        return (residual + h, None) if torch.is_grad_enabled() else (h, residual)


class DenseModel(nn.Module):
    def __init__(self, cfg: DenseConfig, make_mlp=None, make_layer=None):
        """``make_mlp(cfg, i)``: the MLP of layer ``i`` (default: the dense SwiGLU); ``make_layer(cfg, rotary_emb,
        i)``: the whole decoder layer ``i``, for a family whose attention differs too (default: the dense layer
        around ``make_mlp``)."""
        super().__init__()
        self.rotary_emb = RotaryEmbedding.from_config(cfg)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.dtype)
        make_mlp = make_mlp or (lambda cfg, i: DenseMLP(cfg))
        make_layer = make_layer or (lambda cfg, rotary_emb, i: DenseDecoderLayer(cfg, rotary_emb, make_mlp(cfg, i)))
        self.layers = nn.ModuleList(make_layer(cfg, self.rotary_emb, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)

    def forward(self, input_ids, positions, meta, kv_caches: list[KVCache] | None = None):
        x = self.embed_tokens(input_ids)  # [T, H]
        return self.run_layers(x, positions, meta, kv_caches, range(len(self.layers)))

    def run_layers(self, x, positions, meta, kv_caches, layers: Iterable[int]) -> torch.Tensor:
        """The hidden states ``[T, H]`` after ``layers`` (indices, in order; ``kv_caches[i]`` is layer i's) from those
        before the first of them: the model's body, or a pipeline stage's."""
        residual = None
        for i in layers:
            x, residual = self.layers[i](x, positions, meta, None if kv_caches is None else kv_caches[i], residual)
        return x if residual is None else residual + x  # pre-norm: the LM head normalises (lm_head.logits)


class DenseForCausalLM(nn.Module):
    config_class = DenseConfig

    def __init__(self, cfg: DenseConfig, make_mlp=None, make_layer=None):
        """``make_mlp`` / ``make_layer``: the per-layer hooks of :class:`DenseModel`, for families built on it."""
        super().__init__()
        self.config = cfg
        self.model = DenseModel(cfg, make_mlp, make_layer)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_caches: list[KVCache] | None = None,
    ) -> torch.Tensor:
        """Hidden states before the final norm, ``[T, hidden]``."""
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(
                f"expected flat input_ids and positions of equal shape [T]; got {tuple(input_ids.shape)} and "
                f"{tuple(positions.shape)}"
            )
        # read once for the step: every layer's rotary checks the same tensor without a read (vk.tensor_range)
        pos_range = vk.tensor_range(positions)
        if pos_range is not None:
            top, cfg = pos_range[1], self.config
            if top >= cfg.max_position_embeddings:
                raise ValueError(f"position {top} >= max_position_embeddings {cfg.max_position_embeddings}")
            if cfg.sliding_window is not None and top >= cfg.sliding_window:
                raise ValueError(
                    f"position {top} >= sliding_window {cfg.sliding_window}: sliding-window attention is not "
                    "implemented, so sequences must fit in the window (where it equals full attention)"
                )
        return self.model(input_ids, positions, meta, kv_caches)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.logits(hidden, self.model.norm.weight)

    def logprobs(self, hidden, targets, temperature=1.0, chunk_size=1024, with_entropy=False):
        return self.lm_head.logprobs(hidden, self.model.norm.weight, targets, temperature, chunk_size, with_entropy)

    def sample(self, hidden, temperature, seeds):
        """Draw a token per pre-norm hidden row (int64 ``seeds``, one per row) and its logprob; see
        :meth:`LMHead.sample`."""
        return self.lm_head.sample(hidden, self.model.norm.weight, temperature, seeds)


class Qwen3ForCausalLM(DenseForCausalLM):
    config_class = Qwen3Config


class Qwen2ForCausalLM(DenseForCausalLM):
    config_class = Qwen2Config


class LlamaForCausalLM(DenseForCausalLM):
    config_class = LlamaConfig


class MistralForCausalLM(DenseForCausalLM):
    config_class = MistralConfig
