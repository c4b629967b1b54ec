"""The dense decoder shared by Qwen3, Qwen2/Qwen2.5, Llama 3.x and Mistral: GQA attention, NeoX rotary, SwiGLU MLP,
pre-norm residual blocks.

A family is a config (below: ``DenseConfig`` and a subclass per family), not a copy of this file. What differs between
them:
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

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

import vexact_kernels as vk

from ..attention_metadata import AttentionMetadata
from ..config import ARCHITECTURES, HFConfig, check_heads, check_positive_ints, parse_dtype
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
    qk_norm_rotary,
)

KVCache = tuple[torch.Tensor, torch.Tensor]


ROPE_TYPES = ("default", "dynamic", "linear", "llama3")
_ROPE_KEYS = {  # the parameters each rope type needs (HF ``rope_scaling`` / ``rope_parameters`` keys)
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def _rope_scaling(d: dict, where: str) -> dict | None:
    """HF ``rope_parameters`` (transformers 5.x) or ``rope_scaling`` (published configs) as ``{"rope_type": ...,
    <its parameters>}``, None for the default rope; ValueError naming the field for an unsupported type."""
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    field = "rope_parameters" if d.get("rope_parameters") else "rope_scaling"
    if not isinstance(rope, dict):
        raise ValueError(f"{where}: {field} must be an object or null, got {rope!r}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{where}: {field}.rope_type {rope_type!r} is not supported; supported: {list(ROPE_TYPES)}")
    if rope_type == "default":
        return None
    return {"rope_type": rope_type, **{k: v for k, v in rope.items() if k not in ("type", "rope_type", "rope_theta")}}


@dataclass(frozen=True)
class GQAShape(HFConfig):
    """The sizes every GQA decoder's config.json gives, none with a default: the first fields of :class:`DenseConfig`
    and of gpt-oss's config, in this order (``dataclasses.asdict``, and so config.json, keeps it)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int

    @property
    def kv_cache_dims(self) -> tuple[int, int, int]:
        """What one layer's paged KV cache holds per token: ``(kv_heads, k_head_dim, v_head_dim)``."""
        return self.num_key_value_heads, self.head_dim, self.head_dim


