"""The Gumbel-max draw's Triton pieces: Philox noise, scores and the per-tile best column.

A row draws ``argmax(z + g)`` over the vocabulary (the first index among equal scores), ``z`` its logits over the
temperature and ``g = -log(-log(u))`` Gumbel noise, ``u`` from Philox-4x32-10 keyed by the row's 64-bit seed: column
``c`` takes output word ``c % 4`` of counter ``(c // 4, 0, 0, 0)``, so a row's noise depends on (seed, column) alone
and one Philox call serves four columns (:func:`gumbel_noise_tile`; the torch twin, bit for bit, is
``vexact_kernels.sample.gumbel_uniform``). The fused draw (``sample.triton_sample_logprobs``) draws the noise ahead
into a ``[rows, V]`` buffer with :func:`_gumbel_noise_kernel` and the fused logprobs kernel in its sampling form
(``logprobs.py``) takes each tile's best column with :func:`_draw_tile`; the draw over given logits
(``sample.triton_gumbel_argmax``) uses :func:`gumbel_scores` and :func:`best_column`.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.random import philox_impl

# Above the largest Gumbel noise of the draw: -log(-log(u)) at the largest uniform, u = 1 - 2**-24, is 16.635532 in
# fp32 (correctly rounded logs); the margin covers a device log that is off by far more than its few ulps. Only a
# bound for skipping noise that cannot win: it changes no draw (infinity skips nothing).
GUMBEL_NOISE_MAX = 16.75
# Columns per program of the noise kernel (speed only: a row's noise is the same for any block).
NOISE_BLOCK = 1024


@triton.jit
def gumbel_noise(words):
    """Gumbel noise ``-log(-log(u))`` of uint32 Philox words: ``u`` is a word's top 23 bits plus one half over 2**23
    (exact in fp32, never 0 or 1), so the noise never exceeds ``GUMBEL_NOISE_MAX``."""
    u = ((words >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # exact in fp32
    return -tl.log(-tl.log(u))


@triton.jit
def gumbel_noise_tile(col0, key_lo, key_hi, BLOCK: tl.constexpr):
    """Gumbel noise ``-log(-log(u))`` of a ``[rows, BLOCK]`` tile whose first column ``col0`` is a multiple of 4.

    ``u`` in (0, 1) comes from Philox-4x32-10 keyed by the row's 64-bit seed (``key_lo``/``key_hi`` ``[rows, 1]``
    uint32): column ``c`` takes output word ``c % 4`` of counter ``(c // 4, 0, 0, 0)``, a function of (seed, column)
    alone, and one Philox call serves four columns. The word's top 23 bits, plus one half, over 2**23 (exact in fp32):
    never 0 or 1. The torch twin, bit for bit: :func:`vexact_kernels.sample.gumbel_uniform`."""
    tl.static_assert(BLOCK % 4 == 0, "gumbel_noise_tile: a tile holds whole groups of four columns")
    c0 = (col0 // 4 + tl.arange(0, BLOCK // 4)).to(tl.uint32)[None, :] + tl.zeros_like(key_lo)
    zero = tl.zeros_like(c0)
    r0, r1, r2, r3 = philox_impl(c0, zero, zero, zero, key_lo, key_hi)
    # [rows, BLOCK // 4, 2, 2] holding word 2p + q at [..., p, q]; row-major flattening puts word k at column 4j + k
    words = tl.join(tl.join(r0, r2), tl.join(r1, r3))
    return gumbel_noise(tl.reshape(words, [key_lo.shape[0], BLOCK]))


@triton.jit
def gumbel_scores(z, col0, key_lo, key_hi, BLOCK: tl.constexpr):
    """Sampling scores ``z + noise`` of a ``[rows, BLOCK]`` tile (:func:`gumbel_noise_tile`; Gumbel-max: argmax over
    the vocabulary draws from softmax(z))."""
    return z + gumbel_noise_tile(col0, key_lo, key_hi, BLOCK)


@triton.jit
def seed_keys(seed_ptr, row):
    """The Philox key of row ``row``'s int64 seed: its low and high 32-bit halves, ``[1, 1]`` uint32 each."""
    seed = tl.load(seed_ptr + row).to(tl.uint64)
    key_lo = tl.full([1, 1], 0, tl.uint32) + (seed & 0xFFFFFFFF).to(tl.uint32)
    return key_lo, tl.full([1, 1], 0, tl.uint32) + ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)


@triton.jit
def _gumbel_noise_kernel(seed_ptr, out_ptr, V, stride, BLOCK: tl.constexpr):
    """Row ``program_id(0)``'s noise (:func:`gumbel_noise_tile`, keyed by its int64 seed) at columns ``program_id(1) *
    BLOCK ..`` below V, into ``out[row, col]`` (row stride ``stride``): the fused draw's noise, drawn ahead of it by
    an elementwise kernel (many warps, few registers) instead of inside the logits tiles."""
    row = tl.program_id(0).to(tl.int64)
    col0 = tl.program_id(1) * BLOCK
    key_lo, key_hi = seed_keys(seed_ptr, row)
    cols = col0 + tl.arange(0, BLOCK)
    noise = gumbel_noise_tile(col0, key_lo, key_hi, BLOCK)
    tl.store(out_ptr + row * stride + cols[None, :], noise, mask=(cols < V)[None, :])


@triton.jit
def tile_noise(noise, row0, col0, rows, rmask, cols, cmask, stride, TMA: tl.constexpr):
    """The draw's noise at ``[rows, cols]`` (rows from ``row0``, columns from ``col0``), zero outside the masks:
    ``TMA``: a tensor descriptor of ``[rows, cols]`` blocks of the noise; else its pointer (row stride ``stride``)."""
    if TMA:
        out = noise.load([row0, col0])
    else:
        out = tl.load(noise + rows[:, None] * stride + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
    return out


@triton.jit
def best_column(score, cols, V):
    """Each row's best score in a ``[rows, cols]`` tile and the first column holding it (the smallest index among
    equal scores; ``V`` where a row has none)."""
    best = tl.max(score, axis=1)
    return best, tl.min(tl.where(score == best[:, None], cols[None, :], V), axis=1)


@triton.jit
def _draw_tile(zd, noise, row0, col0, drows, dmask, cols, cmask, V, stride, best, best_idx, zt, TMA: tl.constexpr):
    """One tile of the draw: scores ``zd + noise`` (``tile_noise``), the tile's best column per row, taken where it
    beats the best so far (strictly: an earlier tile keeps its token on a tie), with its logit ``zt``."""
    nz = tile_noise(noise, row0, col0, drows, dmask, cols, cmask, stride, TMA)
    score = tl.where(cmask[None, :], zd + nz, float("-inf"))
    tile_best, tile_idx = best_column(score, cols, V)
    take = tile_best > best
    zsel = tl.sum(tl.where(cols[None, :] == tile_idx[:, None], zd, 0.0), axis=1)
    return tl.where(take, tile_best, best), tl.where(take, tile_idx, best_idx), tl.where(take, zsel, zt)
