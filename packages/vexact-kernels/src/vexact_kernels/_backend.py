"""Backend selection: ``invariant`` (fixed-order kernels) or ``fast`` (plain torch, the mismatch baseline).

The choice is explicit and scoped with :func:`use_backend`; nothing ever falls back silently from one to the other.
Below it, the attention implementation the invariant backend runs on CUDA tensors (``triton`` or ``fa4``): one per
process (:func:`set_attention_impl` or ``$VEXACT_ATTENTION``), since the two give different bits.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
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


# ---- attention implementation (invariant backend, CUDA tensors): process-wide, not per context
ATTENTION_IMPLS = ("triton", "fa4")
ATTENTION_ENV = "VEXACT_ATTENTION"


class _AttentionState:
    impl: str | None = None  # None: not resolved yet (read from $VEXACT_ATTENTION on first use)
    used: bool = False  # an op ran on CUDA tensors with it: from then on it is fixed


_attention = _AttentionState()


def _check_attention_impl(name: str, where: str) -> str:
    if name not in ATTENTION_IMPLS:
        raise ValueError(f"{where}: unknown attention implementation {name!r}; expected one of {ATTENTION_IMPLS}")
    return name


def get_attention_impl() -> str:
    """The attention implementation the ``invariant`` backend runs on CUDA tensors: ``triton`` (default; portable)
    or ``fa4`` (FlashAttention 4, Hopper/Blackwell). Read from ``$VEXACT_ATTENTION`` unless
    :func:`set_attention_impl` chose one first."""
    if _attention.impl is None:
        _attention.impl = _check_attention_impl(os.environ.get(ATTENTION_ENV, "") or "triton", f"${ATTENTION_ENV}")
    return _attention.impl


def set_attention_impl(name: str) -> None:
    """Choose the attention implementation for the whole process (trainer and engine must run the same one: their
    bits differ). Allowed until the first attention op on CUDA tensors; changing it afterwards raises."""
    _check_attention_impl(name, "set_attention_impl")
    if _attention.used and name != _attention.impl:
        raise RuntimeError(
            f"set_attention_impl({name!r}): this process already ran attention with {_attention.impl!r}; the "
            "implementation is fixed once used (choose it at start-up, or with $VEXACT_ATTENTION)"
        )
    _attention.impl = name


def attention_impl_in_use() -> str:
    """The implementation for an attention op on CUDA tensors now running; fixes the choice for the process."""
    impl = get_attention_impl()
    _attention.used = True
    return impl
