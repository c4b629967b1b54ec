"""Sliding-window attention and attention sinks (gpt-oss) in the CPU reference.

Accuracy against transformers' eager gpt-oss attention in float64 (the sink concatenated as a last logit, the window
as a mask); bit-equality of the packed, chunked-prefill and paged-decode paths with a window and sinks; nothing
cached before the window reaches an output; the defaults leave every result unchanged; errors; on CUDA tensors, the
Triton kernels (``test_triton_attention_window_sinks.py`` holds their own tests).
"""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import vexact_kernels as vk

attention = importlib.import_module("vexact_kernels.attention")

HQ, HKV, D = 4, 2, 16


def _qkv(total: int, seed: int = 0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(total, h, D, generator=g).to(dtype) for h in (HQ, HKV, HKV))


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _chunking(n: int):
    """A split of n tokens into chunks (as test_attention's)."""
    return st.lists(st.integers(0, n), max_size=4).map(
        lambda cuts: [
            b - a for a, b in zip([0, *sorted(set(cuts) - {0, n})], [*sorted(set(cuts) - {0, n}), n], strict=True)
        ]
    )


def _sinks(seed: int = 0, dtype=torch.float32, hq=HQ) -> torch.Tensor:
    return (torch.randn(hq, generator=torch.Generator().manual_seed(seed + 100)) * 2).to(dtype)


