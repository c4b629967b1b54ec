from .deepseek_v3 import DeepseekV3ForCausalLM
from .dense import DenseForCausalLM, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from .qwen3_moe import Qwen3MoeForCausalLM

MODEL_CLASSES = {
    "qwen3": Qwen3ForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
}

__all__ = [
    "MODEL_CLASSES",
    "DeepseekV3ForCausalLM",
    "DenseForCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
]
