"""Candidate launch forms of the invariant paged decode attention: one query token per sequence over a paged KV
cache, each computing per row what ``attention._attn_fwd`` computes at decode, in another launch form that may read
the cache faster.

These are launch forms measured against the op's launch (``benchmarks/attention_decode.py``: each is timed and its
output compared with the op's, torch.equal). None is used by the op: the op takes one only once a GPU test shows its
bits equal the op's (``tests/test_triton_attention_decode.py::test_gpu_decode_candidates_bits``).

What fixes a row's bits (``attention.py``'s docstring): its q row; key tiles of ``BLOCK_N`` absolute positions
walked in order with the same online-softmax update (scores scaled by ``qk_scale``, ``exp2``, the causal mask); the
MMA instruction and per-thread layout of the ``[16, BLOCK_N]`` score tile (one warp owns 16 rows and all
``BLOCK_N`` columns, so a row's max and sum reduce inside one warp); splits of ``SPLIT_N`` keys folded in split order
by ``attention._fold``. How K and V are addressed and loaded never changes them. The forms (``FORMS``):

* ``addr32``: the op's decode launch (``DECODE_BLOCK_M`` rows in one warp, ``NUM_STAGES`` stages) with cheaper
  address arithmetic. The op gathers each key's page (``table[pos // page_size]``, a runtime page size) and forms a
  64-bit address per (key, dim). Here the page size is a constexpr; a key tile reads one table entry per page it
  covers (four at pages of 16) and its K/V offsets are each page's base plus a fixed ``[rows, D]`` block, in int32
  where the cache's largest offset fits (checked on the host; int64 otherwise). A page size that neither divides
  ``BLOCK_N`` nor is a multiple of it falls back to one table entry per key.
* ``splitwarps``: four warps per (sequence, KV head) program, warp ``w`` walking splits ``w, w + 4, ...``: the scores
  are one batched ``tl.dot`` over ``[4, 16, D] x [4, D, BLOCK_N]``, whose MMA layout Triton puts as warpsPerCTA
  ``[4, 1, 1]`` (``warpsPerTileV2`` in ``AccelerateMatmul.cpp`` returns ``{numWarps, 1, 1}`` for a rank-3 dot; a rank-3
  dot is an MMAv2 dot, the instruction of the one-warp 16-row tile), so each warp holds a full ``[16, BLOCK_N]``
  score tile of its own split. After each round of four splits the partials are folded in split order (0, 1, 2, ...)
  by ``_fold``, as the op folds them. Key tiles past a row's last key, which a warp of the last round may walk, are
  bitwise no-ops (``attention.py``: ``alpha = exp2(0) = 1``, ``p = 0``). The op's per-key addressing.
* ``splitwarps-addr32``: ``splitwarps`` with ``addr32``'s addressing.
* ``tma``: ``addr32``'s launch with each page block of K and V loaded by TMA (host tensor descriptors of the
  ``[rows, Hkv * D]`` storage, as ``matmul.py`` builds them; one load of ``[16, D]`` per page of 16) and the blocks
  joined into the ``[BLOCK_N, D]`` tile. A descriptor load has no mask: a last page's rows past the context are
  zeroed before ``P @ V``, as the masked load gives 0 (their scores are masked to ``-inf`` as in the op). Pages of 16,
  32 or a multiple of ``BLOCK_N``, power-of-2 head dims (``unsupported`` says why not otherwise).

Under the CPU interpreter the MMAs are ``attention._mma``'s broadcast products summed over K in one order (the
rank-3 one, ``_mma3``, the same sums per batch), so every form is tested there against the op, torch.equal: that
holds each form to the op's arithmetic per row (positions, masks, scaling, the folds and their order). The MMA
instruction, the per-thread layout and the in-warp reduction order exist only on the GPU, where the GPU test checks
them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreting, next_pow2
from .attention import _LOG2E, BLOCK_N, DECODE_BLOCK_M, DECODE_NUM_WARPS, NUM_STAGES, SPLIT_N, SPLIT_TILES, _fold, _mma

FORMS = ("addr32", "splitwarps", "splitwarps-addr32", "tma")
SPLIT_WARPS = 4  # splitwarps: warps per program, each walking its own splits
_INT32_MAX = 2**31 - 1


@triton.jit
def _mma3(a, b, acc, UPCAST: tl.constexpr):
    """``acc + a @ b`` per batch (``[W, M, K] x [W, K, N]``); under the interpreter the broadcast product summed over
    K, as ``_mma`` sums it for one batch."""
    if UPCAST:
        return acc + tl.sum(a.to(tl.float32)[:, :, :, None] * b.to(tl.float32)[:, None, :, :], axis=2)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _decode_rows(kvh, G: tl.constexpr, BLOCK_M: tl.constexpr):
    """A decode program's rows: row ``r`` is query head ``kvh * G + r`` of the sequence's one query; rows past the
    group are padding (never stored; they attend to key 0 as the op's padding rows do)."""
    offs_m = tl.arange(0, BLOCK_M)
    row_ok = offs_m < G
    head = kvh * G + offs_m % G
    return row_ok, head


@triton.jit
def _tma_block(desc, tb, pos, hi, col, PAGE_SIZE: tl.constexpr):
    """The ``[ROWS, D]`` descriptor block of keys ``pos .. pos + ROWS - 1`` (one page's, or a part of one)."""
    page_row = tl.load(tb + pos // PAGE_SIZE, mask=pos < hi, other=0)
    return desc.load([page_row + pos % PAGE_SIZE, col])


@triton.jit
def _cat_rows(a, b, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """``[ROWS, D]`` blocks ``a`` then ``b`` as ``[2 * ROWS, D]``."""
    return tl.reshape(tl.permute(tl.join(a, b), (2, 0, 1)), [2 * ROWS, BLOCK_D])


@triton.jit
def _tma_tile(desc, tb, start, hi, col, PAGE_SIZE: tl.constexpr, ROWS: tl.constexpr, NP: tl.constexpr,
              BLOCK_D: tl.constexpr):  # fmt: skip
    """Key tile ``start .. start + NP * ROWS - 1`` as ``NP`` (1, 2 or 4) descriptor loads of ``ROWS`` rows."""
    x = _tma_block(desc, tb, start, hi, col, PAGE_SIZE)
    if NP >= 2:
        x = _cat_rows(x, _tma_block(desc, tb, start + ROWS, hi, col, PAGE_SIZE), ROWS, BLOCK_D)
    if NP == 4:
        y = _cat_rows(
            _tma_block(desc, tb, start + 2 * ROWS, hi, col, PAGE_SIZE),
            _tma_block(desc, tb, start + 3 * ROWS, hi, col, PAGE_SIZE),
            ROWS,
            BLOCK_D,
        )
        x = _cat_rows(x, y, 2 * ROWS, BLOCK_D)
    return x


@triton.jit
def _decode_addr32(
    Q,
    K,
    V,
    Out,
    SEQ_QSTART,
    SEQ_CTX,
    TABLE,
    stride_tb,
    stride_qt,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_ot,
    stride_oh,
    qk_scale,
    KD,
    VD,
    G: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    ROWS: tl.constexpr,
    OFF_64: tl.constexpr,
    TMA: tl.constexpr,
    UPCAST: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    row_ok, head = _decode_rows(kvh, G, BLOCK_M)
    hi = tl.load(SEQ_CTX + b)  # keys of the sequence, its new token's included
    qpos = tl.where(row_ok, hi - 1, 0)
    q_row = tl.load(SEQ_QSTART + b).to(tl.int64)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(
        Q + q_row * stride_qt + head[:, None] * stride_qh + offs_dk[None, :],
        mask=row_ok[:, None] & (offs_dk[None, :] < DK),
        other=0.0,
    )

    NP: tl.constexpr = BLOCK_N // ROWS  # blocks of ROWS keys (one page, or a page's part) per key tile
    offs_p = tl.arange(0, NP) * ROWS
    offs_r = tl.arange(0, ROWS)
    # each block's keys: its base row + r, for r < ROWS; the [ROWS, D] offsets fixed for the launch
    k_fixed = offs_r[:, None] * stride_kn + offs_dk[None, :]
    v_fixed = offs_r[:, None] * stride_vn + offs_dv[None, :]
    dk_ok = (offs_dk < DK)[None, None, :]
    dv_ok = (offs_dv < DV)[None, None, :]
    tb = TABLE + b.to(tl.int64) * stride_tb
    k_base = K + kvh * stride_kh
    v_base = V + kvh * stride_vh
    offs_n = tl.arange(0, BLOCK_N)
    m_run = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_run = tl.zeros([BLOCK_M], tl.float32)
    acc_run = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for start in range(0, hi, BLOCK_N):
        kpos = start + offs_n
        if TMA:  # KD/VD: descriptors of the [rows, Hkv * D] storage; rows past the context are zeroed below
            k = _tma_tile(KD, tb, start, hi, kvh * DK, PAGE_SIZE, ROWS, NP, BLOCK_DK)
        else:
            bpos = start + offs_p  # [NP] first key of each block
            page_row = tl.load(tb + bpos // PAGE_SIZE, mask=bpos < hi, other=0)
            srow = page_row + bpos % PAGE_SIZE
            if OFF_64:
                srow = srow.to(tl.int64)
            kin = ((bpos[:, None] + offs_r[None, :]) < hi)[:, :, None]  # [NP, ROWS, 1]
            k = tl.load(k_base + ((srow * stride_kn)[:, None, None] + k_fixed[None, :, :]), mask=kin & dk_ok, other=0.0)
            k = tl.reshape(k, [BLOCK_N, BLOCK_DK])
        qk = _mma(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), UPCAST) * qk_scale
        qk = tl.where(kpos[None, :] <= qpos[:, None], qk, float("-inf"))
        if (start % SPLIT_N == 0) and (start > 0):
            s0 = start - SPLIT_N
            m_run, l_run, acc_run = _fold(m_run, l_run, acc_run, m_i, l_i, acc, s0 == 0, s0 <= qpos)
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_use)
        p = tl.math.exp2(qk - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if TMA:
            # a page's rows past the context hold whatever the cache holds there: zero them, as the masked load
            # does (p is 0 there, and 0 * inf or 0 * nan would not be)
            v = _tma_tile(VD, tb, start, hi, kvh * DV, PAGE_SIZE, ROWS, NP, BLOCK_DV)
            v = tl.where((kpos < hi)[:, None], v, 0.0)
        else:
            v = tl.load(v_base + ((srow * stride_vn)[:, None, None] + v_fixed[None, :, :]), mask=kin & dv_ok, other=0.0)
            v = tl.reshape(v, [BLOCK_N, BLOCK_DV])
        acc = _mma(p.to(v.dtype), v, acc, UPCAST)
        m_i = m_new
    s0 = (hi - 1) - (hi - 1) % SPLIT_N  # the last split, folded after the loop
    m_run, l_run, acc_run = _fold(m_run, l_run, acc_run, m_i, l_i, acc, s0 == 0, s0 <= qpos)
    out = acc_run / l_run[:, None]
    tl.store(
        Out + b.to(tl.int64) * stride_ot + head[:, None] * stride_oh + offs_dv[None, :],
        out.to(Out.dtype.element_ty),
        mask=row_ok[:, None] & (offs_dv[None, :] < DV),
    )


@triton.jit
def _decode_splitwarps(
    Q,
    K,
    V,
    Out,
    SEQ_QSTART,
    SEQ_CTX,
    TABLE,
    stride_tb,
    stride_qt,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_ot,
    stride_oh,
    qk_scale,
    G: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_N: tl.constexpr,
    SPLIT_TILES: tl.constexpr,
    W: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_ADDR: tl.constexpr,
    OFF_64: tl.constexpr,
    UPCAST: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    row_ok, head = _decode_rows(kvh, G, BLOCK_M)
    hi = tl.load(SEQ_CTX + b)
    qpos = tl.where(row_ok, hi - 1, 0)
    q_row = tl.load(SEQ_QSTART + b).to(tl.int64)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(
        Q + q_row * stride_qt + head[:, None] * stride_qh + offs_dk[None, :],
        mask=row_ok[:, None] & (offs_dk[None, :] < DK),
        other=0.0,
    )
    q = tl.broadcast_to(q[None, :, :], [W, BLOCK_M, BLOCK_DK])  # every warp's split sees the same q rows

    offs_w = tl.arange(0, W)
    offs_n = tl.arange(0, BLOCK_N)
    NP: tl.constexpr = BLOCK_N // ROWS
    offs_p = tl.arange(0, NP) * ROWS
    offs_r = tl.arange(0, ROWS)
    k_fixed = offs_r[:, None] * stride_kn + offs_dk[None, :]
    v_fixed = offs_r[:, None] * stride_vn + offs_dv[None, :]
    tb = TABLE + b.to(tl.int64) * stride_tb
    k_base = K + kvh * stride_kh
    v_base = V + kvh * stride_vh
    m_run = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_run = tl.zeros([BLOCK_M], tl.float32)
    acc_run = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for r0 in range(0, hi, W * SPLIT_N):  # a round: W consecutive splits, warp w on split r0 / SPLIT_N + w
        split0 = r0 + offs_w * SPLIT_N  # [W]
        m_i = tl.full([W, BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([W, BLOCK_M], tl.float32)
        acc = tl.zeros([W, BLOCK_M, BLOCK_DV], tl.float32)
        # the round's first split needs the most tiles; a later split's tiles past its keys are no-ops
        n_tiles = tl.minimum(SPLIT_TILES, tl.cdiv(hi - r0, BLOCK_N))
        for j in range(0, n_tiles):
            kpos = split0[:, None] + j * BLOCK_N + offs_n[None, :]  # [W, BLOCK_N]
            if BLOCK_ADDR:
                bpos = split0[:, None] + j * BLOCK_N + offs_p[None, :]  # [W, NP]
                page_row = tl.load(tb + bpos // PAGE_SIZE, mask=bpos < hi, other=0)
                srow = page_row + bpos % PAGE_SIZE
                if OFF_64:
                    srow = srow.to(tl.int64)
                kin = ((bpos[:, :, None] + offs_r[None, None, :]) < hi)[:, :, :, None]  # [W, NP, ROWS, 1]
                k_off = (srow * stride_kn)[:, :, None, None] + k_fixed[None, None, :, :]
                v_off = (srow * stride_vn)[:, :, None, None] + v_fixed[None, None, :, :]
                k = tl.load(k_base + k_off, mask=kin & (offs_dk < DK)[None, None, None, :], other=0.0)
                k = tl.reshape(k, [W, BLOCK_N, BLOCK_DK])
            else:  # the op's addressing: one table entry and one 64-bit row offset per key
                kin = kpos < hi
                page_row = tl.load(tb + kpos // PAGE_SIZE, mask=kin, other=0)
                srow = (page_row + kpos % PAGE_SIZE).to(tl.int64)
                k = tl.load(
                    k_base + srow[:, :, None] * stride_kn + offs_dk[None, None, :],
                    mask=kin[:, :, None] & (offs_dk < DK)[None, None, :],
                    other=0.0,
                )
            qk = _mma3(q, tl.permute(k, (0, 2, 1)), tl.zeros([W, BLOCK_M, BLOCK_N], tl.float32), UPCAST) * qk_scale
            qk = tl.where(kpos[:, None, :] <= qpos[None, :, None], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 2))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.math.exp2(m_i - m_use)
            p = tl.math.exp2(qk - m_use[:, :, None])
            l_i = l_i * alpha + tl.sum(p, 2)
            acc = acc * alpha[:, :, None]
            if BLOCK_ADDR:
                v = tl.load(v_base + v_off, mask=kin & (offs_dv < DV)[None, None, None, :], other=0.0)
                v = tl.reshape(v, [W, BLOCK_N, BLOCK_DV])
            else:
                v = tl.load(
                    v_base + srow[:, :, None] * stride_vn + offs_dv[None, None, :],
                    mask=kin[:, :, None] & (offs_dv < DV)[None, None, :],
                    other=0.0,
                )
            acc = _mma3(p.to(v.dtype), v, acc, UPCAST)
            m_i = m_new
        # the round's partials into the running state in split order; each is picked out of its warp exactly (its
        # value plus zeros, or the max with -inf)
        for w in tl.static_range(W):
            pick = offs_w == w
            m_s = tl.max(tl.where(pick[:, None], m_i, float("-inf")), 0)
            l_s = tl.sum(tl.where(pick[:, None], l_i, 0.0), 0)
            acc_s = tl.sum(tl.where(pick[:, None, None], acc, 0.0), 0)
            s0 = r0 + w * SPLIT_N
            m_run, l_run, acc_run = _fold(m_run, l_run, acc_run, m_s, l_s, acc_s, s0 == 0, s0 <= qpos)
    out = acc_run / l_run[:, None]
    tl.store(
        Out + b.to(tl.int64) * stride_ot + head[:, None] * stride_oh + offs_dv[None, :],
        out.to(Out.dtype.element_ty),
        mask=row_ok[:, None] & (offs_dv[None, :] < DV),
    )


def _block_rows(page_size: int) -> int:
    """Keys per addressed block: the page where it divides ``BLOCK_N``, ``BLOCK_N`` where the page is a multiple of
    it (a tile inside one page), else 1 (one table entry per key, the op's gather)."""
    if BLOCK_N % page_size == 0:
        return page_size
    if page_size % BLOCK_N == 0:
        return BLOCK_N
    return 1


def unsupported(form: str, page_size: int, dk: int, dv: int) -> str | None:
    """Why ``form`` cannot run pages of ``page_size`` keys and head dims ``dk``/``dv``, or None. Only ``tma`` refuses
    any: it loads blocks of 16, 32 or ``BLOCK_N`` keys of one head (1, 2 or 4 per key tile) with the head dims whole (a
    block of a padded dim would read the next head's columns)."""
    if form != "tma":
        return None
    rows = _block_rows(page_size)
    if rows == 1 or BLOCK_N // rows not in (1, 2, 4):
        return f"the tma form takes pages of 16, 32 or a multiple of {BLOCK_N} keys; got {page_size}"
    if dk != next_pow2(dk) or dv != next_pow2(dv):
        return f"the tma form takes power-of-2 head dims; got {dk}/{dv}"
    return None


def _descriptors(k_rows: torch.Tensor, v_rows: torch.Tensor, rows: int) -> tuple:
    """Host tensor descriptors of the contiguous ``[rows, Hkv * D]`` storages in blocks of ``rows`` keys of one head
    (the ``tma`` form)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    (_, hkv, dk), dv = k_rows.shape, v_rows.shape[2]
    if not (k_rows.is_contiguous() and v_rows.is_contiguous()):
        raise ValueError("decode_attention: the tma form takes contiguous K/V storage")
    return (
        TensorDescriptor.from_tensor(k_rows.view(-1, hkv * dk), [rows, dk]),
        TensorDescriptor.from_tensor(v_rows.view(-1, hkv * dv), [rows, dv]),
    )


def offsets_fit_int32(*caches: torch.Tensor) -> bool:
    """Whether every element offset of these ``[rows, Hkv, D]`` storages (from their first element) fits in int32."""
    return all(sum((n - 1) * s for n, s in zip(c.shape, c.stride(), strict=True)) <= _INT32_MAX for c in caches)


def decode_attention(
    form: str,
    q: torch.Tensor,
    k_rows: torch.Tensor,
    v_rows: torch.Tensor,
    table: torch.Tensor,
    page_size: int,
    q_start: torch.Tensor,
    n_q: torch.Tensor,
    ctx: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """A decode step in candidate launch form ``form`` (one of ``FORMS``): the arguments of ``attention._fwd`` for a
    decode step (``k_rows``/``v_rows`` ``[rows, Hkv, D]`` storage, ``table [B, W]`` int32 first storage row per page,
    int32 ``q_start``/``n_q``/``ctx`` per sequence; ``paged_layout`` builds them). One query per sequence: ``n_q`` is
    all ones (as ``attention.decode_launch`` requires; not read, to keep the launch free of host syncs) and a GQA
    group of at most ``DECODE_BLOCK_M`` query heads. Returns the output ``[B, Hq, Dv]``; no LSE."""
    if form not in FORMS:
        raise ValueError(f"decode_attention: unknown form {form!r}; known: {', '.join(FORMS)}")
    total, hq, dk = q.shape
    hkv, dv = k_rows.shape[1], v_rows.shape[2]
    g = hq // hkv
    if g > DECODE_BLOCK_M or hq % hkv:
        raise ValueError(f"decode_attention: {hq} query heads over {hkv} KV heads; the group must divide and be at "
                         f"most {DECODE_BLOCK_M}")  # fmt: skip
    nseq = n_q.numel()
    if total != nseq:
        raise ValueError(f"decode_attention: {total} queries for {nseq} sequences; decode has one per sequence")
    why = unsupported(form, page_size, dk, dv)
    if why:
        raise ValueError(f"decode_attention: {why}")
    out = q.new_empty(total, hq, dv)
    if nseq == 0:
        return out
    rows = _block_rows(page_size)
    off_64 = not offsets_fit_int32(k_rows, v_rows)
    args = (q, k_rows, v_rows, out, q_start, ctx, table, table.stride(0), q.stride(0), q.stride(1),
            k_rows.stride(0), k_rows.stride(1), v_rows.stride(0), v_rows.stride(1), out.stride(0), out.stride(1),
            scale * _LOG2E)  # fmt: skip
    shape = dict(G=g, DK=dk, DV=dv, BLOCK_DK=next_pow2(dk), BLOCK_DV=next_pow2(dv), BLOCK_M=DECODE_BLOCK_M,
                 BLOCK_N=BLOCK_N, SPLIT_N=SPLIT_N, PAGE_SIZE=page_size, UPCAST=interpreting())  # fmt: skip
    if form in ("addr32", "tma"):
        descs = _descriptors(k_rows, v_rows, rows) if form == "tma" else (k_rows, v_rows)
        _decode_addr32[(nseq, hkv)](*args, *descs, **shape, ROWS=rows, OFF_64=off_64, TMA=form == "tma",
                                    num_warps=DECODE_NUM_WARPS, num_stages=NUM_STAGES)  # fmt: skip
    else:
        block_addr = form == "splitwarps-addr32"
        _decode_splitwarps[(nseq, hkv)](*args, **shape, SPLIT_TILES=SPLIT_TILES, W=SPLIT_WARPS,
                                        ROWS=rows if block_addr else 1, BLOCK_ADDR=block_addr, OFF_64=off_64,
                                        num_warps=SPLIT_WARPS, num_stages=NUM_STAGES)  # fmt: skip
    return out


__all__ = ["FORMS", "decode_attention", "offsets_fit_int32", "unsupported"]
