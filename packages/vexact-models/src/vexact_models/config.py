"""Model configs: typed dataclasses read from a Hugging Face ``config.json``, validated at construction."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

import vexact_kernels as vk

from .errors import read_json_object

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    if isinstance(value, torch.dtype):
        if value not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {value}; expected one of {sorted(_DTYPES)}")
        return value
    name = str(value).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {value!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


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
class DenseConfig:
    """The dense decoder shared by every family (GQA attention, rotary, SwiGLU MLP, pre-norm RMSNorm blocks).

    A family is a subclass that sets its ``model_type``, its HF defaults and the few structural switches below (class
    attributes, not config.json fields): ``qk_norm`` (RMSNorm on each q/k head before rotary) and which projections
    carry a bias (``qkv_bias``, ``o_bias``).

    ``rope_scaling``: None (default rope) or ``{"rope_type": "linear" | "llama3" | "dynamic", ...}``. ``dynamic``
    (NTK) rescales only for sequences longer than ``max_position_embeddings``, which both drivers refuse, so its table
    is the default one, identical in training and inference. ``sliding_window``: the window of the layers that use
    one, None for full attention; the kernels attend to every earlier key, which equals the window only while a
    sequence fits in it, so positions >= ``sliding_window`` are refused (and the engine's ``max_model_len`` with
    them).
    """

    qk_norm: ClassVar[bool] = False

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
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
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{me}.{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{me}: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"{me}.head_dim must be even for rotary, got {self.head_dim}")
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

    @property
    def dtype(self) -> torch.dtype:
        return parse_dtype(self.torch_dtype)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        return tuple(self.eos_token_id) if isinstance(self.eos_token_id, list) else (self.eos_token_id,)

    @property
    def kv_cache_dims(self) -> tuple[int, int, int]:
        """What one layer's paged KV cache holds per token: ``(kv_heads, k_head_dim, v_head_dim)``."""
        return self.num_key_value_heads, self.head_dim, self.head_dim

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
        d["architectures"] = [_ARCHITECTURES[self.model_type]]
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


@dataclass(frozen=True)
class Qwen3MoeConfig(Qwen3Config):
    """Qwen3-MoE (HF ``model_type: qwen3_moe``): Qwen3 attention, sparse MoE blocks with dense layers mixed in.

    Layer ``i`` is sparse when ``i not in mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``; dense layers
    use ``intermediate_size``, experts ``moe_intermediate_size``.
    """

    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    norm_topk_prob: bool = False
    router_aux_loss_coef: float = 0.001
    model_type: str = "qwen3_moe"

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Qwen3MoeConfig.{name} must be a positive integer, got {value!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"Qwen3MoeConfig: num_experts_per_tok ({self.num_experts_per_tok}) > num_experts ({self.num_experts})"
            )
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        bad = [i for i in self.mlp_only_layers if not isinstance(i, int) or not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(
                f"Qwen3MoeConfig.mlp_only_layers has {bad}, outside the layers [0, {self.num_hidden_layers})"
            )
        if not self.router_aux_loss_coef >= 0:
            raise ValueError(f"Qwen3MoeConfig.router_aux_loss_coef must be >= 0, got {self.router_aux_loss_coef!r}")

    @classmethod
    def from_hf_dict(cls, d: dict):
        d = dict(d)
        # transformers 5.x writes the expert count as ``num_local_experts`` (its attribute map); published Qwen3-MoE
        # checkpoints write ``num_experts``
        if "num_experts" not in d and "num_local_experts" in d:
            d["num_experts"] = d["num_local_experts"]
        missing = [k for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size") if k not in d]
        if missing:
            raise ValueError(f"qwen3_moe config.json lacks {missing} (num_experts may be given as num_local_experts)")
        return super().from_hf_dict(d)

    def is_sparse_layer(self, i: int) -> bool:
        return i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    def to_hf_dict(self) -> dict:
        d = super().to_hf_dict()
        d["architectures"] = ["Qwen3MoeForCausalLM"]
        d["mlp_only_layers"] = list(self.mlp_only_layers)
        d["output_router_logits"] = False
        return d


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


@dataclass(frozen=True)
class DeepseekV3Config:
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
        for name in ints:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{c}.{name} must be a positive integer, got {value!r}")
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
        if self.rms_norm_eps <= 0:
            raise ValueError(f"{c}.rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, YarnScaling):
            raise TypeError(f"{c}.rope_scaling must be a YarnScaling or None, got {type(self.rope_scaling).__name__}")
        parse_dtype(self.torch_dtype)

    dtype = DenseConfig.dtype
    eos_token_ids = DenseConfig.eos_token_ids

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
        rope = d.get("rope_scaling") or d.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "yarn":
            scaling = YarnScaling.from_hf(rope, d.get("max_position_embeddings", cls.max_position_embeddings))
        elif rope_type == "default":
            scaling = None
        else:
            raise ValueError(f"rope_scaling.type {rope_type!r} is not supported for deepseek_v3; use 'yarn' or none")
        theta = d.get("rope_theta", rope.get("rope_theta", cls.rope_theta))
        if "n_routed_experts" not in d and "num_local_experts" in d:
            d["n_routed_experts"] = d["num_local_experts"]
        dtype = d.get("torch_dtype") or d.get("dtype") or "bfloat16"
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in fields and v is not None or k == "q_lora_rank"}
        missing = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING and f.name not in kw]
        if missing:
            raise ValueError(f"deepseek_v3 config.json lacks {missing}")
        kw.update(
            rope_theta=float(theta), rope_scaling=scaling, torch_dtype=str(dtype).removeprefix("torch."),
        )  # fmt: skip
        return cls(**kw)

    def to_hf_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["architectures"] = [_ARCHITECTURES[self.model_type]]
        rope = None
        if self.rope_scaling is not None:
            rope = {"type": "yarn", "rope_type": "yarn", **dataclasses.asdict(self.rope_scaling)}
            rope = {k: v for k, v in rope.items() if v is not None}
        d["rope_scaling"] = rope
        d["attention_dropout"] = 0.0
        d["use_cache"] = True
        return d


CONFIG_CLASSES: dict[str, type] = {
    "qwen3": Qwen3Config,
    "qwen3_moe": Qwen3MoeConfig,
    "qwen2": Qwen2Config,
    "llama": LlamaConfig,
    "mistral": MistralConfig,
    "deepseek_v3": DeepseekV3Config,
}
_ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}


def load_config(path: str | Path):
    """Read ``config.json`` from a checkpoint directory (or the file itself); CheckpointError naming the file if it
    is not a valid JSON object."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"no config.json at {p}")
    return config_from_dict(read_json_object(p))


def config_from_dict(d: dict):
    model_type = d.get("model_type")
    if model_type not in CONFIG_CLASSES:
        raise ValueError(f"unknown model_type {model_type!r}; supported: {sorted(CONFIG_CLASSES)}")
    return CONFIG_CLASSES[model_type].from_hf_dict(d)
