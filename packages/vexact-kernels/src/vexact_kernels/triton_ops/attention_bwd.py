"""Invariant attention on GPU, backward, and the differentiable packed op (training).

The forward kernels, their rule and constants are in ``attention.py``; this file holds the packed path: its layout
(built once per ``cu_seqlens``, :func:`packed_layout`), its backward and the ``torch.autograd.Function`` that pairs the
two. Deterministic, no atomics: ``_attn_bwd_dkdv`` owns one KV tile of
one KV head and loops, in order, over the query rows (all ``G`` heads of the group) that can see it; ``_attn_bwd_dq``
owns a query tile and loops over its key tiles. ``delta = rowsum(dO * O)`` is a plain torch reduction (fixed shape, no
atomics). Gradients are run-to-run identical; they are not promised batch-invariant (no one compares them across
batch compositions). The backward reads the forward's base-2 log-sum-exp per row, whatever split structure made it.

A sliding window (``WINDOW``, constexpr; off: the code without it) masks keys ``pos <= t - window`` and bounds both
loops to the keys or queries a window can reach. Sinks change no kernel here: the forward's LSE includes them, so
``p = exp2(s - lse)`` is already each key's share; a sink's own gradient, ``-sum_t p_sink(t) * delta(t)`` over its
head's rows, is a torch reduction of fixed shape.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import torch
import triton
import triton.language as tl

from . import interpreting, next_pow2
from .attention import (
    _LOG2E,
    _PACKED_PAGE,
    _check_shapes,
    _fwd,
    _fwd_tiles,
    _last_dim_contiguous,
    _load_rows,
    _mma,
    _tile_seq,
    _tiles,
)

# Backward: only determinism depends on these (not the forward's bits); may be tuned.
BWD_BLOCK_M = 64
BWD_BLOCK_N = 64
BWD_NUM_WARPS = 4
BWD_NUM_STAGES = 2


@triton.jit
def _load_kv(K, V, k_rows, kvh, kin, offs_dk, offs_dv, stride_kt, stride_kh, stride_vt, stride_vh, DK: tl.constexpr,
             DV: tl.constexpr):  # fmt: skip
    """The K and V rows ``k_rows`` of KV head ``kvh`` (zeros where ``kin`` is False or past the head dims)."""
    k = _load_rows(K, k_rows, kvh, kin, offs_dk, stride_kt, stride_kh, DK)
    v = _load_rows(V, k_rows, kvh, kin, offs_dv, stride_vt, stride_vh, DV)
    return k, v


@triton.jit
def _tile_span(TILE_X0, CU, tile, b, BLOCK: tl.constexpr):
    """Tile ``tile``'s first key or query row ``x0`` (``TILE_X0``), its ``BLOCK`` positions from ``x0``, and its
    sequence ``b``'s first token and length."""
    x0 = tl.load(TILE_X0 + tile)
    s0 = tl.load(CU + b)
    n = tl.load(CU + b + 1) - s0
    return x0, x0 + tl.arange(0, BLOCK), s0, n


@triton.jit
def _store_rows(P, rows, h, x, ok, offs_d, stride_t, stride_h, D: tl.constexpr):
    """``P[rows, h, :D] = x`` cast to ``P``'s type, where ``ok`` (``h`` as in :func:`_load_rows`)."""
    tl.store(
        P + rows[:, None] * stride_t + h * stride_h + offs_d[None, :],
        x.to(P.dtype.element_ty),
        mask=ok[:, None] & (offs_d[None, :] < D),
    )


@triton.jit
def _probs(q, k, lse, qk_scale, kpos, t, seen, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           UPCAST: tl.constexpr, WINDOW: tl.constexpr):  # fmt: skip
    """The forward's probabilities ``exp2(q k^T * qk_scale - lse)`` of the keys a row has ``seen`` (and, with a
    window, only those ``> t - window``); 0 elsewhere."""
    qk = _mma(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), UPCAST) * qk_scale
    if WINDOW:
        seen = seen & (kpos[None, :] > t[:, None] - window)
    return tl.where(seen, tl.math.exp2(qk - lse[:, None]), 0.0)


