"""Backend selection: ``invariant`` (fixed-order kernels) or ``fast`` (plain torch, the mismatch baseline).

The choice is explicit and scoped with :func:`use_backend`; nothing ever falls back silently from one to the other.
It is made per op family (:data:`OPS`), so a training-inference mismatch study can run the ``fast`` kernel of one
family while every other family stays ``invariant``:

- ``use_backend("fast")``: every family on ``fast`` (the global switch; unchanged for existing callers).
- ``use_backend("fast", ops={"linear"})``: the listed families on ``fast``, the others as in the enclosing context.
- a backend *spec* string, for configs: ``"invariant"``, ``"fast"``, or ``"fast:linear,attention"`` (the listed
  families on ``fast``, the rest ``invariant``). :func:`get_backend` returns the spec in force, in that form.

Op families: ``linear`` (every projection but the lm_head), ``attention`` (packed, paged, KV-cache writes),
``rms_norm``, ``rotary``, ``activation`` (silu_and_mul), ``logprobs`` (lm_head matmul, log_softmax, entropy, the
fused logprobs kernel) and ``moe`` (routing and the fused expert MLP).

Below it, the attention implementation the invariant backend runs on CUDA tensors (``triton`` or ``fa4``): one per
process (:func:`set_attention_impl` or ``$VEXACT_ATTENTION``), since the two give different bits.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterable, Iterator, Mapping

BACKENDS = ("invariant", "fast")
OPS = ("linear", "attention", "rms_norm", "rotary", "activation", "logprobs", "moe")
FLOAT_DTYPES = ("torch.bfloat16", "torch.float16", "torch.float32")

_ALL_INVARIANT = tuple("invariant" for _ in OPS)
_current: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("vexact_backend", default=_ALL_INVARIANT)

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


def _check_name(name: object) -> str:
    if name not in BACKENDS:
        raise ValueError(
            f"unknown kernel backend {name!r}; expected one of {BACKENDS} or 'fast:<ops>' with ops in {OPS}"
        )
    return name  # type: ignore[return-value]


def _check_ops(ops: Iterable[str], spec: object) -> tuple[str, ...]:
    if isinstance(ops, str):
        raise TypeError(f"ops must be a collection of op family names, not the string {ops!r}")
    ops = tuple(ops)
    bad = [o for o in ops if o not in OPS]
    if bad or not ops:
        raise ValueError(f"unknown kernel backend {spec!r}: op families must be a non-empty subset of {OPS}; got {ops}")
    return ops


def _parse(spec: str) -> tuple[str, ...]:
    """A spec string as one backend name per op family (in :data:`OPS` order)."""
    if isinstance(spec, str) and ":" in spec:
        name, _, listed = spec.partition(":")
        name = _check_name(name)
        ops = _check_ops([o.strip() for o in listed.split(",")], spec)
        return tuple(name if op in ops else "invariant" for op in OPS)
    name = _check_name(spec)
    return tuple(name for _ in OPS)


def _format(state: tuple[str, ...]) -> str:
    if len(set(state)) == 1:
        return state[0]
    return "fast:" + ",".join(op for op, b in zip(OPS, state, strict=True) if b == "fast")


def check_backend(spec: str, field: str | None = None) -> str:
    """Validate a backend spec (``invariant``, ``fast``, ``fast:<op>,<op>``); returns it in canonical form.
    ``field``: the config field that holds ``spec``; a bad spec then raises one ValueError naming the field and every
    allowed spec."""
    try:
        return _format(_parse(spec))
    except (ValueError, TypeError):
        if field is None:
            raise
        raise ValueError(
            f"{field} must be one of {BACKENDS}, got {spec!r} (or 'fast:<op>,...' with ops in {OPS})"
        ) from None


def get_backend(op: str | None = None) -> str:
    """The backend of op family ``op`` in this context; without ``op``, the whole spec in force (``invariant``
    unless :func:`use_backend` says otherwise; ``fast:<ops>`` when the families differ)."""
    state = _current.get()
    if op is None:
        return _format(state)
    if op not in OPS:
        raise ValueError(f"unknown op family {op!r}; expected one of {OPS}")
    return state[OPS.index(op)]


def backend_map() -> dict[str, str]:
    """``{op family: backend}`` in force in this context."""
    return dict(zip(OPS, _current.get(), strict=True))


def _new_state(spec: str | Mapping[str, str], ops: Iterable[str] | None) -> tuple[str, ...]:
    if isinstance(spec, Mapping):
        if ops is not None:
            raise TypeError("use_backend: give either a {op: backend} mapping or a name with ops, not both")
        _check_ops(spec, dict(spec))
        for b in spec.values():
            _check_name(b)
        return tuple(spec.get(op, cur) for op, cur in zip(OPS, _current.get(), strict=True))
    if ops is None:
        return _parse(spec)
    name = _check_name(spec)
    ops = _check_ops(ops, spec)
    return tuple(name if op in ops else cur for op, cur in zip(OPS, _current.get(), strict=True))


def set_backend(spec: str | Mapping[str, str], ops: Iterable[str] | None = None) -> None:
    """Set the backend for the current context (prefer the scoped :func:`use_backend`)."""
    _current.set(_new_state(spec, ops))


@contextlib.contextmanager
def use_backend(spec: str | Mapping[str, str], ops: Iterable[str] | None = None) -> Iterator[None]:
    """Run the enclosed ops on backend ``spec``.

    ``spec``: a backend name or spec string (sets every family), or a ``{op family: backend}`` mapping (sets those
    families only). With ``ops``, only the listed families take ``spec`` (a backend name); the others keep the
    backend of the enclosing context.
    """
    token = _current.set(_new_state(spec, ops))
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


# ---- attention implementation (invariant backend, CUDA tensors): process-wide, not per context
ATTENTION_IMPLS = ("triton", "fa4")
ATTENTION_ENV = "VEXACT_ATTENTION"
# "auto": FA4 where it runs (Hopper or Blackwell, flash_attn.cute importable), else the Triton kernel; resolved once,
# at the first question, to one of ATTENTION_IMPLS
ATTENTION_CHOICES = ("auto", *ATTENTION_IMPLS)
# auto by default: FA4 is faster on Hopper at every size measured (benchmarks/results/attention-h100.md: prefill
# forward 2.1-2.6x ours; the engine's decode steps 1.6-1.9x faster in a run shared with other jobs, the trainer step
# 1.02x, on an H200: benchmarks/results/throughput-fa4-h200.md, trainer-fa4-h200.md); it runs only where installed
DEFAULT_ATTENTION = "auto"


class _AttentionState:
    impl: str | None = None  # None: not resolved yet (read from $VEXACT_ATTENTION on first use)
    used: bool = False  # an op ran on CUDA tensors with it: from then on it is fixed


_attention = _AttentionState()


def _check_attention_impl(name: str, where: str) -> str:
    """A valid choice, with ``auto`` resolved to the implementation it stands for here."""
    if name not in ATTENTION_CHOICES:
        raise ValueError(f"{where}: unknown attention implementation {name!r}; expected one of {ATTENTION_CHOICES}")
    return _auto_attention_impl() if name == "auto" else name


def _auto_attention_impl() -> str:
    """``fa4`` on a Hopper or Blackwell GPU where flash_attn.cute imports, else ``triton``."""
    import torch

    from .fa4_attention import FA4_CAPABILITY_MAJORS, fa4_importable

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in FA4_CAPABILITY_MAJORS:
        return "triton"
    return "fa4" if fa4_importable()[0] else "triton"


def get_attention_impl() -> str:
    """The attention implementation the ``invariant`` backend runs on CUDA tensors: ``triton`` (portable) or ``fa4``
    (FlashAttention 4, Hopper/Blackwell). Read from ``$VEXACT_ATTENTION`` (``triton``, ``fa4`` or ``auto``; unset:
    :data:`DEFAULT_ATTENTION`) unless :func:`set_attention_impl` chose one first."""
    if _attention.impl is None:
        name = os.environ.get(ATTENTION_ENV, "") or DEFAULT_ATTENTION
        _attention.impl = _check_attention_impl(name, f"${ATTENTION_ENV}")
    return _attention.impl


def set_attention_impl(name: str) -> None:
    """Choose the attention implementation for the whole process (trainer and engine must run the same one: their
    bits differ). ``auto`` picks ``fa4`` where it runs, else ``triton``. Allowed until the first attention op on
    CUDA tensors; changing it afterwards raises."""
    name = _check_attention_impl(name, "set_attention_impl")
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
