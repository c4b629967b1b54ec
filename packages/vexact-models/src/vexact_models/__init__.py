"""vexact-models: one model definition shared by the VeXact trainer and engine."""

from .attention_metadata import AttentionMetadata
from .config import Qwen3Config, config_from_dict, load_config, parse_dtype
from .loader import CheckpointError, iter_checkpoint, load_model, load_weights, save_checkpoint
from .models import MODEL_CLASSES, Qwen3ForCausalLM
from .tiny import QWEN3_SHAPES, default_checkpoint, make_tiny_checkpoint, random_model, tiny_qwen3_config

__version__ = "0.1.0"

__all__ = [
    "MODEL_CLASSES",
    "QWEN3_SHAPES",
    "AttentionMetadata",
    "CheckpointError",
    "Qwen3Config",
    "Qwen3ForCausalLM",
    "__version__",
    "config_from_dict",
    "default_checkpoint",
    "iter_checkpoint",
    "load_config",
    "load_model",
    "load_weights",
    "make_tiny_checkpoint",
    "parse_dtype",
    "random_model",
    "save_checkpoint",
    "tiny_qwen3_config",
]