@triton.jit
def _attn_bwd_dkdv(
    Q, K, V, DO, LSE, DELTA, DKO, DVO, TILE_SEQ, TILE_K0, CU, num_seqs,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_lt,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, qk_scale, sm_scale, window, G: tl.constexpr, DK: tl.constexpr,
    DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, WINDOW: tl.constexpr = False,
):  # fmt: skip
    """dK and dV of one KV tile: its keys' gradients over every query row (all ``G`` heads) that sees them, in order."""
    tile, kvh, _, b = _tile_seq(TILE_SEQ, False)
    if b >= num_seqs:
        return
    k0, offs_n, s0, n = _tile_span(TILE_K0, CU, tile, b, BLOCK_N)
    kin = offs_n < n
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    k_rows = (s0 + offs_n).to(tl.int64)
    k, v = _load_kv(K, V, k_rows, kvh, kin, offs_dk, offs_dv, stride_kt, stride_kh, stride_vt, stride_vh, DK, DV)
    dk = tl.zeros([BLOCK_N, BLOCK_DK], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    q_end = n
    if WINDOW:  # the last query that sees this tile's last key
        q_end = tl.minimum(n, k0 + BLOCK_N - 1 + window)
    for r0 in range(k0 * G, q_end * G, BLOCK_M):
        offs_m = r0 + tl.arange(0, BLOCK_M)
        t = offs_m // G
        head = kvh * G + offs_m % G
        ok = t < n
        q_rows = (s0 + t).to(tl.int64)
        # written out, not through _load_rows: through it, the MLA shape's (Dk 192) spills land in other stack slots,
        # a different SASS (scripts/tuning/sass_diff.py) from the one the GPU fixtures were recorded with
        q = tl.load(
            Q + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_dk[None, :],
            mask=ok[:, None] & (offs_dk[None, :] < DK),
            other=0.0,
        )
        do = tl.load(
            DO + q_rows[:, None] * stride_dot + head[:, None] * stride_doh + offs_dv[None, :],
            mask=ok[:, None] & (offs_dv[None, :] < DV),
            other=0.0,
        )
        lse = tl.load(LSE + q_rows * stride_lt + head, mask=ok, other=0.0)
        delta = tl.load(DELTA + q_rows * stride_lt + head, mask=ok, other=0.0)
        seen = (offs_n[None, :] <= t[:, None]) & ok[:, None] & kin[None, :]
        p = _probs(q, k, lse, qk_scale, offs_n, t, seen, window, BLOCK_M, BLOCK_N, UPCAST, WINDOW)
        dv = _mma(tl.trans(p.to(do.dtype)), do, dv, UPCAST)
        dp = _mma(do, tl.trans(v), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), UPCAST)
        ds = p * (dp - delta[:, None])
        dk = _mma(tl.trans(ds.to(q.dtype)), q, dk, UPCAST)
    dk = dk * sm_scale
    _store_rows(DKO, k_rows, kvh, dk, kin, offs_dk, stride_dkt, stride_dkh, DK)
    _store_rows(DVO, k_rows, kvh, dv, kin, offs_dv, stride_dvt, stride_dvh, DV)


