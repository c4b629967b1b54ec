"""vexact-kernels: batch-invariant ops with an explicit backend switch.

Backends: ``invariant`` (fixed-order reductions; the CPU reference in this release) and ``fast`` (plain torch:
cuBLAS/MKL, SDPA; the training-inference mismatch baseline). Select with :func:`use_backend`, for all op families
or per family (:data:`OPS`): ``use_backend("fast", ops={"attention"})``. The invariant backend's attention on CUDA
is ``triton`` or ``fa4`` (FlashAttention 4), one per process: :func:`set_attention_impl` or ``$VEXACT_ATTENTION``.
"""

from . import portable_math
from ._backend import (
    ATTENTION_IMPLS,
    BACKENDS,
    FP32_MATMUL_PRECISIONS,
    OPS,
    backend_map,
    check_backend,
    get_attention_impl,
    get_backend,
    get_fp32_matmul_precision,
    set_attention_impl,
    set_backend,
    use_backend,
    use_fp32_matmul_precision,
)
from ._ranges import record_range, tensor_range
from .activation import clamped_swiglu, silu_and_mul
from .aten_mode import disable_invariant_mode, enable_invariant_mode, invariant_mode
from .attention import ATTN_BLOCK_N, attention_packed, attention_paged, paged_attention_layout, write_kv_cache
from .linear import LINEAR_BLOCK_K, LINEAR_TUNE_MIN_M, linear, linear_picks, record_linears, tune_linears
from .logprobs import (
    compute_logits,
    entropy_from_logprobs,
    log_softmax,
    logprobs_from_hidden,
)
from .moe import fused_moe, moe_combine, moe_expert_outputs, moe_route, moe_route_grouped
from .rms_norm import add_rms_norm, rms_norm, rms_norm_pair
from .rotary import apply_rotary, apply_rotary_qk, rms_norm_rotary_qk, rope_cos_sin
from .sample import gumbel_uniform, sample_from_hidden

__version__ = "0.5.0"

__all__ = [
    "ATTENTION_IMPLS",
    "ATTN_BLOCK_N",
    "BACKENDS",
    "FP32_MATMUL_PRECISIONS",
    "OPS",
    "LINEAR_BLOCK_K",
    "LINEAR_TUNE_MIN_M",
    "__version__",
    "add_rms_norm",
    "apply_rotary",
    "apply_rotary_qk",
    "attention_packed",
    "attention_paged",
    "backend_map",
    "check_backend",
    "clamped_swiglu",
    "compute_logits",
    "disable_invariant_mode",
    "enable_invariant_mode",
    "fused_moe",
    "entropy_from_logprobs",
    "get_attention_impl",
    "get_backend",
    "get_fp32_matmul_precision",
    "gumbel_uniform",
    "invariant_mode",
    "linear",
    "linear_picks",
    "log_softmax",
    "moe_combine",
    "moe_expert_outputs",
    "moe_route",
    "moe_route_grouped",
    "record_linears",
    "record_range",
    "logprobs_from_hidden",
    "paged_attention_layout",
    "portable_math",
    "rms_norm",
    "rms_norm_pair",
    "rms_norm_rotary_qk",
    "tune_linears",
    "rope_cos_sin",
    "sample_from_hidden",
    "tensor_range",
    "set_attention_impl",
    "set_backend",
    "silu_and_mul",
    "use_backend",
    "use_fp32_matmul_precision",
    "write_kv_cache",
]
