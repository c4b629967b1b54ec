"""Causal attention over packed sequences (training, prefill) and over a paged KV cache (chunked prefill, decode).

Invariance, the central rule of VeXact: a query at position ``p`` walks its keys ``0..p`` in blocks of
``ATTN_BLOCK_N`` absolute positions, in position order, with the same online-softmax update (running max, rescale,
sum), whether it is computed in a packed training batch, in any chunk of a chunked prefill, or in a decode step
reading a paged cache, whatever the page size, the other sequences, or the number of queries in the launch. The
packed and paged entry points differ only in how a key position is turned into a row of K/V storage; both then call
the same ``_attend``. The CPU reference makes one pass over the keys per query; the GPU kernels fold fixed
absolute-position key splits in order (``triton_ops/attention.py``), in every path alike.

On the ``invariant`` backend CUDA tensors go to one of two implementations, chosen once per process
(``$VEXACT_ATTENTION`` or :func:`vexact_kernels.set_attention_impl`; default ``auto``: ``fa4`` on Hopper/Blackwell
where flash_attn.cute imports, else ``triton``): ``triton``, the Triton kernel family in ``triton_ops/attention.py``
(forward) and ``attention_bwd.py`` (the same rule, with its own fixed tile of 64 positions), or ``fa4``,
FlashAttention 4 on Hopper/Blackwell (``fa4_attention.py``: the same rule with FA4's tiles; K and V head sizes that
differ, as in MLA, stay on Triton). GPU results are invariant among themselves within one implementation, not
equal to the CPU reference's nor to the other implementation's. The CPU code below is the exact reference (whatever
the implementation choice) and its numerics are pinned by a golden fixture.

Sliding window and sinks (gpt-oss; both optional, off by default, which leaves every result as without them): with
``window=W`` a query at position ``p`` sees keys ``p - W < pos <= p``; it walks the same ``ATTN_BLOCK_N`` blocks as
without a window, and a block wholly before its window is skipped, a decision made from ``p`` alone, so the packed,
chunked-prefill and paged-decode paths skip the same blocks. ``sinks [Hq]`` adds one logit per head to every softmax's
denominator, folded in at one fixed place: before the first key block (the running max starts at the sink, the sum
at 1). The CPU reference and the Triton kernels take both (the GPU's split structure in ``triton_ops/attention.py``);
FA4 is not given them (its window and sink rules are its own), so on the invariant backend a layer with a window or
sinks runs on Triton under ``fa4`` too, in every path alike (the choice depends on the layer's arguments alone). The
``fast`` backend runs them as transformers' eager attention does.

Scores and the softmax statistics are fp32; the output is cast once to q's dtype. The ``fast`` backend is
``torch.nn.functional.scaled_dot_product_attention`` (per sequence, causal with GQA and no mask where a sequence
comes whole, so torch picks its fastest kernel; except the decode rows of a paged step: one masked call over their
gathered pages), measured not batch-invariant on CPU fp32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import portable_math as pm
from ._backend import attention_impl_in_use, check_float, get_backend, invariant_device_check
from ._reduce import tree_sum
from .triton_ops import use_triton

ATTN_BLOCK_N = 16
# Queries per step of the CPU reference; bounds the [q, heads, BLOCK_N, head_dim] buffers. Does not affect numerics.
_QUERY_BUDGET = 1 << 22


def _check_qkv(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    check_float(op, "q", q)
    if q.dim() != 3 or k.dim() < 3 or v.dim() < 3:
        raise ValueError(f"{op}: expected q [tokens, heads, head_dim]; got q {tuple(q.shape)}")
    hq, hk = q.shape[1], k.shape[-2]
    if hq % hk:
        raise ValueError(f"{op}: {hq} query heads is not a multiple of {hk} KV heads")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"{op}: q head_dim {q.shape[-1]} != k head_dim {k.shape[-1]}")
    if k.dtype != v.dtype:
        raise TypeError(f"{op}: k dtype {k.dtype} != v dtype {v.dtype}")


def _check_window_sinks(op: str, q: torch.Tensor, window, sinks) -> None:
    """``window``: None or an int >= 1; ``sinks``: None or a float tensor [Hq] on q's device."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"{op}: window must be an int >= 1 or None; got {window!r}")
    if sinks is not None:
        check_float(op, "sinks", sinks)
        if tuple(sinks.shape) != (q.shape[1],):
            raise ValueError(f"{op}: sinks must be [Hq={q.shape[1]}] (one per query head); got {tuple(sinks.shape)}")
        if sinks.device != q.device:
            raise ValueError(f"{op}: sinks are on {sinks.device} but q on {q.device}")


