from .deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM, YarnScaling
from .dense import (
    DenseConfig,
    DenseForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from .gpt_oss import GptOssConfig, GptOssForCausalLM
from .qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM

CONFIG_CLASSES: dict[str, type] = {
    "qwen3": Qwen3Config,
    "qwen3_moe": Qwen3MoeConfig,
    "qwen2": Qwen2Config,
    "llama": LlamaConfig,
    "mistral": MistralConfig,
    "deepseek_v3": DeepseekV3Config,
    "gpt_oss": GptOssConfig,
}
MODEL_CLASSES = {
    "qwen3": Qwen3ForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
    "gpt_oss": GptOssForCausalLM,
}

__all__ = [
    "CONFIG_CLASSES",
    "MODEL_CLASSES",
    "DeepseekV3Config",
    "DenseConfig",
    "GptOssConfig",
    "LlamaConfig",
    "MistralConfig",
    "Qwen2Config",
    "Qwen3Config",
    "Qwen3MoeConfig",
    "YarnScaling",
    "DeepseekV3ForCausalLM",
    "DenseForCausalLM",
    "GptOssForCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
]
