"""The invariant Triton attention: packed == chunked prefill == decode per query token (torch.equal), correctness
against SDPA in fp32, a deterministic backward, the KV-cache write. On CPU through the interpreter at small shapes;
on the GPU at real shapes (``-m gpu``).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vexact_kernels.triton_ops import interpreting, triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")
interp = pytest.mark.skipif(not interpreting(), reason="interpreter tests run where TRITON_INTERPRET=1 (no GPU)")


def _ops():
    from vexact_kernels.triton_ops import attention

    return attention


def _packed(*args, **kwargs):
    """The differentiable packed (training) forward, ``triton_ops/attention_bwd.py``."""
    from vexact_kernels.triton_ops import attention_bwd

    return attention_bwd.attention_packed(*args, **kwargs)


def _qkv(lens, hq, hkv, d, seed, device="cpu", dv=None):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q = torch.randn(t, hq, d, generator=g).bfloat16().to(device)
    k = torch.randn(t, hkv, d, generator=g).bfloat16().to(device)
    v = torch.randn(t, hkv, dv or d, generator=g).bfloat16().to(device)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return q, k, v, cu


def _sdpa_ref(q, k, v, cu, scale=None):
    """Per-sequence causal SDPA in fp32 (GQA by repetition)."""
    g = q.shape[1] // k.shape[1]
    outs = []
    for b in range(cu.numel() - 1):
        s, e = int(cu[b]), int(cu[b + 1])
        qq = q[s:e].float().transpose(0, 1)
        kk = k[s:e].float().repeat_interleave(g, 1).transpose(0, 1)
        vv = v[s:e].float().repeat_interleave(g, 1).transpose(0, 1)
        outs.append(F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale).transpose(0, 1))
    return torch.cat(outs)


def _paged_run(ops, q, k, v, lens, chunks, page, seed):
    """Chunked prefill / decode over a paged cache: each step advances every unfinished sequence by its next chunk
    (a mixed batch); pages are handed out in a shuffled order. Returns outputs laid out like the packed batch."""
    dev = q.device
    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    pages = [-(-n // page) for n in lens]
    order = torch.randperm(sum(pages) + 3, generator=torch.Generator().manual_seed(seed))
    bt = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    used = 0
    for b, p in enumerate(pages):
        bt[b, :p] = order[used : used + p]
        used += p
    kc = torch.zeros(sum(pages) + 3, page, *k.shape[1:], dtype=k.dtype, device=dev)
    vc = torch.zeros(sum(pages) + 3, page, *v.shape[1:], dtype=v.dtype, device=dev)
    out = torch.full((q.shape[0], q.shape[1], v.shape[2]), float("nan"), dtype=q.dtype, device=dev)
    done, chunks = [0] * len(lens), [list(c) for c in chunks]
    while any(done[b] < lens[b] for b in range(len(lens))):
        active, cuq, ctx, slots, idx = [], [0], [], [], []
        for b in range(len(lens)):
            if done[b] >= lens[b]:
                continue
            n = min(chunks[b].pop(0) if chunks[b] else lens[b], lens[b] - done[b])
            pos = torch.arange(done[b], done[b] + n)
            slots.append(bt[b, pos // page].long() * page + pos % page)
            idx += range(cu[b] + done[b], cu[b] + done[b] + n)
            active.append(b)
            cuq.append(cuq[-1] + n)
            ctx.append(done[b] + n)
            done[b] += n
        ridx = torch.tensor(idx, device=dev)
        slot = torch.cat(slots)
        slot_padded = torch.cat([slot, torch.tensor([-1])]).to(dev)  # a padding row (slot -1) must be skipped
        kk = torch.cat([k[ridx], torch.full_like(k[:1], 7.0)])
        vv = torch.cat([v[ridx], torch.full_like(v[:1], 7.0)])
        ops.write_kv_cache(kk, vv, kc, vc, slot_padded)
        out[ridx] = ops.attention_paged(
            q[ridx], kc, vc, bt[active].to(dev), torch.tensor(ctx, device=dev), torch.tensor(cuq, device=dev)
        )
    return out


def _check_invariance(ops, lens, hq, hkv, d, page, chunks, seed, device="cpu"):
    q, k, v, cu = _qkv(lens, hq, hkv, d, seed, device)
    packed = _packed(q, k, v, cu)
    paged = _paged_run(ops, q, k, v, lens, chunks, page, seed)
    assert torch.equal(packed, paged), (packed.float() - paged.float()).abs().max()
    # decode: a short prefill, then the last (up to 12) tokens one per step
    decode_chunks = [[max(1, n - 12)] + [1] * 12 if n > 12 else [1] * n for n in lens]
    decode = _paged_run(ops, q, k, v, lens, decode_chunks, page, seed + 1)
    assert torch.equal(packed, decode)
    b = seed % len(lens)
    s, e = int(cu[b]), int(cu[b + 1])
    alone = _packed(q[s:e], k[s:e], v[s:e], torch.tensor([0, e - s], device=device))
    assert torch.equal(alone, packed[s:e])
    return q, k, v, cu, packed


@interp
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    lens=st.lists(st.integers(1, 90), min_size=1, max_size=3),
    page=st.sampled_from([1, 3, 16, 64, 128]),
    heads=st.sampled_from([(4, 2), (6, 1), (2, 2)]),
)
def test_interpreted_packed_equals_chunked_and_decode(data, lens, page, heads):
    """Per query token, bitwise: packed == chunked prefill == one-token decode == the sequence packed alone."""
    ops = _ops()
    chunks = [data.draw(st.lists(st.integers(1, 40), max_size=4)) for _ in lens]
    q, k, v, cu, packed = _check_invariance(ops, lens, *heads, 64, page, chunks, seed=sum(lens) * 7 + page)
    ref = _sdpa_ref(q, k, v, cu)
    torch.testing.assert_close(packed.float(), ref, atol=2e-2, rtol=2e-2)


@interp
def test_interpreted_invariance_check_catches_a_launch_dependent_tile(monkeypatch):
    """The check must fail when one path walks keys in different tiles (as a per-shape tuned kernel would)."""
    ops = _ops()
    lens = [150]
    q, k, v, cu = _qkv(lens, 2, 1, 64, seed=1)
    packed = _packed(q, k, v, cu)
    monkeypatch.setattr(ops, "BLOCK_N", 32)
    paged = _paged_run(ops, q, k, v, lens, [[150]], 16, seed=1)
    assert not torch.equal(packed, paged)


@interp
def test_interpreted_matches_sdpa_head_dim_128_and_scale():
    lens = [130, 1, 65]
    q, k, v, cu = _qkv(lens, 8, 2, 128, seed=3)
    out = _packed(q, k, v, cu, scale=0.07)
    torch.testing.assert_close(out.float(), _sdpa_ref(q, k, v, cu, scale=0.07), atol=2e-2, rtol=2e-2)


def _check_backward(lens, hq, hkv, d, seed, tol, device="cpu"):
    """Gradients of attention_packed: identical on a second run, and close to fp32 SDPA's."""
    q, k, v, cu = _qkv(lens, hq, hkv, d, seed=seed, device=device)
    do = torch.randn(q.shape[0], hq, d, generator=torch.Generator().manual_seed(seed + 4)).bfloat16().to(device)

    def grads(fn, dtype):
        qq, kk, vv = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
        fn(qq, kk, vv).backward(do.to(dtype))
        return qq.grad, kk.grad, vv.grad

    ours = grads(lambda a, b, c: _packed(a, b, c, cu), torch.bfloat16)
    again = grads(lambda a, b, c: _packed(a, b, c, cu), torch.bfloat16)
    ref = grads(lambda a, b, c: _sdpa_ref(a, b, c, cu), torch.float32)
    for x, y, r in zip(ours, again, ref, strict=True):
        assert torch.equal(x, y)
        torch.testing.assert_close(x.float(), r, atol=tol, rtol=tol)


