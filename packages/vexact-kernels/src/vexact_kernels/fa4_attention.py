"""FlashAttention 4 (flash-attn-4's CuTe-DSL kernels) behind the invariant backend's attention ops, on Hopper and
Blackwell. Selected per process with ``VEXACT_ATTENTION=fa4`` or :func:`vexact_kernels.set_attention_impl`.

Why it is invariant: FA4's forward walks a query's keys in tiles of ``tile_n`` positions, in order, with one
online-softmax update, and its tile shape on a given GPU depends on the head dims and the causal flag only (on SM90,
hd128: 128 x 128), not on the batch, the lengths or the page size. Both drivers call one function,
``flash_attn_varlen_func``, with the same settings (:data:`FA4_SETTINGS`): causal, ``num_splits=1`` (no split-KV;
SM90 refuses a split anyway), ``pack_gqa`` fixed by the head counts alone. The packed path gives it
``cu_seqlens`` for q and k; the paged path gives it the engine's cache as it is (``[num_blocks, page_size, Hkv, D]``
is FA4's paged layout), the block table as ``page_table`` and ``context_lens`` as ``seqused_k``, so query ``i`` of
sequence ``b`` sits at ``context_lens[b] - n_q[b] + i`` (causal attention aligned to the bottom right), as in the
Triton and CPU paths. A probe of ``flash_attn_varlen_func`` itself on an H100 (flash-attn-4 4.0.0b36,
nvidia-cutlass-dsl 4.8.1, GQA 32/8, hd128) measured: a sequence alone == its rows of a packed batch == a chunked
prefill == a paged decode, bitwise, for pages of 16 to 256 tokens; the backward (``deterministic=True``) bitwise run
to run. The bits differ from the Triton kernel's (other tiles, other exp), so trainer and engine must run the same
implementation, and golden fixtures are per implementation.

Checked on an H100 (flash-attn-4 4.0.0b36; ``scripts/checks/gpu_checks.sh h100 fa4-probe fa4-kernels fa4-golden
fa4-contracts fa4-bench``): every check of the probe bitwise (alone == packed == chunked == paged for pages of 16 to
256, CUDA-graph replay == eager, deterministic backward run to run); this package's FA4 GPU tests pass; the contract
suite under ``VEXACT_ATTENTION=fa4`` passes, 121 tests (h100-fa4 golden fixtures recorded for every family). K and V
head sizes that differ (MLA: 192 / 128) stay on the Triton kernels (``attention._fa4_takes``): FA4's SM90 paged
kernel refuses them ("Paged KV does not support irregular head dim"). The default where it is installed (``auto``):
on an H200 its contracts pass and the engine and trainer run faster with it.

Heads under ``attention.FA4_MIN_HEAD_DIM`` (32) run the Triton kernels too: FA4's backward at head_dim
16 is wrong (H100: dq max error 2.2 against an fp32 reference, the Triton kernel's 1.0e-2; 32, 64 and 128 agree); under
FA4 it puts the tiny Qwen3-MoE's world-size-2 step-0 grad norm 6.5% off world size 1 (2x H200). The
families' tiny checkpoints have heads of 16, so their golden fixtures under ``fa4`` are the Triton ones; the tiny
``qwen3_hd64`` (heads of 64) runs FA4 and has golden fixtures of its own (``fixtures/<target>-fa4``). FA4 is also
covered by this package's GPU tests (heads of 32-128) and by the contracts that run real shapes (FSDP: Qwen3-0.6B).

Cache rule of FA4's paged path: rows of a sequence's last page past its context are read (masked, but a NaN there
would poison ``P @ V``), so they must be finite. The engine's caches start as zeros and hold only K/V after that.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

# The settings both drivers pass (besides causal=True and the softmax scale). Changing one changes the numerics.
FA4_SETTINGS = {"num_splits": 1, "deterministic": True}
# Compute capability majors FA4 runs on here: 9 (H100, H200), 10 (B200, GB200, B300).
FA4_CAPABILITY_MAJORS = (9, 10)

_INSTALL_HINT = (
    "install the extra vexact-kernels[fa4] (flash-attn-4 and nvidia-cutlass-dsl[cu13]; on the GPU machine "
    "scripts/staging/fa4_device_wheels.sh), or choose VEXACT_ATTENTION=triton"
)


@functools.cache
def _interface():
    try:
        from flash_attn.cute import interface
    except ImportError as e:
        raise ImportError(f"attention implementation 'fa4' needs flash_attn.cute ({e}); {_INSTALL_HINT}") from e
    return interface


def fa4_importable() -> tuple[bool, str]:
    """Whether flash_attn.cute imports here, and if not, why (for skips and error messages)."""
    try:
        _interface()
    except ImportError as e:
        return False, str(e)
    return True, ""


def check_head_dims(op: str, head_dim: int, head_dim_v: int, capability_major: int) -> None:
    """FA4's head-dim rules for bf16/fp16 (multiples of 8): SM90 8..256; SM100 8..128, or 256/256, or 192/128."""
    aligned = head_dim % 8 == 0 and head_dim_v % 8 == 0
    if capability_major == 9:
        ok = aligned and 8 <= head_dim <= 256 and 8 <= head_dim_v <= 256
        allowed = "multiples of 8 from 8 to 256"
    else:
        ok = aligned and (
            (8 <= head_dim <= 128 and 8 <= head_dim_v <= 128) or (head_dim, head_dim_v) in ((256, 256), (192, 128))
        )
        allowed = "multiples of 8 from 8 to 128, or (256, 256), or (192, 128)"
    if not ok:
        raise ValueError(
            f"{op}: attention implementation 'fa4' does not take head_dim {head_dim} / head_dim_v {head_dim_v} on "
            f"compute capability {capability_major}.x (allowed: {allowed}); use VEXACT_ATTENTION=triton"
        )


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def check_device(op: str, device: torch.device, capability: tuple[int, int] | None = None) -> int:
    """Refuse a device FA4 has no (deterministic) kernels for here; returns the capability major."""
    if device.type != "cuda":
        raise ValueError(f"{op}: attention implementation 'fa4' runs on CUDA tensors; got device {device}")
    major, minor = capability if capability is not None else _capability(device.index or 0)
    if major not in FA4_CAPABILITY_MAJORS:
        raise RuntimeError(
            f"{op}: attention implementation 'fa4' runs on Hopper (9.x) and Blackwell (10.x) GPUs; this device has "
            f"compute capability {major}.{minor}; use VEXACT_ATTENTION=triton"
        )
    return major


