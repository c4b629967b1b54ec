"""Fused logprobs (and entropy) from normed hidden states, forward and backward; and a row log_softmax.

Forward, per token row ``t`` with logits ``z = (h_t @ W.T) / temp_t``: ``logprob = z[target] - logsumexp(z)`` and
``entropy = -sum p log p``, without materialising ``[T, V]`` logits. The vocabulary is cut into fixed splits of
``LOGPROBS_SPLIT_TILES`` tiles of ``LOGPROBS_VOCAB_BLOCK`` columns (the number of splits depends on V only). A program
takes ``LOGPROBS_BLOCK_T`` rows and one split: it walks the split's tiles in order, computes each logits tile with
``tl.dot`` over H in ``LOGPROBS_BLOCK_K`` steps (fp32 accumulation), divides by the row's temperature (``div_rn``), and
keeps an online max ``m``, rescaled sum ``s = sum exp(z - m)``, entropy term ``e = sum exp(z - m) * (z - m)`` and the
target's logit. A second kernel folds the splits of each row in split order:
``logprob = (z_target - M) - log S`` and ``entropy = log S - E / S``. The entropy is always computed (one compiled
kernel), so a logprob has the same bits whether or not its caller asked for the entropy.

Sampling form (the fused draw, launched by ``sample.py``; its noise and tile pieces in ``gumbel.py``): the Gumbel
noise of the draw is drawn ahead by an elementwise kernel into a ``[rows, V]`` buffer, and
the split kernel reads a tile of it where the tile can still change a row's draw (inside the logits tiles, Philox and
two logs per element ran at 4 warps beside the tile's registers and spilled). On Hopper and later the logits tiles (and
noise tiles) are read through TMA descriptors, elsewhere through pointers: the same tiles meet the same MMAs.

Invariance: every launch parameter that shapes a row's arithmetic (row block, vocab block, K block, split size, warps,
stages) is a module constant, never chosen per shape, and the row count is not specialised on. Row ``t``'s logits are
computed by the same MMA sequence whatever rows share its tile (padding rows are zeros and tensor cores do not mix
rows), its vocabulary reduction order is fixed by V alone, and the split fold is per row. So a row's logprob and
entropy are bitwise the same for any number of rows, any row subset and any chunking.

Backward: per fixed chunk of ``LOGPROBS_BWD_CHUNK`` tokens, one kernel recomputes the logits tiles and writes the
logits gradient ``(g_lp * (onehot - p) - g_ent * p * (log p + entropy)) / temp`` in the hidden dtype; then the
linear kernel (``matmul.py``: fixed K splits, fp32 accumulation) gives ``d hidden = G @ W`` and accumulates
``d W += G.T @ h`` into an fp32 buffer, chunk after chunk in token order (no atomics). Both are identical run to
run; ``d hidden`` of a row is also independent of the other rows.

``log_softmax``: one program per row, three passes over the row in fixed ``LSM_BLOCK`` tiles (max, sum of exp into a
per-lane vector then one fixed ``tl.sum``, write), so a row's result depends on that row alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import cdiv, interpreting
from . import matmul as mm
from .gumbel import GUMBEL_NOISE_MAX, NOISE_BLOCK, _draw_tile, _gumbel_noise_kernel
from .rms_norm import aligned_rows

# Numerics-affecting launch parameters of the fused kernels: fixed for every shape.
LOGPROBS_BLOCK_T = 64
LOGPROBS_VOCAB_BLOCK = 128
LOGPROBS_BLOCK_K = 64
LOGPROBS_SPLIT_TILES = 8
LOGPROBS_NUM_WARPS = 4
LOGPROBS_NUM_STAGES = 3
# The split kernel's pipeline depth in its sampling form (the engine's fused draw; speed only: stages change no bit, the
# warps above do). H200 sweep (``scripts/tuning/tune_kernels.py --parts draw``, vocabulary 151,936, H = 2048 / 4096,
# T = 64-512): 4 stages took 0.85-0.93 of 3 stages' time, with the same tokens and logprobs at every shape; 5 and 6
# were slower than 4.
LOGPROBS_DRAW_NUM_STAGES = 4
# Rows per program of the split fold (elementwise per row: speed only).
LOGPROBS_COMBINE_ROWS = 128
# Tokens per backward step: bounds the [chunk, V] logits-gradient buffer and fixes the order of the d W sum.
LOGPROBS_BWD_CHUNK = 4096
# The logits-gradient kernel's tile (speed only): a logit is the same MMA sequence over H whatever rows and columns
# share its tile (as for the linear kernel's tiles), and the gradient is elementwise in it, so any tile gives the same
# bits (the GPU test compares this tile with the forward's). H100 sweep at 4096 x 151936 x 2048 (one machine, 3
# stages): 128 x 128 with 4 warps 5.36 ms, 8 warps 5.95, the forward's 64 x 128 with 4 warps 6.00, 64 x 256 6.89.
LOGPROBS_BWD_BLOCK_T = 128
LOGPROBS_BWD_BLOCK_V = 128
LOGPROBS_BWD_NUM_WARPS = 4
# Draw rows (speed only: the same bits whatever is chosen): at T <= r, for the first r here, the draw (noise tile,
# scores, best column) covers the first r rows of the row block instead of all LOGPROBS_BLOCK_T, padding included (at
# T = 1, 1 of 64 rows). The logits tile and the statistics stay those of the full row block, so nothing depends on it
# but the time; the GPU test checks it. To draw over every row of the block again (the form before), set it to ().
SAMPLE_DRAW_ROWS = (1, 16)
# Logits tiles read through TMA tensor descriptors where the GPU has TMA (Hopper or later) and the operands are 16-bit
# with 16-byte aligned rows; else through pointers. Speed only: the same tiles meet the same MMAs (the GPU tests
# compare both); False reads through pointers everywhere.
LOGPROBS_TMA = True
# Fewer rows than this read through pointers even where TMA could (speed only, as above). A single row fills 1 of the
# 64 rows of its TMA block: at T = 1 on an H200 (benchmarks/results/sample-h200.md, lm_head 151,936 x 4096) the draw
# took 531 us through TMA against 442 through pointers, the scoring form 508 against 465; at T = 16 TMA was the
# faster (488 against 562 us).
LOGPROBS_TMA_MIN_ROWS = 2
# log_softmax row kernel.
LSM_BLOCK = 1024
LSM_NUM_WARPS = 4


@triton.jit
def _dot(a, b, acc, PREC: tl.constexpr, INTERPRET: tl.constexpr):
    if INTERPRET:
        # The interpreter's tl.dot is numpy's BLAS on raw 16-bit storage and its result for a row depends on the row's
        # place in the tile: an explicit fp32 product-and-sum stands in for the tensor-core MMA.
        acc = acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    else:
        acc = tl.dot(a, b, acc, input_precision=PREC)
    return acc


@triton.jit
def _span(start, n, BLOCK: tl.constexpr):
    """``start + [0, BLOCK)`` as int64 indices, and which of them are ``< n``."""
    i = start + tl.arange(0, BLOCK)
    mask = i < n
    return i.to(tl.int64), mask


@triton.jit
def _logits_tile(
    h, w, rows, rmask, cols, cmask, row0, col0, H, acc,
    BLOCK_K: tl.constexpr, PREC: tl.constexpr, INTERPRET: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """``acc += h[rows] @ w[cols].T`` over H in ``BLOCK_K`` steps. ``TMA``: ``h`` / ``w`` are tensor descriptors of
    ``[BLOCK_T, BLOCK_K]`` / ``[BLOCK_V, BLOCK_K]`` blocks and the tiles start at ``row0`` / ``col0`` (out-of-bounds
    reads are zero, like the masks); else pointers with the row / column masks. The same tiles meet the same MMAs
    either way (speed only: no address registers, no masks)."""
    if TMA:
        for k0 in range(0, H, BLOCK_K):
            acc = _dot(h.load([row0, k0]), w.load([col0, k0]).T, acc, PREC, INTERPRET)
    else:
        for k0 in range(0, H, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < H
            a = tl.load(h + rows[:, None] * H + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(w + cols[None, :] * H + ks[:, None], mask=cmask[None, :] & kmask[:, None], other=0.0)
            acc = _dot(a, b, acc, PREC, INTERPRET)
    return acc


@triton.jit(do_not_specialize=["T", "NOISE_STRIDE"])
def _logprobs_fwd_split_kernel(
    h, w, tgt_ptr, temp_ptr, m_ptr, s_ptr, e_ptr, zt_ptr, noise, best_ptr, idx_ptr, T, V, H, NOISE_STRIDE,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_TILES: tl.constexpr,
    PREC: tl.constexpr, INTERPRET: tl.constexpr, SAMPLE: tl.constexpr, NOISE_MAX: tl.constexpr,
    DRAW_ROWS: tl.constexpr, TMA: tl.constexpr, SKIP: tl.constexpr,
):  # fmt: skip
    """``SAMPLE``: no targets; each row draws its token (Gumbel-max: the first index among equal scores ``z + noise``,
    the noise ``[T, V]`` drawn ahead by ``_gumbel_noise_kernel``) and ``zt`` is the drawn token's logit: the
    statistics ``m``/``s``/``e`` are computed by the same code either way. ``NOISE_MAX`` bounds the noise
    (``GUMBEL_NOISE_MAX``; infinity reads the noise of every tile): tiles whose scores cannot beat a row's best so far
    skip the noise, with the same tokens as without the skip.

    ``DRAW_ROWS`` (``BLOCK_T`` unless ``SAMPLE``): the draw (noise, scores, best, ``zt``) covers the first
    ``DRAW_ROWS`` rows of the row block. Below ``BLOCK_T`` the launch has one row block and every real row among them
    (``T <= DRAW_ROWS``); the logits tile is still the full row block's, and those rows' logits are taken from it
    exactly (a max against -inf), so every value is the same bits as with ``DRAW_ROWS = BLOCK_T``: only the padding
    rows' draw is not computed. ``TMA``: ``h``, ``w`` (and ``noise``) are tensor descriptors (``_logits_tile``,
    ``tile_noise``), else pointers. ``SKIP`` (``SAMPLE``): the tile skip above; without it every tile is drawn (the
    same tokens)."""
    split = tl.program_id(1)
    row0 = tl.program_id(0) * BLOCK_T
    rows, rmask = _span(row0, T, BLOCK_T)
    drows, dmask = _span(row0, T, DRAW_ROWS)
    temp = tl.load(temp_ptr + rows, mask=rmask, other=1.0)
    m = tl.full([BLOCK_T], float("-inf"), dtype=tl.float32)
    s = tl.zeros([BLOCK_T], dtype=tl.float32)
    e = tl.zeros([BLOCK_T], dtype=tl.float32)
    zt = tl.zeros([DRAW_ROWS], dtype=tl.float32)
    if SAMPLE:
        best = tl.full([DRAW_ROWS], float("-inf"), dtype=tl.float32)
        best_idx = tl.zeros([DRAW_ROWS], dtype=tl.int64)
    else:
        tl.static_assert(DRAW_ROWS == BLOCK_T, "the scoring form reads every row's target")
        tgt = tl.load(tgt_ptr + rows, mask=rmask, other=-1)
    for tile in range(0, SPLIT_TILES):
        col0 = (split * SPLIT_TILES + tile) * BLOCK_V
        cols, cmask = _span(col0, V, BLOCK_V)
        acc = tl.zeros([BLOCK_T, BLOCK_V], dtype=tl.float32)
        acc = _logits_tile(h, w, rows, rmask, cols, cmask, row0, col0, H, acc, BLOCK_K, PREC, INTERPRET, TMA)
        z = tl.where(cmask[None, :], tl.div_rn(acc, temp[:, None]), float("-inf"))
        zmax = tl.max(z, axis=1)
        m_new = tl.maximum(m, zmax)
        alpha = tl.exp(m - m_new)
        d = z - m_new[:, None]
        p = tl.exp(d)
        # s == 0 exactly while m is still -inf (first tile): the rescaled old terms are then zero
        shift = tl.where(s > 0, m - m_new, 0.0) * s
        e = alpha * (e + shift) + tl.sum(p * tl.where(cmask[None, :], d, 0.0), axis=1)
        s = alpha * s + tl.sum(p, axis=1)
        if SAMPLE:
            zd = z
            zd_max = zmax
            if DRAW_ROWS < BLOCK_T:
                # the first DRAW_ROWS rows of the tile: the other groups of DRAW_ROWS rows are -inf in the max
                first = (tl.arange(0, BLOCK_T // DRAW_ROWS) == 0)[:, None, None]
                groups = tl.reshape(z, [BLOCK_T // DRAW_ROWS, DRAW_ROWS, BLOCK_V])
                zd = tl.max(tl.where(first, groups, float("-inf")), axis=0)
                zd_max = tl.max(zd, axis=1)
            draw = True
            if SKIP:
                # No score of this tile exceeds max(z) + NOISE_MAX: where that is below the best so far for every real
                # row, the tile cannot change a draw (a tie keeps the earlier token), and its noise is not read.
                live = dmask & ~(zd_max + NOISE_MAX < best)
                draw = tl.max(live.to(tl.int32), axis=0) > 0
            if draw:  # without SKIP a compile-time True: every tile drawn, no branch
                best, best_idx, zt = _draw_tile(
                    zd, noise, row0, col0, drows, dmask, cols, cmask, V, NOISE_STRIDE, best, best_idx, zt, TMA
                )  # fmt: skip
        else:
            zt += tl.sum(tl.where(cols[None, :] == tgt[:, None], z, 0.0), axis=1)
        m = m_new
    out = split.to(tl.int64) * T + rows
    dout = split.to(tl.int64) * T + drows
    tl.store(m_ptr + out, m, mask=rmask)
    tl.store(s_ptr + out, s, mask=rmask)
    tl.store(zt_ptr + dout, zt, mask=dmask)
    tl.store(e_ptr + out, e, mask=rmask)
    if SAMPLE:
        tl.store(best_ptr + dout, best, mask=dmask)
        tl.store(idx_ptr + dout, best_idx, mask=dmask)


@triton.jit(do_not_specialize=["T"])
def _logprobs_fwd_combine_kernel(
    m_ptr, s_ptr, e_ptr, zt_ptr, lp_ptr, ent_ptr, mx_ptr, logs_ptr, best_ptr, idx_ptr, tok_ptr, T, n_splits,
    ROWS: tl.constexpr, SAMPLE: tl.constexpr,
):  # fmt: skip
    """``SAMPLE``: the drawn token is the best-scoring split's (an earlier split keeps it on a tie), and ``zt`` its
    logit; otherwise ``zt`` sums to the target's logit (the other splits add exact zeros)."""
    rows, rmask = _span(tl.program_id(0) * ROWS, T, ROWS)
    mx = tl.load(m_ptr + rows, mask=rmask, other=0.0)
    s = tl.load(s_ptr + rows, mask=rmask, other=1.0)
    zt = tl.load(zt_ptr + rows, mask=rmask, other=0.0)
    e = tl.load(e_ptr + rows, mask=rmask, other=0.0)
    if SAMPLE:
        best = tl.load(best_ptr + rows, mask=rmask, other=0.0)
        tok = tl.load(idx_ptr + rows, mask=rmask, other=0)
    # the loads of later splits are issued ahead (num_stages, speed only); the fold itself stays in split order
    for sp in tl.range(1, n_splits, num_stages=4):
        off = sp * T + rows
        mi = tl.load(m_ptr + off, mask=rmask, other=0.0)
        si = tl.load(s_ptr + off, mask=rmask, other=1.0)
        if SAMPLE:
            bi = tl.load(best_ptr + off, mask=rmask, other=0.0)
            take = bi > best
            best = tl.where(take, bi, best)
            tok = tl.where(take, tl.load(idx_ptr + off, mask=rmask, other=0), tok)
            zt = tl.where(take, tl.load(zt_ptr + off, mask=rmask, other=0.0), zt)
        else:
            zt += tl.load(zt_ptr + off, mask=rmask, other=0.0)
        m_new = tl.maximum(mx, mi)
        a = tl.exp(mx - m_new)
        b = tl.exp(mi - m_new)
        ei = tl.load(e_ptr + off, mask=rmask, other=0.0)
        e = a * (e + (mx - m_new) * s) + b * (ei + (mi - m_new) * si)
        s = a * s + b * si
        mx = m_new
    log_s = tl.log(s)
    tl.store(lp_ptr + rows, (zt - mx) - log_s, mask=rmask)
    tl.store(mx_ptr + rows, mx, mask=rmask)
    tl.store(logs_ptr + rows, log_s, mask=rmask)
    tl.store(ent_ptr + rows, log_s - tl.div_rn(e, s), mask=rmask)
    if SAMPLE:
        tl.store(tok_ptr + rows, tok, mask=rmask)