def _on_cuda(*tensors: torch.Tensor) -> str | None:
    """The attention implementation for CUDA tensors (fixed for the process once used); None off CUDA."""
    return attention_impl_in_use() if any(t.is_cuda for t in tensors) else None


# FA4 runs heads of at least this size. Its backward at head_dim 16 is wrong (flash-attn-4 4.0.0b36 on an H100: dq max
# error 2.2 against an fp32 reference where the Triton kernel's is 1.0e-2, test_fa4_attention.py; 32 and up agree),
# which made the tiny Qwen3-MoE's world-size-2 step-0 grad norm 6.5% off world size 1 on 2x H200.
FA4_MIN_HEAD_DIM = 32


def fa4_takes(head_dim: int, head_dim_v: int) -> bool:
    """Whether attention of these head sizes runs on FA4 under ``fa4`` (else on the Triton kernels): K and V head
    sizes that agree (FA4's SM90 paged kernel refuses others, "Paged KV does not support irregular head dim",
    flash-attn-4 4.0.0b36; so MLA, qk 192 / v 128, stays on Triton) and of at least ``FA4_MIN_HEAD_DIM``. The decision
    depends on the shapes only, so every driver (packed and paged, trainer and engine) makes the same one and
    engine == trainer holds."""
    return head_dim == head_dim_v and head_dim >= FA4_MIN_HEAD_DIM


def _fa4_takes(q: torch.Tensor, v: torch.Tensor) -> bool:
    return fa4_takes(q.shape[-1], v.shape[-1])


