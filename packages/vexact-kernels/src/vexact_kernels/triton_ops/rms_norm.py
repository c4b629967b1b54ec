"""RMSNorm forward and backward in Triton: ``y = x * rstd * weight``, ``rstd = 1 / sqrt(mean(x^2) + eps)``.

Invariance: one program per row; the row's sum of squares is accumulated over the hidden size in fixed blocks of
``RMS_BLOCK`` (elementwise fp32 adds into a ``[RMS_BLOCK]`` vector, blocks in order), then one ``tl.sum`` whose tree
is fixed by the compile-time block and warp count. Nothing in a row's math reads the number of rows, so row ``i`` of
the output (and of ``dx``) is bitwise the same for any batch, row subset or chunking. The backward keeps ``dx`` of a
row independent of the other rows (several rows a program, each reduced along its own columns) and sums ``dweight``
over rows in fixed blocks of rows (partials) and then over the partials, in an order fixed by the shape (no atomics),
so it is identical run to run for a given input; its tiles follow the hidden size (``bwd_dx_shape``,
``bwd_dw_shape``). ``_rms_norm_fwd_pair_kernel`` normalises the rows of two tensors (q_norm and k_norm of a layer) in
one launch through the same row code, so each row's bits are the single kernel's; it reads a row through a token and a
head stride, so q and k, views into the grouped q/k/v matmul's output, are not copied. ``_add_rms_norm_fwd_kernel``
stores a row's residual sum ``s = x + r`` (fp32 add, rounded once to nearest even, as torch adds) and runs the row
code's arithmetic on the rounded ``s`` it holds: the residual add and the norm after it in one launch, with the bits of
torch's add followed by the single kernel. ``_qk_norm_rotary_kernel`` takes a token's q (or k) head rows in one
``[heads, head_dim]`` tile, normalises and rotates them in registers (and stores the k rows to the KV cache), with the
bits of the pair kernel followed by the rotary kernel: a row's sum of squares in the tile runs the pair kernel's tree
where one warp holds the row (``qk_tile_fits``: each lane's 16-byte vector summed in order, then the butterfly over
the row's lanes; in the pair kernel's ``[RMS_BLOCK]`` row the other lanes and warps add exact zeros).

Speed: a row's blocks are unrolled (``NB = cdiv(H, RMS_BLOCK)``, a compile-time count), so the loads of a pass over
the row are in flight together rather than one block's round trip after another; and no launch reads back what it
stored. At decode sizes (a few hundred rows, one program each) a pass's memory latency, not bandwidth, is the time;
the q/k launch's programs take a token's heads each for that reason.

Accuracy: fp32 throughout (``sqrt_rn``/``div_rn``, correctly rounded), cast once; within a few fp32 ulps of a float64
reference before the final cast.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import cdiv, next_pow2, qk_tile_fits
from .rotary import _rotate_rn

# Numerics-affecting launch parameters: fixed for every shape (the sum-of-squares tree depends on them).
RMS_BLOCK = 1024
RMS_NUM_WARPS = 4
# Backward launch shapes. The backward needs determinism, not invariance (nothing compares its bits with another
# path), so its tiles follow the hidden size; every choice below is a function of the shape alone: a row's ``dx``
# never reads another row, and ``dweight`` sums the rows in an order fixed by (rows, hidden size).
RMS_BWD_TILE = 2048  # elements of the dx kernel's [rows, block] tile: head_dim-sized rows (q/k norms) 16 a program
RMS_DW_ROWS = 64  # at least this many rows per dweight partial ...
RMS_DW_ELEMS = 32768  # ... and about this many elements (256 rows of a 128-wide q/k norm), so few partials remain
RMS_DW_TILE = 32  # rows (partial kernel) or partials (final kernel) summed a tile at a time
RMS_DW_COLS = 128  # columns per dweight program


def aligned_rows(t: torch.Tensor) -> torch.Tensor:
    """Contiguous, 16-byte aligned: Triton specialises kernels on pointer alignment and may then pick a different
    register layout (and so a different reduction tree); fresh allocations are aligned, so a row gets the same
    compiled kernel whether it arrives alone, in a batch or as a slice."""
    t = t.contiguous()
    if t.data_ptr() % 16:
        t = t.clone()
    return t


@triton.jit
def _row_rstd(x_row, rstd_row, H, eps, BLOCK: tl.constexpr, NB: tl.constexpr):
    """A row's ``rstd`` (stored to ``rstd_row`` and returned): the row's squares accumulated block by block into a
    ``[BLOCK]`` fp32 vector, blocks in order, then one ``tl.sum``. ``NB = cdiv(H, BLOCK)`` blocks, unrolled so the
    loads of every block are in flight at once (the arithmetic is the loop's: the same adds in the same order)."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in tl.static_range(NB):
        cols = i * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < H, other=0.0).to(tl.float32)
        acc = tl.fma(x, x, acc)
    rstd = _rstd_of(acc, H, eps)
    tl.store(rstd_row, rstd)
    return rstd