@triton.jit
def _attn_bwd_dq(
    Q, K, V, DO, LSE, DELTA, DQO, TILE_SEQ, TILE_ROW0, CU, num_seqs,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_lt,
    stride_dqt, stride_dqh, qk_scale, sm_scale, window, G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
    WINDOW: tl.constexpr = False,
):  # fmt: skip
    """dQ of one query tile: its rows' gradients over every key tile they see, in order."""
    tile, kvh, _, b = _tile_seq(TILE_SEQ, False)
    if b >= num_seqs:
        return
    row0, offs_m, s0, n = _tile_span(TILE_ROW0, CU, tile, b, BLOCK_M)
    t = offs_m // G
    head = kvh * G + offs_m % G
    ok = t < n
    hi = tl.minimum(n - 1, (row0 + BLOCK_M - 1) // G) + 1
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_rows = (s0 + t).to(tl.int64)
    q = _load_rows(Q, q_rows, head[:, None], ok, offs_dk, stride_qt, stride_qh, DK)
    do = _load_rows(DO, q_rows, head[:, None], ok, offs_dv, stride_dot, stride_doh, DV)
    lse = tl.load(LSE + q_rows * stride_lt + head, mask=ok, other=0.0)
    delta = tl.load(DELTA + q_rows * stride_lt + head, mask=ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_DK], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    k_lo = 0
    if WINDOW:  # the tile's first query's first key, rounded down to a tile
        k_lo = tl.maximum(row0 // G - window + 1, 0)
        k_lo = k_lo - k_lo % BLOCK_N
    for start in range(k_lo, hi, BLOCK_N):
        kpos = start + offs_n
        kin = kpos < hi
        k_rows = (s0 + kpos).to(tl.int64)
        k, v = _load_kv(K, V, k_rows, kvh, kin, offs_dk, offs_dv, stride_kt, stride_kh, stride_vt, stride_vh, DK, DV)
        seen = (kpos[None, :] <= t[:, None]) & ok[:, None]
        p = _probs(q, k, lse, qk_scale, kpos, t, seen, window, BLOCK_M, BLOCK_N, UPCAST, WINDOW)
        dp = _mma(do, tl.trans(v), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), UPCAST)
        ds = p * (dp - delta[:, None])
        dq = _mma(ds.to(k.dtype), k, dq, UPCAST)
    dq = dq * sm_scale
    _store_rows(DQO, q_rows, head[:, None], dq, ok, offs_dk, stride_dqt, stride_dqh, DK)


# The packed path's layout (int32 ``cu_seqlens`` on the device, sequence starts and lengths, the tile tables of the
# forward and of the backward's two kernels) depends on ``cu_seqlens`` and the shapes alone, which every layer of a
# forward pass (and its backward) shares. It is kept for the last few ``cu_seqlens`` tensors (by identity, and only
# while their version counter says nothing wrote them in place), so the later layers reuse it instead of paying
# ~10 small launches and ~90 us of host time each (the trainer's step is host-bound). Never kept or reused during CUDA
# graph capture, nor for tensors without a version counter (inference mode). The same values either way.
_PACKED_LAYOUTS: OrderedDict[int, tuple] = OrderedDict()
_PACKED_LAYOUTS_KEPT = 4


def packed_layout(cu_seqlens: torch.Tensor, device: torch.device, g: int, total: int) -> dict:
    """``{"cu", "starts", "n", "fwd"}`` of a packed batch (the backward adds its tile tables to the same dict)."""
    try:
        key = (cu_seqlens._version, device, g, total)
    except RuntimeError:  # an inference tensor: no version counter to trust
        key = None
    if key is not None and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        key = None
    hit = _PACKED_LAYOUTS.get(id(cu_seqlens)) if key is not None else None
    if hit is not None and hit[0]() is cu_seqlens and hit[1] == key:
        return hit[2]
    cu = cu_seqlens.to(device=device, dtype=torch.int32).contiguous()
    n = (cu[1:] - cu[:-1]).contiguous()
    layout = {"cu": cu, "starts": cu[:-1].contiguous(), "n": n, "fwd": _fwd_tiles(n, g, total)}
    if key is not None:
        _PACKED_LAYOUTS[id(cu_seqlens)] = (weakref.ref(cu_seqlens), key, layout)
        while len(_PACKED_LAYOUTS) > _PACKED_LAYOUTS_KEPT:
            _PACKED_LAYOUTS.popitem(last=False)
    return layout


def _packed_fwd(q, k, v, layout: dict, scale: float, want_lse: bool, window=None, sinks=None):
    starts, n = layout["starts"], layout["n"]
    return _fwd(
        q, k, v, starts.view(-1, 1), _PACKED_PAGE, starts, n, n, scale, want_lse, tiles=layout["fwd"], window=window,
        sinks=sinks,
    )  # fmt: skip


def _bwd(q, k, v, o, lse, do, layout: dict, scale: float, window=None, sinks=None):
    """dq, dk, dv and the sinks' gradient (None without sinks); ``layout``: the forward's :func:`packed_layout`, to
    which the backward's tile tables are added on first use (so later layers of the pass reuse them)."""
    cu = layout["cu"]
    total, hq, dk = q.shape
    hkv, dv = k.shape[1], v.shape[2]
    g = hq // hkv
    nseq = cu.numel() - 1
    do = _last_dim_contiguous(do)
    dq, dkk, dvv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if total == 0 or nseq == 0:
        return dq.zero_(), dkk.zero_(), dvv.zero_(), (None if sinks is None else torch.zeros_like(sinks))
    delta = (do.float() * o.float()).sum(-1).contiguous()  # [T, Hq]
    dsinks = None
    if sinks is not None:  # d/d sink of sum(dO * O) = -p_sink * delta per row; lse is base 2 and includes the sink
        p_sink = torch.exp2(sinks.float() * _LOG2E - lse)  # [T, Hq]
        dsinks = (-(p_sink * delta)).sum(0).to(sinks.dtype)
    common = dict(
        **({"WINDOW": True} if window is not None else {}),  # off: the kernels' default, the code without a window
        UPCAST=interpreting(),
        G=g,
        DK=dk,
        DV=dv,
        BLOCK_DK=next_pow2(dk),
        BLOCK_DV=next_pow2(dv),
        BLOCK_M=BWD_BLOCK_M,
        BLOCK_N=BWD_BLOCK_N,
        num_warps=BWD_NUM_WARPS,
        num_stages=BWD_NUM_STAGES,
    )
    if "dkdv" not in layout:
        n = layout["n"].to(torch.int64)
        layout["dkdv"] = _tiles(n, BWD_BLOCK_N, total)
        layout["dq"] = _tiles(n * g, BWD_BLOCK_M, total * g)
    # the arguments the two kernels share, in their parameters' order
    inputs = (q, k, v, do, lse, delta)
    lse_stride = hq  # lse's and delta's row stride
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0), do.stride(1),
               lse_stride)  # fmt: skip
    scalars = (scale * _LOG2E, scale, window or 0)
    kt_seq, kt_row0, kgrid = layout["dkdv"]
    _attn_bwd_dkdv[(kgrid, hkv)](
        *inputs, dkk, dvv, kt_seq, kt_row0, cu, nseq, *strides,
        dkk.stride(0), dkk.stride(1), dvv.stride(0), dvv.stride(1), *scalars, **common,
    )  # fmt: skip
    qt_seq, qt_row0, qgrid = layout["dq"]
    _attn_bwd_dq[(qgrid, hkv)](
        *inputs, dq, qt_seq, qt_row0, cu, nseq, *strides, dq.stride(0), dq.stride(1), *scalars, **common
    )
    return dq, dkk, dvv, dsinks


