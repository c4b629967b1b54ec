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

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from torch import nn

import vexact_kernels as vk

from ..config import ARCHITECTURES, HFConfig, check_norm_rope_dtype, check_positive_ints, hf_dtype_name, hf_fields
from ..layers import (
    DeepseekMoeBlock,
    Linear,
    MLAttention,
    RotaryEmbedding,
    SiluAndMul,
    grouped_linear,
)
from .dense import DenseDecoderLayer, DenseForCausalLM


@dataclass(frozen=True)
class YarnScaling:
    """YaRN rope scaling (``rope_scaling: {"type": "yarn", ...}``), with transformers' defaults and semantics."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if not self.factor >= 1.0:
            raise ValueError(f"rope_scaling.factor must be >= 1 for yarn, got {self.factor!r}")
        if not isinstance(self.original_max_position_embeddings, int) or self.original_max_position_embeddings < 1:
            raise ValueError(
                "rope_scaling.original_max_position_embeddings must be a positive integer, got "
                f"{self.original_max_position_embeddings!r}"
            )

    @staticmethod
    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        # the kernels' portable log, not the C library's (whose code path depends on the CPU)
        return 1.0 if scale <= 1 else 0.1 * mscale * vk.portable_math.log_scalar(scale) + 1.0

    @property
    def attention_factor(self) -> float:
        """The factor transformers multiplies the cos/sin tables by."""
        if self.mscale and self.mscale_all_dim:
            return float(self.get_mscale(self.factor, self.mscale) / self.get_mscale(self.factor, self.mscale_all_dim))
        return self.get_mscale(self.factor)

    @property
    def softmax_scale_factor(self) -> float:
        """DeepSeek multiplies the softmax scale by ``mscale(factor, mscale_all_dim)^2`` when mscale_all_dim is set."""
        if not self.mscale_all_dim:
            return 1.0
        m = self.get_mscale(self.factor, self.mscale_all_dim)
        return m * m

    @classmethod
    def from_hf(cls, rope: dict, max_position_embeddings: int) -> YarnScaling:
        known = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in rope.items() if k in known and v is not None}
        kw.setdefault("original_max_position_embeddings", max_position_embeddings)
        if "factor" not in kw:
            kw["factor"] = max_position_embeddings / kw["original_max_position_embeddings"]
        for name in ("beta_fast", "beta_slow"):  # transformers: ``x or default``
            if not kw.get(name):
                kw.pop(name, None)
        return cls(**kw)

    @classmethod
    def rope_from_hf(
        cls, d: dict, keys: tuple[str, str], max_position_embeddings: int, rope_theta: float, where: str
    ) -> tuple[YarnScaling | None, float]:
        """``(scaling, theta)`` from an HF config dict: its rope dict (the first of ``keys`` present) as a
        :class:`YarnScaling` for ``yarn`` or None for default rope (another type raises a ValueError naming ``where``),
        and its rope theta; ``max_position_embeddings`` and ``rope_theta``: the family's defaults."""
        rope = d.get(keys[0]) or d.get(keys[1]) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        theta = float(d.get("rope_theta", rope.get("rope_theta", rope_theta)))
        if rope_type == "yarn":
            return cls.from_hf(rope, d.get("max_position_embeddings", max_position_embeddings)), theta
        if rope_type == "default":
            return None, theta
        raise ValueError(f"{where} {rope_type!r} is not supported; use 'yarn' or none")


def yarn_config_from_hf(cls, d: dict, rope_keys: tuple[str, str], where: str, keep_none: tuple[str, ...] = ()):
    """The config dataclass ``cls`` (whose rope is YaRN or the default) from an HF config dict ``d``: the fields of
    ``cls`` that ``d`` holds (:func:`hf_fields`, ``keep_none`` as there), the rope theta and scaling of the first of
    ``rope_keys`` present (:meth:`YarnScaling.rope_from_hf`, ``where`` names the entry in its error) and the dtype."""
    scaling, theta = YarnScaling.rope_from_hf(d, rope_keys, cls.max_position_embeddings, cls.rope_theta, where)
    kw = hf_fields(cls, d, f"{cls.model_type} config.json", keep_none=keep_none)
    kw.update(rope_theta=theta, rope_scaling=scaling, torch_dtype=hf_dtype_name(d))
    return cls(**kw)


