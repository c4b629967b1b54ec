"""Model configs: typed dataclasses read from a Hugging Face ``config.json``, validated at construction."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

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


@dataclass(frozen=True)
class Qwen3Config:
    """Dense Qwen3 (HF ``model_type: qwen3``)."""

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

    def __post_init__(self) -> None:
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
                raise ValueError(f"Qwen3Config.{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"Qwen3Config: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"Qwen3Config.head_dim must be even for rotary, got {self.head_dim}")
        if self.rms_norm_eps <= 0:
            raise ValueError(f"Qwen3Config.rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        parse_dtype(self.torch_dtype)

    @property
    def dtype(self) -> torch.dtype:
        return parse_dtype(self.torch_dtype)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        return tuple(self.eos_token_id) if isinstance(self.eos_token_id, list) else (self.eos_token_id,)

    @classmethod
    def from_hf_dict(cls, d: dict):
        d = dict(d)
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise NotImplementedError(f"rope_type {rope_type!r} is not supported yet (only 'default')")
        theta = d.get("rope_theta", rope.get("rope_theta", cls.rope_theta))
        if d.get("use_sliding_window"):
            raise NotImplementedError("sliding-window attention is not supported yet")
        head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
        dtype = d.get("torch_dtype") or d.get("dtype") or "bfloat16"
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in fields}
        kw.update(rope_theta=float(theta), head_dim=head_dim, torch_dtype=str(dtype).removeprefix("torch."))
        kw.setdefault("num_key_value_heads", d["num_attention_heads"])
        return cls(**kw)

    def to_hf_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["architectures"] = ["Qwen3ForCausalLM"]
        d["hidden_act"] = "silu"
        d["attention_dropout"] = 0.0
        d["use_cache"] = True
        d["use_sliding_window"] = False
        d["rope_scaling"] = None
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


CONFIG_CLASSES: dict[str, type] = {"qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig}


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
