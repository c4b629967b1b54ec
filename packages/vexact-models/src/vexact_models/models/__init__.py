from .dense import DenseForCausalLM, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from .qwen3_moe import Qwen3MoeForCausalLM

MODEL_CLASSES = {
    "qwen3": Qwen3ForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
}

__all__ = [
    "MODEL_CLASSES",
    "DenseForCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
]
