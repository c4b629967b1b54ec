"""Invariant mode: route torch's own aten ops to batch-invariant implementations, for code we do not own.

Hugging Face modules, verl's actor and loss code call ``torch.matmul``, ``F.linear``, ``torch.log_softmax`` and
``x.pow(2).mean(-1)`` directly; they never see :func:`vexact_kernels.linear`. Inside :func:`invariant_mode` (or
between :func:`enable_invariant_mode` and :func:`disable_invariant_mode`) this module registers, through
``torch.library.Library("aten", "IMPL")``, its own kernels for the CPU (and, in CUDA builds, the CUDA) dispatch key
of these ops, so the same code runs with one fixed reduction order per row:

==========================  ==========================================================================================
aten op                     routed to
==========================  ==========================================================================================
``mm``, ``addmm``, ``mv``   :func:`vexact_kernels.linear` (``mm(a, b) = linear(a, b.T)``; addmm's ``beta``/``alpha``
                            and any broadcastable ``self`` are applied in fp32 before the one cast to the output dtype)
``bmm``, ``baddbmm``        :func:`vexact_kernels.linear` once per batch entry
``_log_softmax``            :func:`vexact_kernels.log_softmax` (fp32; the dim is moved last and the rest flattened)
``_softmax``                ``exp(x - max) / tree_sum(...)`` over the dim, in fp32 (eager attention's softmax)
``sum.dim_IntList``         :func:`vexact_kernels._reduce.tree_sum` over the reduced dims moved last and flattened,
``mean.dim``                accumulated in fp32 (fp64 for fp64), then divided (mean) and cast once
==========================  ==========================================================================================

``aten::linear`` and ``aten::matmul`` are composite: on CPU and CUDA they decompose into ``mm``/``addmm``/``bmm``
(plus views) before reaching a backend kernel, so routing those covers ``nn.Linear``, ``F.linear``, ``@``. Autograd
sits above the backend keys, so backward passes (whose formulas call ``mm``, ``_log_softmax_backward_data``, ...)
also go through the routed ``mm``/``bmm``; the ``*_backward_data`` ops themselves are elementwise plus a sum that
is not routed (see below). The kernels always run the ``invariant`` backend, whatever :func:`use_backend` says.

Invariance promised: row ``i`` of ``mm``/``addmm``/``mv``, entry ``(j, i)`` of ``bmm``/``baddbmm`` and each slice
reduced by ``_log_softmax``/``_softmax``/``sum``/``mean`` is bitwise the same whatever the other rows, batch entries
or slices are and however many of them there are. Results differ from torch's own kernels only by the rounding of a
different summation order (fp32 accumulation error; bf16/fp16 outputs are rounded once, from fp32).

Not routed (documented gaps; use vexact's own model code where they matter):

- Attention kernels: ``scaled_dot_product_attention`` and its fused backends (flash, memory-efficient, cuDNN,
  ``_scaled_dot_product_flash_attention_for_cpu``), flash-attn and other custom attention ops run unchanged. SDPA
  is not batch-invariant on GPU (measured on an H100: decode at batch 1 and 8 differ; on CPU with torch 2.13 it
  happened to be invariant at the test's shapes, which nothing guarantees). The supported path is eager
  attention (HF ``attn_implementation="eager"``): its ``matmul``/``softmax`` go through ``bmm`` and ``_softmax``
  here. Invariant attention over packed/paged KV is :func:`vexact_kernels.attention_packed` / ``attention_paged``.
- Full reductions with no ``dim`` (``aten::sum.default``, ``aten::mean.default``: e.g. a loss's ``x.sum()``), which
  have no rows to be invariant over; ``dot``, ``addmv``, ``addbmm``, ``_addmm_activation``, ``cumsum``,
  ``var``/``std``, ``native_layer_norm``, ``_fused_rms_norm``, ``.out=`` and ``out_dtype`` overloads, sparse,
  quantized and fp8 (``_scaled_mm``) ops; ``aten::linear`` on devices where it is a fused kernel of its own.
- Code compiled with ``torch.compile`` (inductor emits its own reductions and calls ``.out`` matmuls) and custom
  kernels that bypass aten (flash-attn's fused cross-entropy, Liger kernels): in verl, select the plain torch
  logprob/entropy path when the mode is on.
- Devices other than CPU and CUDA. On CUDA the routed matmuls and ``_log_softmax`` call vexact's Triton kernels (via
  :func:`vexact_kernels.linear` / :func:`vexact_kernels.log_softmax`) and the reductions run the same torch-level
  tree on the GPU (elementwise adds are deterministic there too); this module's tests run on CPU only.

Dtypes: integer and bool ``mm``/``bmm``/``addmm``/``baddbmm``/``mv`` and integer/bool ``sum`` are exact whatever the
order, so they call the original aten kernel. Floating ops this module cannot run (float64 or complex matmul and
log-softmax, complex reductions) raise ``NotImplementedError`` instead of falling back to a batch-variant kernel.

Scope and threads: the registration is process-wide (every thread's CPU/CUDA ``mm`` is routed while the mode is on),
it replaces whatever kernel was registered before (for instance another batch-invariant library's) and restores that
one on exit. :func:`invariant_mode` blocks nest and may be used from several threads; the mode stays on while any
block is open or :func:`enable_invariant_mode` is in force. Inside a routed kernel a thread-local flag sends any
nested call of a routed op to the original kernel, so the implementations can never recurse into themselves.

Use with HF / verl::

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.bfloat16)
    with vexact_kernels.invariant_mode():
        logits = model(input_ids).logits            # a row's logits do not depend on the rest of the batch
        logp = torch.log_softmax(logits.float(), -1)

In verl's actor, wrap the forward (and backward) of ``compute_log_prob`` / ``update_policy`` in ``invariant_mode()``
or call :func:`enable_invariant_mode` once at worker start-up; vexact-verl does this. Python-level kernels are slow
on CPU and launch one kernel per ``bmm`` batch entry on GPU: use the mode for correctness, vexact models for speed.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator

import torch

from . import portable_math as pm
from ._backend import use_backend
from ._reduce import tree_sum
from .linear import linear
from .logprobs import log_softmax as _vexact_log_softmax

_MATMUL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_REDUCE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_lock = threading.Lock()
_state = threading.local()  # .bypass: inside a routed kernel, nested routed ops go to the original kernels
_open_blocks = 0  # invariant_mode() blocks currently open, over all threads
_explicit = False  # enable_invariant_mode() in force
_lib: torch.library.Library | None = None
_originals: dict[tuple[str, str], torch._C._SafeKernelFunction] = {}


def _dispatch_keys() -> tuple[str, ...]:
    return ("CPU", "CUDA") if torch.backends.cuda.is_built() else ("CPU",)


def _original(op: str, keyset) -> torch._C._SafeKernelFunction:
    key = "CUDA" if keyset.has(torch._C.DispatchKey.CUDA) else "CPU"
    return _originals[(op, key)]


def _call_original(op: str, keyset, *args, **kwargs):
    return _original(op, keyset).call_boxed(keyset, *args, **kwargs)


def _is_exact_dtype(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex


def _check_matmul_dtype(op: str, *tensors: torch.Tensor) -> None:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise RuntimeError(f"invariant_mode aten::{op}: expected operands of one dtype, got {sorted(map(str, dtypes))}")
    dtype = tensors[0].dtype
    if dtype not in _MATMUL_DTYPES:
        raise NotImplementedError(
            f"invariant_mode aten::{op}: no batch-invariant kernel for dtype {dtype} "
            f"(supported: {', '.join(map(str, _MATMUL_DTYPES))}); refusing to fall back to a batch-variant kernel"
        )


def _matmul_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [M, K] @ b [K, N]`` accumulated by :func:`linear` in fp32; any strides, values unchanged."""
    if a.shape[1] == 0:  # empty reduction: exact zeros, nothing to order
        return a.new_zeros(a.shape[0], b.shape[1], dtype=torch.float32)
    return linear(a, b.t(), out_dtype=torch.float32)


