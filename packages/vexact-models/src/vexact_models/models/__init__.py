from .qwen3 import Qwen3ForCausalLM
from .qwen3_moe import Qwen3MoeForCausalLM

MODEL_CLASSES = {"qwen3": Qwen3ForCausalLM, "qwen3_moe": Qwen3MoeForCausalLM}

__all__ = ["MODEL_CLASSES", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"]