def _attend(q, k_store, v_store, key_rows, last_pos, scale: float, window=None, sinks=None) -> torch.Tensor:
    """Core of both paths.

    q [T, Hq, D]; k_store/v_store [S, Hkv, Dk]/[S, Hkv, Dv]; ``key_rows(pos [T, BN]) -> [T, BN]`` maps absolute key
    positions of each query to storage rows; ``last_pos [T]`` is the query's own position (causal bound).
    ``window``: keys at positions ``> last_pos - window`` only; a key block wholly below that is skipped (the
    running statistics pass through it untouched), which depends on the query's position alone. ``sinks [Hq]``:
    each head's sink logit, folded in before the first key block (running max = sink, sum = 1, accumulator 0), so
    it joins the softmax's denominator and adds nothing to its numerator.
    """
    t_total, hq, d = q.shape
    hkv = k_store.shape[1]
    g = hq // hkv
    dv = v_store.shape[-1]
    out = torch.empty(t_total, hq, dv, dtype=torch.float32)
    step = max(1, _QUERY_BUDGET // max(1, hq * ATTN_BLOCK_N * max(d, dv)))
    offs = torch.arange(ATTN_BLOCK_N)
    for t0 in range(0, t_total, step):
        t1 = min(t_total, t0 + step)
        qf = q[t0:t1].float().view(t1 - t0, hkv, g, 1, d)
        lp = last_pos[t0:t1]
        n = t1 - t0
        if sinks is None:
            m = torch.full((n, hkv, g), -math.inf)
            l_sum = torch.zeros(n, hkv, g)
        else:
            m = sinks.float().view(1, hkv, g).expand(n, hkv, g)
            l_sum = torch.ones(n, hkv, g)
        acc = torch.zeros(n, hkv, g, dv)
        # first key position each query sees (0 without a window); blocks before every query's first are not visited
        first = torch.zeros_like(lp) if window is None else (lp - window + 1).clamp(min=0)
        for blk in range(int(first.min()) // ATTN_BLOCK_N, int(lp.max()) // ATTN_BLOCK_N + 1):
            pos = blk * ATTN_BLOCK_N + offs  # [BN]
            valid = pos[None, :] <= lp[:, None]  # [n, BN]
            key_pos = pos.expand(n, -1).clamp(max=lp[:, None])
            if window is not None:  # no key outside the window is read (a cache may hold nothing there)
                valid = valid & (pos[None, :] >= first[:, None])
                key_pos = torch.maximum(key_pos, first[:, None])
            rows = key_rows(t0, t1, key_pos)  # [n, BN]
            kb = k_store[rows].float().permute(0, 2, 1, 3)  # [n, Hkv, BN, D]
            vb = v_store[rows].float().permute(0, 2, 1, 3)
            vmask = valid[:, None, :, None]
            kb = torch.where(vmask, kb, 0.0)
            vb = torch.where(vmask, vb, 0.0)
            s = tree_sum(qf * kb[:, :, None], dim=-1) * scale  # [n, Hkv, G, BN]
            s = torch.where(valid[:, None, None, :], s, -math.inf)
            m_new = torch.maximum(m, s.amax(dim=-1))
            alpha = pm.exp(m - m_new)
            p = pm.exp(s - m_new.unsqueeze(-1))  # masked keys: exp(-inf) = 0
            l_new = l_sum * alpha + tree_sum(p, dim=-1)
            pv = tree_sum(p.unsqueeze(-1) * vb[:, :, None], dim=-2)  # [n, Hkv, G, Dv]
            acc_new = acc * alpha.unsqueeze(-1) + pv
            active = blk * ATTN_BLOCK_N <= lp
            if window is not None:  # a block wholly before the window is skipped, in every path alike
                active = active & ((blk + 1) * ATTN_BLOCK_N > first)
            active = active[:, None, None]
            m = torch.where(active, m_new, m)
            l_sum = torch.where(active, l_new, l_sum)
            acc = torch.where(active.unsqueeze(-1), acc_new, acc)
        out[t0:t1] = (acc / l_sum.unsqueeze(-1)).view(n, hq, dv)
    return out


def _seq_index(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    return torch.repeat_interleave(torch.arange(lens.numel()), lens, output_size=total)


def _check_cu(op: str, cu: torch.Tensor, total: int, name: str = "cu_seqlens") -> None:
    if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != total:
        raise ValueError(f"{op}: {name} must run from 0 to {total} (tokens in the batch); got {cu.tolist()}")
    if bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"{op}: {name} must be non-decreasing; got {cu.tolist()}")


def attention_packed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
    *,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention within each sequence of a packed batch.

    q [T, Hq, D], k/v [T, Hkv, D], ``cu_seqlens [B+1]`` (int) marks sequence boundaries. Returns [T, Hq, Dv].
    ``window``: a query at position p attends to keys at positions ``> p - window`` only (None: every earlier key).
    ``sinks [Hq]``: a learned logit per head that joins each softmax's denominator (gpt-oss). Both default to off,
    which leaves every result as without them.
    """
    _check_qkv("attention_packed", q, k, v)
    _check_window_sinks("attention_packed", q, window, sinks)
    plain = window is None and sinks is None  # FA4 is given neither: such a layer runs on Triton
    if get_backend("attention") == "invariant" and _on_cuda(q, k, v) == "fa4" and _fa4_takes(q, v) and plain:
        from . import fa4_attention

        return fa4_attention.attention_packed(q, k, v, cu_seqlens, scale)
    if get_backend("attention") == "invariant" and use_triton(q, k, v):
        from .triton_ops import attention_bwd as tri

        if plain:
            return tri.attention_packed(q, k, v, cu_seqlens, scale)
        return tri.attention_packed(q, k, v, cu_seqlens, scale, window, sinks)
    total = q.shape[0]
    cu_seqlens = cu_seqlens.to(torch.int64).cpu()
    _check_cu("attention_packed", cu_seqlens, total)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if get_backend("attention") == "fast":
        outs = []
        for b in range(cu_seqlens.numel() - 1):
            s, e = int(cu_seqlens[b]), int(cu_seqlens[b + 1])
            if window is not None or sinks is not None:
                outs.append(_eager(q[s:e], k[s:e], v[s:e], 0, scale, window, sinks))
                continue
            outs.append(_sdpa(q[s:e], k[s:e], v[s:e], causal_offset=0, scale=scale))
        return torch.cat(outs, 0).to(q.dtype) if outs else q.new_empty(0, q.shape[1], v.shape[-1])
    invariant_device_check("attention_packed", q, k, v)
    seq = _seq_index(cu_seqlens, total)
    start = cu_seqlens[:-1][seq]
    last_pos = torch.arange(total) - start

    def key_rows(t0, t1, pos):
        return start[t0:t1, None] + pos

    return _attend(q, k, v, key_rows, last_pos, scale, window, sinks).to(q.dtype)


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store new keys/values: token ``i`` goes to flat slot ``slot_mapping[i]`` (= block * page_size + offset).

    Caches are ``[num_blocks, page_size, Hkv, D]``; slots < 0 are skipped (padding rows).
    """
    if k_cache.dtype != k.dtype:
        raise TypeError(f"write_kv_cache: cache dtype {k_cache.dtype} != key dtype {k.dtype}")
    if get_backend("attention") == "invariant" and use_triton(k, v, k_cache, v_cache):
        from .triton_ops import attention as tri

        return tri.write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    if k.is_cuda:
        return _write_kv_cache_no_sync(k, v, k_cache, v_cache, slot_mapping)
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0
    n_slots = k_cache.shape[0] * k_cache.shape[1]
    if keep.any() and int(slots[keep].max()) >= n_slots:
        raise IndexError(f"write_kv_cache: slot {int(slots[keep].max())} outside a cache of {n_slots} slots")
    kc = k_cache.view(-1, *k_cache.shape[2:])
    vc = v_cache.view(-1, *v_cache.shape[2:])
    kc.index_copy_(0, slots[keep], k[keep])
    vc.index_copy_(0, slots[keep], v[keep])


def _write_kv_cache_no_sync(k, v, k_cache, v_cache, slot_mapping) -> None:
    """write_kv_cache without a host sync (CUDA ``fast`` backend; capturable in a CUDA graph).

    A pad row (slot < 0) cannot be dropped without a sync on how many remain, so it rewrites the first kept row's
    slot with that row's own values (or, with no kept row, slot 0 with what it already holds): duplicates in
    ``index_copy_`` then carry identical values, so the result does not depend on which write lands last.
    """
    slots = slot_mapping.to(device=k.device, dtype=torch.int64)
    keep = slots >= 0
    # index_select, not x[t] with a 0-dim tensor t, which would read t on the host
    first = torch.argmax(keep.to(torch.int32)).view(1)  # first kept row (0 if none)
    any_keep = keep.index_select(0, first)  # [1]
    target = torch.where(keep, slots, torch.where(any_keep, slots.index_select(0, first), 0))
    for new, cache in ((k, k_cache), (v, v_cache)):
        flat = cache.view(-1, *cache.shape[2:])
        fill = torch.where(any_keep[:, None, None], new.index_select(0, first), flat[:1])  # [1, H, D]
        flat.index_copy_(0, target, torch.where(keep[:, None, None], new, fill))


def _fast_decode(q, k_cache, v_cache, tables, ctx, scale: float) -> torch.Tensor:
    """``fast`` backend, one query per sequence: one SDPA call for the whole batch, no host sync (capturable).

    Each sequence's K/V rows are gathered through its block table, padded to the table's width (the engine makes
    it the batch's longest context, or ``max_model_len`` in a CUDA graph) and masked to its context; GQA folds the
    query heads of a KV head into the query length.
    """
    nseq, hq, d = q.shape
    width = tables.shape[1]
    page, hkv, dv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[-1]
    g, length, dev = hq // hkv, width * page, q.device
    rows = (tables[:, :, None] * page + torch.arange(page, device=dev)).view(nseq, length)  # [B, L] storage rows
    kk = k_cache.view(-1, hkv, d)[rows].permute(0, 2, 1, 3)  # [B, Hkv, L, D]
    vv = v_cache.view(-1, hkv, dv)[rows].permute(0, 2, 1, 3)
    qg = q.reshape(nseq, hkv, g, d)  # [B, Hkv, G, D]: the G query heads of a KV head as G queries
    mask = (torch.arange(length, device=dev) < ctx[:, None])[:, None, None, :]  # [B, 1, 1, L]
    o = F.scaled_dot_product_attention(qg, kk, vv, attn_mask=mask, scale=scale)  # [B, Hkv, G, Dv]
    return o.reshape(nseq, hq, dv).to(q.dtype)


def _fast_paged(q, k_cache, v_cache, tables, ctx, cu, scale: float) -> torch.Tensor:
    """``fast`` backend paged attention for a step of prompt chunks and decode rows: the one-query sequences (decode)
    in one batched call, each longer chunk (prefill) in its own causal SDPA call over its gathered keys. Reads the
    layout on the host."""
    n_q = (cu[1:] - cu[:-1]).tolist()
    ctx_host = ctx.tolist()
    starts = cu[:-1].tolist()
    page, dev = k_cache.shape[1], q.device
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
    dec = [b for b, n in enumerate(n_q) if n == 1]
    if dec:
        sel = torch.tensor(dec, device=dev)
        rows = torch.tensor([starts[b] for b in dec], device=dev)
        out[rows] = _fast_decode(q[rows], k_cache, v_cache, tables[sel], ctx[sel], scale)
    kflat, vflat = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
    for b, n in enumerate(n_q):
        if n > 1:
            pos = torch.arange(ctx_host[b], device=dev)
            rows = tables[b, pos // page] * page + pos % page
            s = starts[b]
            out[s : s + n] = _sdpa(q[s : s + n], kflat[rows], vflat[rows], ctx_host[b] - n, scale).to(q.dtype)
    return out


def _paged_on_fa4(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return get_backend("attention") == "invariant" and _on_cuda(q, k_cache, v_cache) == "fa4" and _fa4_takes(q, v_cache)


def _paged_on_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    if get_backend("attention") != "invariant" or _paged_on_fa4(q, k_cache, v_cache):
        return False
    return use_triton(q, k_cache, v_cache)


def paged_attention_layout(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
):
    """What :func:`attention_paged` derives from a step's layout before its launch (Triton: int32 tables and the tile
    table; FA4: int32 page table, context lengths and query offsets), for the same arguments: build it once per step
    and pass it as ``layout=`` to every layer's call, which then runs none of that work (on a CUDA decode step: some
    twenty small kernels per layer on Triton, three on FA4). Same values either way, so the same bits. None where the
    path in force derives nothing up front (CPU, ``fast``); pass that on as well."""
    if _paged_on_fa4(q, k_cache, v_cache):
        from . import fa4_attention

        return fa4_attention.paged_layout(block_tables, context_lens, cu_seqlens_q, q.device)
    if not _paged_on_triton(q, k_cache, v_cache):
        return None
    from .triton_ops import attention as tri

    hq, hkv = q.shape[1], k_cache.shape[-2]
    return tri.paged_layout(block_tables, context_lens, cu_seqlens_q, k_cache.shape[1], q.shape[0], hq, hkv, q.device)


def attention_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float | None = None,
    layout=None,
    *,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """New queries of B sequences against their paged KV (which already holds the new tokens' K/V).

    q [T, Hq, D]; caches [num_blocks, page_size, Hkv, D]; ``block_tables [B, max_pages]`` (page ids);
    ``context_lens [B]`` = KV length of each sequence including its new tokens; ``cu_seqlens_q [B+1]`` splits q.
    Query ``i`` of sequence ``b`` sits at position ``context_lens[b] - n_q[b] + i``. ``layout``: what
    :func:`paged_attention_layout` returned for these arguments (built once per step; default: derived here).
    ``window`` and ``sinks``: as :func:`attention_packed` (the same key blocks, skipped alike); the CPU reference
    reads no page wholly before a query's window.
    """
    _check_qkv("attention_paged", q, k_cache, v_cache)
    _check_window_sinks("attention_paged", q, window, sinks)
    plain = window is None and sinks is None  # FA4 is given neither: such a layer runs on Triton
    if plain and _paged_on_fa4(q, k_cache, v_cache):
        from . import fa4_attention

        return fa4_attention.attention_paged(
            q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, scale, layout
        )
    if get_backend("attention") == "invariant" and use_triton(q, k_cache, v_cache):
        from .triton_ops import attention as tri

        if plain:
            return tri.attention_paged(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, scale, layout)
        if not isinstance(layout, tri.PagedLayout):  # the step's layout was built for FA4: Triton builds its own
            layout = None
        return tri.attention_paged(
            q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, scale, layout, window, sinks
        )
    total = q.shape[0]
    if get_backend("attention") == "fast" and q.is_cuda:
        # No validation here: it would sync with the host every layer. Every sequence brings >= 1 query (as the
        # engine's steps do), so one query per sequence is a decode batch.
        dev = q.device
        cu = cu_seqlens_q.to(device=dev, dtype=torch.int64)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        tables = block_tables.to(device=dev, dtype=torch.int64)
        ctx = context_lens.to(device=dev, dtype=torch.int64)
        if window is not None or sinks is not None:
            return _eager_paged(q, k_cache, v_cache, tables, ctx, cu, scale, window, sinks)
        if total == cu.numel() - 1:
            return _fast_decode(q, k_cache, v_cache, tables, ctx, scale)
        return _fast_paged(q, k_cache, v_cache, tables, ctx, cu, scale)
    cu = cu_seqlens_q.to(torch.int64).cpu()
    _check_cu("attention_paged", cu, total, "cu_seqlens_q")
    ctx = context_lens.to(torch.int64).cpu()
    n_q = cu[1:] - cu[:-1]
    if ctx.numel() != n_q.numel() or bool((ctx < n_q).any()):
        raise ValueError(f"attention_paged: context_lens {ctx.tolist()} must cover the queries {n_q.tolist()}")
    page = k_cache.shape[1]
    tables = block_tables.to(torch.int64).cpu()
    if ctx.numel() and int(ctx.max()) > tables.shape[1] * page:
        raise ValueError(
            f"attention_paged: context {int(ctx.max())} exceeds block table capacity {tables.shape[1] * page}"
        )
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    seq = _seq_index(cu, total)
    last_pos = ctx[seq] - n_q[seq] + (torch.arange(total) - cu[:-1][seq])
    if get_backend("attention") == "fast":
        if total == 0:
            return q.new_empty(0, q.shape[1], v_cache.shape[-1])
        if window is not None or sinks is not None:
            return _eager_paged(q, k_cache, v_cache, tables, ctx, cu, scale, window, sinks)
        return _fast_paged(q, k_cache, v_cache, tables, ctx, cu, scale)
    invariant_device_check("attention_paged", q, k_cache, v_cache)
    seq_tables = tables[seq]  # [T, max_pages]
    kflat = k_cache.view(-1, *k_cache.shape[2:])
    vflat = v_cache.view(-1, *v_cache.shape[2:])

    def key_rows(t0, t1, pos):
        return torch.gather(seq_tables[t0:t1], 1, pos // page) * page + pos % page

    return _attend(q, kflat, vflat, key_rows, last_pos, scale, window, sinks).to(q.dtype)


def _sdpa(q, k, v, causal_offset: int, scale: float) -> torch.Tensor:
    """Plain SDPA for one sequence; queries sit at positions causal_offset.. of the keys.

    A whole sequence (training, a prefill without cached keys) goes in as torch's own causal attention with GQA,
    no mask and no repeated K/V, so torch may pick its fastest kernel (flash on a GPU, the one backend that takes
    GQA): the ``fast`` backend is what a plain PyTorch trainer gets. On CUDA the call is 4-D (a batch of one): torch's
    fused backends take only 4-D inputs, and a 3-D call runs the math backend (fp32 score matrices, seen in an H100
    profile of the trainer). Queries over a cached prefix need the bottom-right mask."""
    hq, hk = q.shape[1], k.shape[1]
    if causal_offset == 0 and q.shape[0] == k.shape[0] and hq % hk == 0:
        qt, kt, vt = (t.transpose(0, 1) for t in (q, k, v))
        if q.is_cuda:
            qt, kt, vt = qt[None], kt[None], vt[None]
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=hq != hk)
        return (o[0] if q.is_cuda else o).transpose(0, 1)
    if hq != hk:
        k = k.repeat_interleave(hq // hk, dim=1)
        v = v.repeat_interleave(hq // hk, dim=1)
    nq, nk = q.shape[0], k.shape[0]
    mask = torch.arange(nk, device=q.device)[None, :] <= (torch.arange(nq, device=q.device)[:, None] + causal_offset)
    qt, kt, vt = (t.transpose(0, 1) for t in (q, k, v))
    if q.is_cuda:  # 4-D, as above: the fused backends that take a mask (memory-efficient, cuDNN)
        qt, kt, vt = qt[None], kt[None], vt[None]
    o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale)
    return (o[0] if q.is_cuda else o).transpose(0, 1)


def _eager(q, k, v, causal_offset: int, scale: float, window, sinks) -> torch.Tensor:
    """``fast`` backend with a window or sinks, as transformers' eager gpt-oss attention runs it (SDPA takes no
    sinks): scores in the input dtype, the sink logit concatenated as a last column, softmax, the sink dropped."""
    hq, hk = q.shape[1], k.shape[1]
    if hq != hk:
        k = k.repeat_interleave(hq // hk, dim=1)
        v = v.repeat_interleave(hq // hk, dim=1)
    nq, nk = q.shape[0], k.shape[0]
    qpos = torch.arange(nq, device=q.device)[:, None] + causal_offset
    kpos = torch.arange(nk, device=q.device)[None, :]
    keep = kpos <= qpos
    if window is not None:
        keep = keep & (kpos > qpos - window)
    scores = torch.matmul(q.transpose(0, 1), k.permute(1, 2, 0)) * scale  # [H, nq, nk]
    scores = scores.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.to(scores.dtype).view(hq, 1, 1).expand(hq, nq, 1)], dim=-1)
    scores = scores - scores.amax(dim=-1, keepdim=True)
    p = F.softmax(scores, dim=-1, dtype=scores.dtype)[..., :nk]
    return torch.matmul(p.to(v.dtype), v.transpose(0, 1)).transpose(0, 1)


def _eager_paged(q, k_cache, v_cache, tables, ctx, cu, scale: float, window, sinks) -> torch.Tensor:
    """``fast`` backend paged attention with a window or sinks: each sequence's keys gathered, then :func:`_eager`."""
    n_q = (cu[1:] - cu[:-1]).tolist()
    ctx_host, starts = ctx.tolist(), cu[:-1].tolist()
    page, dev = k_cache.shape[1], q.device
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
    kflat, vflat = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
    for b, n in enumerate(n_q):
        if n:
            pos = torch.arange(ctx_host[b], device=dev)
            rows = tables[b, pos // page] * page + pos % page
            s = starts[b]
            o = _eager(q[s : s + n], kflat[rows], vflat[rows], ctx_host[b] - n, scale, window, sinks)
            out[s : s + n] = o.to(q.dtype)
    return out
