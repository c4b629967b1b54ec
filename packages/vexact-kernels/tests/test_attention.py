"""Attention over packed sequences and over a paged KV cache.

Accuracy against a float64 causal-softmax reference; invariance (torch.equal) of a query's output to the other
sequences in the batch, to how a prefill is chunked, to the page size and page placement of the cache, and to the
packed-vs-paged code path; errors.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import vexact_kernels as vk

HQ, HKV, D = 4, 2, 16


def _qkv(total: int, seed: int = 0, dtype=torch.bfloat16, hq=HQ, hkv=HKV, d=D):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(total, hq, d, generator=g).to(dtype)
    k = torch.randn(total, hkv, d, generator=g).to(dtype)
    v = torch.randn(total, hkv, d, generator=g).to(dtype)
    return q, k, v


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _reference(q, k, v, lens, scale=None) -> torch.Tensor:
    """Per-sequence causal softmax attention in float64, GQA by head repetition."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    g = q.shape[1] // k.shape[1]
    outs, s = [], 0
    for n in lens:
        qd = q[s : s + n].double().transpose(0, 1)  # [H, n, D]
        kd = k[s : s + n].double().repeat_interleave(g, dim=1).transpose(0, 1)
        vd = v[s : s + n].double().repeat_interleave(g, dim=1).transpose(0, 1)
        scores = (qd @ kd.transpose(1, 2)) * scale
        mask = torch.ones(n, n, dtype=torch.bool).tril()
        p = torch.softmax(scores.masked_fill(~mask, -torch.inf), dim=-1)
        outs.append((p @ vd).transpose(0, 1))
        s += n
    return torch.cat(outs)