@interp
def test_interpreted_backward_matches_autograd_and_is_deterministic():
    _check_backward([70, 3, 40], 4, 2, 64, seed=5, tol=3e-2)


@interp
def test_interpreted_packed_layout_is_built_once_per_cu_seqlens(monkeypatch):
    """The packed layout (tile tables) is built once for a ``cu_seqlens`` tensor and reused by later layers and their
    backward; a ``cu_seqlens`` written in place, or a new tensor with the same values, gets its own; the outputs and
    gradients are the bits of a fresh build every time."""
    from vexact_kernels.triton_ops import attention_bwd

    ops = _ops()
    built = []
    real = ops._tiles
    monkeypatch.setattr(ops, "_tiles", lambda *a: built.append(1) or real(*a))
    monkeypatch.setattr(attention_bwd, "_tiles", lambda *a: built.append(1) or real(*a))
    q, k, v, cu = _qkv([70, 3, 40], 4, 2, 64, seed=6)
    do = torch.randn(q.shape[0], 4, 64, generator=torch.Generator().manual_seed(7)).bfloat16()

    def step(cu_arg):
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        o = _packed(qq, kk, vv, cu_arg)
        o.backward(do)
        return o.detach(), qq.grad, kk.grad, vv.grad

    first = step(cu)
    assert len(built) == 3  # the forward's table and the backward's two
    for _ in range(3):  # later layers of the pass: no new table, the same bits
        assert all(torch.equal(a, b) for a, b in zip(step(cu), first, strict=True))
    assert len(built) == 3
    fresh = cu.clone()  # same values, another tensor: its own build, the same bits
    assert all(torch.equal(a, b) for a, b in zip(step(fresh), first, strict=True)) and len(built) == 6
    moved = cu.clone()
    step(moved)
    moved[1:] += 0  # written in place (same values): the version counter moved, so it is built again
    step(moved)
    assert len(built) == 12