@dataclass(frozen=True)
class DenseConfig(GQAShape):
    """The dense decoder shared by every family (GQA attention, rotary, SwiGLU MLP, pre-norm RMSNorm blocks).

    Its first fields, ``vocab_size`` to ``head_dim``, are :class:`GQAShape`'s. A family is a subclass that sets its
    ``model_type``, its HF defaults and the few structural switches below (class attributes, not config.json fields):
    ``qk_norm`` (RMSNorm on each q/k head before rotary) and which projections carry a bias (``qkv_bias``,
    ``o_bias``).

    ``rope_scaling``: None (default rope) or ``{"rope_type": "linear" | "llama3" | "dynamic", ...}``. ``dynamic``
    (NTK) rescales only for sequences longer than ``max_position_embeddings``, which both drivers refuse, so its table
    is the default one, identical in training and inference. ``sliding_window``: the window of the layers that use
    one, None for full attention; the kernels attend to every earlier key, which equals the window only while a
    sequence fits in it, so positions >= ``sliding_window`` are refused (and the engine's ``max_model_len`` with
    them).
    """

    qk_norm: ClassVar[bool] = False

    max_position_embeddings: int = 40960
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    torch_dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    model_type: str = "qwen3"
    mlp_bias: bool = False
    hidden_act: str = "silu"
    rope_scaling: dict | None = None
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        me = type(self).__name__
        positive = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        )
        check_positive_ints(me, self, positive)
        check_heads(me, self.num_attention_heads, self.num_key_value_heads, self.head_dim)
        if self.rms_norm_eps <= 0:
            raise ValueError(f"{me}.rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.hidden_act != "silu":
            raise ValueError(f"{me}.hidden_act {self.hidden_act!r} is not supported; supported: ['silu'] (SwiGLU)")
        w = self.sliding_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"{me}.sliding_window must be a positive integer or None, got {w!r}")
        self._check_rope_scaling(me)
        parse_dtype(self.torch_dtype)

    def _check_rope_scaling(self, me: str) -> None:
        rope = self.rope_scaling
        if rope is None:
            return
        rope_type = rope.get("rope_type") if isinstance(rope, dict) else None
        if rope_type not in _ROPE_KEYS:
            raise ValueError(
                f"{me}.rope_scaling: rope_type {rope_type!r} is not supported; supported: {list(ROPE_TYPES)} "
                "(None for default)"
            )
        missing = [k for k in _ROPE_KEYS[rope_type] if k not in rope]
        if missing:
            raise ValueError(f"{me}.rope_scaling ({rope_type}) lacks {missing}")
        bad = [k for k in _ROPE_KEYS[rope_type] if isinstance(rope[k], bool) or not rope[k] > 0]
        if bad:
            raise ValueError(f"{me}.rope_scaling ({rope_type}): {bad} must be > 0, got {rope}")
        if rope_type == "llama3" and not rope["high_freq_factor"] > rope["low_freq_factor"]:
            raise ValueError(f"{me}.rope_scaling (llama3): high_freq_factor must be > low_freq_factor, got {rope}")

    # which attention projections carry a bias (Llama's and Qwen3's ``attention_bias``: all four)
    qkv_bias = property(lambda self: self.attention_bias)
    o_bias = property(lambda self: self.attention_bias)

    @classmethod
    def _hf_sliding_window(cls, d: dict) -> int | None:
        """Qwen's rule: ``sliding_window`` counts only with ``use_sliding_window``, on layers >= max_window_layers."""
        if not d.get("use_sliding_window"):
            return None
        layer_types = d.get("layer_types")  # transformers 5.x writes the per-layer choice out
        if layer_types is not None and "sliding_attention" not in layer_types:
            return None
        if layer_types is None and d.get("max_window_layers", 0) >= d["num_hidden_layers"]:
            return None  # no layer uses it
        return d.get("sliding_window")

    @classmethod
    def from_hf_dict(cls, d: dict):
        d = dict(d)
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        theta = d.get("rope_theta", rope.get("rope_theta", cls.rope_theta) if isinstance(rope, dict) else None)
        head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
        dtype = d.get("torch_dtype") or d.get("dtype") or "bfloat16"
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in fields}
        kw.update(
            rope_theta=float(theta),
            head_dim=head_dim,
            torch_dtype=str(dtype).removeprefix("torch."),
            rope_scaling=_rope_scaling(d, f"{d.get('model_type')} config.json"),
            sliding_window=cls._hf_sliding_window(d),
        )
        kw.setdefault("num_key_value_heads", d["num_attention_heads"])
        return cls(**kw)

    def to_hf_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["architectures"] = [ARCHITECTURES[self.model_type]]
        d["attention_dropout"] = 0.0
        d["use_cache"] = True
        d["use_sliding_window"] = self.sliding_window is not None
        if self.sliding_window is not None:
            d["max_window_layers"] = 0
        return d


@dataclass(frozen=True)
class Qwen3Config(DenseConfig):
    """Qwen3 (HF ``model_type: qwen3``): RMSNorm on each q and k head before rotary."""

    qk_norm: ClassVar[bool] = True


@dataclass(frozen=True)
class Qwen2Config(DenseConfig):
    """Qwen2 / Qwen2.5 and the DeepSeek-R1-Distill-Qwen checkpoints (``model_type: qwen2``): biases on q/k/v, none on
    o_proj (transformers hard-codes them; config.json has no ``attention_bias``), no q/k norm."""

    max_position_embeddings: int = 32768
    rope_theta: float = 10_000.0
    model_type: str = "qwen2"
    qkv_bias = property(lambda self: True)
    o_bias = property(lambda self: False)

    def to_hf_dict(self) -> dict:
        d = super().to_hf_dict()
        del d["attention_bias"], d["mlp_bias"]  # not Qwen2 config fields: its biases are fixed
        return d