@triton.jit
def _rstd_of(acc, H, eps, AXIS: tl.constexpr = 0):
    """``1 / sqrt(sum(acc) / H + eps)`` along ``AXIS``, each op correctly rounded."""
    var = tl.div_rn(tl.sum(acc, axis=AXIS), tl.cast(H, tl.float32))
    return tl.div_rn(1.0, tl.sqrt_rn(var + eps))


@triton.jit
def _rms_norm_row(x_row, w_ptr, y_row, rstd_row, H, eps, BLOCK: tl.constexpr, NB: tl.constexpr):
    """One row's forward, from the row's first element ``x_row`` (contiguous) to ``y_row`` and ``rstd_row`` (the body
    of :func:`_rms_norm_fwd_kernel` and of the pair kernel, so both give a row the same bits)."""
    rstd = _row_rstd(x_row, rstd_row, H, eps, BLOCK, NB)
    for i in tl.static_range(NB):
        cols = i * BLOCK + tl.arange(0, BLOCK)
        mask = cols < H
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_row + cols, (x * rstd * w).to(y_row.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, H, eps, BLOCK: tl.constexpr, NB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    _rms_norm_row(x_ptr + row * H, w_ptr, y_ptr + row * H, rstd_ptr + row, H, eps, BLOCK, NB)


@triton.jit
def _strided_row(x_ptr, row, n, stride_t, stride_h):
    """First element of row ``row`` of a ``[T, n, H]`` tensor with strides ``(stride_t, stride_h, 1)``."""
    return x_ptr + (row // n).to(tl.int64) * stride_t + (row % n).to(tl.int64) * stride_h


@triton.jit(do_not_specialize=["m1", "n1", "n2"])
def _rms_norm_fwd_pair_kernel(
    x1_ptr, w1_ptr, y1_ptr, rstd1_ptr, m1, n1, s1t, s1h,
    x2_ptr, w2_ptr, y2_ptr, rstd2_ptr, n2, s2t, s2h,
    H, eps, BLOCK: tl.constexpr, NB: tl.constexpr,
):  # fmt: skip
    """Rows of two tensors of one hidden size in one launch (q_norm and k_norm): the first ``m1`` programs take x1's
    rows, the rest x2's, each through the same row code as :func:`_rms_norm_fwd_kernel`. Input rows are read through
    strides (:func:`_strided_row`: x1 is ``[m1 / n1, n1, H]``, strides ``(s1t, s1h, 1)``); outputs are contiguous."""
    row = tl.program_id(0)
    if row < m1:
        y_row = y1_ptr + row.to(tl.int64) * H
        _rms_norm_row(_strided_row(x1_ptr, row, n1, s1t, s1h), w1_ptr, y_row, rstd1_ptr + row, H, eps, BLOCK, NB)
    else:
        row2 = row - m1
        y_row = y2_ptr + row2.to(tl.int64) * H
        _rms_norm_row(_strided_row(x2_ptr, row2, n2, s2t, s2h), w2_ptr, y_row, rstd2_ptr + row2, H, eps, BLOCK, NB)


@triton.jit
def _head_tile(x_tok, stride_h, n_heads, D, HEADS: tl.constexpr, BLOCK: tl.constexpr, start=0):
    """Offsets and mask of a token's ``[HEADS, BLOCK]`` tile of head rows, columns ``start ..`` (rows ``n_heads`` and
    columns ``D`` on), from the token's first element ``x_tok`` and the head stride."""
    heads = tl.arange(0, HEADS)
    cols = start + tl.arange(0, BLOCK)
    mask = (heads < n_heads)[:, None] & (cols < D)[None, :]
    return x_tok + heads[:, None].to(tl.int64) * stride_h + cols[None, :], mask


@triton.jit
def _normed(x_tok, stride_h, n_heads, w_ptr, rstd, D, start, HEADS: tl.constexpr, HALF: tl.constexpr, dtype):
    """``x * rstd * w`` of columns ``start .. start + HALF`` of a token's head rows, rounded to ``dtype`` as
    ``_rms_norm_row`` stores ``y``, back in fp32 (``rstd``: ``[HEADS]``)."""
    ptrs, mask = _head_tile(x_tok, stride_h, n_heads, start + D // 2, HEADS, HALF, start)
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    cols = start + tl.arange(0, HALF)
    w = tl.load(w_ptr + cols, mask=cols < start + D // 2, other=0.0).to(tl.float32)
    return (x * rstd[:, None] * w[None, :]).to(dtype).to(tl.float32)


@triton.jit
def _qk_heads(
    x_tok, stride_h, n_heads, w_ptr, o_tok, c, s, D, eps,
    HEADS: tl.constexpr, BLOCK: tl.constexpr, HALF: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """A token's q (or k) head rows, normalised and rotated: the rows' ``rstd`` (``_row_rstd``'s arithmetic: each
    square an fma onto zero, one ``tl.sum`` per row over the ``[HEADS, BLOCK]`` tile, whose per-row tree is the
    ``[RMS_BLOCK]`` row's where the row fits one warp: ``qk_norm_rotary_fwd`` checks), ``y = x * rstd * w`` rounded
    to the output dtype, rotated by ``c``, ``s`` (``_rotate_rn``), stored to ``o_tok`` (contiguous ``[heads, D]``).
    Returns the rotated halves, in the output dtype."""
    ptrs, mask = _head_tile(x_tok, stride_h, n_heads, D, HEADS, BLOCK)
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    rstd = _rstd_of(tl.fma(x, x, tl.zeros([HEADS, BLOCK], dtype=tl.float32)), D, eps, 1)
    dtype = o_tok.dtype.element_ty
    half = D // 2
    y1 = _normed(x_tok, stride_h, n_heads, w_ptr, rstd, D, 0, HEADS, HALF, dtype)
    y2 = _normed(x_tok, stride_h, n_heads, w_ptr, rstd, D, half, HEADS, HALF, dtype)
    o1, o2 = _rotate_rn(y1, y2, c[None, :], s[None, :], INTERPRET)
    o1, o2 = o1.to(dtype), o2.to(dtype)
    ptrs, mask = _head_tile(o_tok, D, n_heads, half, HEADS, HALF)
    tl.store(ptrs, o1, mask=mask)
    tl.store(ptrs + half, o2, mask=mask)
    return o1, o2


@triton.jit(do_not_specialize=["hq", "hk"])
def _qk_norm_rotary_kernel(
    q_ptr, sqt, sqh, hq, wq_ptr, oq_ptr,
    k_ptr, skt, skh, hk, wk_ptr, ok_ptr,
    v_ptr, svt, svh,
    pos_ptr, cos_ptr, sin_ptr, stride_tab, D, eps,
    slot_ptr, kc_ptr, vc_ptr, stride_kcs, stride_kch, stride_vcs, stride_vch,
    HEADS_Q: tl.constexpr, HEADS_K: tl.constexpr, BLOCK: tl.constexpr, HALF: tl.constexpr,
    INTERPRET: tl.constexpr, WRITE_KV: tl.constexpr = False,
):  # fmt: skip
    """A token's q rows (program ``(t, 0)``) or k rows (``(t, 1)``), each normalised as the pair kernel normalises it
    and rotated at the token's position (``_qk_heads``); outputs ``[T, heads, D]`` contiguous (no ``rstd``: nothing
    differentiates this launch). ``WRITE_KV``: the paged cache write as well (``write_kv_cache``'s stores: token
    ``t``'s rows to flat slot ``slot[t]``, slots < 0 skipped): the rotated k rows to ``kc``, and programs ``(t, 2)``
    copy the token's v rows to ``vc``. One program a token's heads: at decode sizes a program per head row waited on
    memory more than it moved it."""
    tok = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    if part == 2:  # WRITE_KV: the token's v rows to its cache slot
        slot = tl.load(slot_ptr + tok)
        if slot >= 0:
            src, mask = _head_tile(v_ptr + tok * svt, svh, hk, D, HEADS_K, BLOCK)
            dst, _ = _head_tile(vc_ptr + slot * stride_vcs, stride_vch, hk, D, HEADS_K, BLOCK)
            tl.store(dst, tl.load(src, mask=mask), mask=mask)
    else:
        d = tl.arange(0, HALF)
        pos = tl.load(pos_ptr + tok).to(tl.int64)
        c = tl.load(cos_ptr + pos * stride_tab + d, mask=d < D // 2, other=0.0)
        s = tl.load(sin_ptr + pos * stride_tab + d, mask=d < D // 2, other=0.0)
        if part == 0:
            _qk_heads(
                q_ptr + tok * sqt, sqh, hq, wq_ptr, oq_ptr + tok * hq * D, c, s, D, eps,
                HEADS_Q, BLOCK, HALF, INTERPRET,
            )  # fmt: skip
        else:
            o1, o2 = _qk_heads(
                k_ptr + tok * skt, skh, hk, wk_ptr, ok_ptr + tok * hk * D, c, s, D, eps,
                HEADS_K, BLOCK, HALF, INTERPRET,
            )  # fmt: skip
            if WRITE_KV:
                slot = tl.load(slot_ptr + tok)
                if slot >= 0:
                    dst, mask = _head_tile(kc_ptr + slot * stride_kcs, stride_kch, hk, D // 2, HEADS_K, HALF)
                    tl.store(dst, o1, mask=mask)
                    tl.store(dst + D // 2, o2, mask=mask)


@triton.jit
def _round_to(v, dtype: tl.constexpr):
    """fp32 ``v`` rounded to ``dtype`` to nearest even, as torch rounds an op's fp32 result. bf16 by its bits: the
    same rounding as the GPU's own conversion (NaN: 0x7FFF, the GPU's), and under the interpreter too, whose bf16 cast
    truncates."""
    if dtype == tl.bfloat16:
        u = v.to(tl.uint32, bitcast=True)
        rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        return tl.where(v != v, 0x7FFF, rounded).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return v.to(dtype)


@triton.jit
def _added(x_ptr, r_ptr, cols, mask, dtype: tl.constexpr):
    """``x + r`` at ``cols`` in fp32, rounded to ``dtype`` as torch's add rounds (masked lanes: 0)."""
    x = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return _round_to(x + r, dtype)


@triton.jit
def _add_rms_norm_fwd_kernel(
    x_ptr, r_ptr, s_ptr, w_ptr, y_ptr, rstd_ptr, H, eps, BLOCK: tl.constexpr, NB: tl.constexpr
):  # fmt: skip
    """Row ``row``: ``s = x + r`` stored in s's dtype, then :func:`_rms_norm_row`'s arithmetic on that ``s`` (so
    ``y`` has the single kernel's bits for it): the squares of the rounded ``s`` accumulated block by block, blocks
    in order, as the single kernel accumulates the stored ``s``; then ``y = s * rstd * w``, with ``s`` added again
    (the same rounded values) instead of read back from memory. ``NB = cdiv(H, BLOCK)`` blocks, unrolled."""
    row = tl.program_id(0).to(tl.int64)
    x_row, r_row, s_row, y_row = x_ptr + row * H, r_ptr + row * H, s_ptr + row * H, y_ptr + row * H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in tl.static_range(NB):
        cols = i * BLOCK + tl.arange(0, BLOCK)
        mask = cols < H
        s = _added(x_row, r_row, cols, mask, s_ptr.dtype.element_ty)
        tl.store(s_row + cols, s, mask=mask)
        sf = s.to(tl.float32)
        acc = tl.fma(sf, sf, acc)
    rstd = _rstd_of(acc, H, eps)
    tl.store(rstd_ptr + row, rstd)
    for i in tl.static_range(NB):
        cols = i * BLOCK + tl.arange(0, BLOCK)
        mask = cols < H
        s = _added(x_row, r_row, cols, mask, s_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_row + cols, (s * rstd * w).to(y_row.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_tile(dy_ptr, x_ptr, w_ptr, rows, rmask, start, H, BLOCK: tl.constexpr):
    """The ``[rows, BLOCK]`` tile of ``dy`` and ``x`` at columns ``start ..`` and those columns of ``w``, in fp32,
    with the tile's mask and offsets (both passes of :func:`_rms_norm_bwd_dx_kernel` read the same tiles)."""
    cols = start + tl.arange(0, BLOCK)
    mask = rmask[:, None] & (cols < H)[None, :]
    offs = rows[:, None] * H + cols[None, :]
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
    return dy, x, w, mask, offs


@triton.jit(do_not_specialize=["M"])
def _rms_norm_bwd_dx_kernel(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, add_ptr, M, H,
    ROWS: tl.constexpr, BLOCK: tl.constexpr, HAS_ADD: tl.constexpr,
):  # fmt: skip
    """``dx`` of ``ROWS`` rows: each row's ``c = sum(dy * w * x_hat) / H`` over its own columns (a ``[ROWS, BLOCK]``
    tile reduced along its rows: no row reads another's values), then ``dx = (dy * w - x_hat * c) * rstd``
    (``HAS_ADD``: plus ``add``, the gradient the norm's input gets from its other use, in fp32, rounded once)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rmask = rows < M
    rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
    acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for start in range(0, H, BLOCK):
        dy, x, w, mask, offs = _bwd_tile(dy_ptr, x_ptr, w_ptr, rows, rmask, start, H, BLOCK)
        acc += (dy * w[None, :]) * (x * rstd[:, None])
    c = tl.div_rn(tl.sum(acc, axis=1), tl.cast(H, tl.float32))
    for start in range(0, H, BLOCK):
        dy, x, w, mask, offs = _bwd_tile(dy_ptr, x_ptr, w_ptr, rows, rmask, start, H, BLOCK)
        dx = (dy * w[None, :] - (x * rstd[:, None]) * c[:, None]) * rstd[:, None]
        if HAS_ADD:
            dx += tl.load(add_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _rms_norm_bwd_dw_partial_kernel(
    dy_ptr, x_ptr, rstd_ptr, part_ptr, M, H, ROWS: tl.constexpr, TILE_ROWS: tl.constexpr, COLS: tl.constexpr
):  # fmt: skip
    """``part[rb, cols] = sum over rows rb * ROWS .. + ROWS of dy * x * rstd``: ``TILE_ROWS`` rows at a time, each
    tile summed along its rows, the tiles added in row order."""
    rb = tl.program_id(0)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    cmask = cols < H
    acc = tl.zeros([COLS], dtype=tl.float32)
    for r0 in range(0, ROWS, TILE_ROWS):
        rows = rb.to(tl.int64) * ROWS + r0 + tl.arange(0, TILE_ROWS)
        rmask = rows < M
        mask = rmask[:, None] & cmask[None, :]
        offs = rows[:, None] * H + cols[None, :]
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        acc += tl.sum(dy * (x * rstd[:, None]), axis=0)
    tl.store(part_ptr + rb.to(tl.int64) * H + cols, acc, mask=cmask)


@triton.jit(do_not_specialize=["n_parts"])
def _rms_norm_bwd_dw_final_kernel(
    part_ptr, dw_ptr, n_parts, H, TILE_PARTS: tl.constexpr, COLS: tl.constexpr
):  # fmt: skip
    """``dw[cols] = sum of the partials``: ``TILE_PARTS`` partials at a time, each tile summed, tiles in order."""
    cols = tl.program_id(0) * COLS + tl.arange(0, COLS)
    cmask = cols < H
    acc = tl.zeros([COLS], dtype=tl.float32)
    for p0 in range(0, n_parts, TILE_PARTS):
        parts = p0 + tl.arange(0, TILE_PARTS)
        mask = (parts < n_parts)[:, None] & cmask[None, :]
        acc += tl.sum(tl.load(part_ptr + parts[:, None].to(tl.int64) * H + cols[None, :], mask=mask, other=0.0), 0)
    tl.store(dw_ptr + cols, acc.to(dw_ptr.dtype.element_ty), mask=cmask)


def rms_norm_fwd(
    x2d: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x2d [M, H]`` -> ``(y [M, H] out_dtype, rstd [M] fp32)``.

    ``rstd`` is always written (one compiled kernel whether or not autograd records, so the values are the same)."""
    x2d = aligned_rows(x2d)
    weight = aligned_rows(weight)
    m, h = x2d.shape
    y = torch.empty(m, h, dtype=out_dtype, device=x2d.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x2d.device)
    if m:
        _rms_norm_fwd_kernel[(m,)](
            x2d, weight, y, rstd, h, eps, BLOCK=RMS_BLOCK, NB=cdiv(h, RMS_BLOCK), num_warps=RMS_NUM_WARPS
        )  # fmt: skip
    return y, rstd


def _int_spec(v: int) -> tuple[bool, bool, bool]:
    """What Triton specialises an integer argument on: the value 1, divisibility by 16, 64-bit."""
    return v == 1, v % 16 == 0, v >= 2**31


def strided_rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """``x``'s rows (last dim ``H``, any leading shape) as ``(x, n, stride_t, stride_h)`` for :func:`_strided_row`:
    row ``r`` starts at ``(r // n) * stride_t + (r % n) * stride_h``. A view (q or k, split from the grouped q/k/v
    output: ``[T, H_heads, D]``, token stride ``(Hq + 2 Hkv) D``) is passed as it is where it gets the compiled kernel
    its contiguous copy would get (16-byte aligned, strides specialised as ``H`` is, so the same code and the same
    bits); otherwise (last dim not contiguous, leading dims that flatten to no ``[T, n]`` grid, other alignment or
    specialisation) its copy, ``(aligned_rows(x), 1, H, H)``, as before."""
    h = x.shape[-1]
    dims: list[tuple[int, int]] = []  # (size, stride) of the leading dims, size-1 dropped, mergeable ones merged
    for size, stride in zip(x.shape[:-1], x.stride()[:-1], strict=True):
        if size == 1:
            continue
        if dims and dims[-1][1] == size * stride:
            dims[-1] = (dims[-1][0] * size, stride)
        else:
            dims.append((size, stride))
    if len(dims) < 2:
        dims = [(1, h)] * (1 - len(dims)) + dims + [(1, h)]  # [rows, H]: n = 1
    viewable = len(dims) == 2 and (x.stride(-1) == 1 or h == 1) and x.data_ptr() % 16 == 0
    if viewable and x.numel() and all(_int_spec(s) == _int_spec(h) for _, s in dims):
        return x, dims[1][0], dims[0][1], dims[1][1]
    return aligned_rows(x.reshape(-1, h)), 1, h, h


def _pair_operands(x1: torch.Tensor, w1: torch.Tensor, x2: torch.Tensor, w2: torch.Tensor) -> tuple:
    """What the pair launch passes for its two inputs' rows: each input's :func:`strided_rows`, the aligned weights,
    the row counts ``m1, m2`` and the fp32 ``rstd [m1 + m2]`` the kernel writes (as the single-input kernel writes
    it)."""
    h = x1.shape[-1]
    m1, m2 = x1.numel() // h, x2.numel() // h
    rstd = torch.empty(m1 + m2, dtype=torch.float32, device=x1.device)
    return strided_rows(x1), strided_rows(x2), aligned_rows(w1), aligned_rows(w2), m1, m2, rstd


def rms_norm_fwd_pair(
    x1: torch.Tensor, w1: torch.Tensor, x2: torch.Tensor, w2: torch.Tensor, eps: float, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm_fwd(x1.reshape(-1, H), w1)[0], rms_norm_fwd(x2.reshape(-1, H), w2)[0]`` (one hidden size ``H``, any
    leading shapes) in one launch, bitwise the same; inputs read through their strides (:func:`strided_rows`, no
    copy of a q or k view), outputs ``[rows, H]`` contiguous."""
    h = x1.shape[-1]
    (x1, n1, s1t, s1h), (x2, n2, s2t, s2h), w1, w2, m1, m2, rstd = _pair_operands(x1, w1, x2, w2)
    y1 = torch.empty(m1, h, dtype=out_dtype, device=x1.device)
    y2 = torch.empty(m2, h, dtype=out_dtype, device=x1.device)
    if m1 + m2:
        _rms_norm_fwd_pair_kernel[(m1 + m2,)](
            x1, w1, y1, rstd, m1, n1, s1t, s1h, x2, w2, y2, rstd[m1:], n2, s2t, s2h, h, eps,
            BLOCK=RMS_BLOCK, NB=cdiv(h, RMS_BLOCK), num_warps=RMS_NUM_WARPS,
        )  # fmt: skip
    return y1, y2


def _head_rows(x: torch.Tensor) -> torch.Tensor:
    """``x [T, H, D]`` as the q/k launch reads it: as it is where its base is 16-byte aligned and its token and head
    strides are multiples of 16 elements (Triton then knows every row's vectors aligned, as in the pair kernel's
    rows), else its contiguous copy."""
    if x.data_ptr() % 16 == 0 and x.stride(-1) == 1 and x.stride(0) % 16 == 0 and x.stride(1) % 16 == 0:
        return x
    return aligned_rows(x)


def qk_norm_rotary_fwd(
    q: torch.Tensor, wq: torch.Tensor, k: torch.Tensor, wk: torch.Tensor, eps: float,
    positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_write: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``rotary(rms_norm(q, wq)), rotary(rms_norm(k, wk))`` for ``q [T, Hq, D]`` and ``k [T, Hk, D]`` (one dtype, any
    strides with a contiguous last dim, a head size :func:`qk_tile_fits` takes) in one launch, bitwise what
    :func:`rms_norm_fwd_pair` and ``rotary.rotary_pair_launch`` give in two; outputs contiguous in q's dtype.
    ``kv_write``: ``(v [T, Hk, D], k_cache, v_cache [blocks, page, Hk, D], slot_mapping [T])``: the same launch also
    stores the rotated k and v in the caches as ``attention.write_kv_cache`` stores them (the caller checks the
    caches' dtype and layout)."""
    from . import interpreting

    if not qk_tile_fits(q):
        raise ValueError(f"qk_norm_rotary_fwd: head size {q.shape[-1]} of {q.dtype} is not one qk_tile_fits takes")
    t, hq, h = q.shape
    hk = k.shape[1]
    q, k = _head_rows(q), _head_rows(k)
    wq, wk = aligned_rows(wq), aligned_rows(wk)
    o1 = torch.empty(t, hq, h, dtype=q.dtype, device=q.device)
    o2 = torch.empty(t, hk, h, dtype=q.dtype, device=q.device)
    cos, sin, positions = cos.contiguous(), sin.contiguous(), positions.contiguous()
    v, slots, kc, vc = k, positions, k, k
    if kv_write is not None:
        v, k_cache, v_cache, slot_mapping = kv_write
        v = _head_rows(v)
        slots = slot_mapping.to(device=q.device, dtype=torch.int64).contiguous()
        kc, vc = k_cache.flatten(0, 1), v_cache.flatten(0, 1)  # views: the caches have contiguous pages
    block = next_pow2(h)
    # at least the rows one [RMS_NUM_WARPS warps x 32 lanes x 16 bytes] layout tile spans, so a row stays in one warp
    min_heads = max(1, RMS_NUM_WARPS * 32 * (16 // q.element_size()) // block)
    if t:
        _qk_norm_rotary_kernel[(t, 3 if kv_write is not None else 2)](
            q, q.stride(0), q.stride(1), hq, wq, o1,
            k, k.stride(0), k.stride(1), hk, wk, o2,
            v, v.stride(0), v.stride(1),
            positions, cos, sin, cos.stride(0), h, eps,
            slots, kc, vc, kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1),
            HEADS_Q=max(next_pow2(hq), min_heads), HEADS_K=max(next_pow2(hk), min_heads), BLOCK=block,
            HALF=next_pow2(h // 2), INTERPRET=interpreting(),
            **({"WRITE_KV": True} if kv_write is not None else {}), num_warps=RMS_NUM_WARPS,
        )  # fmt: skip
    return o1, o2


def add_rms_norm_fwd(
    x2d: torch.Tensor, r2d: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x2d, r2d [M, H]`` (one dtype) -> ``(s, y)``, both ``[M, H]`` in that dtype: ``s = x2d + r2d`` as torch adds
    and ``y = rms_norm_fwd(s, weight, eps, s.dtype)[0]``, bitwise, in one launch."""
    s, y, _ = _add_rms_norm(x2d, r2d, weight, eps)
    return s, y


def _add_rms_norm(x2d, r2d, weight, eps):
    """:func:`add_rms_norm_fwd` and the rows' fp32 ``rstd`` (what the backward reads)."""
    x2d, r2d, weight = aligned_rows(x2d), aligned_rows(r2d), aligned_rows(weight)
    m, h = x2d.shape
    s = torch.empty_like(x2d)
    y = torch.empty_like(x2d)
    rstd = torch.empty(m, dtype=torch.float32, device=x2d.device)
    if m:
        _add_rms_norm_fwd_kernel[(m,)](
            x2d, r2d, s, weight, y, rstd, h, eps, BLOCK=RMS_BLOCK, NB=cdiv(h, RMS_BLOCK), num_warps=RMS_NUM_WARPS
        )  # fmt: skip
    return s, y, rstd


def rms_norm_bwd(
    dy: torch.Tensor,
    x2d: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    need_dw: bool = True,
    add: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients of :func:`rms_norm_fwd`: ``(dx [M, H] in x's dtype, dweight [H] in weight's dtype)``; ``add``
    (``[M, H]``): a gradient ``x2d`` also gets from elsewhere, added to ``dx`` in fp32 before its one rounding."""
    dy = aligned_rows(dy)
    m, h = x2d.shape
    dx = torch.empty_like(x2d)
    rows, block = bwd_dx_shape(h)
    if add is not None:
        add = aligned_rows(add)
    if m:
        _rms_norm_bwd_dx_kernel[(cdiv(m, rows),)](
            dy, x2d, weight, rstd, dx, dx if add is None else add, m, h,
            ROWS=rows, BLOCK=block, HAS_ADD=add is not None, num_warps=RMS_NUM_WARPS,
        )  # fmt: skip
    if not need_dw:
        return dx, None
    dw = torch.empty_like(weight)
    part_rows, cols = bwd_dw_shape(h)
    n_parts = max(1, cdiv(m, part_rows))
    parts = torch.zeros(n_parts, h, dtype=torch.float32, device=x2d.device)
    col_blocks = cdiv(h, cols)
    if m:
        _rms_norm_bwd_dw_partial_kernel[(n_parts, col_blocks)](
            dy, x2d, rstd, parts, m, h, ROWS=part_rows, TILE_ROWS=RMS_DW_TILE, COLS=cols, num_warps=RMS_NUM_WARPS
        )  # fmt: skip
    _rms_norm_bwd_dw_final_kernel[(col_blocks,)](
        parts, dw, n_parts, h, TILE_PARTS=RMS_DW_TILE, COLS=cols, num_warps=RMS_NUM_WARPS
    )  # fmt: skip
    return dx, dw


def bwd_dx_shape(h: int) -> tuple[int, int]:
    """(rows per program, column block) of the ``dx`` kernel for hidden size ``h``: a function of ``h`` alone."""
    block = min(next_pow2(max(h, 1)), RMS_BLOCK)
    return max(1, RMS_BWD_TILE // block), block


def bwd_dw_shape(h: int) -> tuple[int, int]:
    """(rows per ``dweight`` partial, columns per program) for hidden size ``h``: a function of ``h`` alone, so the
    order of the sum over rows is fixed by the shape (small ``h``, as q/k norms over head_dim: more rows a partial,
    so the final sum has few partials to add)."""
    cols = min(next_pow2(max(h, 1)), RMS_DW_COLS)
    rows = max(RMS_DW_ROWS, RMS_DW_ELEMS // max(h, 1)) // RMS_DW_TILE * RMS_DW_TILE
    return rows, cols


class RMSNormFunction(torch.autograd.Function):
    """Autograd wrapper: forward saves fp32 ``rstd`` per row; backward is :func:`rms_norm_bwd`."""

    @staticmethod
    def forward(ctx, x2d: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
        x2d, weight = aligned_rows(x2d), aligned_rows(weight)
        y, rstd = rms_norm_fwd(x2d, weight, eps, out_dtype)
        ctx.save_for_backward(x2d, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2d, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_bwd(dy, x2d, weight, rstd, need_dw=ctx.needs_input_grad[1])
        return dx, dw, None, None


class AddRMSNormFunction(torch.autograd.Function):
    """``(s, y) = (x + r, rms_norm(s))`` in one launch (the bits of the two ops), differentiable: the backward adds the
    gradient ``s`` gets from its other use (the residual stream) into the norm's ``dx`` kernel, and ``x`` and ``r``
    both get that sum (one launch fewer each way than the two ops)."""

    @staticmethod
    def forward(ctx, x2d: torch.Tensor, r2d: torch.Tensor, weight: torch.Tensor, eps: float):
        s, y, rstd = _add_rms_norm(x2d, r2d, weight, eps)
        ctx.save_for_backward(s, aligned_rows(weight), rstd)
        return s, y

    @staticmethod
    def backward(ctx, ds: torch.Tensor, dy: torch.Tensor):
        s, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_bwd(dy, s, weight, rstd, need_dw=ctx.needs_input_grad[2], add=ds)
        return dx if ctx.needs_input_grad[0] else None, dx if ctx.needs_input_grad[1] else None, dw, None


def triton_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """RMSNorm over the last dim of ``x`` (any leading shape), Triton; autograd-aware when an input needs grad."""
    if x.device != weight.device:
        raise ValueError(f"rms_norm: x is on {x.device} but weight is on {weight.device}")
    out_dtype = out_dtype or x.dtype
    x2d = x.reshape(-1, x.shape[-1])
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        y = RMSNormFunction.apply(x2d, weight, eps, out_dtype)
    else:
        y, _ = rms_norm_fwd(x2d, weight, eps, out_dtype)
    return y.reshape(x.shape)


def triton_rms_norm_pair(
    x1: torch.Tensor, w1: torch.Tensor, x2: torch.Tensor, w2: torch.Tensor, eps: float, out_dtype=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`triton_rms_norm` of x1 and of x2 (the same last dim and dtype): one launch where no input records
    autograd, else one each."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x1, w1, x2, w2))
    same = x1.dtype == x2.dtype and w1.dtype == w2.dtype and len({t.device for t in (x1, w1, x2, w2)}) == 1
    if grad or not same:
        return triton_rms_norm(x1, w1, eps, out_dtype), triton_rms_norm(x2, w2, eps, out_dtype)
    out_dtype = out_dtype or x1.dtype
    y1, y2 = rms_norm_fwd_pair(x1, w1, x2, w2, eps, out_dtype)  # q and k views are read in place, not copied
    return y1.reshape(x1.shape), y2.reshape(x2.shape)


def triton_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, triton_rms_norm(s, weight, eps))`` with ``s = x + residual`` (same shape and dtype), bitwise, in one
    launch; differentiable (:class:`AddRMSNormFunction`) where an input records autograd."""
    if len({x.device, residual.device, weight.device}) != 1:
        raise ValueError(f"add_rms_norm: x, residual and weight are on {x.device}, {residual.device}, {weight.device}")
    x2d, r2d = x.reshape(-1, x.shape[-1]), residual.reshape(-1, x.shape[-1])
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, residual, weight)):
        s, y = AddRMSNormFunction.apply(x2d, r2d, weight, eps)
    else:
        s, y = add_rms_norm_fwd(x2d, r2d, weight, eps)
    return s.reshape(x.shape), y.reshape(x.shape)