@triton.jit(do_not_specialize=["T"])
def _logprobs_bwd_grad_logits_kernel(
    h_ptr, w_ptr, tgt_ptr, temp_ptr, mx_ptr, logs_ptr, ent_ptr, glp_ptr, gent_ptr, g_ptr, T, V, H,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
    HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr, INTERPRET: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """One ``[BLOCK_T, BLOCK_V]`` tile of the logits gradient (``TMA``: ``h_ptr`` / ``w_ptr`` are tensor descriptors,
    see ``_logits_tile``)."""
    rows, rmask = _span(tl.program_id(0) * BLOCK_T, T, BLOCK_T)
    cols, cmask = _span(tl.program_id(1) * BLOCK_V, V, BLOCK_V)
    temp = tl.load(temp_ptr + rows, mask=rmask, other=1.0)
    mx = tl.load(mx_ptr + rows, mask=rmask, other=0.0)
    log_s = tl.load(logs_ptr + rows, mask=rmask, other=0.0)
    acc = tl.zeros([BLOCK_T, BLOCK_V], dtype=tl.float32)
    acc = _logits_tile(
        h_ptr, w_ptr, rows, rmask, cols, cmask, tl.program_id(0) * BLOCK_T, tl.program_id(1) * BLOCK_V, H, acc,
        BLOCK_K, PREC, INTERPRET, TMA,
    )  # fmt: skip
    z = tl.div_rn(acc, temp[:, None])
    logp = (z - mx[:, None]) - log_s[:, None]
    p = tl.exp(logp)
    g = tl.zeros([BLOCK_T, BLOCK_V], dtype=tl.float32)
    if HAS_GLP:
        tgt = tl.load(tgt_ptr + rows, mask=rmask, other=-1)
        glp = tl.load(glp_ptr + rows, mask=rmask, other=0.0)
        onehot = tl.where(cols[None, :] == tgt[:, None], 1.0, 0.0)
        g += glp[:, None] * (onehot - p)
    if HAS_GENT:
        ent = tl.load(ent_ptr + rows, mask=rmask, other=0.0)
        gent = tl.load(gent_ptr + rows, mask=rmask, other=0.0)
        g -= gent[:, None] * (p * (tl.where(cmask[None, :], logp, 0.0) + ent[:, None]))
    g = tl.where(rmask[:, None] & cmask[None, :], tl.div_rn(g, temp[:, None]), 0.0)
    tl.store(
        g_ptr + rows[:, None] * V + cols[None, :], g.to(g_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :]
    )


@triton.jit
def _log_softmax_kernel(x_ptr, temp_ptr, out_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * V
    o_row = out_ptr + row * V
    temp = tl.load(temp_ptr + row)
    mvec = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        z = tl.div_rn(tl.load(x_row + cols, mask=cols < V, other=float("-inf")), temp)
        mvec = tl.maximum(mvec, z)
    mx = tl.max(mvec, axis=0)
    svec = tl.zeros([BLOCK], dtype=tl.float32)
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        z = tl.div_rn(tl.load(x_row + cols, mask=cols < V, other=float("-inf")), temp)
        svec += tl.exp(z - mx)
    lse = tl.log(tl.sum(svec, axis=0))
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        mask = cols < V
        z = tl.div_rn(tl.load(x_row + cols, mask=mask, other=0.0), temp)
        tl.store(o_row + cols, (z - mx) - lse, mask=mask)


def rows_on(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A per-row column (temperatures, targets, seeds) as ``dtype`` on ``device``, 16-byte aligned. A host column goes
    to a GPU through pinned memory without blocking the host: a copy from pageable memory may wait for the work
    already queued on the stream (the engine's decode graph replay, when it passes host temperatures and seeds)."""
    if t.device.type == "cpu" and device.type == "cuda":
        # contiguous first: a broadcast column (one temperature expanded to every row) has no memory to pin
        t = t.to(dtype=dtype).contiguous().pin_memory().to(device, non_blocking=True)
    return aligned_rows(t.to(device=device, dtype=dtype))


def n_vocab_splits(vocab: int) -> int:
    """How many vocabulary splits the fused forward uses: a function of V alone."""
    return cdiv(cdiv(vocab, LOGPROBS_VOCAB_BLOCK), LOGPROBS_SPLIT_TILES)


def _tma_operands(normed, weight, block_t: int = LOGPROBS_BLOCK_T, block_v: int = LOGPROBS_VOCAB_BLOCK):
    """``(h, w, tma)``: the logits tiles' operands as TMA tensor descriptors of ``[block_t | block_v, BLOCK_K]``
    blocks where ``LOGPROBS_TMA`` and the GPU and (row-major) operands allow it and there are at least
    ``LOGPROBS_TMA_MIN_ROWS`` rows, else the tensors themselves."""
    ok = (
        LOGPROBS_TMA
        and normed.shape[0] >= LOGPROBS_TMA_MIN_ROWS
        and normed.dtype in (torch.bfloat16, torch.float16)
        and mm._tma_ok(normed, weight)
        and mm._tma_layout(normed) == mm._tma_layout(weight) == "rows"
    )
    if not ok:
        return normed, weight, False
    from triton.tools.tensor_descriptor import TensorDescriptor

    h = TensorDescriptor.from_tensor(normed, [block_t, LOGPROBS_BLOCK_K])
    return h, TensorDescriptor.from_tensor(weight, [block_v, LOGPROBS_BLOCK_K]), True


def _cuda_major(device: torch.device) -> int | None:
    return mm.sm_major(device) if device.type == "cuda" else None


def _skip_ok(device: torch.device) -> bool:
    """Whether the draw's tile skip compiles for ``device``: Triton 3.6 fails on its data-dependent branch for sm_100
    and later (TritonNvidiaGPUOptimizeTMemLayoutsPass: "parent layout must have at least rank >= 2"; the logits tile
    lives in tensor memory there; ``scripts/tuning/kernel_regs.py --arch 100`` shows it). Speed only: the same
    tokens."""
    major = _cuda_major(device)
    return major is None or major < 10


def _fwd(normed, weight, targets, temps, seeds):
    """The fused forward: ``(logprob, entropy, row max M, log S, tokens)`` [T] each; ``seeds`` (int64 [T]) draws
    the tokens (``targets`` unused), else ``targets`` are scored and ``tokens`` is None."""
    t, h = normed.shape
    v = weight.shape[0]
    dev = normed.device
    f32 = dict(dtype=torch.float32, device=dev)
    sample = seeds is not None
    lp, ent, mx, log_s = (torch.empty(t, **f32) for _ in range(4))
    tokens = torch.empty(t, dtype=torch.int64, device=dev) if sample else None
    if t == 0:
        return lp, ent, mx, log_s, tokens
    n_splits = n_vocab_splits(v)
    pm, ps, pe, pz = (torch.empty(n_splits, t, **f32) for _ in range(4))
    pb = torch.empty(n_splits, t, **f32) if sample else pm
    pi = torch.empty(n_splits, t, dtype=torch.int64, device=dev) if sample else pm
    h_arg, w_arg, tma = _tma_operands(normed, weight)
    draw_rows, noise, stride = LOGPROBS_BLOCK_T, pm, 0
    if sample:  # all rows in one row block: the fewest draw rows that hold them
        draw_rows = min((r for r in SAMPLE_DRAW_ROWS if t <= r < LOGPROBS_BLOCK_T), default=LOGPROBS_BLOCK_T)
        stride = cdiv(v, 4) * 4  # 16-byte aligned rows
        noise = torch.empty(t, stride, **f32)
        _gumbel_noise_kernel[(t, cdiv(v, NOISE_BLOCK))](seeds, noise, v, stride, BLOCK=NOISE_BLOCK, num_warps=4)
        if tma:
            from triton.tools.tensor_descriptor import TensorDescriptor

            noise = TensorDescriptor.from_tensor(noise[:, :v], [draw_rows, LOGPROBS_VOCAB_BLOCK])
    _logprobs_fwd_split_kernel[(cdiv(t, LOGPROBS_BLOCK_T), n_splits)](
        h_arg, w_arg, targets if not sample else seeds, temps, pm, ps, pe, pz, noise, pb, pi, t, v, h, stride,
        BLOCK_T=LOGPROBS_BLOCK_T, BLOCK_V=LOGPROBS_VOCAB_BLOCK, BLOCK_K=LOGPROBS_BLOCK_K,
        SPLIT_TILES=LOGPROBS_SPLIT_TILES, PREC=mm.input_precision(normed.dtype), INTERPRET=interpreting(),
        SAMPLE=sample, NOISE_MAX=GUMBEL_NOISE_MAX, DRAW_ROWS=draw_rows, TMA=tma, SKIP=_skip_ok(normed.device),
        num_warps=LOGPROBS_NUM_WARPS, num_stages=LOGPROBS_DRAW_NUM_STAGES if sample else LOGPROBS_NUM_STAGES,
    )  # fmt: skip
    _logprobs_fwd_combine_kernel[(cdiv(t, LOGPROBS_COMBINE_ROWS),)](
        pm, ps, pe, pz, lp, ent, mx, log_s, pb, pi, tokens if sample else lp, t, n_splits,
        ROWS=LOGPROBS_COMBINE_ROWS, SAMPLE=sample, num_warps=4,
    )  # fmt: skip
    return lp, ent, mx, log_s, tokens


def logprobs_fwd(
    normed: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temps: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``(logprob [T], entropy [T] or None, row max M [T], log S [T])``, all fp32."""
    # The entropy is always computed: one compiled kernel, so a row's logprob is the same bits whether or not the
    # caller (engine or trainer) asked for the entropy.
    lp, ent, mx, log_s, _ = _fwd(normed, weight, targets, temps, None)
    return lp, ent if with_entropy else None, mx, log_s


def logprobs_bwd(
    normed, weight, targets, temps, mx, log_s, ent, grad_lp, grad_ent, need_dh: bool, need_dw: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(d normed [T, H] in normed's dtype, d weight [V, H] in weight's dtype)``; see the module docstring."""
    t, h = normed.shape
    v = weight.shape[0]
    dh = torch.empty_like(normed) if need_dh else None
    dw32 = torch.zeros(v, h, dtype=torch.float32, device=normed.device) if need_dw else None
    chunk = min(LOGPROBS_BWD_CHUNK, max(t, 1))
    g = torch.empty(chunk, v, dtype=normed.dtype, device=normed.device)
    for s0 in range(0, t, LOGPROBS_BWD_CHUNK):
        s1 = min(t, s0 + LOGPROBS_BWD_CHUNK)
        rows = slice(s0, s1)
        gc = g[: s1 - s0]
        bt, bv = LOGPROBS_BWD_BLOCK_T, LOGPROBS_BWD_BLOCK_V
        grid = (cdiv(s1 - s0, bt), cdiv(v, bv))
        h_arg, w_arg, tma = _tma_operands(normed[rows], weight, bt, bv)
        _logprobs_bwd_grad_logits_kernel[grid](
            h_arg, w_arg, targets[rows], temps[rows], mx[rows], log_s[rows],
            ent[rows] if grad_ent is not None else mx, grad_lp[rows] if grad_lp is not None else mx,
            grad_ent[rows] if grad_ent is not None else mx, gc, s1 - s0, v, h,
            BLOCK_T=bt, BLOCK_V=bv, BLOCK_K=LOGPROBS_BLOCK_K,
            PREC=mm.input_precision(normed.dtype), INTERPRET=interpreting(),
            HAS_GLP=grad_lp is not None, HAS_GENT=grad_ent is not None, TMA=tma,
            num_warps=LOGPROBS_BWD_NUM_WARPS, num_stages=LOGPROBS_NUM_STAGES,
        )  # fmt: skip
        # The tuned linear kernel (fixed K splits, fp32 accumulation): dh = G @ W; dW += G.T @ h, chunk by chunk.
        if need_dh:
            dh[rows] = mm.matmul(gc, weight.t())
        if need_dw:
            mm.matmul(gc.t(), normed[rows].t(), accumulate_into=dw32)
    return dh, (dw32.to(weight.dtype) if need_dw else None)


class FusedLogprobsFunction(torch.autograd.Function):
    """Autograd wrapper of :func:`logprobs_fwd` / :func:`logprobs_bwd` (targets and temperatures get no gradient)."""

    @staticmethod
    def forward(ctx, normed, weight, targets, temps, with_entropy: bool):
        lp, ent, mx, log_s = logprobs_fwd(normed, weight, targets, temps, with_entropy)
        ctx.save_for_backward(normed, weight, targets, temps, mx, log_s, ent)
        ctx.set_materialize_grads(False)
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp, grad_ent):
        normed, weight, targets, temps, mx, log_s, ent = ctx.saved_tensors
        grad_lp = None if grad_lp is None else grad_lp.float().contiguous()
        grad_ent = None if grad_ent is None or ent is None else grad_ent.float().contiguous()
        if grad_lp is None and grad_ent is None:
            return None, None, None, None, None
        dh, dw = logprobs_bwd(
            normed, weight, targets, temps, mx, log_s, ent, grad_lp, grad_ent,
            need_dh=ctx.needs_input_grad[0], need_dw=ctx.needs_input_grad[1],
        )  # fmt: skip
        return dh, dw, None, None, None


def _operands(op: str, normed, weight, temps, per_row_ints):
    """The fused kernels' operands: shapes checked, one dtype, aligned rows; fp32 temperatures and int64 per-row
    integers (targets or seeds) on ``normed``'s device."""
    if normed.dim() != 2 or weight.dim() != 2 or normed.shape[1] != weight.shape[1]:
        raise ValueError(f"{op}: hidden {tuple(normed.shape)} and lm_head {tuple(weight.shape)} need [T, H], [V, H]")
    if normed.dtype != weight.dtype:
        dtype = torch.promote_types(normed.dtype, weight.dtype)
        normed, weight = normed.to(dtype), weight.to(dtype)
    normed, weight = aligned_rows(normed), aligned_rows(weight)
    temps = rows_on(temps, normed.device, torch.float32)
    return normed, weight, temps, rows_on(per_row_ints, normed.device, torch.int64)


def triton_logprobs(
    normed: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temps: torch.Tensor, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of ``targets [T]`` (and entropy) under ``normed [T, H] @ weight[V, H].T / temps [T]``, fp32, fused.

    ``normed`` is the final-norm output (the lm_head input). Autograd-aware in ``normed`` and ``weight``.
    """
    normed, weight, temps, targets = _operands("logprobs", normed, weight, temps, targets)
    if torch.is_grad_enabled() and (normed.requires_grad or weight.requires_grad):
        return FusedLogprobsFunction.apply(normed, weight, targets, temps, with_entropy)
    lp, ent, _, _ = logprobs_fwd(normed, weight, targets, temps, with_entropy)
    return lp, ent


def triton_log_softmax(logits: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
    """fp32 ``log_softmax(logits [T, V] / temps [T])`` per row (no autograd: the sampler's path)."""
    logits = aligned_rows(logits)
    temps = rows_on(temps, logits.device, torch.float32)
    t, v = logits.shape
    out = torch.empty_like(logits)
    if t and v:
        _log_softmax_kernel[(t,)](logits, temps, out, v, BLOCK=LSM_BLOCK, num_warps=LSM_NUM_WARPS)
    return out