@dataclass(frozen=True)
class LlamaConfig(DenseConfig):
    """Llama 3.x (``model_type: llama``): ``attention_bias`` on all four projections, ``mlp_bias`` on the MLP,
    usually ``rope_scaling`` type ``llama3``; tied embeddings in 3.2 1B/3B."""

    max_position_embeddings: int = 2048
    rope_theta: float = 10_000.0
    model_type: str = "llama"

    @classmethod
    def _hf_sliding_window(cls, d: dict) -> int | None:
        return None

    def to_hf_dict(self) -> dict:
        d = super().to_hf_dict()
        del d["sliding_window"], d["use_sliding_window"]  # not Llama config fields
        return d


@dataclass(frozen=True)
class MistralConfig(DenseConfig):
    """Mistral (``model_type: mistral``): Llama's layout without biases; ``sliding_window`` applies to every layer
    when set (4096 in v0.1, null in v0.2/v0.3)."""

    max_position_embeddings: int = 4096 * 32
    rope_theta: float = 10_000.0
    model_type: str = "mistral"
    qkv_bias = property(lambda self: False)
    o_bias = property(lambda self: False)

    @classmethod
    def _hf_sliding_window(cls, d: dict) -> int | None:
        return d.get("sliding_window")

    def to_hf_dict(self) -> dict:
        d = super().to_hf_dict()
        d.pop("use_sliding_window")
        d.pop("max_window_layers", None)
        del d["attention_bias"], d["mlp_bias"]  # not Mistral config fields: it has no biases
        return d


class DenseAttention(nn.Module):
    def __init__(self, cfg: DenseConfig, rotary: RotaryEmbedding, window: int | None = None, sinks: bool = False):
        """``window``: the layer's sliding window run by the kernels (None: every earlier key); ``sinks``: a learned
        sink logit per query head (gpt-oss)."""
        super().__init__()
        dt, d = cfg.dtype, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = Linear(cfg.hidden_size, self.num_heads * d, cfg.qkv_bias, dt)
        self.k_proj = Linear(cfg.hidden_size, self.num_kv_heads * d, cfg.qkv_bias, dt)
        self.v_proj = Linear(cfg.hidden_size, self.num_kv_heads * d, cfg.qkv_bias, dt)
        self.o_proj = Linear(self.num_heads * d, cfg.hidden_size, cfg.o_bias, dt)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dt) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dt) if cfg.qk_norm else None
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=dt)) if sinks else None  # [Hq]
        self.rotary = rotary  # the model's shared table (non-persistent buffers: in no state_dict)
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, window=window)

    def forward(self, x, positions, meta: AttentionMetadata, kv_cache: KVCache | None):
        t = x.shape[0]
        q, k, v = grouped_linear(x, (self.q_proj, self.k_proj, self.v_proj))  # one matmul on packed weights
        q = q.view(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)
        written = False
        if self.q_norm is not None:  # the norms and the rotation in one launch on CUDA, the paged cache write in it
            kv_write = (v, *kv_cache, meta.slot_mapping) if meta.paged and kv_cache is not None else None
            q, k = qk_norm_rotary(self.q_norm, q, self.k_norm, k, self.rotary, positions, kv_write)
            written = kv_write is not None
        else:
            q, k = self.rotary(positions, q, k)
        o = self.attn(q, k, v, meta, kv_cache, sinks=self.sinks, kv_written=written)  # [T, Hq, D]
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
    def __init__(
        self, cfg: DenseConfig, rotary: RotaryEmbedding, mlp: nn.Module | None = None, attn: nn.Module | None = None
    ):
        """``mlp`` / ``attn``: a family's own MLP (an MoE block) and attention (MLA, a windowed one) in the dense
        layer's place (default: :class:`DenseMLP`, :class:`DenseAttention`)."""
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
        self.self_attn = attn if attn is not None else DenseAttention(cfg, rotary)
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
            unhonoured = not getattr(cfg, "windowed_attention", False)  # gpt-oss: the kernels run its window
            if unhonoured and cfg.sliding_window is not None and top >= cfg.sliding_window:
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
