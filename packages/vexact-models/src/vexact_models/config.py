"""What every family's config shares: dtypes, the HF architecture names, the ``dtype`` / ``eos_token_ids``
properties. Each family's config dataclass sits at the top of its model file (``models/dense.py``,
``models/qwen3_moe.py``, ``models/deepseek_v3.py``); ``load_config`` reads a ``config.json`` into one
(``loader.py``)."""

from __future__ import annotations

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
