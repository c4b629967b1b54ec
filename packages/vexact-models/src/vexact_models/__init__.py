"""vexact-models: one model definition shared by the VeXact trainer and engine."""

from .attention_metadata import AttentionMetadata
from .config import (
    DeepseekV3Config,
    Qwen3Config,
    Qwen3MoeConfig,
    YarnScaling,
    config_from_dict,
    load_config,
    parse_dtype,
)
from .layers import RouterOutput, checkpoint_pieces, load_balancing_loss, record_router
from .loader import CheckpointError, expected_tensors, iter_checkpoint, load_model, load_weights, save_checkpoint
from .models import MODEL_CLASSES, DeepseekV3ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM
from .tiny import (
    DEEPSEEK_V3_SHAPES,
    QWEN3_MOE_SHAPES,
    QWEN3_SHAPES,
    default_checkpoint,
    make_tiny_checkpoint,
    random_model,
    tiny_deepseek_v3_config,
    tiny_qwen3_config,
    tiny_qwen3_moe_config,
)
from .weight_transfer import (
    BucketPacker,
    PackedBucket,
    TensorSpec,
    WeightSyncGroup,
    broadcast_weights,
    device_uuid,
    ipc_handle,
    load_bucket,
    open_ipc_handle,
    receive_weights,
    send_buckets,
    weight_targets,
)

__version__ = "0.2.0"

__all__ = [
    "DEEPSEEK_V3_SHAPES",
    "MODEL_CLASSES",
    "QWEN3_MOE_SHAPES",
    "QWEN3_SHAPES",
    "AttentionMetadata",
    "BucketPacker",
    "CheckpointError",
    "DeepseekV3Config",
    "DeepseekV3ForCausalLM",
    "PackedBucket",
    "Qwen3Config",
    "Qwen3ForCausalLM",
    "Qwen3MoeConfig",
    "Qwen3MoeForCausalLM",
    "RouterOutput",
    "TensorSpec",
    "WeightSyncGroup",
    "__version__",
    "broadcast_weights",
    "checkpoint_pieces",
    "config_from_dict",
    "default_checkpoint",
    "device_uuid",
    "expected_tensors",
    "ipc_handle",
    "iter_checkpoint",
    "load_balancing_loss",
    "load_bucket",
    "load_config",
    "load_model",
    "load_weights",
    "make_tiny_checkpoint",
    "open_ipc_handle",
    "parse_dtype",
    "random_model",
    "receive_weights",
    "record_router",
    "save_checkpoint",
    "YarnScaling",
    "tiny_deepseek_v3_config",
    "send_buckets",
    "tiny_qwen3_config",
    "tiny_qwen3_moe_config",
    "weight_targets",
]
