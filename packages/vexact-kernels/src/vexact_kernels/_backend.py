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
