"""What every family's config shares: dtypes, the HF architecture names, the ``dtype`` / ``eos_token_ids``
properties, the checks every family's config runs. Each family's config dataclass sits at the top of its model file
(``models/dense.py``, ``models/qwen3_moe.py``, ``models/deepseek_v3.py``, ``models/gpt_oss.py``); ``load_config``
reads a ``config.json`` into one (``loader.py``)."""

from __future__ import annotations

import dataclasses

import torch

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


# model_type -> the HF architecture name a written config.json carries
ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}


class HFConfig:
    """The base of every family's config dataclass (no fields): properties read from its HF fields."""

    @property
    def dtype(self) -> torch.dtype:
        return parse_dtype(self.torch_dtype)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        return tuple(self.eos_token_id) if isinstance(self.eos_token_id, list) else (self.eos_token_id,)


def check_positive_ints(owner: str, config, names) -> None:
    """Each field of ``names`` an int >= 1 (a bool is not one); else a ValueError naming ``owner.name`` and the
    value."""
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{owner}.{name} must be a positive integer, got {value!r}")


def check_heads(owner: str, num_attention_heads: int, num_key_value_heads: int, head_dim: int) -> None:
    """Query heads a multiple of the KV heads (GQA), and a rotary head dim that is even."""
    if num_attention_heads % num_key_value_heads:
        raise ValueError(
            f"{owner}: num_attention_heads ({num_attention_heads}) must be a multiple of "
            f"num_key_value_heads ({num_key_value_heads})"
        )
    if head_dim % 2:
        raise ValueError(f"{owner}.head_dim must be even for rotary, got {head_dim}")


def check_norm_rope_dtype(owner: str, config, rope_class: type) -> None:
    """The checks a family's config ends with: ``rms_norm_eps > 0`` (a ValueError), ``rope_scaling`` None or a
    ``rope_class`` (a TypeError), ``torch_dtype`` one that :func:`parse_dtype` takes."""
    if config.rms_norm_eps <= 0:
        raise ValueError(f"{owner}.rms_norm_eps must be > 0, got {config.rms_norm_eps}")
    if config.rope_scaling is not None and not isinstance(config.rope_scaling, rope_class):
        name = type(config.rope_scaling).__name__
        raise TypeError(f"{owner}.rope_scaling must be a {rope_class.__name__} or None, got {name}")
    parse_dtype(config.torch_dtype)


def hf_fields(cls, d: dict, where: str, keep_none: tuple[str, ...] = ()) -> dict:
    """The entries of an HF ``config.json`` dict ``d`` that are fields of the dataclass ``cls`` (``None`` values left
    out, but for ``keep_none``); a ValueError naming ``where`` lists the required fields missing."""
    fields = {f.name for f in dataclasses.fields(cls)}
    kw = {k: v for k, v in d.items() if k in fields and (v is not None or k in keep_none)}
    missing = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING and f.name not in kw]
    if missing:
        raise ValueError(f"{where} lacks {missing}")
    return kw


def hf_dtype_name(d: dict) -> str:
    """The checkpoint dtype an HF config dict names (``torch_dtype``, or ``dtype`` in transformers 5), bf16 if none."""
    return str(d.get("torch_dtype") or d.get("dtype") or "bfloat16").removeprefix("torch.")