@dataclass(frozen=True)
class DeepseekV3Config(HFConfig):
    """DeepSeek-V3 / Moonlight (HF ``model_type: deepseek_v3``): MLA attention, DeepSeek MoE with shared experts.

    Layer ``i`` is an MoE layer when ``i >= first_k_dense_replace and i % moe_layer_freq == 0`` (DeepSeek's rule;
    transformers reads only ``first_k_dense_replace``, the same for ``moe_layer_freq == 1``, as every published
    config has it). Dense layers use ``intermediate_size``; routed experts ``moe_intermediate_size``; the shared
    experts are one dense MLP of ``n_shared_experts * moe_intermediate_size``.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    num_key_value_heads: int | None = None
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    rope_scaling: YarnScaling | None = None
    rope_interleave: bool = True
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    torch_dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    model_type: str = "deepseek_v3"
    sliding_window: ClassVar[int | None] = None  # full attention on every layer (read by the causal-LM shell)

    def __post_init__(self) -> None:
        c = "DeepseekV3Config"
        ints = [
            "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
            "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group", "moe_layer_freq",
            "max_position_embeddings",
        ]  # fmt: skip
        if self.q_lora_rank is not None:
            ints.append("q_lora_rank")
        check_positive_ints(c, self, ints)
        for name in ("n_shared_experts", "first_k_dense_replace"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{c}.{name} must be a non-negative integer, got {value!r}")
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(
                f"{c}.num_key_value_heads ({self.num_key_value_heads}) must equal num_attention_heads "
                f"({self.num_attention_heads}): MLA expands one key and value per query head"
            )
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"{c}.qk_rope_head_dim must be even for rotary, got {self.qk_rope_head_dim}")
        if self.n_routed_experts % self.n_group:
            raise ValueError(
                f"{c}.n_routed_experts ({self.n_routed_experts}) must be a multiple of n_group ({self.n_group})"
            )
        if self.topk_group > self.n_group:
            raise ValueError(f"{c}.topk_group ({self.topk_group}) must be <= n_group ({self.n_group})")
        per_group = self.n_routed_experts // self.n_group
        if self.n_group > 1 and per_group < 2:
            raise ValueError(f"{c}: group-limited routing needs >= 2 experts per group, got {per_group}")
        if self.num_experts_per_tok > self.topk_group * per_group:
            raise ValueError(
                f"{c}.num_experts_per_tok ({self.num_experts_per_tok}) > the experts of topk_group groups "
                f"({self.topk_group} * {per_group})"
            )
        if self.scoring_func not in ("sigmoid", "softmax"):
            raise ValueError(f"{c}.scoring_func must be 'sigmoid' or 'softmax', got {self.scoring_func!r}")
        if self.topk_method != "noaux_tc":
            raise ValueError(f"{c}.topk_method must be 'noaux_tc' (bias-corrected top-k), got {self.topk_method!r}")
        if self.hidden_act != "silu":
            raise ValueError(f"{c}.hidden_act must be 'silu', got {self.hidden_act!r}")
        if not self.routed_scaling_factor > 0:
            raise ValueError(f"{c}.routed_scaling_factor must be > 0, got {self.routed_scaling_factor!r}")
        check_norm_rope_dtype(c, self, YarnScaling)

    @property
    def num_experts(self) -> int:
        """``n_routed_experts`` under the name the trainer's router outputs use (transformers maps
        ``num_local_experts`` to it)."""
        return self.n_routed_experts

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def head_dim(self) -> int:
        """The rotary width (transformers' ``head_dim`` for this model type)."""
        return self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """``qk_head_dim ** -0.5``, times YaRN's ``mscale(factor, mscale_all_dim)^2`` (as transformers applies it)."""
        scale = self.qk_head_dim**-0.5
        return scale * self.rope_scaling.softmax_scale_factor if self.rope_scaling is not None else scale

    @property
    def kv_cache_dims(self) -> tuple[int, int, int]:
        """Expanded MLA cache (see ``layers/mla.py``): one key of qk_head_dim and one value of v_head_dim per head."""
        return self.num_attention_heads, self.qk_head_dim, self.v_head_dim

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    @classmethod
    def from_hf_dict(cls, d: dict):
        d = dict(d)
        if d.get("quantization_config"):
            method = (
                d["quantization_config"].get("quant_method", "?") if isinstance(d["quantization_config"], dict) else "?"
            )
            raise ValueError(
                f"config.json has quantization_config (quant_method {method!r}): FP8/quantized deepseek_v3 "
                "checkpoints are not supported; convert the weights to bf16 first"
            )
        if "n_routed_experts" not in d and "num_local_experts" in d:
            d["n_routed_experts"] = d["num_local_experts"]
        keys = ("rope_scaling", "rope_parameters")
        return yarn_config_from_hf(cls, d, keys, "deepseek_v3: rope_scaling.type", keep_none=("q_lora_rank",))

    def to_hf_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["architectures"] = [ARCHITECTURES[self.model_type]]
        rope = None
        if self.rope_scaling is not None:
            rope = {"type": "yarn", "rope_type": "yarn", **dataclasses.asdict(self.rope_scaling)}
            rope = {k: v for k, v in rope.items() if v is not None}
        d["rope_scaling"] = rope
        d["attention_dropout"] = 0.0
        d["use_cache"] = True
        return d


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


def _layer(cfg: DeepseekV3Config, rotary: RotaryEmbedding, i: int) -> DenseDecoderLayer:
    """Layer ``i``: the dense decoder layer around MLA attention and layer ``i``'s MLP (dense or MoE)."""
    return DenseDecoderLayer(cfg, rotary, _mlp(cfg, i), MLAttention(cfg, rotary))


class DeepseekV3ForCausalLM(DenseForCausalLM):
    """The dense decoder's causal-LM shell (input checks, ``logits``, ``logprobs``, tied head) around the DeepSeek-V3
    body."""

    config_class = DeepseekV3Config

    def __init__(self, cfg: DeepseekV3Config):
        super().__init__(cfg, make_layer=_layer)