def _epilogue(prod: torch.Tensor, bias: torch.Tensor, beta, alpha, out_dtype: torch.dtype) -> torch.Tensor:
    """``beta * bias + alpha * prod`` in fp32 (elementwise, so still per-row), cast once."""
    if alpha != 1:
        prod = prod * alpha
    if beta != 0:  # beta == 0 ignores bias entirely, NaNs included, as torch does
        b = bias.float()
        prod = prod + (b if beta == 1 else b * beta)
    return prod.to(out_dtype)


def _check_mm(op: str, a: torch.Tensor, b: torch.Tensor) -> None:
    """``a [m, k]`` and ``b [k, n]``, else a RuntimeError as torch raises one."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise RuntimeError(f"invariant_mode aten::{op}: cannot multiply {tuple(a.shape)} by {tuple(b.shape)}")


def _mm(keyset, a, b):
    if _is_exact_dtype(a.dtype) and _is_exact_dtype(b.dtype):
        return _call_original("mm", keyset, a, b)
    _check_matmul_dtype("mm", a, b)
    _check_mm("mm", a, b)
    if a.shape[1] == 0:
        return a.new_zeros(a.shape[0], b.shape[1])
    return linear(a, b.t())


def _addmm(keyset, bias, a, b, *, beta=1, alpha=1):
    if _is_exact_dtype(a.dtype) and _is_exact_dtype(b.dtype):
        return _call_original("addmm", keyset, bias, a, b, beta=beta, alpha=alpha)
    _check_matmul_dtype("addmm", bias, a, b)
    _check_mm("addmm", a, b)
    m, n = a.shape[0], b.shape[1]
    torch.broadcast_shapes(bias.shape, (m, n))  # raises like torch for a bias that does not broadcast
    if beta == 1 and alpha == 1 and bias.shape == (n,) and a.shape[1] != 0:
        return linear(a, b.t(), bias)  # the common nn.Linear case, in linear's own (fused, on GPU) epilogue
    return _epilogue(_matmul_fp32(a, b), bias, beta, alpha, a.dtype).expand(m, n).contiguous()


def _mv(keyset, a, v):
    if _is_exact_dtype(a.dtype) and _is_exact_dtype(v.dtype):
        return _call_original("mv", keyset, a, v)
    _check_matmul_dtype("mv", a, v)
    if a.dim() != 2 or v.dim() != 1 or a.shape[1] != v.shape[0]:
        raise RuntimeError(f"invariant_mode aten::mv: cannot multiply {tuple(a.shape)} by {tuple(v.shape)}")
    return _matmul_fp32(a, v.unsqueeze(1)).squeeze(1).to(a.dtype)


def _bmm_fp32(op: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise RuntimeError(f"invariant_mode aten::{op}: cannot batch-multiply {tuple(a.shape)} by {tuple(b.shape)}")
    out = a.new_empty(a.shape[0], a.shape[1], b.shape[2], dtype=torch.float32)
    # One linear per batch entry: entry j's rows never share a reduction with another entry's.
    for j in range(a.shape[0]):
        out[j] = _matmul_fp32(a[j], b[j])
    return out


def _bmm(keyset, a, b):
    if _is_exact_dtype(a.dtype) and _is_exact_dtype(b.dtype):
        return _call_original("bmm", keyset, a, b)
    _check_matmul_dtype("bmm", a, b)
    return _bmm_fp32("bmm", a, b).to(a.dtype)


def _baddbmm(keyset, bias, a, b, *, beta=1, alpha=1):
    if _is_exact_dtype(a.dtype) and _is_exact_dtype(b.dtype):
        return _call_original("baddbmm", keyset, bias, a, b, beta=beta, alpha=alpha)
    _check_matmul_dtype("baddbmm", bias, a, b)
    prod = _bmm_fp32("baddbmm", a, b)
    torch.broadcast_shapes(bias.shape, prod.shape)
    return _epilogue(prod, bias, beta, alpha, a.dtype).expand(prod.shape).contiguous()


def _rows_last(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """``x`` as ``[rows, x.shape[dim]]`` and the function that puts a result of that shape back."""
    if x.dim() == 0:
        return x.reshape(1, 1), lambda y: y.reshape(())
    moved = x.movedim(dim, -1)
    shape = moved.shape
    return moved.reshape(-1, shape[-1]), lambda y: y.reshape(shape).movedim(-1, dim)


def _softmax_out_dtype(op: str, x: torch.Tensor, half_to_float: bool) -> torch.dtype:
    if x.dtype not in _MATMUL_DTYPES:
        raise NotImplementedError(
            f"invariant_mode aten::{op}: no batch-invariant kernel for dtype {x.dtype} "
            f"(supported: {', '.join(map(str, _MATMUL_DTYPES))}); refusing to fall back to a batch-variant kernel"
        )
    return torch.float32 if half_to_float else x.dtype


def _log_softmax(keyset, x, dim, half_to_float):
    out_dtype = _softmax_out_dtype("_log_softmax", x, half_to_float)
    if x.numel() == 0:
        return x.new_empty(x.shape, dtype=out_dtype)
    rows, restore = _rows_last(x, dim)
    return restore(_vexact_log_softmax(rows.float())).to(out_dtype).contiguous()


def _softmax(keyset, x, dim, half_to_float):
    out_dtype = _softmax_out_dtype("_softmax", x, half_to_float)
    if x.numel() == 0:
        return x.new_empty(x.shape, dtype=out_dtype)
    rows, restore = _rows_last(x, dim)
    rows = rows.float()
    e = pm.exp(rows - rows.amax(dim=-1, keepdim=True))  # max is exact in any order; torch.exp off the CPU
    return restore(e / tree_sum(e, dim=-1).unsqueeze(-1)).to(out_dtype).contiguous()


def _reduce_dims(x: torch.Tensor, dim) -> list[int]:
    if dim is None or len(dim) == 0:  # aten: an empty dim list reduces over everything
        return list(range(x.dim()))
    bad = [d for d in dim if not -x.dim() <= d < x.dim()]
    if bad:
        raise IndexError(f"invariant_mode: dim {bad[0]} out of range [{-x.dim()}, {x.dim() - 1}]")
    dims = sorted({d % x.dim() for d in dim})
    if len(dims) != len(dim):
        raise RuntimeError(f"invariant_mode: dim {list(dim)} names a dimension twice")
    return dims


def _fixed_order_sum(x: torch.Tensor, dim, keepdim: bool, out_dtype: torch.dtype, divide: bool) -> torch.Tensor:
    """Sum (or mean) over ``dim``: reduced dims moved last and flattened, one pairwise tree per kept position."""
    # like aten, an explicit dtype converts the input first; half-precision inputs accumulate in fp32
    acc_dtype = torch.float64 if out_dtype == torch.float64 else torch.float32
    if x.dim() == 0:
        dims, kept, n, rows = [], [], 1, x.reshape(1)
    else:
        dims = _reduce_dims(x, dim)
        kept = [d for d in range(x.dim()) if d not in dims]
        n = 1
        for d in dims:
            n *= x.shape[d]
        rows = x.permute(kept + dims).reshape(*[x.shape[d] for d in kept], n)
    rows = rows.to(acc_dtype)
    total = tree_sum(rows, dim=-1) if n else rows.new_zeros(rows.shape[:-1])
    if divide:
        total = total / n
    if keepdim:
        total = total.reshape([1 if d in dims else s for d, s in enumerate(x.shape)])
    return total.to(out_dtype)


def _check_reduce_dtype(op: str, dtype: torch.dtype) -> None:
    if dtype not in _REDUCE_DTYPES:
        raise NotImplementedError(
            f"invariant_mode aten::{op}: no batch-invariant kernel for dtype {dtype} "
            f"(supported: {', '.join(map(str, _REDUCE_DTYPES))}); refusing to fall back to a batch-variant kernel"
        )


def _sum(keyset, x, dim=None, keepdim=False, *, dtype=None):
    out_dtype = dtype if dtype is not None else (torch.int64 if _is_exact_dtype(x.dtype) else x.dtype)
    if _is_exact_dtype(out_dtype):  # integer sums are exact (wrap-around is associative too)
        return _call_original("sum.dim_IntList", keyset, x, dim, keepdim, dtype=dtype)
    _check_reduce_dtype("sum.dim_IntList", out_dtype)
    return _fixed_order_sum(x, dim, keepdim, out_dtype, divide=False)


def _mean(keyset, x, dim=None, keepdim=False, *, dtype=None):
    out_dtype = dtype if dtype is not None else x.dtype
    if _is_exact_dtype(out_dtype):  # torch rejects these itself, with its own message
        return _call_original("mean.dim", keyset, x, dim, keepdim, dtype=dtype)
    _check_reduce_dtype("mean.dim", out_dtype)
    return _fixed_order_sum(x, dim, keepdim, out_dtype, divide=True)


_IMPLS: dict[str, Callable] = {
    "mm": _mm,
    "addmm": _addmm,
    "mv": _mv,
    "bmm": _bmm,
    "baddbmm": _baddbmm,
    "_log_softmax": _log_softmax,
    "_softmax": _softmax,
    "sum.dim_IntList": _sum,
    "mean.dim": _mean,
}


def _routed(op: str, impl: Callable) -> Callable:
    def kernel(keyset, *args, **kwargs):
        if getattr(_state, "bypass", False):
            return _call_original(op, keyset, *args, **kwargs)
        _state.bypass = True
        try:
            # Below autograd already; no_grad also keeps vexact's ops from building autograd.Functions of their own.
            with use_backend("invariant"), torch.no_grad():
                return impl(keyset, *args, **kwargs)
        finally:
            _state.bypass = False

    kernel.__name__ = f"vexact_invariant_{op.replace('.', '_')}"
    return kernel


def _sync_registration() -> None:
    """Register or unregister the kernels so they are in force exactly when some caller wants the mode. Holds _lock."""
    global _lib
    want = _explicit or _open_blocks > 0
    if want and _lib is None:
        lib = torch.library.Library("aten", "IMPL")
        try:
            for key in _dispatch_keys():
                for op in _IMPLS:  # read before registering: afterwards the computed kernel is ours
                    _originals[(op, key)] = torch.library.get_kernel(f"aten::{op}", key)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
                for key in _dispatch_keys():
                    for op, impl in _IMPLS.items():
                        lib.impl(op, _routed(op, impl), key, with_keyset=True)
        except BaseException:
            lib._destroy()
            raise
        _lib = lib
    elif not want and _lib is not None:
        _lib._destroy()  # deregisters our kernels: the dispatcher recomputes the originals
        _lib = None


def is_invariant_mode_enabled() -> bool:
    """Whether torch's aten ops are routed to the invariant kernels right now."""
    return _lib is not None


def enable_invariant_mode() -> None:
    """Route aten ops to the invariant kernels until :func:`disable_invariant_mode` (idempotent)."""
    global _explicit
    with _lock:
        _explicit = True
        _sync_registration()


def disable_invariant_mode() -> None:
    """Undo :func:`enable_invariant_mode` (idempotent); open :func:`invariant_mode` blocks keep the mode on."""
    global _explicit
    with _lock:
        _explicit = False
        _sync_registration()


@contextlib.contextmanager
def invariant_mode() -> Iterator[None]:
    """Route torch's mm/addmm/mv/bmm/baddbmm, _log_softmax/_softmax and sum/mean over dims to invariant kernels.

    Blocks nest; leaving the outermost one (normally or by an exception) restores the original kernels, unless
    :func:`enable_invariant_mode` is in force.
    """
    global _open_blocks
    with _lock:
        _open_blocks += 1
        try:
            _sync_registration()
        except BaseException:
            _open_blocks -= 1
            raise
    try:
        yield
    finally:
        with _lock:
            _open_blocks -= 1
            _sync_registration()