class _PackedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu, scale, window=None, sinks=None):
        q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
        layout = packed_layout(cu, q.device, q.shape[1] // k.shape[1], q.shape[0])
        grads = (q, k, v) if sinks is None else (q, k, v, sinks)
        want_lse = torch.is_grad_enabled() or any(t.requires_grad for t in grads)
        o, lse = _packed_fwd(q, k, v, layout, scale, want_lse, window, sinks)
        if want_lse:
            ctx.save_for_backward(q, k, v, o, lse, sinks)
            ctx.layout = layout  # index tensors of this batch, never written after they are built
        ctx.scale, ctx.window = scale, window
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, sinks = ctx.saved_tensors
        dq, dk, dv, dsinks = _bwd(q, k, v, o, lse, do, ctx.layout, ctx.scale, ctx.window, sinks)
        return dq, dk, dv, None, None, None, dsinks


def attention_packed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention within each packed sequence; differentiable (deterministic backward).

    q [T, Hq, Dk], k [T, Hkv, Dk], v [T, Hkv, Dv], ``cu_seqlens [B+1]``. Returns [T, Hq, Dv]. Bitwise equal, per
    query token, to :func:`attention_paged` over the same keys (any page size, chunking or batch). ``window``: keys
    ``> t - window`` only; ``sinks [Hq]``: a logit per head in every softmax's denominator (differentiable).
    """
    _check_shapes("attention_packed", q, k, v)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _PackedAttention.apply(q, k, v, cu_seqlens, scale, window, sinks)


__all__ = ["BWD_BLOCK_M", "BWD_BLOCK_N", "attention_packed"]
