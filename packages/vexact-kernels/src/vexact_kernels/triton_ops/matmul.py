"""Batch-invariant matmul for ``linear``: ``C = A @ B_t.T (+ bias)``, bf16/fp16/fp32 in, fp32 accumulation.

Invariance (design.md rule 2): every output element is reduced over K in one fixed structure, the same for every M and
every launch:

* K is cut at fixed absolute positions into splits of ``SPLIT_TILES * BLOCK_K`` (1024) elements. Within a split,
  tiles of ``BLOCK_K`` (64) are reduced in K order, one ``tl.dot`` per tile accumulating into an fp32 partial that
  starts at zero. The partials are then added in split order to a zero-initialised fp32 total, then the bias.
* The split boundaries depend on K alone, never on M, N or the tile shape, so *where* a split is computed does not
  matter: at large M one program walks all splits of its tile in order (no extra memory traffic); at small M each
  split gets its own program (more CTAs to stream the weight: the decode case) and writes its fp32 partial; the last
  of a tile's split programs to finish (an atomic count per tile says which) reads all of the tile's partials and adds
  them in the same split order, as a separate combine kernel would (that two-launch path remains, for launches the
  counts cannot take, and ``fused_combine=False``). All give the same bits (checked on the GPU in
  ``tests/test_triton_matmul.py``): the atomic picks *who* adds, never the order. No atomic adds of values, no
  stream-K, no split counts chosen from the shape.

The M/N tile shape is chosen per M bucket for speed; ``BLOCK_K`` and ``SPLIT_TILES`` are not. That a tile's M/N shape
does not change any element's bits (the tensor-core instruction reduces each element's K slice the same way) is
checked, not assumed: the GPU tests compare every config against every other, bitwise.

fp32 operands: ``tl.dot`` multiplies them with the precision :func:`input_precision` names (``ieee`` by default:
fp32 products and sums on the CUDA cores, so an fp32 linear means fp32; ``tf32`` is selectable with
``vexact_kernels.use_fp32_matmul_precision``). They run the pointer kernel with ``FP32_CONFIGS`` (smaller tiles: fp32
stages take twice the shared memory, and the CUDA-core dot gains nothing from large ones).

Backward (``LinearFunction``): dX = dY @ W and dW = dY.T @ X with the same kernels on the transposed views; where
the GPU has TMA those column-major operands are read through descriptors over the row-major tensors
(``TMA_COLUMN_MAJOR``; H100: 0.80-0.95 of cuBLAS against 0.53-0.69 through the pointer kernel,
``benchmarks/results/kernels-bwd-h100.md``). Both are deterministic run to run (fixed reduction order; dW reduces over
tokens in the same fixed splits) and dW is rounded once, in the epilogue.
"""

from __future__ import annotations

import contextvars
import functools
import threading

import torch
import triton
import triton.language as tl

from . import cdiv

BLOCK_K = 64  # numerics: the K tile is the same for every shape and every config below
# numerics: K tiles per split (splits of 1024); partials are added in split order. H100 sweep of 8/16/32
# (benchmarks/results/tune-matmul-h100.txt): 16 is the best trade between decode (more splits, more CTAs) and large
# M (each split boundary stalls the MMA pipeline once).
SPLIT_TILES = 16
GROUP_M = 8

# (BLOCK_M, BLOCK_N, num_warps, num_stages): speed only, picked by M (and N) from an H100 sweep
# (scripts/tuning/tune_matmul.py). Under the interpreter the smallest tiles are used so CPU tests stay fast.
CONFIGS = (
    (16, 32, 4, 6),  # decode: M <= 32, more CTAs over N to stream the weight
    (64, 64, 4, 6),  # M <= 256
    (128, 128, 8, 3),  # larger M when the persistent TMA kernel cannot take the operands
)
INTERPRET_CONFIG = (16, 16, 4, 1)
# fp32 operands (speed only): (BLOCK_M, BLOCK_N, num_warps, num_stages, split-programs max tiles) for M <= 32 and above
FP32_CONFIGS = ((16, 32, 4, 4, 131), (64, 64, 4, 3, 48))
# Split programs (one per K split, then the combine) pay when the output has fewer tiles than this, per config above
# (H100 sweep, scripts/tuning/tune_kernels.py `cold`/`small`). Speed only: the bits are the same either way.
SPLIT_PROGRAMS_MAX_TILES = (131, 48, 0)


