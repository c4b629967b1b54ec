"""Fused MoE expert MLP in Triton: grouped GEMMs over the (token, rank) pairs sorted by expert, fwd and bwd.

``out[t] = sum_r w[t, r] * down_e(silu(gate_e(x_t)) * up_e(x_t))``, ``e = ids[t, r]``; ``w_gate_up [E, 2I, H]``
(gate rows ``[0, I)``, up rows ``[I, 2I)``), ``w_down [E, H, I]``. The same arithmetic as ``moe._fused_moe_reference``.

Plan (all on the device, no host sync, so a decode step can be captured in a CUDA graph while its expert counts change
from step to step): the pairs ``p = t * k + r`` are grouped stably by expert (a pair's sorted row: its expert's first
row plus the number of earlier pairs of that expert), and a tile schedule (expert and first sorted row of each M tile)
comes from a ``cumsum`` of the per-expert tile counts. Up to ``PLAN_KERNEL_MAX_PAIRS`` pairs four small Triton kernels
build it (per-chunk histograms, a scan, per-chunk ranks, the schedule); above, torch's stable sort and
``searchsorted``; the same integers. The grid has ``cdiv(T*k, BLOCK_M) + min(E, T*k)`` M tiles, a bound that
depends on ``(T, k, E)`` alone; tiles past the last expert's return at once.

Invariance: every pair row is reduced over K by ``matmul.k_reduce``, the loop ``matmul._matmul_kernel`` runs:
``BLOCK_K`` (64) tiles in K order, one ``tl.dot`` per tile into an fp32 partial, partials of ``SPLIT_TILES`` tiles added
in split order. A row never shares a reduction with another row; which rows share its M tile (that depends on the expert
loads) only decides which lanes are masked. The tile shape is picked from ``T*k`` for speed and checked on the GPU not
to change a bit (``config=`` forces one). Then: gate/up cast to x's dtype, silu-and-mul in fp32 cast once
(``activation.py``), down kept in fp32, and the combine ``((0 + w_0 y_0) + w_1 y_1) + ...`` in the token's own rank
order, cast once. No atomics.

Backward (``FusedMoEFunction``), deterministic run to run: ``dy = w * g`` and ``d w[t, r] = sum_h g[t] * y[pair]``
(lanes of ``COMBINE_BLOCK`` summed over H blocks in order, then one ``tl.sum``); ``d act`` and the per-pair ``dx``
by the same grouped GEMM on the weights' transposed strides; ``dx`` summed per token in rank order in fp32; silu
backward in fp32 (``activation.py``); ``dW[e]`` by one program per (expert, N tile, K tile) walking the expert's
sorted rows in order, in tiles of ``BLOCK_K`` rows and splits of ``SPLIT_TILES`` tiles, as ``matmul`` reduces dW.

gpt-oss's experts (``extras``, all off by default; off, every launch is the code without them): expert biases
``b_gate_up [E, 2I]`` and ``b_down [E, H]`` added in fp32 to the row's fp32 GEMM result in the grouped GEMM's epilogue
(``HAS_BIAS``; gate/up's before its cast, down's to the fp32 output), as the CPU reference adds them; gate and up as
the even and odd columns of the gate_up output (``gate_up_interleaved``) and the clamped SwiGLU
(``activation.glu_fwd``, the CPU reference's formula with Triton's ``exp``). Their backward: ``dh`` at gate/up's own
columns; a bias's gradient is the sum of its expert's ``dh`` (or ``dy``) rows by ``_grouped_wgrad`` against a column of
ones, in sorted-row order, as every dW.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..activation import SWIGLU_ALPHA, SWIGLU_LIMIT
from . import cdiv, next_pow2
from .activation import ACT_BLOCK, ACT_NUM_WARPS, _silu_and_mul_bwd_kernel, glu_bwd, glu_fwd, silu_and_mul_fwd
from .matmul import BLOCK_K, SPLIT_TILES, end_split, input_precision, k_reduce

# (BLOCK_M, BLOCK_N, num_warps, num_stages) of the grouped GEMMs, picked by T*k (never by an expert's count); speed
# only: every one gives the same bits (tests/test_triton_moe.py, on the GPU). H100 sweep at the Qwen3-30B-A3B layer
# (CUDA-graph replays): T=1 84 us, T=64 504 us (every expert's weights streamed once), T=4096 1235 us.
CONFIGS = (
    (16, 64, 4, 5),  # decode: T*k <= 256, one or a few rows per expert: the weights streamed over many CTAs
    (64, 64, 4, 4),  # T*k <= 4096
    (64, 128, 4, 4),  # T*k <= 16384
    (128, 128, 8, 4),  # prefill and training
)
INTERPRET_CONFIG = (16, 32, 4, 1)
# (BLOCK_N, BLOCK_K, num_warps, num_stages) of the dW tiles; the reduction over an expert's rows is in tiles of
# BLOCK_K rows whatever this says. Speed only: on an H200 (benchmarks/results/tune-wgrad-h200.txt) 128 x 64 runs the
# gate/up dW at 316 / 310 TFLOP/s (Qwen3-30B-A3B / Moonlight shapes) where 64 x 64 runs at 256 / 259, same bits.
WGRAD_CONFIG = (128, 64, 4, 3)
INTERPRET_WGRAD_CONFIG = (32, 32, 4, 1)
COMBINE_BLOCK = 1024  # numerics: lanes of the d-weights dot product over H (its reduction tree)


def pick_config(pairs: int, interpret: bool = False, elem_bytes: int = 2) -> tuple[int, int, int, int]:
    """The grouped GEMM tile for ``pairs = T * k`` (speed only)."""
    if interpret:
        return INTERPRET_CONFIG
    bm, bn, warps, stages = CONFIGS[sum(pairs > bound for bound in (256, 4096, 16384))]
    return bm, bn, warps, min(stages, 3) if elem_bytes == 4 else stages  # fp32 tiles: fit shared memory


@triton.jit
def _grouped_mm_kernel(
    a_ptr, a_rows_ptr, b_ptr, c_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr,
    N, K, E,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn, bias_ptr, stride_bias,
    GATHER: tl.constexpr, INTERPRET: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_TILES: tl.constexpr,
    HAS_BIAS: tl.constexpr = False,
):  # fmt: skip
    """``c[rows] = a[a_rows[rows]] @ b[e].T`` for one (M tile, N tile); the M tile's expert ``e`` and first sorted row
    come from the schedule, its last row from ``offsets[e + 1]``. K is reduced by ``matmul.k_reduce``."""
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n
    e = tl.load(tile_expert_ptr + pid_m)
    if e >= E:  # past the last expert's tiles: the grid is a bound fixed by (T, k, E)
        return
    row0 = tl.load(tile_row_ptr + pid_m)
    row_end = tl.load(offsets_ptr + e + 1)
    offs_m = row0 + tl.arange(0, BLOCK_M).to(tl.int64)
    mask_m = offs_m < row_end
    if GATHER:
        a_rows = tl.load(a_rows_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    else:
        a_rows = offs_m
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    a_base = a_ptr + a_rows[:, None] * stride_am
    b_base = b_ptr + e.to(tl.int64) * stride_be + offs_n[None, :].to(tl.int64) * stride_bn
    mask_a = mask_m[:, None]
    mask_n = offs_n[None, :] < N
    total = k_reduce(
        a_base, b_base, stride_ak, stride_bk, mask_a, mask_n, K, 0, tl.cdiv(K, BLOCK_K),
        BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_TILES, INTERPRET, INPUT_PRECISION,
    )  # fmt: skip
    if HAS_BIAS:  # the expert's bias widened to fp32 (exact), added to the fp32 result before the one cast (off: the
        # code without it)
        bias = tl.load(bias_ptr + e.to(tl.int64) * stride_bias + offs_n[None, :], mask=mask_n, other=0.0)
        total = total + bias.to(tl.float32)
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :].to(tl.int64) * stride_cn
    tl.store(c_ptrs, total.to(c_ptr.dtype.element_ty), mask=mask_a & mask_n)


@triton.jit
def _grouped_wgrad_kernel(
    dy_ptr, x_ptr, x_rows_ptr, dw_ptr, offsets_ptr,
    N, K,
    stride_dym, stride_dyn, stride_xm, stride_xk, stride_we, stride_wn, stride_wk,
    GATHER: tl.constexpr, INTERPRET: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT_TILES: tl.constexpr,
):  # fmt: skip
    """``dw[e] = dy[rows_e].T @ x[x_rows[rows_e]]`` for one (N tile, K tile) of expert ``program_id(1)``: the expert's
    sorted rows in order, ``BLOCK_R`` rows per ``tl.dot``, partials of ``SPLIT_TILES`` tiles added in split order."""
    pid = tl.program_id(0)
    e = tl.program_id(1)
    num_pid_k = tl.cdiv(K, BLOCK_K)
    pid_n = pid // num_pid_k
    pid_k = pid % num_pid_k
    start = tl.load(offsets_ptr + e)
    end = tl.load(offsets_ptr + e + 1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R).to(tl.int64)
    mask_n = offs_n < N
    mask_k = offs_k < K
    r_tiles = tl.cdiv(end - start, BLOCK_R)
    total = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for rt in range(0, r_tiles):
        rows = start + rt * BLOCK_R + offs_r
        mask_r = rows < end
        if GATHER:
            x_rows = tl.load(x_rows_ptr + rows, mask=mask_r, other=0).to(tl.int64)
        else:
            x_rows = rows
        a = tl.load(
            dy_ptr + rows[None, :] * stride_dym + offs_n[:, None].to(tl.int64) * stride_dyn,
            mask=mask_n[:, None] & mask_r[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_R]
        b = tl.load(
            x_ptr + x_rows[:, None] * stride_xm + offs_k[None, :].to(tl.int64) * stride_xk,
            mask=mask_r[:, None] & mask_k[None, :],
            other=0.0,
        )  # [BLOCK_R, BLOCK_K]
        if INTERPRET:
            acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
        else:
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        total, acc = end_split(total, acc, rt, r_tiles, SPLIT_TILES)
    w_ptrs = (
        dw_ptr + e.to(tl.int64) * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
        + offs_k[None, :].to(tl.int64) * stride_wk
    )  # fmt: skip
    tl.store(w_ptrs, total.to(dw_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_k[None, :])


@triton.jit
def _combine_kernel(
    y_ptr, w_ptr, inv_ptr, out_ptr, H, stride_y, stride_o,
    TOPK: tl.constexpr, HAS_W: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """``out[t] = ((0 + w[t,0] y[inv[t,0]]) + w[t,1] y[inv[t,1]]) + ...`` in fp32, rank order, cast once."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for r in tl.static_range(TOPK):
        row = tl.load(inv_ptr + t * TOPK + r)
        v = tl.load(y_ptr + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            v = tl.load(w_ptr + t * TOPK + r).to(tl.float32) * v
        acc = acc + v
    tl.store(out_ptr + t * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _combine_bwd_kernel(
    g_ptr, w_ptr, y_ptr, inv_ptr, dy_ptr, dw_ptr, H, stride_g, stride_y, stride_dy,
    TOPK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Per token: ``dy[pair] = w[t, r] * g[t]`` (cast to dy's dtype) and ``dw[t, r] = sum_h g[t, h] * y[pair, h]``."""
    t = tl.program_id(0).to(tl.int64)
    for r in tl.static_range(TOPK):
        row = tl.load(inv_ptr + t * TOPK + r)
        w = tl.load(w_ptr + t * TOPK + r).to(tl.float32)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for h0 in range(0, H, BLOCK):
            cols = h0 + tl.arange(0, BLOCK)
            mask = cols < H
            g = tl.load(g_ptr + t * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
            y = tl.load(y_ptr + row * stride_y + cols, mask=mask, other=0.0)
            acc += g * y
            tl.store(dy_ptr + row * stride_dy + cols, (w * g).to(dy_ptr.dtype.element_ty), mask=mask)
        tl.store(dw_ptr + t * TOPK + r, tl.sum(acc, axis=0))


# The plan of a launch with at most PLAN_KERNEL_MAX_PAIRS pairs (decode and small prefill steps) is built by four
# Triton launches (a histogram per chunk of PLAN_CHUNK pairs, one scan, a rank per chunk, the tile schedule) instead of
# torch's stable sort and about fifteen small torch ops; larger ones (prefill, training) keep torch's. The same
# integers either way (tests/test_triton_moe.py holds them equal): a pair's sorted row is its expert's first row plus
# the number of earlier pairs of that expert, which is what a stable sort gives. On an H200 the torch plan took about
# 3 ms of a 31.5 ms Qwen3-30B-A3B decode step at batch 256 (48 layers; the sort alone 1.4 ms,
# benchmarks/results/throughput-rl-h200.md).
# On an H200 at a82f62f the four took 1.71 ms of the 30.0 ms step; the tile schedule, then one program walking its
# tiles 32 at a time, 1.13 ms of it: it now runs a program per PLAN_TILES_PER_PROGRAM tiles.
PLAN_CHUNK = 128
PLAN_KERNEL_MAX_PAIRS = 64 * PLAN_CHUNK
PLAN_TILES_PER_PROGRAM = 32


@triton.jit
def _plan_onehot(IDS, chunk, P, EP: tl.constexpr, C: tl.constexpr):
    """The chunk's pairs, whether each is real, and ``[C, EP]`` int32: pair i's expert column set (none for a row
    past ``P``)."""
    rows = chunk * C + tl.arange(0, C)
    ok = rows < P
    ids = tl.load(IDS + rows, mask=ok, other=EP)  # EP: no column
    onehot = (ids[:, None] == tl.arange(0, EP)[None, :]).to(tl.int32)
    return rows, ok, onehot


@triton.jit
def _plan_hist_kernel(IDS, HIST, P, EP: tl.constexpr, C: tl.constexpr):
    """``HIST[chunk, e]``: the chunk's pairs of expert ``e``."""
    chunk = tl.program_id(0)
    _, _, onehot = _plan_onehot(IDS, chunk, P, EP, C)
    tl.store(HIST + chunk * EP + tl.arange(0, EP), tl.sum(onehot, axis=0))


@triton.jit
def _plan_scan_kernel(HIST, BASE, COUNTS, OFFSETS, n_chunks, E, EP: tl.constexpr, NC: tl.constexpr):
    """Per expert its count and first sorted row (``OFFSETS [E+1]``: the pairs of lower id), and ``BASE[chunk, e]``:
    the sorted row of the chunk's first pair of expert ``e`` (its first row plus the earlier chunks' pairs of it)."""
    ch = tl.arange(0, NC)
    cols = tl.arange(0, EP)
    h = tl.load(HIST + ch[:, None] * EP + cols[None, :], mask=ch[:, None] < n_chunks, other=0)
    counts = tl.sum(h, axis=0)
    offsets = tl.cumsum(counts, axis=0) - counts
    tl.store(BASE + ch[:, None] * EP + cols[None, :], offsets[None, :] + tl.cumsum(h, axis=0) - h,
             mask=ch[:, None] < n_chunks)  # fmt: skip
    tl.store(COUNTS + cols, counts)
    tl.store(OFFSETS + cols, offsets.to(tl.int64), mask=cols <= E)


@triton.jit
def _plan_rank_kernel(IDS, BASE, INV, TOK, P, K, EP: tl.constexpr, C: tl.constexpr):
    """Each pair's sorted row (``INV``) and the token of each sorted row (``TOK``)."""
    chunk = tl.program_id(0)
    rows, ok, onehot = _plan_onehot(IDS, chunk, P, EP, C)
    base = tl.load(BASE + chunk * EP + tl.arange(0, EP))
    row = tl.sum(onehot * (tl.cumsum(onehot, axis=0) - 1 + base[None, :]), axis=1)
    tl.store(INV + rows, row.to(tl.int64), mask=ok)
    tl.store(TOK + row, (rows // K).to(tl.int64), mask=ok)


@triton.jit
def _plan_tiles_kernel(COUNTS, OFFSETS, EXPERT, FIRST, num_tiles, E, BLOCK_M: tl.constexpr, EP: tl.constexpr,
                       TP: tl.constexpr):  # fmt: skip
    """The tile schedule of :meth:`_Plan.tiles` for tiles of ``BLOCK_M`` rows: tile ``pid``'s expert (the number of
    experts whose tiles end at or before it; ``E``: no work) and first sorted row. A program per ``TP`` tiles, each
    taking the experts' tile counts and their running sum itself (integers: the same values in every program)."""
    cols = tl.arange(0, EP)
    real = cols < E
    per = tl.where(real, (tl.load(COUNTS + cols) + BLOCK_M - 1) // BLOCK_M, 0)
    end = tl.cumsum(per, axis=0)
    offsets = tl.load(OFFSETS + cols, mask=cols <= E, other=0)
    pid = tl.program_id(0) * TP + tl.arange(0, TP)
    expert = tl.sum(((end[None, :] <= pid[:, None]) & real[None, :]).to(tl.int32), axis=1)
    pick = cols[None, :] == tl.minimum(expert, E - 1)[:, None]
    first = tl.sum(tl.where(pick, offsets[None, :], 0), axis=1)
    start = tl.sum(tl.where(pick, (end - per)[None, :], 0), axis=1)
    ok = pid < num_tiles
    tl.store(EXPERT + pid, expert.to(tl.int64), mask=ok)
    tl.store(FIRST + pid, first + (pid - start).to(tl.int64) * BLOCK_M, mask=ok)


def _plan_kernels_ok(device: torch.device, pairs: int) -> bool:
    """Whether :class:`_Plan` is built by the plan kernels: on CUDA (or under the interpreter), up to
    ``PLAN_KERNEL_MAX_PAIRS`` pairs."""
    from . import interpreting

    return (device.type == "cuda" or interpreting()) and 0 < pairs <= PLAN_KERNEL_MAX_PAIRS


class _Plan:
    """Where each pair goes: ``tok [T*k]`` (sorted row -> token), ``inv [T*k]`` (pair -> sorted row), ``offsets
    [E+1]`` (expert -> first sorted row); all on the device, computed without a host sync. Ids may be ``E`` (pairs
    held elsewhere: sorted after every expert's, in no tile). ``device_kernels``: build it with the plan kernels
    (default: on CUDA, and under the interpreter, up to ``PLAN_KERNEL_MAX_PAIRS`` pairs); the same integers."""

    def __init__(self, topk_ids: torch.Tensor, num_experts: int, device_kernels: bool | None = None):
        t, k = topk_ids.shape
        flat = topk_ids.reshape(-1).to(torch.int64)
        dev = flat.device
        self.num_experts, self.topk, self.pairs = num_experts, k, t * k
        if device_kernels is None:
            device_kernels = _plan_kernels_ok(dev, self.pairs)
        self._counts = None
        self._tiles: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}
        if device_kernels:
            self._build_on_device(flat.contiguous(), k)
            return
        sorted_ids, order = torch.sort(flat, stable=True)  # pairs of an expert contiguous, in token order
        self.offsets = torch.searchsorted(sorted_ids, torch.arange(num_experts + 1, device=dev))
        self.tok = order // k
        self.inv = torch.empty_like(order).scatter_(0, order, torch.arange(t * k, device=dev))

    def _build_on_device(self, flat: torch.Tensor, k: int) -> None:
        e, p, dev = self.num_experts, self.pairs, flat.device
        ep = next_pow2(e + 1)  # a column per expert and one for the ids held elsewhere
        n_chunks = cdiv(p, PLAN_CHUNK)
        hist = torch.empty(n_chunks, ep, dtype=torch.int32, device=dev)
        base = torch.empty_like(hist)
        self._counts = torch.empty(ep, dtype=torch.int32, device=dev)
        self.offsets = torch.empty(e + 1, dtype=torch.int64, device=dev)
        self.inv = torch.empty(p, dtype=torch.int64, device=dev)
        self.tok = torch.empty(p, dtype=torch.int64, device=dev)
        _plan_hist_kernel[(n_chunks,)](flat, hist, p, EP=ep, C=PLAN_CHUNK, num_warps=4)
        _plan_scan_kernel[(1,)](hist, base, self._counts, self.offsets, n_chunks, e, EP=ep,
                                NC=next_pow2(n_chunks), num_warps=8)  # fmt: skip
        _plan_rank_kernel[(n_chunks,)](flat, base, self.inv, self.tok, p, k, EP=ep, C=PLAN_CHUNK, num_warps=8)

    def tiles(self, block_m: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        """``(num_tiles, expert [num_tiles], first_row [num_tiles])``; ``expert == E`` marks a tile with no work."""
        if block_m not in self._tiles:
            e = self.num_experts
            num_tiles = cdiv(self.pairs, block_m) + min(e, self.pairs)  # a bound fixed by (T, k, E)
            if self._counts is not None:  # built by the plan kernels
                expert = torch.empty(num_tiles, dtype=torch.int64, device=self.offsets.device)
                first_row = torch.empty_like(expert)
                _plan_tiles_kernel[(cdiv(num_tiles, PLAN_TILES_PER_PROGRAM),)](
                    self._counts, self.offsets, expert, first_row, num_tiles, e,
                    BLOCK_M=block_m, EP=self._counts.numel(), TP=PLAN_TILES_PER_PROGRAM, num_warps=4,
                )  # fmt: skip
            else:
                counts = self.offsets[1:] - self.offsets[:-1]
                per_expert = (counts + block_m - 1) // block_m
                end = torch.cumsum(per_expert, 0)
                pid = torch.arange(num_tiles, device=end.device)
                expert = torch.searchsorted(end, pid, right=True)
                ec = expert.clamp(max=e - 1)
                first_row = self.offsets[ec] + (pid - (end - per_expert)[ec]) * block_m
            self._tiles[block_m] = (num_tiles, expert, first_row)
        return self._tiles[block_m]


def _grouped_mm(a, a_rows, b, b_strides, n, k, plan: _Plan, out_dtype, config, bias=None) -> torch.Tensor:
    """``[T*k, n]`` in sorted-row order: row ``i`` is ``a[a_rows[i]] @ B_e.T`` with ``B_e[n', k'] = b[e] at
    (n' * b_strides[0] + k' * b_strides[1])``; ``a_rows`` None reads ``a`` in sorted-row order; ``bias [E, n]``
    (None: none) added in fp32 before the cast."""
    from . import interpreting

    bm, bn, warps, stages = config
    c = torch.empty(plan.pairs, n, dtype=out_dtype, device=a.device)
    num_tiles, expert, first_row = plan.tiles(bm)
    _grouped_mm_kernel[(num_tiles * cdiv(n, bn),)](
        a, a_rows if a_rows is not None else a, b, c, expert, first_row, plan.offsets,
        n, k, plan.num_experts,
        a.stride(0), a.stride(1), b.stride(0), b_strides[0], b_strides[1], c.stride(0), c.stride(1),
        bias if bias is not None else c, bias.stride(0) if bias is not None else 0,
        GATHER=a_rows is not None, INTERPRET=interpreting(), INPUT_PRECISION=input_precision(a.dtype),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK_K, SPLIT_TILES=SPLIT_TILES,
        **({"HAS_BIAS": True} if bias is not None else {}),
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return c


def _grouped_wgrad(dy, x, x_rows, plan: _Plan, out_dtype) -> torch.Tensor:
    """``dw [E, N, K]``: ``dw[e] = dy[rows_e].T @ x[x_rows[rows_e]]``, reduced over the expert's rows in order."""
    from . import interpreting

    n, k = dy.shape[1], x.shape[1]
    bn, bk, warps, stages = INTERPRET_WGRAD_CONFIG if interpreting() else WGRAD_CONFIG
    dw = torch.empty(plan.num_experts, n, k, dtype=out_dtype, device=dy.device)
    _grouped_wgrad_kernel[(cdiv(n, bn) * cdiv(k, bk), plan.num_experts)](
        dy, x, x_rows if x_rows is not None else x, dw, plan.offsets,
        n, k,
        dy.stride(0), dy.stride(1), x.stride(0), x.stride(1), dw.stride(0), dw.stride(1), dw.stride(2),
        GATHER=x_rows is not None, INTERPRET=interpreting(), INPUT_PRECISION=input_precision(dy.dtype),
        BLOCK_N=bn, BLOCK_K=bk, BLOCK_R=BLOCK_K, SPLIT_TILES=SPLIT_TILES,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return dw


def _combine(y, w, plan: _Plan, t: int, out_dtype) -> torch.Tensor:
    """``[T, H]``: each token's k sorted rows of ``y`` (times ``w`` unless None) added in rank order, cast once."""
    h = y.shape[1]
    out = torch.empty(t, h, dtype=out_dtype, device=y.device)
    _combine_kernel[(t, cdiv(h, COMBINE_BLOCK))](
        y, w if w is not None else y, plan.inv, out, h, y.stride(0), out.stride(0),
        TOPK=plan.topk, HAS_W=w is not None, BLOCK=COMBINE_BLOCK, num_warps=4, enable_fp_fusion=False,
    )  # fmt: skip
    return out


class Extras:
    """gpt-oss's expert options: contiguous biases (or None) in their own dtype, interleaved gate/up, the clamped
    SwiGLU. The grouped GEMM widens a bias to fp32 as it loads it (exact from bf16: the same values a cast gives), so
    no cast kernel runs per call (two a layer before: 48 launches in a decode step of gpt-oss-20b)."""

    def __init__(self, b_gate_up=None, b_down=None, interleaved=False, activation="silu"):
        self.b_gate_up = None if b_gate_up is None else b_gate_up.contiguous()
        self.b_down = None if b_down is None else b_down.contiguous()
        self.interleaved, self.clamped = interleaved, activation == "clamped_swiglu"


def _forward(x, w_gate_up, w_down, topk_weights, plan: _Plan, config, extras: Extras | None = None):
    t, hid = x.shape
    inter = w_down.shape[2]
    if extras is None:  # the code without gpt-oss's options
        # h [T*k, 2I] = x[tok] @ w_gate_up[e].T, in x's dtype
        h = _grouped_mm(x, plan.tok, w_gate_up, (w_gate_up.stride(1), w_gate_up.stride(2)), 2 * inter, hid, plan,
                        x.dtype, config)  # fmt: skip
        act = silu_and_mul_fwd(h[:, :inter], h[:, inter:])  # [T*k, I], fp32 inside, cast once
        # y [T*k, H] = act @ w_down[e].T, fp32
        y = _grouped_mm(act, None, w_down, (w_down.stride(1), w_down.stride(2)), hid, inter, plan, torch.float32,
                        config)  # fmt: skip
        return h, act, y, _combine(y, topk_weights, plan, t, x.dtype)
    h = _grouped_mm(x, plan.tok, w_gate_up, (w_gate_up.stride(1), w_gate_up.stride(2)), 2 * inter, hid, plan,
                    x.dtype, config, extras.b_gate_up)  # fmt: skip
    act = glu_fwd(h, extras.interleaved, extras.clamped, SWIGLU_ALPHA, SWIGLU_LIMIT)
    y = _grouped_mm(act, None, w_down, (w_down.stride(1), w_down.stride(2)), hid, inter, plan, torch.float32, config,
                    extras.b_down)  # fmt: skip
    return h, act, y, _combine(y, topk_weights, plan, t, x.dtype)


def _bias_grad(d_rows, plan: _Plan, dtype) -> torch.Tensor:
    """``[E, n]``: each expert's sum of its sorted rows of ``d_rows [T*k, n]``, in row order (``_grouped_wgrad``
    against a column of ones)."""
    ones = d_rows.new_ones(1, 1).expand(d_rows.shape[0], 1)
    return _grouped_wgrad(d_rows, ones, None, plan, dtype)[:, :, 0]


def _check(x, w_gate_up, w_down, topk_weights, topk_ids, config) -> None:
    """What the public ``vexact_kernels.fused_moe`` has not checked already (shapes, dtypes, ids: it checks those)."""
    devices = {t.device for t in (x, w_gate_up, w_down, topk_weights, topk_ids)}
    if len(devices) != 1:
        raise ValueError(f"triton_fused_moe: inputs are on several devices: {sorted(map(str, devices))}")
    if config is not None and (len(config) != 4 or config[0] < 16 or config[1] < 16):
        raise ValueError(f"triton_fused_moe: config must be (BLOCK_M>=16, BLOCK_N>=16, warps, stages); got {config}")


class FusedMoEFunction(torch.autograd.Function):
    """The fused MoE with its deterministic backward (grads for x, both weights and the routing weights)."""

    @staticmethod
    def forward(ctx, x, w_gate_up, w_down, topk_weights, topk_ids, config, b_gate_up=None, b_down=None, extras=None):
        plan = _Plan(topk_ids, w_gate_up.shape[0])
        h, act, y, out = _forward(x, w_gate_up, w_down, topk_weights, plan, config, extras)
        ctx.save_for_backward(x, w_gate_up, w_down, topk_weights, h, act, y)
        ctx.plan, ctx.config, ctx.extras = plan, config, extras
        ctx.bias_dtypes = (None if b_gate_up is None else b_gate_up.dtype, None if b_down is None else b_down.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, w_gate_up, w_down, topk_weights, h, act, y = ctx.saved_tensors
        plan, config = ctx.plan, ctx.config
        t, hid = x.shape
        inter = w_down.shape[2]
        need_x, need_gu, need_down, need_w = ctx.needs_input_grad[:4]
        g = grad_out.contiguous()
        dy = torch.empty(plan.pairs, hid, dtype=x.dtype, device=x.device)  # sorted rows
        d_topk = torch.empty(t, plan.topk, dtype=torch.float32, device=x.device)
        _combine_bwd_kernel[(t,)](
            g, topk_weights, y, plan.inv, dy, d_topk, hid, g.stride(0), y.stride(0), dy.stride(0),
            TOPK=plan.topk, BLOCK=COMBINE_BLOCK, num_warps=4, enable_fp_fusion=False,
        )  # fmt: skip
        dx = d_gu = d_down = db_gu = db_down = None
        extras = ctx.extras
        if extras is not None and ctx.bias_dtypes[1] is not None and ctx.needs_input_grad[7]:
            db_down = _bias_grad(dy, plan, ctx.bias_dtypes[1])  # [E, H]
        if need_down:
            d_down = _grouped_wgrad(dy, act, None, plan, w_down.dtype)  # [E, H, I]
        if need_x or need_gu:
            # d act [T*k, I] = dy @ w_down[e]: w_down[e] read as [I, H] through its transposed strides
            d_act = _grouped_mm(dy, None, w_down, (w_down.stride(2), w_down.stride(1)), inter, hid, plan, x.dtype,
                                config)  # fmt: skip
            if extras is not None:
                dh = glu_bwd(d_act, h, extras.interleaved, extras.clamped, SWIGLU_ALPHA, SWIGLU_LIMIT)
            else:  # the code without gpt-oss's options
                dh = torch.empty(plan.pairs, 2 * inter, dtype=x.dtype, device=x.device)
            if dh.numel() and extras is None:
                _silu_and_mul_bwd_kernel[(plan.pairs, cdiv(inter, ACT_BLOCK))](
                    d_act, h, h[:, inter:], dh, dh[:, inter:], inter,
                    d_act.stride(0), h.stride(0), h.stride(0), dh.stride(0), BLOCK=ACT_BLOCK,
                    num_warps=ACT_NUM_WARPS, enable_fp_fusion=False,
                )  # fmt: skip
            if extras is not None and ctx.bias_dtypes[0] is not None and ctx.needs_input_grad[6]:
                db_gu = _bias_grad(dh, plan, ctx.bias_dtypes[0])  # [E, 2I]
            if need_gu:
                d_gu = _grouped_wgrad(dh, x, plan.tok, plan, w_gate_up.dtype)  # [E, 2I, H]
            if need_x:
                dx_pairs = _grouped_mm(dh, None, w_gate_up, (w_gate_up.stride(2), w_gate_up.stride(1)), hid,
                                       2 * inter, plan, torch.float32, config)  # fmt: skip
                dx = _combine(dx_pairs, None, plan, t, x.dtype)
        d_w = d_topk.to(topk_weights.dtype) if need_w else None
        return (dx, d_gu, d_down, d_w, None, None, db_gu, db_down, None)[: len(ctx.needs_input_grad)]


def triton_fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: tuple[int, int, int, int] | None = None,
    *,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    gate_up_interleaved: bool = False,
    activation: str = "silu",
) -> torch.Tensor:
    """``sum_r topk_weights[t, r] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` -> ``[T, H]`` in x's dtype.

    Any strides for x and the weights. ``config`` forces the grouped GEMM tile ``(BLOCK_M, BLOCK_N, warps, stages)``
    (default: picked from ``T * k``); it never changes a bit. Expert ids must lie in ``[0, E)`` (not checked here: a
    check would sync with the host; ``moe.fused_moe`` checks them outside a graph capture). ``b_gate_up``,
    ``b_down``, ``gate_up_interleaved``, ``activation``: gpt-oss's experts, as ``moe.fused_moe`` (differentiable in
    the biases); all off by default, which runs the code without them.
    """
    from . import interpreting

    _check(x, w_gate_up, w_down, topk_weights, topk_ids, config)
    t, k = topk_ids.shape
    if t == 0:
        return x.new_zeros(x.shape)
    config = tuple(config) if config is not None else pick_config(t * k, interpreting(), x.element_size())
    tw = topk_weights.float().contiguous()
    ids = topk_ids.contiguous()
    with_extras = b_gate_up is not None or b_down is not None or gate_up_interleaved or activation != "silu"
    extras = Extras(b_gate_up, b_down, gate_up_interleaved, activation) if with_extras else None
    grads = (x, w_gate_up, w_down, topk_weights, b_gate_up, b_down)
    if torch.is_grad_enabled() and any(g is not None and g.requires_grad for g in grads):
        if extras is None:
            return FusedMoEFunction.apply(x, w_gate_up, w_down, tw, ids, config)
        return FusedMoEFunction.apply(x, w_gate_up, w_down, tw, ids, config, b_gate_up, b_down, extras)
    _, _, _, out = _forward(x, w_gate_up, w_down, tw, _Plan(ids, w_gate_up.shape[0]), config, extras)
    return out


def triton_moe_expert_outputs(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """``[T, k, H]`` fp32: each pair's ``down_e(silu(gate_e(x_t)) * up_e(x_t))``, the rows :func:`_forward` combines;
    pairs whose id is outside ``[0, E)`` (experts on another rank, pad rows) are sorted past the last expert, never
    computed, and hold zeros. No host sync, fixed shapes for fixed ``(T, k, E)``: graph-capturable."""
    from . import interpreting

    t, k = topk_ids.shape
    e = w_gate_up.shape[0]
    hid, inter = x.shape[1], w_down.shape[2]
    ids = topk_ids.to(torch.int64)
    valid = (ids >= 0) & (ids < e)
    plan = _Plan(torch.where(valid, ids, e), e)
    config = pick_config(t * k, interpreting(), x.element_size())
    h = _grouped_mm(x, plan.tok, w_gate_up, (w_gate_up.stride(1), w_gate_up.stride(2)), 2 * inter, hid, plan,
                    x.dtype, config)  # fmt: skip
    act = silu_and_mul_fwd(h[:, :inter], h[:, inter:])
    y = _grouped_mm(act, None, w_down, (w_down.stride(1), w_down.stride(2)), hid, inter, plan, torch.float32, config)
    return torch.where(valid.reshape(-1, 1), y[plan.inv], 0.0).view(t, k, hid)


class _Identity:
    """A plan whose pairs are already in ``[token, rank]`` order (for :func:`_combine` over gathered rows)."""

    def __init__(self, t: int, k: int, device: torch.device):
        self.topk = k
        self.inv = torch.arange(t * k, device=device)


def triton_moe_combine(y: torch.Tensor, topk_weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[T, H]``: the combine of :func:`_forward` (``_combine_kernel``) over ``y [T, k, H]`` fp32 in rank order."""
    t, k, h = y.shape
    return _combine(y.reshape(t * k, h), topk_weights.float().contiguous(), _Identity(t, k, y.device), t, dtype)
