from .deepseek_v3 import DeepseekV3ForCausalLM
from .qwen3 import Qwen3ForCausalLM
from .qwen3_moe import Qwen3MoeForCausalLM

MODEL_CLASSES = {"qwen3": Qwen3ForCausalLM, "qwen3_moe": Qwen3MoeForCausalLM, "deepseek_v3": DeepseekV3ForCausalLM}

__all__ = ["MODEL_CLASSES", "DeepseekV3ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"]