@interp
def test_interpreted_mla_head_dims():
    """Separate q/k and v head dims (MLA-shaped, padded to powers of two inside the kernel)."""
    lens = [20, 9]
    q, k, v, cu = _qkv(lens, 2, 1, 48, seed=2, dv=32)
    out = _packed(q, k, v, cu)
    torch.testing.assert_close(out.float(), _sdpa_ref(q, k, v, cu), atol=2e-2, rtol=2e-2)


def _paged_decode_inputs(lens, n_q, hq, hkv, d, page, seed, device, dv=None):
    """A paged step: sequence ``b`` holds ``lens[b]`` keys (its last ``n_q[b]`` are this step's queries), pages in a
    shuffled order; returns (q, k_cache, v_cache, tables, ctx, cu_q) and the packed (q, k, v, cu) of the same keys."""
    q, k, v, cu = _qkv(lens, hq, hkv, d, seed, device, dv)
    pages = [-(-n // page) for n in lens]
    order = torch.randperm(sum(pages) + 2, generator=torch.Generator().manual_seed(seed))
    bt = torch.zeros(len(lens), max(pages), dtype=torch.int64)
    kc = torch.zeros(sum(pages) + 2, page, hkv, d, dtype=k.dtype, device=device)
    vc = torch.zeros(sum(pages) + 2, page, hkv, v.shape[-1], dtype=v.dtype, device=device)
    used, rows = 0, []
    for b, n in enumerate(lens):
        bt[b, : pages[b]] = order[used : used + pages[b]]
        used += pages[b]
        pos = torch.arange(n)
        slot = (bt[b, pos // page] * page + pos % page).to(device)
        kc.view(-1, hkv, d)[slot] = k[int(cu[b]) : int(cu[b]) + n]
        vc.view(-1, hkv, v.shape[-1])[slot] = v[int(cu[b]) : int(cu[b]) + n]
        rows += range(int(cu[b]) + n - n_q[b], int(cu[b]) + n)
    cuq = torch.tensor([0, *torch.tensor(n_q).cumsum(0).tolist()], device=device)
    paged = (q[torch.tensor(rows, device=device)], kc, vc, bt.to(device), torch.tensor(lens, device=device), cuq)
    return paged, (q, k, v, cu), rows


def _split_forms(ops, paged):
    """The paged forward launched one program per split with the fused combine (the last split program of a tile
    folds), one program per split + the combine kernel, and one program per tile; the first two must agree here."""
    q, kc, vc, bt, ctx, cuq = paged
    page = kc.shape[1]
    lay = ops.paged_layout(bt, ctx, cuq, page, q.shape[0], q.shape[1], kc.shape[2], q.device)
    args = (q, kc.flatten(0, 1), vc.flatten(0, 1), lay.table, page, lay.q_start, lay.n_q, lay.ctx, 0.125, True)
    fused = ops._fwd(*args, split_programs=True, fused_combine=True)
    two = ops._fwd(*args, split_programs=True, fused_combine=False)
    assert torch.equal(fused[0], two[0]) and torch.equal(fused[1], two[1])
    return fused, ops._fwd(*args, split_programs=False)


@interp
@pytest.mark.parametrize("split_n", [64, 128])
@pytest.mark.parametrize("n_q", [[1, 1, 1], [1, 40, 3]])
def test_interpreted_split_launch_equals_one_pass_and_packed(monkeypatch, split_n, n_q):
    """Keys cut into splits at fixed absolute positions: one program per split + the ordered combine == one program
    folding the splits in registers == the packed (training) forward, per query, output and LSE, torch.equal. Rows of
    a prefill chunk that sit before a later split (n_q 40) must leave it out in both forms."""
    ops = _ops()
    monkeypatch.setattr(ops, "SPLIT_N", split_n)
    lens = [300, 200, 129]
    paged, (q, k, v, cu), rows = _paged_decode_inputs(lens, n_q, 4, 2, 64, 16, seed=sum(n_q), device="cpu")
    (o_split, lse_split), (o_one, lse_one) = _split_forms(ops, paged)
    assert torch.equal(o_split, o_one) and torch.equal(lse_split, lse_one)
    packed = _packed(q, k, v, cu, scale=0.125)
    assert torch.equal(o_split, packed[torch.tensor(rows)])
    # and through the public entry, whose default picks the split launch at this size
    assert torch.equal(ops.attention_paged(*paged, 0.125), o_split)
    torch.testing.assert_close(packed.float(), _sdpa_ref(q, k, v, cu, scale=0.125), atol=2e-2, rtol=2e-2)


@interp
def test_interpreted_split_check_catches_other_boundaries(monkeypatch):
    """The split contract can fail: decode with splits of 64 against a packed forward with splits of 128 differs
    (queries past position 64); queries within the first split are the one-pass result in both."""
    ops = _ops()
    paged, (q, k, v, cu), rows = _paged_decode_inputs([200], [1], 4, 2, 64, 16, seed=1, device="cpu")
    monkeypatch.setattr(ops, "SPLIT_N", 64)
    split64 = ops.attention_paged(*paged, 0.125)
    monkeypatch.setattr(ops, "SPLIT_N", 128)
    assert not torch.equal(split64, _packed(q, k, v, cu, scale=0.125)[torch.tensor(rows)])
    first = _packed(q[:60], k[:60], v[:60], torch.tensor([0, 60]), scale=0.125)
    monkeypatch.setattr(ops, "SPLIT_N", 64)
    assert torch.equal(first, _packed(q[:60], k[:60], v[:60], torch.tensor([0, 60]), scale=0.125))


@interp
def test_interpreted_split_launch_mla_head_dims(monkeypatch):
    ops = _ops()
    monkeypatch.setattr(ops, "SPLIT_N", 64)
    paged, (q, k, v, cu), rows = _paged_decode_inputs([150, 70], [1, 2], 2, 1, 48, 8, seed=2, device="cpu", dv=32)
    (o_split, lse_split), (o_one, lse_one) = _split_forms(ops, paged)
    assert torch.equal(o_split, o_one) and torch.equal(lse_split, lse_one)
    assert torch.equal(o_split, _packed(q, k, v, cu, scale=0.125)[torch.tensor(rows)])


def test_decode_launch_is_chosen_from_sizes_alone():
    ops = _ops()
    big = ops.DECODE_MIN_PROGRAMS // 8
    assert ops.decode_launch(big, big, 2, 8) == (ops.DECODE_BLOCK_M, ops.DECODE_NUM_WARPS, ops.NUM_STAGES)
    assert ops.decode_launch(big - 1, big - 1, 2, 8) is None  # too few programs: the constants' launch
    assert ops.decode_launch(big + 1, big, 2, 8) is None  # a prefill chunk in the step
    assert ops.decode_launch(4 * big, 4 * big, 32, 1) is None  # a GQA group wider than the decode tile
    small = (ops.DECODE_BLOCK_M, ops.DECODE_SPLIT_NUM_WARPS, ops.NUM_STAGES)  # so few programs that the step runs split
    assert ops.decode_launch(1, 1, 2, 8) == small and ops.decode_launch(16, 16, 8, 4) == small
    assert ops.decode_launch(ops.DECODE_SPLIT_MAX_SEQS + 1, ops.DECODE_SPLIT_MAX_SEQS + 1, 16, 1) is None
    assert ops.decode_launch(ops.SPLIT_BELOW_PROGRAMS // 8, ops.SPLIT_BELOW_PROGRAMS // 8, 2, 8) is None
    assert ops.decode_launch(5, 4, 2, 8) is None  # a prefill chunk in the step


def _check_decode_launch(ops, lens, hq, hkv, dims, page, seed, device, warps=None, orders=False):
    """A decode step (the last token of each sequence) at the decode launch == the packed (training) forward's rows
    and == the constants' launch, output and LSE, torch.equal; the layout must have picked the decode launch (16-row
    tiles in ``warps``, default ``DECODE_NUM_WARPS``). ``orders``: and the launch orders of
    :func:`_check_launch_orders` give its bits."""
    paged, (q, k, v, cu), rows = _paged_decode_inputs(
        lens, [1] * len(lens), hq, hkv, dims[0], page, seed=seed, device=device, dv=dims[1]
    )
    qd, kc, vc, bt, ctx, cuq = paged
    lay = ops.paged_layout(bt, ctx, cuq, page, qd.shape[0], hq, hkv, qd.device)
    assert lay.launch == (ops.DECODE_BLOCK_M, warps or ops.DECODE_NUM_WARPS, ops.NUM_STAGES)
    out = ops.attention_paged(*paged, 0.125, layout=lay)
    assert torch.equal(out, _packed(q, k, v, cu, scale=0.125)[torch.tensor(rows, device=device)])
    args = (qd, kc.flatten(0, 1), vc.flatten(0, 1), lay.table, page, lay.q_start, lay.n_q, lay.ctx, 0.125, True)
    for split in (False, True):
        dec, const = ops._fwd(*args, split_programs=split, launch=lay.launch), ops._fwd(*args, split_programs=split)
        assert torch.equal(dec[0], out) and torch.equal(dec[0], const[0]) and torch.equal(dec[1], const[1])
        if orders:
            _check_launch_orders(ops, args, lay, dec, split)
    return args, out


def _check_launch_orders(ops, args, lay, ref, split):
    """The decode step's launch orders (longest context first, KV heads first, both) == the slot order's launch
    ``ref`` (output and LSE, torch.equal): the same programs, started in another order."""
    q = args[0]
    slot = ops._fwd_tiles(lay.n_q, lay.g, q.shape[0], lay.launch[0])  # the slot order ``ref`` was launched in
    lf = ops.longest_first(slot, lay.ctx)
    real = lf[0][lf[0] < lay.ctx.numel()].long()
    assert sorted(real.tolist()) == list(range(lay.ctx.numel()))  # every sequence's tile, once
    assert bool((lay.ctx[real][:-1] >= lay.ctx[real][1:]).all())  # longest first
    for tiles, heads_first in ((lf, False), (slot, True), (lf, True)):
        got = ops._fwd(*args, tiles, split_programs=split, launch=lay.launch, heads_first=heads_first)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


@interp
def test_interpreted_decode_launch_equals_packed(monkeypatch):
    ops = _ops()
    monkeypatch.setattr(ops, "DECODE_MIN_PROGRAMS", 4)
    monkeypatch.setattr(ops, "SPLIT_N", 64)
    _check_decode_launch(ops, [150, 70, 3], 8, 2, (64, 64), 16, seed=3, device="cpu")


@interp
def test_interpreted_decode_launch_orders_keep_bits(monkeypatch):
    """Longest first, KV heads first and both give the slot order's bits (one pass and split); the layout takes them
    from the constants at a decode step only, and a tile table that loses a tile is caught."""
    ops = _ops()
    monkeypatch.setattr(ops, "DECODE_MIN_PROGRAMS", 4)
    monkeypatch.setattr(ops, "SPLIT_BELOW_PROGRAMS", 4)
    monkeypatch.setattr(ops, "SPLIT_N", 64)
    lens = [70, 150, 3, 129]
    args, out = _check_decode_launch(ops, lens, 8, 2, (64, 64), 16, seed=5, device="cpu", orders=True)
    paged, _, _ = _paged_decode_inputs(lens, [1] * 4, 8, 2, 64, 16, seed=5, device="cpu")
    lay = ops.paged_layout(*paged[3:], 16, 4, 8, 2, "cpu")
    assert lay.heads_first and lay.tiles[0][:4].tolist() == [1, 3, 0, 2]  # contexts 150, 129, 70, 3
    for name in ("DECODE_LONGEST_FIRST", "DECODE_HEADS_FIRST"):
        monkeypatch.setattr(ops, name, False)
    off = ops.paged_layout(*paged[3:], 16, 4, 8, 2, "cpu")
    assert not off.heads_first and off.tiles[0][:4].tolist() == [0, 1, 2, 3]
    monkeypatch.setattr(ops, "DECODE_LONGEST_FIRST", True)
    monkeypatch.setattr(ops, "DECODE_HEADS_FIRST", True)
    monkeypatch.setattr(ops, "SPLIT_BELOW_PROGRAMS", 9)  # 4 sequences x 2 KV heads: the split form's slot order
    few = ops.paged_layout(*paged[3:], 16, 4, 8, 2, "cpu")
    assert not few.heads_first and few.tiles[0][:4].tolist() == [0, 1, 2, 3]
    monkeypatch.setattr(ops, "SPLIT_BELOW_PROGRAMS", 4)
    assert torch.equal(ops.attention_paged(*paged, 0.125, layout=lay), out)
    prefill = ops.paged_layout(paged[3], paged[4], torch.tensor([0, 1, 2, 3, 5]), 16, 5, 8, 2, "cpu")
    assert not prefill.heads_first and prefill.tiles[0][:4].tolist() == [0, 1, 2, 3]  # a prefill chunk: slot order
    seq, row0, grid = lay.tiles
    lost = (torch.cat([seq[:1], seq[:-1]]), row0, grid)  # the first tile twice, the last one lost
    assert not torch.equal(ops._fwd(*args, lost, launch=lay.launch, heads_first=True)[0], out)


@interp
def test_interpreted_small_decode_launch_equals_packed(monkeypatch):
    ops = _ops()
    monkeypatch.setattr(ops, "SPLIT_N", 64)  # contexts past several key splits: the split form
    _check_decode_launch(ops, [150, 70, 3], 8, 2, (64, 64), 16, seed=4, device="cpu", warps=ops.DECODE_SPLIT_NUM_WARPS)


if triton_available():
    import triton
    import triton.language as tl

    from vexact_kernels.triton_ops.attention import _row_sum_one_warp

    @triton.jit
    def _row_sum_kernel(P, S, M: tl.constexpr):
        rows, cols = tl.arange(0, M), tl.arange(0, 64)
        p = tl.load(P + rows[:, None] * 64 + cols[None, :])
        tl.store(S + rows, _row_sum_one_warp(p, M, 64))


def _one_warp_order_sum(p: torch.Tensor) -> torch.Tensor:
    """Each row's sum of ``p [M, 64]`` (fp32) as one warp's MMA layout adds it (read from the PTX of the one-warp
    launch): lane ``q`` adds columns ``8n + 2q + c`` left to right in ``(n, c)`` order, then
    ``(s0 + s2) + (s1 + s3)``."""
    out = torch.empty(p.shape[0], dtype=torch.float32)
    for r in range(p.shape[0]):
        s = []
        for q in range(4):
            acc = torch.tensor(0.0)
            for n in range(8):
                for c in range(2):
                    acc = acc + p[r, 8 * n + 2 * q + c]
            s.append(acc)
        out[r] = (s[0] + s[2]) + (s[1] + s[3])
    return out


@interp
def test_interpreted_row_sum_one_warp_adds_in_the_one_warp_order():
    """``_row_sum_one_warp``'s reshapes and splits put each value where the one-warp order adds it: torch.equal with
    that order done by hand, and (the check can fail) not with a plain left-to-right sum on the same rows."""
    g = torch.Generator().manual_seed(0)
    p = torch.rand(16, 64, generator=g) * torch.rand(16, 1, generator=g) * 4
    out = torch.empty(16)
    _row_sum_kernel[(1,)](p, out, M=16)
    assert torch.equal(out, _one_warp_order_sum(p))
    plain = torch.stack([sum((row[i] for i in range(64)), torch.tensor(0.0)) for row in p])
    assert not torch.equal(out, plain)


def test_write_kv_cache_matches_index_copy():
    if not (interpreting() or torch.cuda.is_available()):
        pytest.skip("needs a CUDA device or TRITON_INTERPRET=1")
    ops = _ops()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(6, 3, 64, generator=g).bfloat16().to(dev), torch.randn(6, 3, 64, generator=g).bfloat16().to(dev)
    slots = torch.tensor([5, 0, -1, 17, 9, 2], device=dev)
    kc, vc = torch.zeros(5, 4, 3, 64, dtype=torch.bfloat16, device=dev), torch.zeros(5, 4, 3, 64, device=dev).bfloat16()
    ops.write_kv_cache(k, v, kc, vc, slots)
    keep = slots >= 0
    rk, rv = torch.zeros_like(kc).view(20, 3, 64), torch.zeros_like(vc).view(20, 3, 64)
    rk[slots[keep]], rv[slots[keep]] = k[keep], v[keep]
    assert torch.equal(kc.view(20, 3, 64), rk) and torch.equal(vc.view(20, 3, 64), rv)


def _check_shared_layout(n_q, ctx, hq, hkv, d, page, seed, device):
    """Layers that share one step's layout (built once by ``paged_layout``) give bitwise what each call gives when it
    derives the layout itself; a layout of other tensors is refused."""
    ops = _ops()
    g = torch.Generator().manual_seed(seed)
    pages = [-(-c // page) for c in ctx]
    n_blocks = sum(pages) + 2
    order = torch.randperm(n_blocks, generator=g)
    bt = torch.zeros(len(ctx), max(pages), dtype=torch.int64)
    used = 0
    for b, p in enumerate(pages):
        bt[b, :p] = order[used : used + p]
        used += p
    total = sum(n_q)
    bt = bt.to(device)
    cuq = torch.tensor([0, *torch.tensor(n_q).cumsum(0).tolist()], device=device)
    ctx_t = torch.tensor(ctx, device=device)
    layout = ops.paged_layout(bt, ctx_t, cuq, page, total, hq, hkv, torch.device(device))
    for layer in range(3):
        q = torch.randn(total, hq, d, generator=g).bfloat16().to(device)
        kc = torch.randn(n_blocks, page, hkv, d, generator=g).bfloat16().to(device)
        vc = torch.randn(n_blocks, page, hkv, d, generator=g).bfloat16().to(device)
        own = ops.attention_paged(q, kc, vc, bt, ctx_t, cuq, 0.1 * (layer + 1))
        shared = ops.attention_paged(q, kc, vc, bt, ctx_t, cuq, 0.1 * (layer + 1), layout=layout)
        assert torch.equal(own, shared), layer
    with pytest.raises(ValueError, match="layout was built for other arguments"):
        ops.attention_paged(q, kc, vc, bt.clone(), ctx_t, cuq, layout=layout)
    with pytest.raises(ValueError, match="layout was built for other arguments"):
        ops.attention_paged(q[:, : hkv * (hq // hkv // 2 or 1)], kc, vc, bt, ctx_t, cuq, layout=layout)


@interp
@pytest.mark.parametrize("n_q", [[1, 1, 1], [1, 5, 1], [3]])
def test_interpreted_layout_shared_by_layers_is_bitwise(n_q):
    ctx = [c + n for c, n in zip([40, 7, 90][: len(n_q)], n_q, strict=True)]
    _check_shared_layout(n_q, ctx, 4, 2, 64, 16, seed=sum(n_q), device="cpu")


@pytest.mark.gpu
def test_gpu_layout_shared_by_layers_is_bitwise():
    n_q = [1] * 40 + [37, 1, 300]
    ctx = [random.Random(i).randint(1, 3000) + n for i, n in enumerate(n_q)]
    _check_shared_layout(n_q, ctx, 16, 8, 128, 16, seed=3, device="cuda")


def test_public_layout_is_none_off_the_triton_path():
    import vexact_kernels as vk

    q, kc = torch.zeros(2, 4, 8), torch.zeros(3, 4, 2, 8)
    args = (q, kc, kc, torch.zeros(2, 1, dtype=torch.int64), torch.tensor([1, 2]), torch.tensor([0, 1, 2]))
    assert vk.paged_attention_layout(*args) is None
    with vk.use_backend("fast"):
        assert vk.paged_attention_layout(*args) is None


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads", [(32, 8), (16, 16), (28, 4), (12, 2)])
def test_gpu_packed_equals_chunked_and_decode(d, heads):
    ops = _ops()
    rng = random.Random(d * 100 + heads[0])
    lens = [rng.choice([1, 2, 63, 64, 65, 300, 1000, 4096]) for _ in range(4)] + [rng.randint(1, 4096)]
    page = rng.choice([1, 16, 32, 100, 256])
    chunks = [[rng.randint(1, 1500) for _ in range(4)] for _ in lens]
    q, k, v, cu, packed = _check_invariance(ops, lens, *heads, d, page, chunks, seed=d + heads[1], device="cuda")
    torch.testing.assert_close(packed.float(), _sdpa_ref(q, k, v, cu), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dims", [(128, 128), (192, 128)])
def test_gpu_split_launch_equals_one_pass_and_packed(dims):
    """At real sizes (contexts past many splits, GQA, MLA head dims): the split launch == the one-pass launch == the
    packed forward, output and LSE, torch.equal; decode rows and a prefill chunk in one step."""
    ops = _ops()
    lens, n_q = [4096, 9000, 257, 256, 2000], [1, 1, 1, 1, 300]
    paged, (q, k, v, cu), rows = _paged_decode_inputs(lens, n_q, 16, 4, dims[0], 16, seed=5, device="cuda", dv=dims[1])
    (o_split, lse_split), (o_one, lse_one) = _split_forms(ops, paged)
    assert torch.equal(o_split, o_one) and torch.equal(lse_split, lse_one)
    assert torch.equal(o_split, _packed(q, k, v, cu, scale=0.125)[torch.tensor(rows, device="cuda")])


@pytest.mark.gpu
@pytest.mark.parametrize(("hq", "hkv", "dims"), [(16, 8, (128, 128)), (32, 8, (128, 128)), (32, 4, (128, 128)),
                                                 (64, 4, (128, 128)), (16, 1, (192, 128))])  # fmt: skip
def test_gpu_decode_launch_equals_packed(hq, hkv, dims):
    """Decode at the RL shape's launch (16-row tiles in two warps; the GQA groups of Qwen3-1.7B / 8B / 30B-A3B, a
    group of 16, an MLA head) == the packed training forward and == 16-row tiles in one warp and in four, torch.equal,
    over contexts past many splits. The check can fail: four warps with plain sums of P (added across warps) give
    other bits."""
    ops = _ops()
    rng = random.Random(hq + hkv)
    nseq = -(-ops.DECODE_MIN_PROGRAMS // hkv)
    lens = [rng.randint(1, 4100) if rng.random() < 0.125 else rng.randint(1, 1200) for _ in range(nseq)]
    args, out = _check_decode_launch(ops, lens, hq, hkv, dims, 16, seed=hq, device="cuda", orders=True)
    for warps in (1, 4):
        assert torch.equal(ops._fwd(*args, launch=(ops.DECODE_BLOCK_M, warps, ops.NUM_STAGES))[0], out)
    if (hq, hkv) == (16, 8):
        plain = ops._fwd(*args, launch=(ops.DECODE_BLOCK_M, 4, ops.NUM_STAGES), one_warp_sum=False)[0]
        assert not torch.equal(plain, out)


@pytest.mark.gpu
@pytest.mark.parametrize(("hq", "hkv", "nseq"), [(16, 8, 1), (32, 8, 4), (32, 4, 16)])
def test_gpu_small_decode_launch_equals_packed(hq, hkv, nseq):
    """Decode at a small batch (the split form, 16-row tiles in DECODE_SPLIT_NUM_WARPS warps) == the packed training
    forward and == the 64-row launch, torch.equal, over contexts past many key splits."""
    ops = _ops()
    rng = random.Random(nseq)
    lens = [rng.randint(1, 9000) for _ in range(nseq)]
    _check_decode_launch(ops, lens, hq, hkv, (128, 128), 16, seed=nseq, device="cuda", warps=ops.DECODE_SPLIT_NUM_WARPS,
                         orders=True)  # fmt: skip


@pytest.mark.gpu
def test_gpu_many_sequences_mixed_batch():
    """Several hundred sequences of mixed lengths: packed == chunked/decode mixed batch, per token."""
    ops = _ops()
    rng = random.Random(1)
    lens = [rng.choice([rng.randint(1, 64), rng.randint(64, 700)]) for _ in range(300)]
    chunks = [[rng.choice([1, 7, 64, 129, 512]) for _ in range(3)] for _ in lens]
    _check_invariance(ops, lens, 32, 8, 128, 16, chunks, seed=11, device="cuda")


@pytest.mark.gpu
def test_gpu_backward_matches_autograd_and_is_deterministic():
    _check_backward([4096, 1000, 63, 1, 2000], 32, 8, 128, seed=4, tol=5e-2, device="cuda")


@pytest.mark.gpu
def test_gpu_dispatch_through_public_api():
    import vexact_kernels as vk

    if vk.get_attention_impl() != "triton":
        pytest.skip(f"the public ops run attention implementation {vk.get_attention_impl()!r} ($VEXACT_ATTENTION)")

    q, k, v, cu = _qkv([100, 37], 8, 2, 64, seed=0, device="cuda")
    assert torch.equal(vk.attention_packed(q, k, v, cu), _packed(q, k, v, cu))  # attention_bwd.py since the split