@triton.jit
def end_split(total, acc, kt, k_tiles, SPLIT_TILES: tl.constexpr):
    """After tile ``kt``: at a split's last tile (or the last of ``k_tiles``), ``acc`` added to ``total``, zeroed."""
    if (kt % SPLIT_TILES == SPLIT_TILES - 1) or (kt == k_tiles - 1):
        total += acc
        acc = tl.zeros(acc.shape, dtype=tl.float32)
    return total, acc


@triton.jit
def k_reduce(
    a_base, b_base, stride_ak, stride_bk, mask_a, mask_b, K, kt_lo, kt_hi,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_TILES: tl.constexpr,
    INTERPRET: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    """The K reduction of every invariant GEMM tile (this module's and the grouped MoE GEMMs'): K tiles ``kt_lo ..
    kt_hi - 1`` of ``BLOCK_K`` in order, one ``tl.dot`` per tile into an fp32 partial, which is added to the fp32 total
    and restarted from zero at every split boundary (``SPLIT_TILES`` tiles, positions fixed by K alone), with
    ``INPUT_PRECISION`` (:func:`input_precision`) for fp32 operands. ``a_base``
    ``[BLOCK_M, 1]`` / ``b_base`` ``[1, BLOCK_N]`` pointers at k = 0, with their row / column masks."""
    offs_k = tl.arange(0, BLOCK_K)
    k_tiles = tl.cdiv(K, BLOCK_K)
    # One loop over the K tiles (one software pipeline); a split boundary is a uniform branch that adds the split's
    # partial to the total and restarts it from zero.
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(kt_lo, kt_hi):
        kk = kt * BLOCK_K + offs_k
        a = tl.load(a_base + kk[None, :].to(tl.int64) * stride_ak, mask=mask_a & (kk[None, :] < K), other=0.0)
        b = tl.load(b_base + kk[:, None].to(tl.int64) * stride_bk, mask=mask_b & (kk[:, None] < K), other=0.0)
        if INTERPRET:
            # The interpreter's tl.dot is numpy's BLAS, whose result for a row depends on its place in the tile (and
            # which mishandles 16-bit floats): an explicit fp32 product-and-sum stands in for the tensor-core MMA.
            acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
        else:
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        total, acc = end_split(total, acc, kt, k_tiles, SPLIT_TILES)
    return total


@triton.jit
def _epilogue(
    total, c_ptr, bias_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn,
    HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr,
):  # fmt: skip
    """``c = total + bias`` (``ACCUMULATE``: ``c = c + (total + bias)``), cast to ``c``'s dtype."""
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if HAS_BIAS:
        total += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    if ACCUMULATE:
        total = tl.load(c_ptrs, mask=mask, other=0.0) + total
    tl.store(c_ptrs, total.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """``(pid_m, pid_n)`` of output tile ``pid``, tiles taken ``GROUP_M`` rows of tiles at a time (L2 reuse)."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_pid_n
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % group) % size_m, (pid % group) // size_m


@triton.jit
def _split_out(
    total, c_ptr, bias_ptr, part_ptr, count_ptr, tile, split, num_splits, offs_m, offs_n, M, N, stride_cm, stride_cn,
    HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr, COMBINE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """A split program's end: its fp32 partial ``total`` to ``part_ptr[split, M, N]``; ``COMBINE``: the tile's split
    program that finishes last (an atomic count in ``count_ptr[tile]``, reset to 0 after) adds the tile's partials as
    ``_combine_kernel`` does, in split order, and writes ``c``."""
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    mn = tl.cast(M, tl.int64) * N
    parts = part_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(parts + split * mn, total, mask=mask)
    if COMBINE:
        # Every thread's partial store comes before the count's release (the CUTLASS semaphore pattern); the
        # acquire and the barrier that hands the count to every thread come before the loads, which bypass L1.
        tl.debug_barrier()
        done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if done == num_splits - 1:
            # ``_combine_kernel``'s adds, element by element: 0 + p_0 + p_1 + ... in split order
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(num_splits):
                total += tl.load(parts + s * mn, mask=mask, other=0.0, cache_modifier=".cg")
            _epilogue(total, c_ptr, bias_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn, HAS_BIAS, ACCUMULATE)
            tl.store(count_ptr + tile, 0)  # no program of this launch counts this tile again


@triton.jit
def _matmul_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, part_ptr, count_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    HAS_BIAS: tl.constexpr, INTERPRET: tl.constexpr, SPLIT_OUT: tl.constexpr, COMBINE: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_TILES: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One output tile; all K splits in order (``SPLIT_OUT=False``) or the one split ``program_id(1)``, whose fp32
    partial goes to ``part_ptr[split, M, N]`` (``SPLIT_OUT=True``). ``COMBINE`` (with ``SPLIT_OUT``): the tile's split
    program that finishes last (an atomic count in ``count_ptr[tile]``, reset to 0 after) adds the tile's partials as
    ``_combine_kernel`` does, in split order, and writes ``c``. ``ACCUMULATE``: ``c = c + result`` (fp32 ``c``)."""
    pid = tl.program_id(0)
    pid_m, pid_n = _grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    a_base = a_ptr + offs_m[:, None].to(tl.int64) * stride_am
    b_base = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn
    mask_m = offs_m[:, None] < M
    mask_n = offs_n[None, :] < N
    k_tiles = tl.cdiv(K, BLOCK_K)
    if SPLIT_OUT:
        split = tl.program_id(1)
        kt_lo = split * SPLIT_TILES
        kt_hi = tl.minimum(kt_lo + SPLIT_TILES, k_tiles)
    else:
        kt_lo = 0
        kt_hi = k_tiles
    total = k_reduce(
        a_base, b_base, stride_ak, stride_bk, mask_m, mask_n, K, kt_lo, kt_hi,
        BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_TILES, INTERPRET, INPUT_PRECISION,
    )  # fmt: skip
    if SPLIT_OUT:
        _split_out(
            total, c_ptr, bias_ptr, part_ptr, count_ptr, pid, split, tl.num_programs(1), offs_m, offs_n, M, N,
            stride_cm, stride_cn, HAS_BIAS, ACCUMULATE, COMBINE, BLOCK_M, BLOCK_N,
        )  # fmt: skip
    else:
        _epilogue(total, c_ptr, bias_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn, HAS_BIAS, ACCUMULATE)


@triton.jit
def _combine_kernel(
    part_ptr, c_ptr, bias_ptr, M, N, num_splits, stride_cm, stride_cn,
    HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """``c = (((0 + p_0) + p_1) + ...) + bias``: the split partials added in split order, as ``_matmul_kernel`` does."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(num_splits):
        total += tl.load(part_ptr + s * M * N + offs, mask=mask, other=0.0)
    m = offs // N
    n = offs % N
    if HAS_BIAS:
        total += tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
    if ACCUMULATE:
        total = tl.load(c_ptr + m * stride_cm + n * stride_cn, mask=mask, other=0.0) + total
    tl.store(c_ptr + m * stride_cm + n * stride_cn, total.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _matmul_tma_kernel(
    a_desc, b_desc, c_ptr, bias_ptr,
    M, N, K, stride_cm, stride_cn,
    HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr, A_COLS: tl.constexpr, B_COLS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_TILES: tl.constexpr, NUM_SMS: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Persistent Hopper variant (TMA loads): the same per-element K structure as ``_matmul_kernel``, for large M.
    ``A_COLS`` / ``B_COLS``: the operand is column-major (``a`` is ``a_kt.T``, ``b_t`` is ``b_kn.T``, as in the
    backward's ``dY @ W`` and ``dY.T @ X``); its descriptor is over the contiguous ``[K, M]`` / ``[K, N]`` tensor and
    its tiles come in ``[BLOCK_K, BLOCK_M]`` / ``[BLOCK_K, BLOCK_N]``, the same values meeting the same MMAs."""
    start = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    group = GROUP_M * num_pid_n
    for tile in tl.range(start, num_pid_m * num_pid_n, NUM_SMS, warp_specialize=WARP_SPECIALIZE):
        first_m = (tile // group) * GROUP_M
        size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (tile % group) % size_m
        pid_n = (tile % group) // size_m
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kt in range(k_tiles):
            # out-of-bounds reads are zero, like the masks
            if A_COLS:
                a = a_desc.load([kt * BLOCK_K, pid_m * BLOCK_M]).T
            else:
                a = a_desc.load([pid_m * BLOCK_M, kt * BLOCK_K])
            if B_COLS:
                acc = tl.dot(a, b_desc.load([kt * BLOCK_K, pid_n * BLOCK_N]), acc, input_precision=INPUT_PRECISION)
            else:
                b = b_desc.load([pid_n * BLOCK_N, kt * BLOCK_K])
                acc = tl.dot(a, b.T, acc, input_precision=INPUT_PRECISION)
            if (kt % SPLIT_TILES == SPLIT_TILES - 1) or (kt == k_tiles - 1):
                total += acc
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if ACCUMULATE:
            _epilogue(total, c_ptr, bias_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn, HAS_BIAS, ACCUMULATE)
        else:
            if HAS_BIAS:
                total += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
            c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
            tl.store(c_ptrs, total.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _matmul_tma_split_kernel(
    a_desc, b_desc, c_ptr, bias_ptr, part_ptr, count_ptr,
    M, N, K, stride_cm, stride_cn,
    HAS_BIAS: tl.constexpr, COMBINE: tl.constexpr, ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_TILES: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    """``_matmul_kernel``'s split programs (one per output tile and K split, ``program_id(1)`` the split) with the
    tiles read through TMA descriptors of row-major operands: the split's K tiles in order into an fp32 partial that
    starts at zero, added to a zero total (as ``k_reduce`` ends a split), then ``_split_out``."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    pid_m, pid_n = _grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    k_tiles = tl.cdiv(K, BLOCK_K)
    kt_lo = split * SPLIT_TILES
    kt_hi = tl.minimum(kt_lo + SPLIT_TILES, k_tiles)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(kt_lo, kt_hi):  # out-of-bounds reads are zero, like the masks
        a = a_desc.load([pid_m * BLOCK_M, kt * BLOCK_K])
        b = b_desc.load([pid_n * BLOCK_N, kt * BLOCK_K])
        acc = tl.dot(a, b.T, acc, input_precision=INPUT_PRECISION)
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    total += acc
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    _split_out(
        total, c_ptr, bias_ptr, part_ptr, count_ptr, pid, split, tl.num_programs(1), offs_m, offs_n, M, N,
        stride_cm, stride_cn, HAS_BIAS, ACCUMULATE, COMBINE, BLOCK_M, BLOCK_N,
    )  # fmt: skip


# (BLOCK_M, BLOCK_N, num_warps, num_stages, warp_specialize) of the persistent TMA variant, used for M >= TMA_MIN_M.
TMA_CONFIG = (128, 256, 8, 3, False)
TMA_CONFIG_MID = (128, 128, 8, 4, True)  # warp-specialized 128x128
TMA_CONFIG_NARROW = (64, 128, 4, 4, False)  # few output tiles (M = 256-512 with a narrow N): twice the tiles of 128x128
TMA_CONFIG_FP32_OUT = (128, 128, 8, 4, False)  # a 128x256 fp32 epilogue does not fit in shared memory
TMA_MIN_M = 256
# The pick among these three (speed only) by how well each fills the GPU's SMs: score = (tiles / (waves * SMs)) x the
# tile's own efficiency. The efficiencies are fitted to an H200 sweep of the grouped Qwen3-1.7B / 8B projections at
# M = 256 .. 4096 (scripts/tuning/tune_kernels.py --parts mid; benchmarks/results/tune-mid-h200.txt): e.g. 64 tiles of
# 128x128 leave half the SMs idle, so 64x128 wins (1.7B q/k/v at M = 256: 0.86 of cuBLAS against 0.63 with the
# pointer kernel); at 384 tiles the warp-specialized 128x128 wins (8B gate/up at M = 256: 0.89 against 0.52).
TMA_PICKS = ((TMA_CONFIG_NARROW, 0.65), (TMA_CONFIG_MID, 0.92), (TMA_CONFIG, 1.0))


@functools.lru_cache(maxsize=4096)
def tma_config(m: int, n: int, num_sms: int) -> tuple:
    """The persistent TMA kernel's tile for a bf16/fp16 ``[M, N]`` output on a GPU of ``num_sms`` SMs (speed only:
    every config gives the same bits)."""
    best = None
    for cfg, efficiency in TMA_PICKS:
        tiles = cdiv(m, cfg[0]) * cdiv(n, cfg[1])
        score = tiles / (cdiv(tiles, num_sms) * num_sms) * efficiency
        if best is None or score > best[0]:
            best = (score, cfg)
    return best[1]


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


# Column-major operands (the backward's ``dY @ W`` and ``dY.T @ X``: transposed views of row-major tensors) read
# through TMA descriptors over the row-major tensor, where the GPU has TMA; else the pointer kernel. Speed only: the
# same tiles meet the same MMAs (the GPU tests compare the two bit for bit); False gives them the pointer kernel.
TMA_COLUMN_MAJOR = True


def _tma_layout(t: torch.Tensor) -> str | None:
    """``"rows"`` (row-major) or ``"cols"`` (column-major) where a TMA descriptor can read the 2-D ``t``, else None:
    a unit stride, 16-byte aligned base and 16-byte multiple outer stride."""
    es = t.element_size()
    if t.data_ptr() % 16:
        return None
    if t.stride(1) == 1 and (t.stride(0) * es) % 16 == 0:
        return "rows"
    if TMA_COLUMN_MAJOR and t.stride(0) == 1 and (t.stride(1) * es) % 16 == 0 and t.shape[0] > 1:
        return "cols"
    return None


@functools.cache
def sm_major(device: torch.device) -> int:
    """The compute capability's major number of a CUDA device (cached: a launch asks on every call)."""
    return torch.cuda.get_device_capability(device)[0]


def _tma_ok(a: torch.Tensor, b_t: torch.Tensor) -> bool:
    if not a.is_cuda or sm_major(a.device) < 9:
        return False
    return _tma_layout(a) is not None and _tma_layout(b_t) is not None


def _launch_tma(a, b_t, c, bias, cfg, accumulate: bool = False) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, warps, stages, ws = cfg
    m, k = a.shape
    n = b_t.shape[0]
    num_sms = _num_sms(a.device)
    a_cols, b_cols = _tma_layout(a) == "cols", _tma_layout(b_t) == "cols"
    a_desc = (
        TensorDescriptor.from_tensor(a.t(), [BLOCK_K, bm]) if a_cols else TensorDescriptor.from_tensor(a, [bm, BLOCK_K])
    )
    b_desc = (
        TensorDescriptor.from_tensor(b_t.t(), [BLOCK_K, bn])
        if b_cols
        else TensorDescriptor.from_tensor(b_t, [bn, BLOCK_K])
    )
    tiles = cdiv(m, bm) * cdiv(n, bn)
    _matmul_tma_kernel[(min(num_sms, tiles),)](
        a_desc, b_desc, c, bias if bias is not None else c,
        m, n, k, c.stride(0), c.stride(1),
        HAS_BIAS=bias is not None, ACCUMULATE=accumulate, A_COLS=a_cols, B_COLS=b_cols,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK_K, GROUP_M=GROUP_M, SPLIT_TILES=SPLIT_TILES, NUM_SMS=num_sms,
        WARP_SPECIALIZE=ws, INPUT_PRECISION=input_precision(a.dtype),
        num_warps=warps, num_stages=stages,
    )  # fmt: skip


def _split_counts(device: torch.device, tiles: int, fused_combine: bool | None) -> torch.Tensor | None:
    """The tile counts of a split launch's fused combine, or None (the combine kernel folds the partials);
    ``fused_combine=True`` where no counter slot takes the launch raises ``RuntimeError``."""
    if fused_combine is False:
        return None
    counts = _tile_counters(device, tiles)
    if counts is None and fused_combine:
        raise RuntimeError(
            f"matmul: fused_combine=True, but {tiles} output tiles need a counter slot of this stream "
            f"(at most {COMBINE_SLOT_TILES} tiles, {COMBINE_SLOTS} streams per device, not first made in capture)"
        )
    return counts


def _combine_partials(part, c, bias, num_splits: int, accumulate: bool) -> None:
    """``_combine_kernel`` over a split launch's fp32 partials ``part [num_splits, M, N]`` into ``c``."""
    m, n = c.shape
    _combine_kernel[(cdiv(m * n, 1024),)](
        part, c, bias if bias is not None else c, m, n, num_splits, c.stride(0), c.stride(1),
        HAS_BIAS=bias is not None, ACCUMULATE=accumulate, BLOCK=1024, num_warps=4,
    )  # fmt: skip


def _launch_tma_split(a, b_t, c, bias, cfg, num_splits: int, accumulate: bool, fused_combine: bool | None) -> None:
    """``_matmul_tma_split_kernel`` over row-major ``a`` / ``b_t``: a program per output tile and K split, then the
    fused combine (or ``_combine_kernel`` where no counter slot takes the launch, or ``fused_combine=False``)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, warps, stages, _ = cfg
    m, n, k = a.shape[0], b_t.shape[0], a.shape[1]
    tiles = cdiv(m, bm) * cdiv(n, bn)
    counts = _split_counts(a.device, tiles, fused_combine)
    part = torch.empty(num_splits, m, n, dtype=torch.float32, device=a.device)
    _matmul_tma_split_kernel[(tiles, num_splits)](
        TensorDescriptor.from_tensor(a, [bm, BLOCK_K]), TensorDescriptor.from_tensor(b_t, [bn, BLOCK_K]),
        c, bias if bias is not None else c, part, counts if counts is not None else c,
        m, n, k, c.stride(0), c.stride(1),
        HAS_BIAS=bias is not None, COMBINE=counts is not None, ACCUMULATE=accumulate,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK_K, GROUP_M=GROUP_M, SPLIT_TILES=SPLIT_TILES,
        INPUT_PRECISION=input_precision(a.dtype), num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if counts is None:
        _combine_partials(part, c, bias, num_splits, accumulate)


def input_precision(dtype: torch.dtype) -> str:
    """The ``tl.dot`` input precision for operands of ``dtype``: for fp32 the one in force
    (``vexact_kernels.get_fp32_matmul_precision()``, default ``ieee``); for 16-bit operands Triton's default ``tf32``,
    which does not apply to them (they always run on the tensor cores at full precision), so their kernels are the
    ones compiled before the choice existed."""
    from .._backend import get_fp32_matmul_precision

    return get_fp32_matmul_precision() if dtype == torch.float32 else "tf32"


# Fused combine (speed only: the bits are those of the combine kernel): per output tile, an int32 count of the split
# programs done, which the last one resets to 0. Each device gets one buffer, zeroed once and never freed (CUDA graphs
# keep its address), of COMBINE_SLOTS slots of COMBINE_SLOT_TILES counts; each stream gets a slot on its first fused
# launch, so matmuls running at once on different streams never share a count. A launch with more output tiles, a
# stream without a slot, or a first launch on a device during graph capture runs the two-launch combine instead.
# A graph's launches use the slot of the stream it was captured on: two replays of graphs captured on one stream must
# not overlap (the engine's decode graphs share a memory pool too, and never run together).
COMBINE_SLOT_TILES = 4096
COMBINE_SLOTS = 64
_counter_buffers: dict[torch.device, torch.Tensor] = {}
_counter_slots: dict[tuple[torch.device, int], torch.Tensor | None] = {}
_counter_lock = threading.Lock()


def _tile_counters(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The current stream's zeroed counts for a fused-combine launch of ``tiles`` output tiles, or None."""
    if tiles > COMBINE_SLOT_TILES:
        return None
    stream = torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else 0
    key = (device, stream)
    slot = _counter_slots.get(key)
    if slot is not None or key in _counter_slots:
        return slot
    with _counter_lock:
        buf = _counter_buffers.get(device)
        if buf is None:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return None  # zeroing it would be a node of the graph; the next eager launch creates it
            buf = torch.zeros(COMBINE_SLOTS * COMBINE_SLOT_TILES, dtype=torch.int32, device=device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # zero before any stream's first launch reads it
            _counter_buffers[device] = buf
        used = sum(1 for d, _ in _counter_slots if d == device)
        slot = buf[used * COMBINE_SLOT_TILES : (used + 1) * COMBINE_SLOT_TILES] if used < COMBINE_SLOTS else None
        _counter_slots[key] = slot
        return slot


def pick_config(m: int, n: int, interpret: bool = False) -> int:
    """Index into CONFIGS for the pointer kernel."""
    if interpret or m <= 32:
        return 0
    if m <= 256:
        return 1
    return 2


def matmul(
    a: torch.Tensor,
    b_t: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: tuple | None = None,
    split_programs: bool | None = None,
    accumulate_into: torch.Tensor | None = None,
    fused_combine: bool | None = None,
) -> torch.Tensor:
    """``a [M, K] @ b_t[N, K].T (+ bias [N])`` -> ``[M, N]``; any strides.

    ``config`` overrides the tile choice: 4 values for the pointer kernel, 5 for the persistent TMA kernel (fp32
    operands: the pointer kernel with ``FP32_CONFIGS`` unless ``config`` says otherwise); 5 values with
    ``split_programs=True`` and row-major operands: ``_matmul_tma_split_kernel`` (a program per tile and K split,
    read through TMA; no default pick takes it yet: ``scripts/tuning/tune_kernels.py --parts mid`` times it).
    ``split_programs`` overrides whether K splits run as separate programs plus a combine (default: when the output
    has few tiles). ``fused_combine`` (split programs only): whether the last split program of each tile adds the
    partials (one launch) or a combine kernel does (two launches); default: fused where a counter slot is free (see
    ``COMBINE_SLOT_TILES``); True raises ``RuntimeError`` where it cannot be. None of them changes a single bit of the
    result.
    ``accumulate_into``: an fp32 ``[M, N]`` tensor (any strides) that gets ``+= result`` in place and is returned.
    """
    from . import interpreting

    if a.dim() != 2 or b_t.dim() != 2 or a.shape[1] != b_t.shape[1]:
        raise ValueError(f"matmul: expected a [M, K] and b_t [N, K]; got {tuple(a.shape)} and {tuple(b_t.shape)}")
    if a.dtype != b_t.dtype:
        raise TypeError(f"matmul: a is {a.dtype} but b_t is {b_t.dtype}; cast the weight first")
    m, k = a.shape
    n = b_t.shape[0]
    acc_in = accumulate_into is not None
    if config is None and split_programs is None and fused_combine is None and not acc_in:
        kw = _picked_form(a, b_t, m, n, k)
        if kw is not None:
            return matmul(a, b_t, bias, out_dtype, **kw)
    if acc_in:
        if accumulate_into.dtype != torch.float32 or tuple(accumulate_into.shape) != (m, n):
            raise ValueError(
                f"matmul: accumulate_into must be fp32 [{m}, {n}]; got {accumulate_into.dtype} "
                f"{tuple(accumulate_into.shape)}"
            )
        c = accumulate_into
    else:
        c = torch.empty(m, n, dtype=out_dtype or a.dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    if k == 0:
        if acc_in:
            return c if bias is None else c.add_(bias.float().expand(m, n))
        return c.zero_() if bias is None else c.copy_(bias.expand(m, n))
    num_splits = cdiv(cdiv(k, BLOCK_K), SPLIT_TILES)
    fp32 = a.dtype == torch.float32
    want_tma = (
        config is None and m >= TMA_MIN_M and split_programs is not True or config is not None and len(config) == 5
    )
    tma_split = (
        split_programs is True and config is not None and len(config) == 5 and num_splits > 1 and _tma_ok(a, b_t)
        and _tma_layout(a) == _tma_layout(b_t) == "rows"
    )  # fmt: skip
    if tma_split:
        _launch_tma_split(a, b_t, c, bias, config, num_splits, acc_in, fused_combine)
        return c
    if want_tma and _tma_ok(a, b_t) and (config is not None or not fp32) and split_programs is not True:
        if config is None:
            sms = _num_sms(a.device)
            config = TMA_CONFIG_FP32_OUT if c.element_size() == 4 else tma_config(m, n, sms)
        _launch_tma(a, b_t, c, bias, config, accumulate=acc_in)
        return c
    idx = pick_config(m, n, interpreting())
    max_tiles = SPLIT_PROGRAMS_MAX_TILES[idx]
    if config is not None:
        bm, bn, warps, stages = config[:4]
    elif interpreting():
        bm, bn, warps, stages = INTERPRET_CONFIG
    elif fp32:
        bm, bn, warps, stages, max_tiles = FP32_CONFIGS[0 if m <= 32 else 1]
    else:
        bm, bn, warps, stages = CONFIGS[idx]
    tiles = cdiv(m, bm) * cdiv(n, bn)
    if split_programs is None:
        split_programs = num_splits > 1 and tiles <= max_tiles
    split_programs = split_programs and num_splits > 1
    counts = _split_counts(a.device, tiles, fused_combine) if split_programs else None
    part = torch.empty(num_splits, m, n, dtype=torch.float32, device=a.device) if split_programs else c
    _matmul_kernel[(tiles, num_splits if split_programs else 1)](
        a, b_t, c, bias if bias is not None else c, part, counts if counts is not None else c,
        m, n, k,
        a.stride(0), a.stride(1), b_t.stride(0), b_t.stride(1), c.stride(0), c.stride(1),
        HAS_BIAS=bias is not None, INTERPRET=interpreting(), SPLIT_OUT=split_programs, COMBINE=counts is not None,
        ACCUMULATE=acc_in,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK_K, GROUP_M=GROUP_M, SPLIT_TILES=SPLIT_TILES,
        INPUT_PRECISION=input_precision(a.dtype),
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if split_programs and counts is None:
        _combine_partials(part, c, bias, num_splits, acc_in)
    return c


# Forms picked per shape on the running GPU (``matmul_tuning.py``; speed only). While a picks dict is active
# (``matmul_tuning.linear_picks``), a call that leaves the form to the default (no ``config``, ``split_programs``,
# ``fused_combine`` or ``accumulate_into``) with 16-bit row-major operands TMA can read, whose
# ``(M, N, K, dtype)`` has a pick, runs that form; every other call takes the default pick above. While a recorder is
# active (``matmul_tuning.record_linears``), the same calls at ``M >= TUNE_MIN_M`` (or the recorder's own least M)
# are noted with their weight.
TUNE_MIN_M = 128  # by default, below it the pointer kernel's small-M picks stand (CONFIGS, SPLIT_PROGRAMS_MAX_TILES)
_active_picks: contextvars.ContextVar[dict | None] = contextvars.ContextVar("vexact_matmul_picks", default=None)
# the recorder: (the list the calls go to, the least M noted)
_recorder: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("vexact_matmul_recorder", default=None)


def _picked_form(a: torch.Tensor, b_t: torch.Tensor, m: int, n: int, k: int) -> dict | None:
    """The picked form's ``matmul`` keywords for this call, or None (the default pick); notes the call while a
    recorder is active."""
    picks, rec = _active_picks.get(), _recorder.get()
    if picks is None and rec is None:
        return None
    if a.dtype not in (torch.bfloat16, torch.float16) or not _tma_ok(a, b_t):
        return None
    if _tma_layout(a) != "rows" or _tma_layout(b_t) != "rows":
        return None
    if rec is not None and m >= rec[1]:
        rec[0].append((m, n, k, a.dtype, b_t))
    return None if picks is None else picks.get((m, n, k, a.dtype))


class LinearFunction(torch.autograd.Function):
    """``y = x @ w.T + b`` with invariant forward and deterministic backward."""

    @staticmethod
    def forward(ctx, x2d, weight, bias, out_dtype):
        ctx.save_for_backward(x2d, weight)
        ctx.has_bias = bias is not None
        return matmul(x2d, weight, bias, out_dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x2d, weight = ctx.saved_tensors
        g = grad_out.to(x2d.dtype)
        dx = matmul(g, weight.t(), out_dtype=x2d.dtype) if ctx.needs_input_grad[0] else None  # [M,N] @ [N,K]
        # dW rounded once from its fp32 total, in the kernel's epilogue (round to nearest even, as ``.to`` does)
        dw = matmul(g.t(), x2d.t(), out_dtype=weight.dtype) if ctx.needs_input_grad[1] else None
        db = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            ones = torch.ones(1, g.shape[0], dtype=g.dtype, device=g.device)
            db = matmul(ones, g.t(), out_dtype=torch.float32)[0]
        return dx, dw, db, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1])
    if torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        y = LinearFunction.apply(x2d, weight, bias, out_dtype)
    else:
        y = matmul(x2d, weight, bias, out_dtype)
    return y.reshape(*lead, weight.shape[0])