def _paged_run(q, k, v, lens, chunks, page, seed=0, backend="invariant"):
    """Feed each sequence to a paged cache chunk by chunk (step i runs chunk i of every sequence that has one).

    Pages are handed out in a shuffled order so a sequence's KV is scattered through the cache.
    Returns the outputs, laid out like the packed batch.
    """
    starts = [0, *torch.tensor(lens).cumsum(0).tolist()]
    pages_per_seq = [-(-n // page) for n in lens]
    num_pages = sum(pages_per_seq) + 2
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, used = [], 0
    for n_pages in pages_per_seq:
        tables.append(order[used : used + n_pages])
        used += n_pages
    width = max(pages_per_seq)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    k_cache = torch.zeros(num_pages, page, *k.shape[1:], dtype=k.dtype)
    v_cache = torch.zeros(num_pages, page, *v.shape[1:], dtype=v.dtype)
    out = torch.full((q.shape[0], q.shape[1], v.shape[-1]), float("nan"), dtype=q.dtype)
    done = [0] * len(lens)
    for step in range(max(len(c) for c in chunks)):
        seqs = [b for b in range(len(lens)) if step < len(chunks[b])]
        rows, slots, n_q, ctx = [], [], [], []
        for b in seqs:
            n = chunks[b][step]
            pos = list(range(done[b], done[b] + n))
            rows += [starts[b] + p for p in pos]
            slots += [tables[b][p // page] * page + p % page for p in pos]
            n_q.append(n)
            ctx.append(done[b] + n)
            done[b] += n
        rows_t = torch.tensor(rows)
        vk.write_kv_cache(k[rows_t], v[rows_t], k_cache, v_cache, torch.tensor(slots))
        with vk.use_backend(backend):
            o = vk.attention_paged(q[rows_t], k_cache, v_cache, block_tables[seqs], torch.tensor(ctx), _cu(n_q))
        out[rows_t] = o
    assert done == lens
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", vk.BACKENDS)
def test_packed_matches_float64_reference(dtype, backend):
    lens = [1, 5, 16, 17, 40]
    q, k, v = _qkv(sum(lens), seed=1, dtype=dtype)
    with vk.use_backend(backend):
        out = vk.attention_packed(q, k, v, _cu(lens))
    assert out.dtype == dtype and out.shape == (sum(lens), HQ, D)
    tol = 2e-6 if dtype == torch.float32 else 2.0**-8
    torch.testing.assert_close(out.double(), _reference(q, k, v, lens), rtol=tol, atol=tol)


def test_custom_scale_and_mha():
    lens = [7, 20]
    q, k, v = _qkv(sum(lens), seed=2, dtype=torch.float32, hq=3, hkv=3, d=8)
    out = vk.attention_packed(q, k, v, _cu(lens), scale=0.3)
    torch.testing.assert_close(out.double(), _reference(q, k, v, lens, scale=0.3), rtol=2e-6, atol=2e-6)


def test_first_token_attends_only_to_itself():
    q, k, v = _qkv(10, seed=3)
    out = vk.attention_packed(q, k, v, _cu([4, 6]))
    assert torch.equal(out[0], v[0].repeat_interleave(HQ // HKV, dim=0))
    assert torch.equal(out[4], v[4].repeat_interleave(HQ // HKV, dim=0))


@pytest.mark.parametrize("backend", vk.BACKENDS)
def test_paged_matches_float64_reference(backend):
    lens = [3, 18, 33]
    q, k, v = _qkv(sum(lens), seed=4, dtype=torch.float32)
    out = _paged_run(q, k, v, lens, [[n] for n in lens], page=4, backend=backend)
    torch.testing.assert_close(out.double(), _reference(q, k, v, lens), rtol=2e-6, atol=2e-6)


seq_lens = st.lists(st.integers(1, 40), min_size=1, max_size=4)


@settings(max_examples=30, deadline=None)
@given(lens=seq_lens, seed=st.integers(0, 2**16), data=st.data())
def test_packed_sequence_result_independent_of_batch(lens, seed, data):
    q, k, v = _qkv(sum(lens), seed=seed)
    full = vk.attention_packed(q, k, v, _cu(lens))
    starts = [0, *torch.tensor(lens).cumsum(0).tolist()]
    # each sequence alone
    for b, n in enumerate(lens):
        s = starts[b]
        alone = vk.attention_packed(q[s : s + n], k[s : s + n], v[s : s + n], _cu([n]))
        assert torch.equal(alone, full[s : s + n])
    # the sequences in another order
    perm = data.draw(st.permutations(range(len(lens))), label="order")
    idx = torch.cat([torch.arange(starts[b], starts[b] + lens[b]) for b in perm])
    shuffled = vk.attention_packed(q[idx], k[idx], v[idx], _cu([lens[b] for b in perm]))
    assert torch.equal(shuffled, full[idx])


def _chunking(n: int):
    return st.lists(st.integers(0, n), max_size=4).map(
        lambda cuts: [
            b - a for a, b in zip([0, *sorted(set(cuts) - {0, n})], [*sorted(set(cuts) - {0, n}), n], strict=True)
        ]
    )


@settings(max_examples=30, deadline=None)
@given(lens=seq_lens, page=st.sampled_from([1, 3, 4, 16]), seed=st.integers(0, 2**16), data=st.data())
def test_paged_chunked_prefill_equals_packed(lens, page, seed, data):
    """Chunked prefill and decode through a paged cache give the packed result bit for bit."""
    q, k, v = _qkv(sum(lens), seed=seed)
    packed = vk.attention_packed(q, k, v, _cu(lens))
    chunks = [data.draw(_chunking(n), label=f"chunks of seq {b}") for b, n in enumerate(lens)]
    assert [sum(c) for c in chunks] == lens
    paged = _paged_run(q, k, v, lens, chunks, page, seed=seed)
    assert torch.equal(paged, packed)


def test_token_by_token_decode_equals_packed():
    lens = [35, 9]
    q, k, v = _qkv(sum(lens), seed=5)
    packed = vk.attention_packed(q, k, v, _cu(lens))
    paged = _paged_run(q, k, v, lens, [[1] * n for n in lens], page=8)
    assert torch.equal(paged, packed)


def test_query_budget_stepping_does_not_change_values(monkeypatch):
    mod = importlib.import_module("vexact_kernels.attention")
    lens = [20, 30]
    q, k, v = _qkv(sum(lens), seed=6)
    expected = vk.attention_packed(q, k, v, _cu(lens))
    monkeypatch.setattr(mod, "_QUERY_BUDGET", HQ * vk.ATTN_BLOCK_N * D * 3)  # 3 queries per step
    assert torch.equal(vk.attention_packed(q, k, v, _cu(lens)), expected)


def test_write_kv_cache_places_tokens_and_skips_negative_slots():
    k = torch.arange(4 * HKV * D, dtype=torch.float32).view(4, HKV, D)
    v = -k
    k_cache, v_cache = torch.zeros(3, 2, HKV, D), torch.zeros(3, 2, HKV, D)
    vk.write_kv_cache(k, v, k_cache, v_cache, torch.tensor([5, -1, 0, 2]))
    assert torch.equal(k_cache[2, 1], k[0]) and torch.equal(v_cache[2, 1], v[0])
    assert torch.equal(k_cache[0, 0], k[2]) and torch.equal(k_cache[1, 0], k[3])
    written = {(2, 1), (0, 0), (1, 0)}
    for blk in range(3):
        for off in range(2):
            if (blk, off) not in written:
                assert not k_cache[blk, off].any()


def test_write_kv_cache_errors():
    k = torch.zeros(2, HKV, D)
    cache = torch.zeros(2, 4, HKV, D)
    with pytest.raises(IndexError, match="slot 8 outside a cache of 8 slots"):
        vk.write_kv_cache(k, k, cache, cache.clone(), torch.tensor([0, 8]))
    with pytest.raises(TypeError, match="cache dtype torch.bfloat16 != key dtype torch.float32"):
        vk.write_kv_cache(k, k, cache.bfloat16(), cache.bfloat16(), torch.tensor([0, 1]))


@pytest.mark.parametrize("backend", vk.BACKENDS)
def test_input_errors(backend):
    q, k, v = _qkv(6)
    cu = _cu([6])
    with vk.use_backend(backend):
        with pytest.raises(TypeError, match="q has dtype torch.int64"):
            vk.attention_packed(torch.ones(6, HQ, D, dtype=torch.int64), k, v, cu)
        with pytest.raises(TypeError, match="k dtype torch.bfloat16 != v dtype torch.float32"):
            vk.attention_packed(q, k, v.float(), cu)
        with pytest.raises(ValueError, match=r"expected q \[tokens, heads, head_dim\]"):
            vk.attention_packed(q.view(6, -1), k, v, cu)
        with pytest.raises(ValueError, match="3 query heads is not a multiple of 2 KV heads"):
            vk.attention_packed(q[:, :3], k, v, cu)
        with pytest.raises(ValueError, match="q head_dim 8 != k head_dim 16"):
            vk.attention_packed(q[..., :8], k, v, cu)
        with pytest.raises(ValueError, match=r"must run from 0 to 6 .* got \[0, 5\]"):
            vk.attention_packed(q, k, v, torch.tensor([0, 5]))
        with pytest.raises(ValueError, match="non-decreasing"):
            vk.attention_packed(q, k, v, torch.tensor([0, 4, 2, 6]))


@pytest.mark.parametrize("backend", vk.BACKENDS)
def test_paged_input_errors(backend):
    q, _, _ = _qkv(4)
    cache = torch.zeros(4, 4, HKV, D, dtype=torch.bfloat16)
    tables = torch.tensor([[0, 1]])
    with vk.use_backend(backend):
        with pytest.raises(ValueError, match=r"context_lens \[3\] must cover the queries \[4\]"):
            vk.attention_paged(q, cache, cache, tables, torch.tensor([3]), _cu([4]))
        with pytest.raises(ValueError, match="context 9 exceeds block table capacity 8"):
            vk.attention_paged(q, cache, cache, tables, torch.tensor([9]), _cu([4]))
        with pytest.raises(ValueError, match="cu_seqlens_q must run from 0 to 4"):
            vk.attention_paged(q, cache, cache, tables, torch.tensor([4]), _cu([3]))


@pytest.mark.gpu
def test_invariant_backend_on_cuda_runs_the_triton_kernels():
    """CUDA tensors on the invariant backend go to the Triton kernels (their own tests: test_triton_attention.py)."""
    from vexact_kernels.triton_ops import attention_bwd as tri

    if vk.get_attention_impl() != "triton":
        pytest.skip(f"the public ops run attention implementation {vk.get_attention_impl()!r} ($VEXACT_ATTENTION)")

    q, k, v = (t.cuda() for t in _qkv(70, d=64))
    out = vk.attention_packed(q, k, v, _cu([30, 40]).cuda())
    assert torch.equal(out, tri.attention_packed(q, k, v, _cu([30, 40]).cuda()))
    torch.testing.assert_close(
        out.double().cpu(), _reference(q.cpu(), k.cpu(), v.cpu(), [30, 40]), atol=2e-2, rtol=2e-2
    )


def _empty_and_pad_sequences_change_nothing(attn, device, hq, hkv, d, page, seed):
    """The engine's padded steps with prompt tokens (CUDA graphs of a fixed token count and sequence count): the real
    sequences, then one pad sequence (its own queries at positions 0.., a table row of any valid pages), then empty
    sequences (no query, context 0, any table row). The real queries' outputs are bitwise those of the real sequences
    alone."""
    g = torch.Generator().manual_seed(seed)
    n_q, ctx, pad, empty = [3, 1, 7, 1], [10, 25, 7, 2 * page + 1], 5, 3
    width = -(-max(ctx) // page)
    blocks = (len(n_q) + 1 + empty) * width + 3
    kc = torch.randn(blocks, page, hkv, d, generator=g).bfloat16().to(device)
    vc = torch.randn(blocks, page, hkv, d, generator=g).bfloat16().to(device)
    rows = len(n_q) + 1 + empty
    tables = torch.randperm(blocks, generator=g)[: rows * width].view(rows, width).to(device)
    q = torch.randn(sum(n_q) + pad, hq, d, generator=g).bfloat16().to(device)
    n = sum(n_q)
    alone = attn(q[:n], kc, vc, tables[: len(n_q)], torch.tensor(ctx, device=device), _cu(n_q).to(device))
    padded = attn(
        q, kc, vc, tables, torch.tensor(ctx + [pad] + [0] * empty, device=device),
        _cu(n_q + [pad] + [0] * empty).to(device),
    )  # fmt: skip
    assert torch.equal(padded[:n], alone)


@pytest.mark.parametrize("impl", ["reference", "triton-interpreter"])
def test_paged_empty_and_pad_sequences_change_nothing(impl):
    attn = vk.attention_paged
    if impl == "triton-interpreter":
        from vexact_kernels.triton_ops import attention as tri
        from vexact_kernels.triton_ops import interpreting

        if not interpreting():
            pytest.skip("the Triton kernel runs here through the interpreter only (TRITON_INTERPRET=1, no GPU)")
        attn = tri.attention_paged
    _empty_and_pad_sequences_change_nothing(attn, "cpu", HQ, HKV, D, 4, seed=0)


@pytest.mark.gpu
def test_gpu_paged_empty_and_pad_sequences_change_nothing():
    """On CUDA through the public op: the Triton kernel or FA4, as ``$VEXACT_ATTENTION`` chooses."""
    _empty_and_pad_sequences_change_nothing(vk.attention_paged, "cuda", 16, 8, 128, 16, seed=1)
