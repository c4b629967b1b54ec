"""Backend selection: ``invariant`` (fixed-order kernels) or ``fast`` (plain torch, the mismatch baseline).

The choice is explicit and scoped with :func:`use_backend`; nothing ever falls back silently from one to the other.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

BACKENDS = ("invariant", "fast")
FLOAT_DTYPES = ("torch.bfloat16", "torch.float16", "torch.float32")

_current: contextvars.ContextVar[str] = contextvars.ContextVar("vexact_backend", default="invariant")

# How the GPU kernels' tensor-core dot (Triton's ``tl.dot``) multiplies fp32 operands; a numerics choice, named here
# only. "ieee": fp32 products and sums (CUDA cores, no tensor cores), so an fp32 linear means fp32, like the CPU
# reference; "tf32": Triton's default, each operand rounded to a 10-bit mantissa on the tensor cores (several times
# faster, relative error ~1e-3); "tf32x3": three tf32 products, close to fp32. Either way a row's bits never depend on
# the batch. 16-bit operands always run on the tensor cores at full precision: the choice does not apply to them.
# The CPU reference is exact fp32 whatever this says.
FP32_MATMUL_PRECISIONS = ("ieee", "tf32", "tf32x3")
DEFAULT_FP32_MATMUL_PRECISION = "ieee"
_fp32_precision: contextvars.ContextVar[str] = contextvars.ContextVar(
    "vexact_fp32_matmul_precision", default=DEFAULT_FP32_MATMUL_PRECISION
)


def check_backend(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; expected one of {BACKENDS}")
    return name


def get_backend() -> str:
    """The backend in force in this context (``invariant`` unless :func:`use_backend` says otherwise)."""
    return _current.get()


def set_backend(name: str) -> None:
    """Set the backend for the current context (prefer the scoped :func:`use_backend`)."""
    _current.set(check_backend(name))


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Run the enclosed ops on backend ``name``."""
    token = _current.set(check_backend(name))
    try:
        yield
    finally:
        _current.reset(token)


def get_fp32_matmul_precision() -> str:
    """How fp32 matmuls run on the GPU in this context: ``ieee`` unless :func:`use_fp32_matmul_precision` says
    otherwise (see ``FP32_MATMUL_PRECISIONS``)."""
    return _fp32_precision.get()


@contextlib.contextmanager
def use_fp32_matmul_precision(name: str) -> Iterator[None]:
    """Run the enclosed fp32 matmuls (linear, the MoE GEMMs) on the GPU with ``tl.dot`` input precision ``name``:
    ``ieee`` (default: fp32 means fp32), ``tf32`` or ``tf32x3``. No effect on 16-bit operands or on CPU tensors."""
    if name not in FP32_MATMUL_PRECISIONS:
        raise ValueError(f"unknown fp32 matmul precision {name!r}; expected one of {FP32_MATMUL_PRECISIONS}")
    token = _fp32_precision.set(name)
    try:
        yield
    finally:
        _fp32_precision.reset(token)


def invariant_device_check(op: str, *tensors) -> None:
    """Refuse devices the invariant backend has no kernels for (it has Triton kernels for CUDA, a reference for CPU)."""
    for t in tensors:
        if t is not None and t.device.type != "cpu":
            raise NotImplementedError(
                f"vexact_kernels.{op}: the invariant backend has no kernel for device {t.device.type!r} "
                "(it runs on CUDA and CPU tensors); use one of those or the 'fast' backend"
            )


def check_float(op: str, name: str, t) -> None:
    if str(t.dtype) not in FLOAT_DTYPES:
        raise TypeError(f"vexact_kernels.{op}: {name} has dtype {t.dtype}; expected one of {FLOAT_DTYPES}")