def _check(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"{op}: FA4 takes bf16 or fp16 q/k/v of one dtype; got {q.dtype}/{k.dtype}/{v.dtype}")
    major = check_device(op, q.device)
    check_head_dims(op, q.shape[-1], v.shape[-1], major)


def _settings(q: torch.Tensor, k: torch.Tensor, scale: float) -> dict:
    # pack_gqa from the head counts only, identical in both drivers (FA4's own default, made explicit)
    return {**FA4_SETTINGS, "causal": True, "softmax_scale": scale, "pack_gqa": q.shape[-2] > k.shape[-2]}


def attention_packed(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Causal attention within each packed sequence (q [T, Hq, D], k/v [T, Hkv, D], ``cu_seqlens [B+1]``);
    differentiable, with FA4's deterministic backward. No host sync when ``cu_seqlens`` is on the GPU."""
    _check("attention_packed", q, k, v)
    fi = _interface()
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32).contiguous()
    # a host bound is a scheduling hint (free when cu_seqlens is on the host); FA4 derives one otherwise
    max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if not cu_seqlens.is_cuda and cu.numel() > 1 else None
    out, _ = fi.flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len, max_seqlen_k=max_len, **_settings(q, k, scale)
    )
    return out


@dataclass
class PagedLayout:
    """A paged step's layout as FA4 reads it: int32 copies of the step's tensors on the query's device. Built once
    per step by :func:`paged_layout` and passed to every layer's :func:`attention_paged`, so the three casts run once
    per step instead of once per layer (inside a decode graph: 3 kernels instead of 3 per layer). The values are
    those :func:`attention_paged` makes itself without one, so the bits are too."""

    block_tables: torch.Tensor  # the step's tensors it was built from, checked by identity at each use
    context_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    page_table: torch.Tensor  # [B, W] int32, the first B rows of block_tables
    seqused_k: torch.Tensor  # [B] int32
    cu: torch.Tensor  # [B+1] int32


def paged_layout(
    block_tables: torch.Tensor, context_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, device: torch.device
) -> PagedLayout:
    """The int32 tensors :func:`attention_paged` hands FA4 for this step (no host sync, CUDA-graph capturable);
    tensors already int32 and contiguous on ``device`` are used as they are."""
    nseq = cu_seqlens_q.numel() - 1
    if context_lens.numel() != nseq or block_tables.dim() != 2 or block_tables.shape[0] < nseq:
        raise ValueError(
            f"attention_paged: {nseq} sequences (cu_seqlens_q) need context_lens [{nseq}] and block_tables "
            f"[>= {nseq}, pages]; got {tuple(context_lens.shape)} and {tuple(block_tables.shape)}"
        )
    table = block_tables if block_tables.shape[0] == nseq else block_tables[:nseq]
    return PagedLayout(
        block_tables,
        context_lens,
        cu_seqlens_q,
        table.to(device=device, dtype=torch.int32).contiguous(),
        context_lens.to(device=device, dtype=torch.int32).contiguous(),
        cu_seqlens_q.to(device=device, dtype=torch.int32).contiguous(),
    )


def attention_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float | None = None,
    layout: PagedLayout | None = None,
) -> torch.Tensor:
    """New queries over the paged cache (prefill chunks and decode); no host sync, CUDA-graph capturable.

    Caches ``[num_blocks, page_size, Hkv, D]`` (contiguous); ``block_tables [B, W]``; ``context_lens [B]``;
    ``cu_seqlens_q [B+1]``. Every sequence brings >= 1 query (as the engine's steps do): a step with as many queries
    as sequences is then a decode step, and FA4 is told its queries are one per sequence. ``layout``:
    :func:`paged_layout` of these tensors, built once per step (default: built here, in this call).
    """
    _check("attention_paged", q, k_cache, v_cache)
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not c.is_contiguous():
            raise ValueError(f"attention_paged: {name} must be contiguous for 'fa4'; strides {c.stride()}")
    if layout is None:
        layout = paged_layout(block_tables, context_lens, cu_seqlens_q, q.device)
    elif not (
        layout.block_tables is block_tables
        and layout.context_lens is context_lens
        and layout.cu_seqlens_q is cu_seqlens_q
        and layout.cu.device == q.device
    ):
        raise ValueError(
            "attention_paged: layout was built for other tensors (it must come from paged_layout of this call's "
            "block_tables, context_lens and cu_seqlens_q, on q's device)"
        )
    fi = _interface()
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    nseq = layout.cu.numel() - 1
    out, _ = fi.flash_attn_varlen_func(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q=layout.cu,
        seqused_k=layout.seqused_k,
        page_table=layout.page_table,
        max_seqlen_q=1 if q.shape[0] == nseq else None,
        **_settings(q, k_cache, scale),
    )
    return out
