from .qwen3 import Qwen3ForCausalLM

MODEL_CLASSES = {"qwen3": Qwen3ForCausalLM}

__all__ = ["MODEL_CLASSES", "Qwen3ForCausalLM"]