def _reference(q, k, v, lens, window=None, sinks=None, scale=None) -> torch.Tensor:
    """transformers' eager gpt-oss attention per sequence, in float64: masked scores, the sink a last column, the
    row max subtracted, softmax, the sink's column dropped."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    g = q.shape[1] // k.shape[1]
    outs, s = [], 0
    for n in lens:
        qd = q[s : s + n].double().transpose(0, 1)  # [H, n, D]
        kd = k[s : s + n].double().repeat_interleave(g, dim=1).transpose(0, 1)
        vd = v[s : s + n].double().repeat_interleave(g, dim=1).transpose(0, 1)
        scores = (qd @ kd.transpose(1, 2)) * scale
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        keep = j <= i if window is None else (j <= i) & (j > i - window)
        scores = scores.masked_fill(~keep, -torch.inf)
        if sinks is not None:
            scores = torch.cat([scores, sinks.double().view(-1, 1, 1).expand(-1, n, 1)], dim=-1)
        p = torch.softmax(scores - scores.amax(-1, keepdim=True), dim=-1)[..., :n]
        outs.append((p @ vd).transpose(0, 1))
        s += n
    return torch.cat(outs)


def _paged(q, k, v, lens, chunks, page, window, sinks, seed=0, poison_before_window=False):
    """Feed each sequence to a paged cache chunk by chunk, as test_attention's ``_paged_run``, with a window and
    sinks. ``poison_before_window``: before each step, every cached key and value before the earliest position a
    query of the step can see is overwritten with NaN (a page the reference must not read)."""
    starts = [0, *torch.tensor(lens).cumsum(0).tolist()]
    pages_per_seq = [-(-n // page) for n in lens]
    num_pages = sum(pages_per_seq) + 1
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
        seqs = [b for b in range(len(lens)) if step < len(chunks[b]) and chunks[b][step]]
        if not seqs:
            continue
        rows, slots, n_q, ctx = [], [], [], []
        for b in seqs:
            n = chunks[b][step]
            pos = list(range(done[b], done[b] + n))
            rows += [starts[b] + p for p in pos]
            slots += [tables[b][p // page] * page + p % page for p in pos]
            n_q.append(n)
            ctx.append(done[b] + n)
        rows_t = torch.tensor(rows)
        vk.write_kv_cache(k[rows_t], v[rows_t], k_cache, v_cache, torch.tensor(slots))
        if poison_before_window:
            for b in seqs:
                for p in range(max(0, done[b] - window + 1)):
                    k_cache[tables[b][p // page], p % page] = float("nan")
                    v_cache[tables[b][p // page], p % page] = float("nan")
        for b in seqs:
            done[b] += chunks[b][step]
        o = vk.attention_paged(
            q[rows_t], k_cache, v_cache, block_tables[seqs], torch.tensor(ctx), _cu(n_q), window=window, sinks=sinks
        )
        out[rows_t] = o
    assert done == lens
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", vk.BACKENDS)
@pytest.mark.parametrize(("window", "with_sinks"), [(5, False), (None, True), (16, True), (1, True)])
def test_packed_matches_float64_reference(dtype, backend, window, with_sinks):
    lens = [1, 5, 16, 17, 40]
    q, k, v = _qkv(sum(lens), seed=1, dtype=dtype)
    sinks = _sinks(1, dtype) if with_sinks else None
    with vk.use_backend(backend):
        out = vk.attention_packed(q, k, v, _cu(lens), window=window, sinks=sinks)
    assert out.dtype == dtype and out.shape == (sum(lens), HQ, q.shape[-1])
    tol = 2e-6 if dtype == torch.float32 else 2.0**-7
    want = _reference(q, k, v, lens, window, sinks)
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)


def test_window_boundary_key_counts_once():
    """The oldest key a window of W admits is at p - W + 1: W and W + 1 differ exactly where that key exists."""
    lens = [40]
    q, k, v = _qkv(40, seed=2, dtype=torch.float32)
    w8 = vk.attention_packed(q, k, v, _cu(lens), window=8)
    w9 = vk.attention_packed(q, k, v, _cu(lens), window=9)
    assert torch.equal(w8[:8], w9[:8])  # positions < 8: both windows hold every earlier key
    assert all(not torch.equal(w8[p], w9[p]) for p in range(8, 40))
    torch.testing.assert_close(w8.double(), _reference(q, k, v, lens, window=8), rtol=2e-6, atol=2e-6)


def test_defaults_and_a_window_longer_than_the_sequence_change_no_bit():
    lens = [3, 33, 20]
    q, k, v = _qkv(sum(lens), seed=3)
    plain = vk.attention_packed(q, k, v, _cu(lens))
    assert torch.equal(vk.attention_packed(q, k, v, _cu(lens), window=None, sinks=None), plain)
    assert torch.equal(vk.attention_packed(q, k, v, _cu(lens), window=33), plain)
    assert torch.equal(vk.attention_packed(q, k, v, _cu(lens), window=1000), plain)


def test_sink_joins_the_denominator_only():
    """A very negative sink is no sink; a large sink shrinks every output toward zero by the same factor."""
    lens = [12]
    q, k, v = _qkv(12, seed=4, dtype=torch.float32)
    plain = vk.attention_packed(q, k, v, _cu(lens))
    none = vk.attention_packed(q, k, v, _cu(lens), sinks=torch.full((HQ,), -1e4))
    torch.testing.assert_close(none, plain, rtol=1e-6, atol=1e-6)
    big = vk.attention_packed(q, k, v, _cu(lens), sinks=torch.full((HQ,), 30.0))
    assert big.abs().max() < 1e-3


seq_lens = st.lists(st.integers(1, 40), min_size=1, max_size=3)


@settings(max_examples=25, deadline=None)
@given(
    lens=seq_lens,
    page=st.sampled_from([1, 4, 16]),
    window=st.sampled_from([1, 7, 16, 17]),
    with_sinks=st.booleans(),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_paged_chunked_prefill_equals_packed(lens, page, window, with_sinks, seed, data):
    """With a window and sinks, chunked prefill and decode through a paged cache give the packed result bit for bit,
    and every sequence alone gives its rows of the batch."""
    q, k, v = _qkv(sum(lens), seed=seed)
    sinks = _sinks(seed, torch.bfloat16) if with_sinks else None
    packed = vk.attention_packed(q, k, v, _cu(lens), window=window, sinks=sinks)
    chunks = [data.draw(_chunking(n), label=f"chunks of seq {b}") for b, n in enumerate(lens)]
    assert torch.equal(_paged(q, k, v, lens, chunks, page, window, sinks, seed=seed), packed)
    s = 0
    for n in lens:
        alone = vk.attention_packed(q[s : s + n], k[s : s + n], v[s : s + n], _cu([n]), window=window, sinks=sinks)
        assert torch.equal(alone, packed[s : s + n])
        s += n


@pytest.mark.parametrize("window", [3, 16, 20])
def test_decode_reads_no_key_before_the_window(window):
    """Token-by-token decode with every cached key and value before the window overwritten with NaN: finite and
    bit-equal to the packed result (a page wholly before the window may hold anything, or be gone)."""
    lens = [45, 21]
    q, k, v = _qkv(sum(lens), seed=5)
    sinks = _sinks(5, torch.bfloat16)
    packed = vk.attention_packed(q, k, v, _cu(lens), window=window, sinks=sinks)
    paged = _paged(q, k, v, lens, [[1] * n for n in lens], 4, window, sinks, poison_before_window=True)
    assert torch.isfinite(paged).all()
    assert torch.equal(paged, packed)


def test_decode_reads_no_page_before_the_window():
    """A decode step whose block table names, for every page wholly before the query's window, a page that does not
    exist: no error and the packed result, so no such page is read (a sliding layer's old pages may be gone)."""
    n, page, window = 50, 4, 9
    q, k, v = _qkv(n, seed=9)
    sinks = _sinks(9, torch.bfloat16)
    packed = vk.attention_packed(q, k, v, _cu([n]), window=window, sinks=sinks)
    pages = -(-n // page)
    k_cache = torch.zeros(pages, page, HKV, D, dtype=k.dtype)
    v_cache = torch.zeros(pages, page, HKV, D, dtype=v.dtype)
    vk.write_kv_cache(k, v, k_cache, v_cache, torch.arange(n))
    first = n - 1 - window + 1  # the oldest key the last query sees
    table = torch.tensor([[p if (p + 1) * page > first else 10_000 + p for p in range(pages)]])
    assert (table >= pages).sum() == first // page > 0
    out = vk.attention_paged(
        q[-1:], k_cache, v_cache, table, torch.tensor([n]), _cu([1]), window=window, sinks=sinks
    )  # fmt: skip
    assert torch.equal(out, packed[-1:])
    with pytest.raises(IndexError):  # without the window the same table is read out of range
        vk.attention_paged(q[-1:], k_cache, v_cache, table, torch.tensor([n]), _cu([1]), sinks=sinks)


def test_query_budget_stepping_does_not_change_values(monkeypatch):
    lens = [20, 30]
    q, k, v = _qkv(sum(lens), seed=6)
    sinks = _sinks(6)
    expected = vk.attention_packed(q, k, v, _cu(lens), window=9, sinks=sinks)
    monkeypatch.setattr(attention, "_QUERY_BUDGET", HQ * vk.ATTN_BLOCK_N * q.shape[-1] * 3)  # 3 queries per step
    assert torch.equal(vk.attention_packed(q, k, v, _cu(lens), window=9, sinks=sinks), expected)


def test_gradients_match_float64_autograd():
    """Backward through the reference (q, k, v and the sinks) against autograd through the float64 eager formula."""
    lens = [9, 30]
    q, k, v = _qkv(sum(lens), seed=7, dtype=torch.float32)
    sinks = _sinks(7)
    g = torch.randn(sum(lens), HQ, q.shape[-1], generator=torch.Generator().manual_seed(8))
    grads = []
    for fn, dtype in (
        (lambda a, b, c, s: vk.attention_packed(a, b, c, _cu(lens), window=7, sinks=s), torch.float32),
        (lambda a, b, c, s: _reference(a, b, c, lens, window=7, sinks=s), torch.float64),
    ):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v, sinks)]
        (fn(*leaves).double() * g.double()).sum().backward()
        grads.append([t.grad.double() for t in leaves])
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bad_window_and_sinks_are_errors():
    q, k, v = _qkv(6)
    cu = _cu([6])
    for bad in (0, -3, True, 2.0):
        with pytest.raises(ValueError, match="window must be an int >= 1"):
            vk.attention_packed(q, k, v, cu, window=bad)
    with pytest.raises(ValueError, match=r"sinks must be \[Hq=4\]"):
        vk.attention_packed(q, k, v, cu, sinks=torch.zeros(HKV))
    with pytest.raises(TypeError, match="sinks has dtype torch.int64"):
        vk.attention_packed(q, k, v, cu, sinks=torch.zeros(HQ, dtype=torch.int64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("impl", ["triton", "fa4"])
def test_invariant_backend_runs_window_and_sinks_on_triton(monkeypatch, impl):
    """On CUDA tensors the invariant backend runs a window and sinks on the Triton kernels, under ``fa4`` too (FA4 is
    given neither): the public packed and paged calls are the Triton ops' bits, close to the float64 reference."""
    from vexact_kernels.triton_ops import attention as tri
    from vexact_kernels.triton_ops import attention_bwd as tri_bwd

    monkeypatch.setattr(attention, "attention_impl_in_use", lambda: impl)
    lens, d = [40, 7], 64  # a head size FA4 takes
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(sum(lens), h, d, generator=g).bfloat16().cuda() for h in (HQ, HKV, HKV))
    cu, sinks = _cu(lens).cuda(), _sinks().cuda()
    out = vk.attention_packed(q, k, v, cu, window=16, sinks=sinks)
    assert torch.equal(out, tri_bwd.attention_packed(q, k, v, cu, None, 16, sinks))
    ref = _reference(q.cpu(), k.cpu(), v.cpu(), lens, 16, sinks.cpu())
    torch.testing.assert_close(out.cpu().double(), ref, atol=2e-2, rtol=2e-2)
    # the paged path: every key cached, the last token of each sequence a decode query
    kc, vc = k.view(-1, 1, HKV, d), v.view(-1, 1, HKV, d)  # pages of one slot, in token order
    tables = torch.tensor([list(range(40)), list(range(40, 47)) + [0] * 33], dtype=torch.int32, device="cuda")
    last = torch.tensor([39, 46], device="cuda")
    ctx, cuq = torch.tensor(lens, device="cuda"), _cu([1, 1]).cuda()
    layout = vk.paged_attention_layout(q[last], kc, vc, tables, ctx, cuq)
    dec = vk.attention_paged(q[last], kc, vc, tables, ctx, cuq, layout=layout, window=16, sinks=sinks)
    assert torch.equal(dec, out[last])
    assert torch.equal(dec, tri.attention_paged(q[last], kc, vc, tables, ctx, cuq, window=16, sinks=sinks))
