"""Shared layers: small modules that call vexact-kernels ops. Model files only assemble them."""

from .activation import SiluAndMul
from .attention import Attention
from .embed_head import LMHead, VocabEmbedding
from .layernorm import RMSNorm, add_rms_norm, rms_norm_pair
from .linear import Linear, grouped_linear
from .mla import MLAttention
from .moe import (
    DeepseekMoeBlock,
    GptOssMoeBlock,
    RouterOutput,
    SparseMoeBlock,
    checkpoint_pieces,
    load_balancing_loss,
    named_weights,
    record_router,
    stacked_experts,
    weight_dtype,
)
from .rotary import RotaryEmbedding

__all__ = [
    "Attention",
    "DeepseekMoeBlock",
    "GptOssMoeBlock",
    "LMHead",
    "Linear",
    "MLAttention",
    "RMSNorm",
    "RotaryEmbedding",
    "RouterOutput",
    "SiluAndMul",
    "SparseMoeBlock",
    "VocabEmbedding",
    "add_rms_norm",
    "checkpoint_pieces",
    "grouped_linear",
    "load_balancing_loss",
    "named_weights",
    "record_router",
    "stacked_experts",
    "rms_norm_pair",
    "weight_dtype",
]
