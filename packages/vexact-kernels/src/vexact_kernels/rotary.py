"""Rotary position embedding (NeoX layout, as Qwen3 uses: the two halves of head_dim are rotated together).

The cos/sin table is built once for all positions by :func:`rope_cos_sin` and indexed by position, so a token's
rotation depends only on its position, never on how many tokens are computed with it. The rotation itself is
elementwise fp32 (no fused multiply-add); on CUDA the ``invariant`` backend runs the Triton kernel of
``triton_ops/rotary.py`` (same arithmetic, FMA contraction off, with a backward). The ``fast`` backend is the
mismatch baseline as transformers runs it: ``x * cos + rotate_half(x) * sin`` with cos/sin cast to x's dtype, each
product and the sum rounded to that dtype (bf16), so it differs from the fp32 rotation in the last bits.
"""

from __future__ import annotations

import torch

from . import portable_math as pm
from ._backend import check_float, get_backend
from ._ranges import tensor_range
from .triton_ops import qk_tile_fits, use_triton


def rope_cos_sin(head_dim: int, max_position: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 tables ``cos, sin`` of shape ``[max_position, head_dim // 2]`` (HF's default rope), built on the CPU with
    :mod:`portable_math` (the same bits on every machine, for the CPU reference and the GPU kernels alike)."""
    if head_dim % 2:
        raise ValueError(f"rotary: head_dim must be even, got {head_dim}")
    inv_freq = 1.0 / pm.pow_of(theta, torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    t = torch.arange(max_position, dtype=torch.int64).float()
    sin, cos = pm.sincos(torch.outer(t, inv_freq))  # outer: one IEEE product per entry
    return cos, sin


def _check_positions(positions: torch.Tensor, cos: torch.Tensor) -> None:
    # read once per positions tensor, not once per layer (_ranges.py); skipped in a CUDA graph capture
    top = tensor_range(positions)
    if top is not None and top[1] >= cos.shape[0]:
        raise ValueError(f"rotary: position {top[1]} >= table size {cos.shape[0]}")


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [tokens, heads, head_dim]`` by ``positions [tokens]``; returns x's dtype."""
    check_float("apply_rotary", "x", x)
    _check_positions(positions, cos)
    if get_backend("rotary") == "invariant" and use_triton(x, positions, cos, sin):
        from .triton_ops.rotary import triton_apply_rotary

        return triton_apply_rotary(x, positions, cos, sin)
    half = x.shape[-1] // 2
    if get_backend("rotary") == "fast":
        c = torch.cat([cos[positions], cos[positions]], dim=-1).unsqueeze(1).to(x.dtype)  # [tokens, 1, head_dim]
        s = torch.cat([sin[positions], sin[positions]], dim=-1).unsqueeze(1).to(x.dtype)
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * c + rotated * s
    c = cos[positions].unsqueeze(1)  # [tokens, 1, half]
    s = sin[positions].unsqueeze(1)
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    o1 = x1 * c - x2 * s
    o2 = x2 * c + x1 * s
    return torch.cat([o1, o2], dim=-1).to(x.dtype)


def apply_rotary_qk(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(apply_rotary(q, ...), apply_rotary(k, ...))``, bitwise; on the ``invariant`` backend's CUDA path both in
    one launch (one kernel fewer per layer)."""
    if get_backend("rotary") == "invariant" and use_triton(q, k, positions, cos, sin):
        from .triton_ops.rotary import triton_apply_rotary_pair

        check_float("apply_rotary", "q", q)
        check_float("apply_rotary", "k", k)
        _check_positions(positions, cos)
        return triton_apply_rotary_pair(q, k, positions, cos, sin)
    return apply_rotary(q, positions, cos, sin), apply_rotary(k, positions, cos, sin)


# On the invariant backend's CUDA path, a layer's q/k norms and the rotation after them in one launch (speed only: the
# same bits as the two launches, held by the GPU test test_gpu_norm_rotary_qk_is_the_two_launches_bitwise; on an H200
# every golden fixture records with the same tensors, and the 1.7B shape's batch-1 decode step takes 2.08-2.10 ms
# against 2.12 with two launches). False: two launches (rms_norm_pair, apply_rotary_qk), for an A/B.
FUSE_NORM_ROTARY = True
# With FUSE_NORM_ROTARY, a paged step's cache write (``kv_write``) in the same launch: each rotated k row and each v row
# stored at its token's slot, as ``write_kv_cache`` stores them (speed only: one launch fewer per layer; the GPU test
# compares the caches with those of the separate write). Off, the write is ``write_kv_cache``'s own launch. On an H200
# (benchmarks/results/throughput-rl-h200.md) the Qwen3-8B shape's batch-1 decode step took 5.474 ms with it against
# 5.511 without; at the rl workload the two were within 0.1% (10,840 against 10,828 tok/s).
FUSE_KV_WRITE = True


def rms_norm_rotary_qk(
    q: torch.Tensor,
    wq: torch.Tensor,
    k: torch.Tensor,
    wk: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_write: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rotary_qk(*rms_norm_pair(q, wq, k, wk, eps), positions, cos, sin)``, bitwise: a Qwen3 attention's q/k
    norms and rotary. ``q [T, Hq, D]``, ``k [T, Hk, D]``. On the ``invariant`` backend's CUDA path, without autograd
    recording, in one launch (``FUSE_NORM_ROTARY``; head sizes ``qk_tile_fits`` takes); otherwise the two ops.
    ``kv_write``: ``(v, k_cache, v_cache,
    slot_mapping)``: then the rotated k and ``v`` are stored in the paged caches as well, as
    ``attention.write_kv_cache(k, v, k_cache, v_cache, slot_mapping)`` stores them (in the same launch with
    ``FUSE_KV_WRITE``)."""
    from .attention import write_kv_cache
    from .rms_norm import _check, rms_norm_pair

    fused = (
        FUSE_NORM_ROTARY
        and get_backend("rms_norm") == "invariant"
        and get_backend("rotary") == "invariant"
        and use_triton(q, wq, k, wk, positions, cos, sin)
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, wq, k, wk)))
        and q.dim() == k.dim() == 3
        and q.shape[-1] == k.shape[-1]
        and q.dtype == k.dtype
        and wq.dtype == wk.dtype
        and q.stride(-1) == k.stride(-1) == 1
        and qk_tile_fits(q)
    )
    in_launch = False  # the cache write in the norm + rotary launch
    if not fused:
        qr, kr = apply_rotary_qk(*rms_norm_pair(q, wq, k, wk, eps), positions, cos, sin)
    else:
        from .triton_ops.rms_norm import qk_norm_rotary_fwd
        from .triton_ops.rotary import _check_args

        _check(q, wq)
        _check(k, wk)
        _check_args(q, positions, cos, sin)
        _check_args(k, positions, cos, sin)
        _check_positions(positions, cos)
        in_launch = kv_write is not None and FUSE_KV_WRITE and _fusable_write(k, *kv_write)
        qr, kr = qk_norm_rotary_fwd(q, wq, k, wk, eps, positions, cos, sin, kv_write if in_launch else None)
    if kv_write is not None and not in_launch:
        write_kv_cache(kr, *kv_write)
    return qr, kr


def _fusable_write(k, v, k_cache, v_cache, slot_mapping) -> bool:
    """Whether the fused launch can store this write as ``write_kv_cache`` would: one dtype for k, v and both caches,
    v ``[T, Hk, D]`` like k with a contiguous last dim, caches ``[blocks, page, Hk, D]`` with contiguous pages, and
    ``slot_mapping`` one slot per token, on the ``invariant`` attention backend. Otherwise ``write_kv_cache`` runs (and
    names what it refuses)."""
    return (
        get_backend("attention") == "invariant"
        and v.shape == k.shape
        and v.stride(-1) == 1
        and k_cache.dtype == v_cache.dtype == v.dtype == k.dtype
        and k_cache.dim() == v_cache.dim() == 4
        and k_cache.shape[2:] == v_cache.shape[2:] == k.shape[1:]
        and all(c.stride(-1) == 1 and c.stride(0) == c.shape[1] * c.stride(1) for c in (k_cache, v_cache))
        and slot_mapping.numel() == k.shape[0]
        and slot_mapping.device == k.device
    )
