"""Invariant attention on GPU, forward: one Triton kernel family for packed training batches, prefill chunks, decode.

The rule (design.md rule 3): a query at position ``p`` walks its keys ``0..p`` in tiles of ``BLOCK_N`` *absolute*
positions (tile ``j`` holds positions ``j*BLOCK_N .. j*BLOCK_N+BLOCK_N-1``), in position order, with the same
online-softmax update, whatever launched it. How that is made true:

* **One forward kernel, one compiled binary.** ``_attn_fwd`` serves the packed (training) path and the paged
  (prefill-chunk and decode) path. A key position of sequence ``b`` maps to a storage row through a table:
  ``row = table[b, pos // page_size] + pos % page_size``. For a paged cache ``table`` holds each page's first slot
  (block id * page size); for a packed batch it holds one entry, the sequence's first token, with a page size larger
  than any sequence. The mapping is runtime data (``page_size`` is not specialised), so both paths run literally the
  same machine code: same tile shapes, same ``num_warps``/``num_stages``, same MMA instructions, same reductions
  (the split launch below is the same source with one constexpr flipped; a GPU test holds the two forms equal).
* **Rows never interact.** A program owns ``BLOCK_M`` rows, each one (query token, query head) of one KV head's
  group, flattened as ``row = token * G + g`` within one sequence. Decode with GQA thus still puts ``G`` rows in a
  tile, and a prefill chunk or packed sequence fills it. Each row's result is a function of its own q row and of the
  keys; the tile-mates only decide how many key tiles the program walks. A key tile wholly past a row's causal bound
  is a bitwise no-op for it (its scores are ``-inf``: ``m`` is unchanged, ``alpha = exp2(0) = 1``, ``p = 0``), and
  tile 0 always holds position 0, so ``m`` is finite after the first step for every row.
* **Split-KV at fixed absolute positions.** A query's keys are cut into splits of ``SPLIT_N`` positions (split
  ``s`` holds ``s*SPLIT_N .. s*SPLIT_N+SPLIT_N-1``). Within a split the online softmax runs as above from a fresh
  state; the splits' partials ``(m, l, acc)`` are then folded in split order by ``_fold`` (explicit FMAs; the first
  split taken as it is, so a query with at most ``SPLIT_N`` keys gets the one-pass result exactly; a split a row
  cannot see is left out). Two launch forms give the same bits: one program per tile folding its splits in
  registers (training, prefill, decode at a large batch), or one program per (tile, split) writing fp32 partials,
  the tile's last split program folding them (``_attn_combine`` where no tile counts are at hand): decode at a small
  batch, where one program per sequence and KV head leaves most SMs idle (H100, batch 1 at 4096 keys: 0.15 -> 0.65
  TB/s, benchmarks/results/attention-h100.md). The form is picked from the launch's size, never from the data, and
  the training kernel folds at the same boundaries.
* **Fixed constants, never autotuned.** ``BLOCK_M``, ``BLOCK_N``, ``SPLIT_TILES``, ``NUM_WARPS``, ``NUM_STAGES``
  below. Changing any of them changes the numerics (and so the golden fixtures of GPU targets). The GPU ``BLOCK_N``
  (64) differs from the CPU reference's ``ATTN_BLOCK_N`` (16): CPU and GPU results are each invariant, not equal to
  each other.

Numerics: bf16/fp16 q, k, v; scores, running max/sum and the accumulator in fp32 (scores scaled by
``scale * log2(e)`` and exponentiated with ``exp2``); ``P`` cast to v's dtype for the ``P @ V`` MMA; output cast
once. The forward also returns the base-2 log-sum-exp per row for the backward.

The backward (packed path only, training) and the differentiable ``attention_packed`` are in ``attention_bwd.py``.

``DK``/``DV`` are separate constexprs (MLA: q/k head dim != v head dim; non-power-of-2 dims are padded to
``BLOCK_DK``/``BLOCK_DV`` with masks).

Sliding window and sinks (gpt-oss), two constexpr-gated features; with both off (``WINDOW``/``HAS_SINKS`` False) the
compiled code is the code without them, so no existing model's bits move:

* **Window** ``W``: a query at ``qpos`` sees keys ``qpos - W < pos <= qpos`` (the CPU reference's convention); its
  first key is ``fpos = max(qpos - W + 1, 0)``. A program walks its tiles from the tile holding its rows' smallest
  ``fpos`` (loads masked below it, so a paged decode reads no page wholly before the window), on the same absolute
  tile and split grid. A tile wholly before a row's window is a bitwise no-op for that row (its state is still the
  split's initial one: ``m = -inf`` or the sink, ``p = 0``, ``alpha`` 0 or 1 on zeros), so which tiles count for a
  row depends on its position alone, as the CPU reference's block skip does, and packed == paged == decode holds.
  A split wholly before a row's window is left out of its fold; the row's *first* split (the one holding ``fpos``)
  is taken as it is, as split 0 is without a window (this is the guard for rows whose state is still ``-inf``).
* **Sinks** ``[Hq]``: a logit per head joining the softmax's denominator, folded where the CPU reference folds it,
  before the first key: the row's first split starts its online softmax at ``m = sink * log2(e)``, ``l = 1``,
  ``acc = 0``; later splits start fresh. The LSE (for the backward) includes the sink.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import cdiv, interpreting, next_pow2

# Chosen on an H100 (benchmarks/results/attention-h100.md): 64 rows keep decode (G rows of real work per tile)
# near HBM bandwidth while prefill stays at ~0.8x SDPA-flash; 128 rows gained prefill but lost a third of decode.
BLOCK_M = 64  # query rows (token x head of one KV group) per program, forward
BLOCK_N = 64  # keys per step: the absolute-position tile every query walks
NUM_WARPS = 4
NUM_STAGES = 2
# Keys are cut at fixed absolute positions into splits of SPLIT_TILES * BLOCK_N; a query's splits are folded in order
# (``_fold``), in registers by one program, or through memory after one program per split (by the tile's last split
# program, else ``_attn_combine``). A numerics constant like BLOCK_N (a query with at most SPLIT_N keys gets the
# one-pass result exactly).
SPLIT_TILES = 8
SPLIT_N = SPLIT_TILES * BLOCK_N
# Launch form only (same bits either way): one program per split when the one-pass launch would have fewer programs
# than this (decode at small batch, where one program per sequence and KV head leaves most SMs idle).
SPLIT_BELOW_PROGRAMS = 256

# Launch shape of a decode step (one query per sequence, a GQA group of at most DECODE_BLOCK_M heads) with at least
# DECODE_MIN_PROGRAMS (sequence, KV head) programs: tiles of 16 rows in two warps instead of 64 rows in four. A 64-row
# tile holds 2-8 real rows at decode, and its warps spend most of their time on the padding. Per row the same source,
# BLOCK_N, split boundaries and order: the warps split the score tile's columns and P @ V's output columns (each
# product still summed over the same keys in the same MMA chain), and each row's sum of P, which would otherwise be
# added across warps in another order, is added in the one-warp order (``_row_sum_one_warp``); a GPU test holds the
# launch to the packed forward's bits and to the one-warp launch's. One warp per 16-row tile holds both accumulators,
# the Q fragment and the load addresses in one warp's registers and spills (255 registers and 184 bytes of stack per
# thread at sm_90; two warps: 214 and none; scripts/tuning/kernel_regs.py). On an H200 at batch 256-512 and contexts
# of 1k-8k (equal lengths) two warps read the KV cache at 0.93-1.01 of the copy bandwidth, one warp at 0.81-0.91,
# four warps at 0.76-0.81 (the explicit sum's layout conversions cost more than the extra warps gain);
# benchmarks/results/attention-decode-h200.md. From 512 programs with the heads-first order below (1.7B / 8B layouts
# at 64 sequences, 30B-A3B at 128) the 16-row launch takes 0.85-0.90 of the 64-row launch's time at contexts of 1k and
# 4k, equal or mixed; at 256 programs (30B-A3B at 64 sequences) 1.1-1.2x (attention-decode-h200.md, launch orders).
DECODE_BLOCK_M = 16
DECODE_NUM_WARPS = 2
DECODE_MIN_PROGRAMS = 512
# A decode step with fewer than SPLIT_BELOW_PROGRAMS (sequence, KV head) programs runs in the split form (a program
# per key split); there the same 16-row tiles in four warps (each row's sum of P in the one-warp order, as above) take
# 0.77-0.98 of the 64-row split launch's time at batch 1-16 and contexts of 1k-8k on the 1.7B, 8B and 30B-A3B layouts
# (H200, `benchmarks/attention.py --decode-only --variants m16-w4-split`, attention-decode-h200.md), with the same bits
# in every cell. Taken up to DECODE_SPLIT_MAX_SEQS sequences, the batches measured (an MLA layer, one KV head, runs
# split up to 255 sequences: unmeasured there); between the thresholds the 64-row launch stays.
DECODE_SPLIT_NUM_WARPS = 4
DECODE_SPLIT_MAX_SEQS = 16
# Launch order of a decode step's programs (launch form only: a program's output does not depend on when it runs, so
# every order gives the same bits). DECODE_LONGEST_FIRST: the tile table sorted by context length, longest first,
# so that the longest sequences start in the first wave and the short ones fill the last (at mixed lengths one
# program walks its sequence's keys alone, and the launch ends with its longest program). DECODE_HEADS_FIRST: the
# grid is (KV heads, tiles) instead of (tiles, KV heads), so a sequence's KV heads are neighbours in launch order and
# read the same pages at about the same time. Both at decode steps of at least SPLIT_BELOW_PROGRAMS programs (the
# split form's few programs are left in slot order: unmeasured there). On an H200 (attention-decode-h200.md, launch
# orders; the same bits in every cell): the 16-row launch at 1024 programs of a GQA group of 4-8 (8B at 128
# sequences, 30B-A3B at 256), equal lengths of 1k and 4k keys, 0.73-0.79 of the copy bandwidth in slot order,
# 0.89-1.00 heads first; at mixed lengths [ctx/2, ctx] from 1024 programs both orders together 0.83-1.03 against
# 0.72-0.96. In the engine (throughput-rl-h200.md, same run): the
# 1.7B rl workload 39.6 s against 41.5 s, the 8B one 36.7 s against 37.4 s.
DECODE_LONGEST_FIRST = True
DECODE_HEADS_FIRST = True
MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension: a heads-first launch puts the tiles there

_PACKED_PAGE = 1 << 30  # "page size" of a packed batch: one page per sequence
_LOG2E = 1.4426950408889634


@triton.jit
def _mma(a, b, acc, UPCAST: tl.constexpr):
    """``acc + a @ b``.

    Under the CPU interpreter (``UPCAST``) tl.dot is unusable for the invariance tests: its bf16 dot is broken, and its
    fp32 dot goes to BLAS, whose result for a row depends on the row's place in the tile. There the product is a
    broadcast multiply (exact for bf16/fp16 operands) summed over K in one fixed order, the same for every row.
    """
    if UPCAST:
        return acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _load_rows(P, rows, h, ok, offs_d, stride_t, stride_h, D: tl.constexpr):
    """``P[rows, h, :D]`` as a ``[rows, BLOCK_D]`` tile (``h``: a head per row, ``[BLOCK, 1]``, or one for all); zeros
    where ``ok`` is False and past ``D``."""
    return tl.load(
        P + rows[:, None] * stride_t + h * stride_h + offs_d[None, :],
        mask=ok[:, None] & (offs_d[None, :] < D),
        other=0.0,
    )


@triton.jit
def _tile_seq(TILE_SEQ, HEADS_FIRST: tl.constexpr):
    """This program's tile, KV head and the tile's sequence (``>= num_seqs``: a padding tile of the grid), and the
    number of KV heads in the grid. ``HEADS_FIRST``: the grid is (KV heads, tiles), else (tiles, KV heads)."""
    if HEADS_FIRST:
        kvh = tl.program_id(0)
        tile = tl.program_id(1)
        n_kvh = tl.num_programs(0)
    else:
        tile = tl.program_id(0)
        kvh = tl.program_id(1)
        n_kvh = tl.num_programs(1)
    return tile, kvh, n_kvh, tl.load(TILE_SEQ + tile)


@triton.jit
def _tile_rows(tile, kvh, b, TILE_ROW0, SEQ_QSTART, SEQ_NQ, SEQ_CTX, G: tl.constexpr, BLOCK_M: tl.constexpr):
    """The rows of forward tile ``tile`` (KV head ``kvh``, sequence ``b``): each row's token ``t`` in the sequence's
    queries and query head, whether it is a real query, its key position, the keys the tile needs (``hi``) and the
    sequence's first query row."""
    row0 = tl.load(TILE_ROW0 + tile)
    q_start = tl.load(SEQ_QSTART + b)
    n_q = tl.load(SEQ_NQ + b)
    ctx = tl.load(SEQ_CTX + b)
    offs_m = row0 + tl.arange(0, BLOCK_M)
    t = offs_m // G
    head = kvh * G + offs_m % G
    row_ok = t < n_q
    qpos = tl.where(row_ok, ctx - n_q + t, 0)  # padding rows attend to key 0 only and are never stored
    t_last = tl.minimum(n_q - 1, (row0 + BLOCK_M - 1) // G)
    hi = ctx - n_q + t_last + 1  # keys this tile needs: up to its last row's position
    return t, head, row_ok, qpos, hi, q_start


@triton.jit
def _window_rows(qpos, row_ok, hi, window, WINDOW: tl.constexpr, SPLIT_N: tl.constexpr):
    """Each row's first key ``fpos`` (``qpos - window < pos``), the tile's first key ``klo`` (the least ``fpos`` of its
    real rows) and each row's first split ``fs``; all 0 without a window."""
    if WINDOW:
        fpos = tl.maximum(qpos - window + 1, 0)
        klo = tl.min(tl.where(row_ok, fpos, hi), 0)
        fs = fpos - fpos % SPLIT_N
    else:
        fpos = 0
        klo = 0
        fs = 0
    return fpos, klo, fs


@triton.jit
def _split_start(fs, s_start, sink, BLOCK_M: tl.constexpr):
    """The online softmax's state at the start of split ``s_start``: each row's sink logit (base 2) with sum 1 where
    it is the row's first split (the CPU reference's fold before the first key), else empty (``-inf``, 0)."""
    mine = fs == s_start  # a scalar without a window (every row's first split is split 0)
    m = tl.where(mine, sink.to(tl.float32), float("-inf"))
    lsum = tl.where(mine, tl.full([BLOCK_M], 1.0, tl.float32), 0.0)
    return m, lsum


@triton.jit
def _halves(x, BLOCK_M: tl.constexpr, K: tl.constexpr):
    """``x [BLOCK_M, 4, K]`` as its first and second halves along the last axis (data movement only)."""
    x = tl.permute(tl.reshape(x, [BLOCK_M, 4, 2, K // 2]), [0, 1, 3, 2])
    return tl.split(x)


@triton.jit
def _add4(s, x, BLOCK_M: tl.constexpr):
    """``s + x[..., 0] + x[..., 1] + x[..., 2] + x[..., 3]``, left to right, for ``x [BLOCK_M, 4, 4]``."""
    a, b = _halves(x, BLOCK_M, 4)
    x0, x1 = tl.split(a)
    x2, x3 = tl.split(b)
    return (((s + x0) + x1) + x2) + x3


@triton.jit
def _row_sum_one_warp(p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``tl.sum(p, 1)`` for ``p [BLOCK_M, 64]`` in the order one warp's MMA layout sums it, whatever layout ``p`` is in.

    A warp that owns all 64 columns of a row (the 16-row one-warp launch, the 64-row four-warp launch) holds them in
    four lanes: lane ``q`` has columns ``8n + 2q + c`` (``n`` the 8-column MMA tile, ``c`` 0/1), adds its 16 values
    left to right in ``(n, c)`` order, then the lanes combine by butterfly: ``(s0 + s2) + (s1 + s3)`` (Triton 3.6's
    reduction, read from its PTX). Launches that spread a row over warps (16 rows in four warps) sum here in that same
    order, with explicit adds; the reshapes and splits only move data, so the bits are the one-warp sum's."""
    tl.static_assert(BLOCK_N == 64)
    x = tl.permute(tl.reshape(p, [BLOCK_M, 8, 4, 2]), [0, 2, 1, 3])  # [m, q, n, c]
    x = tl.reshape(x, [BLOCK_M, 4, 16])  # [m, q, 2n + c]: each lane's values in its order
    lo, hi = _halves(x, BLOCK_M, 16)
    x0, x1 = _halves(lo, BLOCK_M, 8)
    x2, x3 = _halves(hi, BLOCK_M, 8)
    s = tl.zeros([BLOCK_M, 4], tl.float32)  # 0 + x is x: the chain starts at the first value
    s = _add4(_add4(_add4(_add4(s, x0, BLOCK_M), x1, BLOCK_M), x2, BLOCK_M), x3, BLOCK_M)
    y = tl.permute(tl.reshape(s, [BLOCK_M, 2, 2]), [0, 2, 1])  # [m, q % 2, q // 2]
    low, high = tl.split(y)  # lanes q and q + 2
    y0, y1 = tl.split(low + high)
    return y0 + y1


@triton.jit(do_not_specialize=["page_size", "num_seqs", "part_stride", "window"])
def _attn_fwd(
    Q,
    K,
    V,
    Out,
    LSE,
    PM,
    PL,
    PACC,
    COUNT,
    part_stride,
    TILE_SEQ,
    TILE_ROW0,
    SEQ_QSTART,
    SEQ_NQ,
    SEQ_CTX,
    TABLE,
    stride_tb,
    page_size,
    num_seqs,
    SINKS,
    window,
    stride_qt,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_lt,
    qk_scale,
    G: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_N: tl.constexpr,
    SPLIT_OUT: tl.constexpr,
    FUSED_COMBINE: tl.constexpr,
    STORE_LSE: tl.constexpr,
    UPCAST: tl.constexpr,
    WINDOW: tl.constexpr = False,
    HAS_SINKS: tl.constexpr = False,
    SAME_KV_OFFS: tl.constexpr = False,
    OFFS_TY: tl.constexpr = tl.int64,
    ONE_WARP_SUM: tl.constexpr = False,
    HEADS_FIRST: tl.constexpr = False,
):
    tile, kvh, n_kvh, b = _tile_seq(TILE_SEQ, HEADS_FIRST)
    if b >= num_seqs:
        return
    t, head, row_ok, qpos, hi, q_start = _tile_rows(tile, kvh, b, TILE_ROW0, SEQ_QSTART, SEQ_NQ, SEQ_CTX, G, BLOCK_M)
    # fpos: each row's first key; klo: the tile's first key (its rows' least fpos); fs: each row's first split
    fpos, klo, fs = _window_rows(qpos, row_ok, hi, window, WINDOW, SPLIT_N)
    if SPLIT_OUT:  # this program: one split of the tile's keys; its partial goes to PM/PL/PACC[split]
        split = tl.program_id(2)
        lo = split * SPLIT_N
        if lo >= hi:
            return
        top = tl.minimum(lo + SPLIT_N, hi)
        if WINDOW:
            if top <= klo:  # the split is wholly before every row's window
                return
            lo = tl.maximum(lo, klo - klo % BLOCK_N)
    else:  # every split of the tile's keys, in order, folded here
        lo = 0
        if WINDOW:
            lo = klo - klo % BLOCK_N
        top = hi

    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_rows = (q_start + t).to(tl.int64)
    q = _load_rows(Q, q_rows, head[:, None], row_ok, offs_dk, stride_qt, stride_qh, DK)

    offs_n = tl.arange(0, BLOCK_N)
    tb = TABLE + b.to(tl.int64) * stride_tb
    k_base = K + kvh * stride_kh
    v_base = V + kvh * stride_vh
    m_run = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_run = tl.zeros([BLOCK_M], tl.float32)
    acc_run = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    if HAS_SINKS:  # the split walked first starts at each row's sink if it is that row's first split
        sink = tl.load(SINKS + head)
        m_i, l_i = _split_start(fs, lo - lo % SPLIT_N, sink, BLOCK_M)
    # one loop over the tiles, the fold a branch at each split's last tile: the loads stay pipelined across splits
    for start in range(lo, top, BLOCK_N):
        kpos = start + offs_n
        kin = kpos < hi
        if WINDOW:  # no key before the tile's window is read (a cache need hold nothing there)
            kin = kin & (kpos >= klo)
        page_row = tl.load(tb + kpos // page_size, mask=kin, other=0)
        srow = (page_row + kpos % page_size).to(OFFS_TY)
        k_off = srow[:, None] * stride_kn + offs_dk[None, :]
        if BLOCK_DK == DK:
            k = tl.load(k_base + k_off, mask=kin[:, None], other=0.0)
        else:
            k = tl.load(k_base + k_off, mask=kin[:, None] & (offs_dk[None, :] < DK), other=0.0)
        qk = _mma(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), UPCAST) * qk_scale
        qk = tl.where(kpos[None, :] <= qpos[:, None], qk, float("-inf"))
        if WINDOW:
            qk = tl.where(kpos[None, :] >= fpos[:, None], qk, float("-inf"))
        if not SPLIT_OUT:
            # the first tile of a later split: fold the split before it, here where the rescale below waits for
            # the last P @ V anyway (a fold after that MMA would wait for it every tile)
            if (start % SPLIT_N == 0) and (start > lo):
                s0 = start - SPLIT_N
                if WINDOW:
                    m_run, l_run, acc_run = _fold_window(m_run, l_run, acc_run, m_i, l_i, acc, s0, qpos, fpos, fs,
                                                         SPLIT_N)  # fmt: skip
                else:  # the code without a window
                    m_run, l_run, acc_run = _fold(m_run, l_run, acc_run, m_i, l_i, acc, s0 == 0, s0 <= qpos)
                m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
                l_i = tl.zeros([BLOCK_M], tl.float32)
                acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
                if HAS_SINKS:
                    m_i, l_i = _split_start(fs, start, sink, BLOCK_M)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # a row that sees no key of this split yet (it sits before the split): exponents against 0, not -inf
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_use)
        p = tl.math.exp2(qk - m_use[:, None])
        if ONE_WARP_SUM:
            l_i = l_i * alpha + _row_sum_one_warp(p, BLOCK_M, BLOCK_N)
        else:
            l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if SAME_KV_OFFS:  # V's rows sit where K's do (one offset tile for both: half the address registers)
            v = tl.load(v_base + k_off, mask=kin[:, None], other=0.0)
        else:
            v_off = srow[:, None] * stride_vn + offs_dv[None, :]
            v = tl.load(v_base + v_off, mask=kin[:, None] & (offs_dv[None, :] < DV), other=0.0)
        acc = _mma(p.to(v.dtype), v, acc, UPCAST)
        m_i = m_new
    if SPLIT_OUT:
        n_splits = tl.cdiv(hi, SPLIT_N)  # the tile's split programs that get here (the others returned above)
        if WINDOW:
            n_splits -= klo // SPLIT_N
        if FUSED_COMBINE and n_splits == 1:  # one split: its partial is the result (the fold takes it as it is)
            _store_out(Out, LSE, m_i, l_i, acc, q_rows, head, row_ok, offs_dv, stride_ot, stride_oh, stride_lt, DV,
                       STORE_LSE, True)  # fmt: skip
        else:
            prow = split.to(tl.int64) * part_stride + q_rows * stride_lt + head
            tl.store(PM + prow, m_i, mask=row_ok)
            tl.store(PL + prow, l_i, mask=row_ok)
            tl.store(PACC + prow[:, None] * BLOCK_DV + offs_dv[None, :], acc, mask=row_ok[:, None])
            if FUSED_COMBINE:
                # The tile's last split program to finish folds every split in order, as _attn_combine does (the
                # matmul's fused combine: partial stores, then the count's release; the acquire, then loads that
                # bypass L1). The count is reset for the next launch.
                tl.debug_barrier()
                count = COUNT + tile * n_kvh + kvh
                done = tl.atomic_add(count, 1, sem="acq_rel", scope="gpu")
                if done == n_splits - 1:
                    m_run, l_run, acc_run = _fold_parts(
                        PM, PL, PACC, q_rows, head, row_ok, qpos, hi, part_stride, stride_lt, offs_dv,
                        BLOCK_M, BLOCK_DV, SPLIT_N, True, fpos, klo, fs, WINDOW,
                    )  # fmt: skip
                    _store_out(Out, LSE, m_run, l_run, acc_run, q_rows, head, row_ok, offs_dv, stride_ot, stride_oh,
                               stride_lt, DV, STORE_LSE, True)  # fmt: skip
                    tl.store(count, 0)
    else:
        s0 = (top - 1) - (top - 1) % SPLIT_N  # the last split, folded after the loop
        if WINDOW:
            m_run, l_run, acc_run = _fold_window(m_run, l_run, acc_run, m_i, l_i, acc, s0, qpos, fpos, fs, SPLIT_N)
        else:  # the code without a window
            m_run, l_run, acc_run = _fold(m_run, l_run, acc_run, m_i, l_i, acc, s0 == 0, s0 <= qpos)
        _store_out(Out, LSE, m_run, l_run, acc_run, q_rows, head, row_ok, offs_dv, stride_ot, stride_oh, stride_lt, DV,
                   STORE_LSE, False)  # fmt: skip


@triton.jit
def _store_out(Out, LSE, m, lsum, acc, q_rows, head, row_ok, offs_dv, stride_ot, stride_oh, stride_lt, DV: tl.constexpr,
               STORE_LSE: tl.constexpr, SPLIT: tl.constexpr):  # fmt: skip
    """The output rows from their folded ``(m, lsum, acc)``: ``acc / lsum`` cast once; the base-2 LSE. ``SPLIT``: the
    split launch's rows past the tile's queries (never stored) hold no key and divide by 1, not 0 (the one-program
    forward's attend to key 0)."""
    if SPLIT:
        lsum = tl.where(row_ok, lsum, 1.0)
    out = acc / lsum[:, None]
    tl.store(
        Out + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_dv[None, :],
        out.to(Out.dtype.element_ty),
        mask=row_ok[:, None] & (offs_dv[None, :] < DV),
    )
    if STORE_LSE:
        tl.store(LSE + q_rows * stride_lt + head, m + tl.math.log2(lsum), mask=row_ok)


@triton.jit
def _fold_parts(PM, PL, PACC, q_rows, head, row_ok, qpos, hi, part_stride, stride_lt, offs_dv, BLOCK_M: tl.constexpr,
                BLOCK_DV: tl.constexpr, SPLIT_N: tl.constexpr, BYPASS_L1: tl.constexpr, fpos, klo, fs,
                WINDOW: tl.constexpr):  # fmt: skip
    """Every split partial of a tile's rows folded in split order (:func:`_fold`); a row leaves out the splits
    that start past its position (never written for it), and under a window those before its first split."""
    m_run = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_run = tl.zeros([BLOCK_M], tl.float32)
    acc_run = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    cache: tl.constexpr = ".cg" if BYPASS_L1 else ""
    s_lo = 0
    if WINDOW:
        s_lo = klo - klo % SPLIT_N
    for s0 in tl.range(s_lo, hi, SPLIT_N, num_stages=3):  # loads pipelined; the folds stay in split order
        sees = row_ok & (s0 <= qpos)
        if WINDOW:
            sees = sees & (s0 >= fs)
        prow = q_rows * stride_lt + head + (s0 // SPLIT_N) * part_stride  # int64: q_rows is
        m_s = tl.load(PM + prow, mask=sees, other=float("-inf"), cache_modifier=cache)
        l_s = tl.load(PL + prow, mask=sees, other=0.0, cache_modifier=cache)
        acc_s = tl.load(
            PACC + prow[:, None] * BLOCK_DV + offs_dv[None, :], mask=sees[:, None], other=0.0, cache_modifier=cache
        )
        if WINDOW:
            m_run, l_run, acc_run = _fold_window(m_run, l_run, acc_run, m_s, l_s, acc_s, s0, qpos, fpos, fs, SPLIT_N)
        else:  # the code without a window
            m_run, l_run, acc_run = _fold(m_run, l_run, acc_run, m_s, l_s, acc_s, s0 == 0, sees)
    return m_run, l_run, acc_run


@triton.jit
def _fold(m_run, l_run, acc_run, m_s, l_s, acc_s, first, sees):
    """Fold one split's partial ``(m_s, l_s, acc_s)`` into the running ``(m_run, l_run, acc_run)``: the first split
    is taken as it is (so a query whose keys fit in one split gets exactly the one-pass result), a later one is
    rescaled onto the common max with explicit FMAs (no contraction left to the compiler, so the forward's in-register
    fold and the combine kernel's fold are the same instructions), and only for the rows that ``sees`` it."""
    m_new = tl.maximum(m_run, m_s)
    w_run = tl.math.exp2(m_run - m_new)
    w_s = tl.math.exp2(m_s - m_new)
    l_new = tl.fma(l_s, w_s, l_run * w_run)
    acc_new = tl.fma(acc_s, w_s[:, None], acc_run * w_run[:, None])
    return (
        tl.where(first, m_s, tl.where(sees, m_new, m_run)),
        tl.where(first, l_s, tl.where(sees, l_new, l_run)),
        tl.where(first, acc_s, tl.where(sees[:, None], acc_new, acc_run)),
    )


@triton.jit
def _fold_window(m_run, l_run, acc_run, m_s, l_s, acc_s, s0, qpos, fpos, fs, SPLIT_N: tl.constexpr):
    """:func:`_fold` of split ``s0`` under a sliding window: a row takes its first split (``fs``) as it is and folds a
    later one it sees (``fs < s0 <= qpos``); a split before its window is left out (its state may still be ``-inf``)."""
    first = fs == s0
    sees = (s0 <= qpos) & (s0 > fs)
    m_run, l_run, acc_run = _fold(m_run, l_run, acc_run, m_s, l_s, acc_s, False, sees)
    return (
        tl.where(first, m_s, m_run),
        tl.where(first, l_s, l_run),
        tl.where(first[:, None], acc_s, acc_run),
    )


@triton.jit(do_not_specialize=["num_seqs", "part_stride", "window"])
def _attn_combine(
    PM,
    PL,
    PACC,
    Out,
    LSE,
    TILE_SEQ,
    TILE_ROW0,
    SEQ_QSTART,
    SEQ_NQ,
    SEQ_CTX,
    num_seqs,
    part_stride,
    stride_ot,
    stride_oh,
    stride_lt,
    window,
    G: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SPLIT_N: tl.constexpr,
    STORE_LSE: tl.constexpr,
    WINDOW: tl.constexpr = False,
):
    """The split launch's second half: each row folds its splits' partials in split order with :func:`_fold`, as the
    one-program forward does in registers, and writes the output. Same tile table as the forward."""
    tile, kvh, _, b = _tile_seq(TILE_SEQ, False)
    if b >= num_seqs:
        return
    t, head, row_ok, qpos, hi, q_start = _tile_rows(tile, kvh, b, TILE_ROW0, SEQ_QSTART, SEQ_NQ, SEQ_CTX, G, BLOCK_M)
    q_rows = (q_start + t).to(tl.int64)
    offs_dv = tl.arange(0, BLOCK_DV)
    fpos, klo, fs = _window_rows(qpos, row_ok, hi, window, WINDOW, SPLIT_N)
    m_run, l_run, acc_run = _fold_parts(
        PM, PL, PACC, q_rows, head, row_ok, qpos, hi, part_stride, stride_lt, offs_dv, BLOCK_M, BLOCK_DV, SPLIT_N,
        False, fpos, klo, fs, WINDOW,
    )  # fmt: skip
    _store_out(Out, LSE, m_run, l_run, acc_run, q_rows, head, row_ok, offs_dv, stride_ot, stride_oh, stride_lt, DV,
               STORE_LSE, True)  # fmt: skip


@triton.jit
def _write_kv(
    K,
    V,
    KC,
    VC,
    SLOT,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcs,
    stride_kch,
    stride_vcs,
    stride_vch,
    HKV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    i = tl.program_id(0)
    slot = tl.load(SLOT + i).to(tl.int64)
    if slot < 0:
        return
    h = tl.arange(0, BLOCK_H)
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    mk = (h[:, None] < HKV) & (dk[None, :] < DK)
    mv = (h[:, None] < HKV) & (dv[None, :] < DV)
    row = i.to(tl.int64)
    k = tl.load(K + row * stride_kt + h[:, None] * stride_kh + dk[None, :], mask=mk)
    v = tl.load(V + row * stride_vt + h[:, None] * stride_vh + dv[None, :], mask=mv)
    tl.store(KC + slot * stride_kcs + h[:, None] * stride_kch + dk[None, :], k, mask=mk)
    tl.store(VC + slot * stride_vcs + h[:, None] * stride_vch + dv[None, :], v, mask=mv)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _tiles(rows_per_seq: torch.Tensor, block: int, rows_bound: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Tile table without a host sync: tile i -> (sequence, first row). Surplus tiles get sequence = B (exit)."""
    nseq = rows_per_seq.numel()
    ntiles = (rows_per_seq + block - 1) // block
    cum = torch.cumsum(ntiles, 0)
    grid = rows_bound // block + nseq  # >= sum(ceil(rows_b / block))
    ids = torch.arange(grid, device=rows_per_seq.device)
    seq = torch.searchsorted(cum, ids, right=True)
    first = (cum - ntiles)[seq.clamp(max=max(nseq - 1, 0))]
    row0 = (ids - first) * block
    return seq.to(torch.int32), row0.to(torch.int32), grid


TileTable = tuple[torch.Tensor, torch.Tensor, int]  # tile -> sequence, tile -> first row, number of tiles


def longest_first(tiles: TileTable, ctx: torch.Tensor) -> TileTable:
    """A tile table in launch order longest context first (the grid's padding tiles last); the same tiles, so the
    same bits (``DECODE_LONGEST_FIRST``). No host sync: a sort of one key per tile."""
    seq, row0, grid = tiles
    nseq = ctx.numel()
    key = torch.where(seq < nseq, ctx[seq.clamp(max=max(nseq - 1, 0)).long()].to(torch.int64), -1)
    order = torch.argsort(key, descending=True, stable=True)
    return seq[order].contiguous(), row0[order].contiguous(), grid


def _offsets(k_rows: torch.Tensor, v_rows: torch.Tensor) -> dict:
    """Address forms of the forward's K/V loads (the same bits in every form): one offset tile for K and V where their
    rows have one stride and their head dims one padded width; 32-bit offsets where every row of both fits."""
    same = k_rows.stride(0) == v_rows.stride(0) and k_rows.shape[2] == v_rows.shape[2] == next_pow2(k_rows.shape[2])
    small = max(k_rows.shape[0] * k_rows.stride(0), v_rows.shape[0] * v_rows.stride(0)) < 2**31
    flags = {}
    if same:
        flags["SAME_KV_OFFS"] = True
    if small:
        flags["OFFS_TY"] = tl.int32
    return flags


def _fwd_tiles(n_q: torch.Tensor, g: int, total: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The forward's tile table: ``n_q [B]`` queries per sequence, ``g`` query heads per KV head, ``total`` queries,
    in tiles of ``block_m`` rows (the launch's)."""
    return _tiles(n_q.to(torch.int64) * g, block_m, total * g)


def _fwd(
    q: torch.Tensor,
    k_rows: torch.Tensor,
    v_rows: torch.Tensor,
    table: torch.Tensor,
    page_size: int,
    q_start: torch.Tensor,
    n_q: torch.Tensor,
    ctx: torch.Tensor,
    scale: float,
    want_lse: bool,
    tiles: tuple[torch.Tensor, torch.Tensor, int] | None = None,
    split_programs: bool | None = None,
    fused_combine: bool | None = None,
    launch: tuple[int, int, int] | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    one_warp_sum: bool | None = None,
    heads_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the forward. k_rows/v_rows: [rows, Hkv, D] storage; table [B, W] int32 first storage row per page;
    ``tiles``: the tile table of these queries in tiles of the launch's rows (:func:`_fwd_tiles` for the
    constants), when the caller built it already.
    ``split_programs``: one program per key split plus the combine (True) or one program per tile (False); default:
    split where the one-pass launch has fewer than ``SPLIT_BELOW_PROGRAMS`` programs and a query can have more than
    one split (``W * page_size > SPLIT_N``). ``fused_combine`` (split launch only): the last split program of each
    tile folds the partials (one launch; a tile with one split writes its output directly), or ``_attn_combine``
    does (two launches); default: fused where the matmul's per-stream tile counts can take the launch. The same bits
    in every form. ``launch``: ``(block_m, num_warps, num_stages)`` in place of the constants, for benchmarks that
    measure other launch shapes (a GPU test must show a shape gives the constants' bits before anything uses it).
    ``window`` (keys ``> qpos - window``) and ``sinks [Hq]`` (a logit per head): see the module docstring; None: off,
    the kernel compiled without them. ``one_warp_sum``: each row's sum of ``P`` in one warp's order
    (:func:`_row_sum_one_warp`); default: where the launch spreads a row's columns over warps (more warps than
    16-row MMA tiles), so that every launch gives the bits of the one-warp launch. False there is for the tests that
    show the bits move without it. ``heads_first``: the grid as (KV heads, tiles) (``DECODE_HEADS_FIRST``; launch
    order only, the same bits)."""
    total, hq, dk = q.shape
    hkv, dv = k_rows.shape[1], v_rows.shape[2]
    g = hq // hkv
    nseq = n_q.numel()
    out = q.new_empty(total, hq, dv)
    lse = torch.empty(total, hq, device=q.device, dtype=torch.float32) if want_lse else out
    if total == 0 or nseq == 0:
        return out, (lse if want_lse else None)
    block_m, num_warps, num_stages = launch if launch is not None else (BLOCK_M, NUM_WARPS, NUM_STAGES)
    if tiles is None:
        tiles = _fwd_tiles(n_q, g, total, block_m)
    tile_seq, tile_row0, grid = tiles
    if one_warp_sum is None:  # the interpreter has no warps: its sums are numpy's in every launch
        one_warp_sum = num_warps > block_m // 16 and not interpreting()
    n_splits = cdiv(min(table.shape[1] * page_size, _PACKED_PAGE), SPLIT_N)
    if split_programs is None:
        split_programs = n_splits > 1 and grid * hkv < SPLIT_BELOW_PROGRAMS and page_size < _PACKED_PAGE
    block_dv = next_pow2(dv)
    if split_programs:
        pm = torch.empty(n_splits, total, hq, device=q.device, dtype=torch.float32)
        pl = torch.empty_like(pm)
        pacc = torch.empty(n_splits, total, hq, block_dv, device=q.device, dtype=torch.float32)
    else:
        n_splits, pm, pl, pacc = 1, lse, lse, lse
    # off: the kernel's defaults, so the launch without a window or sinks compiles the code without them
    features = {}
    if window is not None:
        features["WINDOW"] = True
    if sinks is not None:
        features["HAS_SINKS"] = True
        sinks2 = (sinks.to(device=q.device, dtype=torch.float32) * _LOG2E).contiguous()  # base 2, as the scores
    counts = None
    if split_programs and fused_combine is not False:
        from .matmul import _tile_counters  # the matmul's fused combine counts (one slot per stream, zeroed)

        counts = _tile_counters(q.device, grid * hkv)
        if counts is None and fused_combine:
            raise RuntimeError(f"attention: fused_combine=True, but no tile-count slot takes {grid * hkv} tiles here")
    if heads_first and grid > MAX_GRID_Y:
        raise ValueError(f"attention: a heads-first launch takes at most {MAX_GRID_Y} tiles; this one has {grid}")
    _attn_fwd[(hkv, grid, n_splits) if heads_first else (grid, hkv, n_splits)](
        q,
        k_rows,
        v_rows,
        out,
        lse,
        pm,
        pl,
        pacc,
        counts if counts is not None else pm,
        total * hq,
        tile_seq,
        tile_row0,
        q_start,
        n_q,
        ctx,
        table,
        table.stride(0),
        page_size,
        nseq,
        sinks2 if sinks is not None else pm,
        window or 0,
        q.stride(0),
        q.stride(1),
        k_rows.stride(0),
        k_rows.stride(1),
        v_rows.stride(0),
        v_rows.stride(1),
        out.stride(0),
        out.stride(1),
        hq,
        scale * _LOG2E,
        G=g,
        DK=dk,
        DV=dv,
        BLOCK_DK=next_pow2(dk),
        BLOCK_DV=block_dv,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        SPLIT_N=SPLIT_N,
        SPLIT_OUT=split_programs,
        FUSED_COMBINE=counts is not None,
        STORE_LSE=want_lse,
        UPCAST=interpreting(),
        **features,
        **_offsets(k_rows, v_rows),
        **({"ONE_WARP_SUM": True} if one_warp_sum else {}),
        **({"HEADS_FIRST": True} if heads_first else {}),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if split_programs and counts is None:
        _attn_combine[(grid, hkv)](
            pm,
            pl,
            pacc,
            out,
            lse,
            tile_seq,
            tile_row0,
            q_start,
            n_q,
            ctx,
            nseq,
            total * hq,
            out.stride(0),
            out.stride(1),
            hq,
            window or 0,
            G=g,
            DV=dv,
            BLOCK_DV=block_dv,
            BLOCK_M=block_m,
            SPLIT_N=SPLIT_N,
            STORE_LSE=want_lse,
            **({"WINDOW": True} if window is not None else {}),
            num_warps=num_warps,
        )
    return out, (lse if want_lse else None)


def _check_shapes(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"{op}: the GPU kernels take bf16 or fp16 q/k/v of one dtype; got {q.dtype}/{k.dtype}/{v.dtype}"
        )
    hq, hkv = q.shape[1], k.shape[-2]
    if hq % hkv:
        raise ValueError(f"{op}: {hq} query heads is not a multiple of {hkv} KV heads")


@dataclass(frozen=True, eq=False)
class PagedLayout:
    """A paged step's layout in the forward kernel's terms: int32 query starts, query counts, page tables (first
    storage row of each page) and context lengths, and the tile table. Built by :func:`paged_layout` once per step and
    passed to every layer's :func:`attention_paged`, so its casts, cumsum and searchsorted run once per step instead
    of once per layer; the values are those :func:`attention_paged` builds itself without one, so the bits are too."""

    block_tables: torch.Tensor  # the step's tensors it was built from, checked by identity at each use
    context_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    page_size: int
    g: int  # query heads per KV head
    total: int  # query tokens
    q_start: torch.Tensor  # [B] int32
    n_q: torch.Tensor  # [B] int32
    table: torch.Tensor  # [B, W] int32, block id * page_size
    ctx: torch.Tensor  # [B] int32
    tiles: tuple[torch.Tensor, torch.Tensor, int] | None  # None when the step has no query or no sequence
    launch: tuple[int, int, int] | None = None  # (block_m, warps, stages) of a decode step; None: the constants
    heads_first: bool = False  # the grid as (KV heads, tiles): DECODE_HEADS_FIRST at a decode step


def decode_launch(num_tokens: int, num_seqs: int, g: int, num_kv_heads: int) -> tuple[int, int, int] | None:
    """The launch shape of a paged step, from its sizes alone: for a decode step (one query per sequence) of a GQA
    group that fits ``DECODE_BLOCK_M`` rows, 16-row tiles in ``DECODE_NUM_WARPS`` warps with enough programs to fill
    the GPU, in ``DECODE_SPLIT_NUM_WARPS`` warps with so few that the step runs split (up to ``DECODE_SPLIT_MAX_SEQS``
    sequences); else None (the constants)."""
    if num_tokens != num_seqs or g > DECODE_BLOCK_M:
        return None
    programs = num_seqs * num_kv_heads
    if programs >= DECODE_MIN_PROGRAMS:
        return DECODE_BLOCK_M, DECODE_NUM_WARPS, NUM_STAGES
    if programs < SPLIT_BELOW_PROGRAMS and num_seqs <= DECODE_SPLIT_MAX_SEQS:
        return DECODE_BLOCK_M, DECODE_SPLIT_NUM_WARPS, NUM_STAGES
    return None


def paged_layout(
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    page_size: int,
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    device: torch.device,
) -> PagedLayout:
    """The layout :func:`attention_paged` reads for ``num_tokens`` queries of ``num_heads`` heads over caches of
    ``num_kv_heads`` heads in pages of ``page_size`` positions (no host sync, CUDA-graph friendly)."""
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"attention_paged: {num_heads} query heads is not a multiple of {num_kv_heads} KV heads")
    cu = cu_seqlens_q.to(device=device, dtype=torch.int32)
    n_q = (cu[1:] - cu[:-1]).contiguous()
    table = (block_tables.to(device=device, dtype=torch.int32) * page_size).contiguous()
    ctx = context_lens.to(device=device, dtype=torch.int32).contiguous()
    g = num_heads // num_kv_heads
    launch = decode_launch(num_tokens, n_q.numel(), g, num_kv_heads)
    block_m = launch[0] if launch else BLOCK_M
    tiles = _fwd_tiles(n_q, g, num_tokens, block_m) if num_tokens and n_q.numel() else None
    # one query per sequence, enough programs for the launch order to matter
    decode = tiles is not None and num_tokens == n_q.numel() and num_tokens * num_kv_heads >= SPLIT_BELOW_PROGRAMS
    if decode and DECODE_LONGEST_FIRST:
        tiles = longest_first(tiles, ctx)
    heads_first = decode and DECODE_HEADS_FIRST and tiles[2] <= MAX_GRID_Y
    q_start = cu[:-1].contiguous()
    return PagedLayout(
        block_tables, context_lens, cu_seqlens_q, page_size, g, num_tokens, q_start, n_q, table, ctx, tiles, launch,
        heads_first,
    )  # fmt: skip


def attention_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float | None = None,
    layout: PagedLayout | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """New queries over a paged KV cache (prefill chunks and decode; no host sync, CUDA-graph friendly).

    q [T, Hq, Dk]; caches [num_blocks, page_size, Hkv, D]; ``block_tables [B, max_pages]``; ``context_lens [B]``
    (KV length including the new tokens); ``cu_seqlens_q [B+1]``. Query ``i`` of sequence ``b`` sits at position
    ``context_lens[b] - n_q[b] + i``. ``layout``: :func:`paged_layout` of these arguments, built once per step
    (default: built here). ``window``/``sinks``: a sliding window and per-head sink logits (module docstring); a
    windowed query reads no page wholly before its window.
    """
    _check_shapes("attention_paged", q, k_cache, v_cache)
    page = k_cache.shape[1]
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.stride(-1) != 1 or c.stride(0) != page * c.stride(1):
            raise ValueError(f"attention_paged: {name} must have contiguous pages; strides {c.stride()}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    q = _last_dim_contiguous(q)
    total, hq, hkv = q.shape[0], q.shape[1], k_cache.shape[2]
    if layout is None:
        layout = paged_layout(block_tables, context_lens, cu_seqlens_q, page, total, hq, hkv, q.device)
    elif not (
        layout.block_tables is block_tables
        and layout.context_lens is context_lens
        and layout.cu_seqlens_q is cu_seqlens_q
        and (layout.page_size, layout.g, layout.total) == (page, hq // hkv, total)
        and layout.n_q.device == q.device
    ):
        raise ValueError(
            "attention_paged: layout was built for other arguments (it must come from paged_layout of this call's "
            f"block_tables, context_lens and cu_seqlens_q; page {layout.page_size}, {layout.g} query heads per KV "
            f"head, {layout.total} tokens, on {layout.n_q.device}; this call: page {page}, {hq // hkv}, {total}, "
            f"on {q.device})"
        )
    out, _ = _fwd(
        q,
        k_cache.flatten(0, 1),
        v_cache.flatten(0, 1),
        layout.table,
        page,
        layout.q_start,
        layout.n_q,
        layout.ctx,
        scale,
        False,
        layout.tiles,
        launch=layout.launch,
        window=window,
        sinks=sinks,
        heads_first=layout.heads_first,
    )
    return out


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Token ``i``'s K/V to flat slot ``slot_mapping[i]`` of caches [num_blocks, page_size, Hkv, D]; slots < 0 skip."""
    if k_cache.dtype != k.dtype or v_cache.dtype != v.dtype:
        raise TypeError(f"write_kv_cache: cache dtype {k_cache.dtype} != key dtype {k.dtype}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.stride(-1) != 1 or c.stride(0) != c.shape[1] * c.stride(1):
            raise ValueError(f"write_kv_cache: {name} must have contiguous pages; strides {c.stride()}")
    total = k.shape[0]
    if total == 0:
        return
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    kc, vc = k_cache.flatten(0, 1), v_cache.flatten(0, 1)  # views: caches have contiguous pages
    hkv, dk, dv = k.shape[1], k.shape[2], v.shape[2]
    slots = slot_mapping.to(device=k.device, dtype=torch.int64).contiguous()
    _write_kv[(total,)](
        k,
        v,
        kc,
        vc,
        slots,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kc.stride(0),
        kc.stride(1),
        vc.stride(0),
        vc.stride(1),
        HKV=hkv,
        DK=dk,
        DV=dv,
        BLOCK_H=next_pow2(hkv),
        BLOCK_DK=next_pow2(dk),
        BLOCK_DV=next_pow2(dv),
    )


__all__ = [
    "BLOCK_M",
    "BLOCK_N",
    "SPLIT_N",
    "PagedLayout",
    "attention_paged",
    "decode_launch",
    "longest_first",
    "paged_layout",
    "write_kv_cache",
]
