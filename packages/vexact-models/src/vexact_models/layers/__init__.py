"""Shared layers: small modules that call vexact-kernels ops. Model files only assemble them.

The MoE checkpoint and routing helpers (``named_weights``, ``record_router``, ...) are in :mod:`.moe`."""

from .activation import SiluAndMul
from .attention import Attention
from .embed_head import LMHead, VocabEmbedding
from .layernorm import RMSNorm, add_rms_norm, qk_norm_rotary, rms_norm_pair
from .linear import Linear, grouped_linear
from .mla import MLAttention
from .moe import DeepseekMoeBlock, GptOssMoeBlock, SparseMoeBlock
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
    "SiluAndMul",
    "SparseMoeBlock",
    "VocabEmbedding",
    "add_rms_norm",
    "grouped_linear",
    "qk_norm_rotary",
    "rms_norm_pair",
]
