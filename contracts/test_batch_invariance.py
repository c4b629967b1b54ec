"""Contract 1: every op's result for a row is independent of the batch, the chunking and the code path."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import vexact_kernels as vk
from contracts.harness import row_invariance_violations

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = st.sampled_from([torch.bfloat16, torch.float32])


def _rand(g, *shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _subsets(draw_rows, n):
    return draw_rows(st.lists(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True), max_size=3))


@SETTINGS
@given(data=st.data(), m=st.integers(1, 96), k=st.sampled_from([8, 33, 64, 160]), n=st.integers(1, 80), dtype=DTYPES)
def test_linear_rows(device, data, m, k, n, dtype):
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    x, w = _rand(g, m, k, dtype=dtype).to(device), _rand(g, n, k, dtype=dtype).to(device)
    assert row_invariance_violations(lambda t: vk.linear(t, w), x, _subsets(data.draw, m)) == []


@SETTINGS
@given(data=st.data(), m=st.integers(1, 64), h=st.sampled_from([16, 64, 100]), dtype=DTYPES)
def test_rms_norm_rows(device, data, m, h, dtype):
    g = torch.Generator().manual_seed(m * 7 + h)
    x, w = _rand(g, m, h, dtype=dtype, scale=3).to(device), _rand(g, h, dtype=dtype).to(device)
    assert row_invariance_violations(lambda t: vk.rms_norm(t, w, 1e-6), x, _subsets(data.draw, m)) == []


@SETTINGS
@given(data=st.data(), m=st.integers(1, 64), i=st.sampled_from([8, 160, 333]))
def test_silu_and_mul_rows(device, data, m, i):
    g = torch.Generator().manual_seed(m + i)
    x = _rand(g, m, 2 * i, scale=4).to(device)
    op = lambda t: vk.silu_and_mul(t[:, :i], t[:, i:])  # noqa: E731
    assert row_invariance_violations(op, x, _subsets(data.draw, m)) == []


@SETTINGS
@given(data=st.data(), m=st.integers(1, 48))
def test_rotary_rows(device, data, m):
    g = torch.Generator().manual_seed(m)
    cos, sin = vk.rope_cos_sin(16, 512, 10_000.0)
    x = _rand(g, m, 3, 16).to(device)
    cos, sin = cos.to(device), sin.to(device)
    pos = torch.randint(0, 512, (m,), generator=g).to(device)
    full = vk.apply_rotary(x, pos, cos, sin)
    rows = data.draw(st.lists(st.integers(0, m - 1), min_size=1, max_size=m, unique=True))
    assert torch.equal(vk.apply_rotary(x[rows], pos[rows], cos, sin), full[rows])


@SETTINGS
@given(
    data=st.data(),
    m=st.integers(1, 40),
    temp=st.sampled_from([1.0, 0.7, 1.3]),
    chunk=st.integers(1, 50),
)
def test_logprobs_rows_and_chunks(device, data, m, temp, chunk):
    g = torch.Generator().manual_seed(m * 31 + chunk)
    hidden, head, norm = (t.to(device) for t in (_rand(g, m, 64), _rand(g, 272, 64, scale=0.3), _rand(g, 64)))
    targets = torch.randint(0, 272, (m,), generator=g).to(device)
    ref, ref_e = vk.logprobs_from_hidden(hidden, norm, 1e-6, head, targets, temp, chunk_size=m, with_entropy=True)
    lp, e = vk.logprobs_from_hidden(
        hidden, norm, 1e-6, head, targets, torch.full((m,), temp, device=device), chunk, True
    )
    assert torch.equal(lp, ref) and torch.equal(e, ref_e)
    rows = data.draw(st.lists(st.integers(0, m - 1), min_size=1, max_size=m, unique=True))
    sub, _ = vk.logprobs_from_hidden(hidden[rows], norm, 1e-6, head, targets[rows], temp, chunk)
    assert torch.equal(sub, ref[rows])


def _paged_run(q, k, v, lens, chunks, page, perm_seed, n_hkv, d, scale=None):
    dev = q.device
    """Run sequences through the paged path in the given chunks; pages assigned in a shuffled order."""
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    pages_per_seq = [-(-n // page) for n in lens]
    total_pages = sum(pages_per_seq) + 3
    order = torch.randperm(total_pages, generator=torch.Generator().manual_seed(perm_seed))
    tables, used = [], 0
    for p in pages_per_seq:
        tables.append(order[used : used + p])
        used += p
    width = max(pages_per_seq)
    bt = torch.zeros(len(lens), width, dtype=torch.int64)
    for b, t in enumerate(tables):
        bt[b, : len(t)] = t
    bt = bt.to(dev)
    kc = torch.zeros(total_pages, page, n_hkv, d, dtype=k.dtype, device=dev)
    vc = torch.zeros(total_pages, page, n_hkv, v.shape[-1], dtype=v.dtype, device=dev)
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    done = [0] * len(lens)
    # each step: every unfinished sequence advances by its next chunk (mixed prefill / decode batch)
    while any(done[b] < lens[b] for b in range(len(lens))):
        active, cuq, ctx, slots, idx = [], [0], [], [], []
        for b in range(len(lens)):
            if done[b] >= lens[b]:
                continue
            n = min(chunks[b][0] if chunks[b] else lens[b], lens[b] - done[b])
            if chunks[b]:
                chunks[b] = chunks[b][1:]
            rows = list(range(cu[b] + done[b], cu[b] + done[b] + n))
            pos = torch.arange(done[b], done[b] + n, device=dev)
            slots.append(bt[b, pos // page] * page + pos % page)
            idx += rows
            active.append(b)
            cuq.append(cuq[-1] + n)
            ctx.append(done[b] + n)
            done[b] += n
        ridx = torch.tensor(idx, device=dev)
        vk.write_kv_cache(k[ridx], v[ridx], kc, vc, torch.cat(slots))
        out[ridx] = vk.attention_paged(
            q[ridx], kc, vc, bt[active], torch.tensor(ctx, device=dev), torch.tensor(cuq, device=dev), scale
        )
    return out


@SETTINGS
@given(
    data=st.data(),
    lens=st.lists(st.integers(1, 48), min_size=1, max_size=5),
    page=st.sampled_from([1, 2, 4, 8, 16, 32]),
    heads=st.sampled_from([(4, 2), (4, 4), (6, 1)]),
    # (k head_dim, v head_dim, softmax scale): tensor-core tiles need head_dim >= 16 on GPU targets; (48, 32, 0.2)
    # is MLA's expanded layout (K = nope + rope wider than V, a YaRN-scaled softmax scale), non-power-of-2 K
    dims=st.sampled_from([(16, 16, None), (32, 32, None), (48, 32, 0.2)]),
)
def test_attention_packed_equals_chunked_paged(device, data, lens, page, heads, dims):
    """Packed training attention == chunked-prefill/decode attention over a paged cache, per query, bitwise."""
    hq, hkv = heads
    d, dv, scale = dims
    total = sum(lens)
    g = torch.Generator().manual_seed(total * 13 + page)
    q, k = (_rand(g, total, h, d).to(device) for h in (hq, hkv))
    v = _rand(g, total, hkv, dv).to(device)
    cu = torch.tensor([0] + [sum(lens[: i + 1]) for i in range(len(lens))], device=device)
    packed = vk.attention_packed(q, k, v, cu, scale)
    chunks = [data.draw(st.lists(st.integers(1, 16), max_size=6)) for _ in lens]
    paged = _paged_run(q, k, v, lens, chunks, page, total, hkv, d, scale)
    assert torch.equal(packed, paged)
    # and a single sequence alone in a packed batch gives the same rows
    b = data.draw(st.integers(0, len(lens) - 1))
    s, e = int(cu[b]), int(cu[b + 1])
    alone = vk.attention_packed(q[s:e], k[s:e], v[s:e], torch.tensor([0, e - s], device=device), scale)
    assert torch.equal(alone, packed[s:e])


@st.composite
def _moe_case(draw):
    """Router logits that give anything from an even spread to every token on one expert (skewed: big logits on
    a few experts), so expert loads run from 0 to all tokens."""
    e = draw(st.sampled_from([4, 8, 16, 128]))
    k = draw(st.integers(1, min(8, e)))
    m = draw(st.integers(1, 48))
    skew = draw(st.sampled_from([0.0, 4.0, 50.0]))
    hot = draw(st.lists(st.integers(0, e - 1), min_size=1, max_size=min(k, 3), unique=True))
    return e, k, m, skew, hot


@SETTINGS
@given(data=st.data(), case=_moe_case(), norm=st.booleans())
def test_fused_moe_rows_and_chunks(device, data, case, norm):
    """Routing + fused experts: a token's output alone, in the full batch, in any sub-batch and in any chunking is the
    same, whatever the expert loads (0 to all tokens per expert)."""
    e, k, m, skew, hot = case
    h, i = 32, 16
    g = torch.Generator().manual_seed(m * 1009 + e * 31 + k)
    x = _rand(g, m, h).to(device)
    w_gate = _rand(g, e, h, scale=0.2).to(device)
    w13, w2 = _rand(g, e, 2 * i, h, scale=0.2).to(device), _rand(g, e, h, i, scale=0.25).to(device)
    bias = torch.zeros(e)
    bias[hot] = skew

    def op(t):
        logits = vk.linear(t, w_gate, out_dtype=torch.float32) + bias.to(device)
        w, ids = vk.moe_route(logits, k, norm)
        return vk.fused_moe(t, w13, w2, w, ids)

    assert row_invariance_violations(op, x, _subsets(data.draw, m)) == []
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, m - 1)), max_size=4))) - {m})
    pieces = torch.cat([op(x[a:b]) for a, b in zip([0, *cuts], [*cuts, m], strict=True)])
    assert torch.equal(pieces, op(x))


def test_fused_moe_contract_fails_on_load_dependent_expert_gemm(monkeypatch):
    """The MoE contract can fail: an expert GEMM whose reduction depends on how many tokens the expert received (as a
    grouped cuBLAS call picks its kernel by M) makes a token's output depend on the other tokens' routing."""
    import importlib

    moe = importlib.import_module("vexact_kernels.moe")
    real = moe._linear_reference

    def load_dependent(x, w):
        return real(x, w) + (x.shape[0] > 2) * 1e-3  # a switch by the expert's row count, like a split-K choice

    monkeypatch.setattr(moe, "_linear_reference", load_dependent)
    g = torch.Generator().manual_seed(0)
    x, w_gate = _rand(g, 24, 32), _rand(g, 8, 32, scale=0.2)
    w13, w2 = _rand(g, 8, 32, 32, scale=0.2), _rand(g, 8, 32, 16, scale=0.25)

    def op(t):
        w, ids = vk.moe_route(vk.linear(t, w_gate, out_dtype=torch.float32), 2, True)
        return vk.fused_moe(t, w13, w2, w, ids)

    assert row_invariance_violations(op, x, []) != []


def test_contract_fails_on_perturbed_op(monkeypatch):
    """The row-invariance check must catch an op whose rows depend on the batch size."""
    import importlib

    lin = importlib.import_module("vexact_kernels.linear")  # the package re-exports a function of that name

    real = lin._linear_reference

    def perturbed(x, w):
        y = real(x, w)
        return y + (x.shape[0] > 1) * 1e-3  # a batch-size-dependent nudge, like a split-K switch

    monkeypatch.setattr(lin, "_linear_reference", perturbed)
    g = torch.Generator().manual_seed(0)
    x, w = _rand(g, 16, 64, dtype=torch.float32), _rand(g, 32, 64, dtype=torch.float32)
    assert row_invariance_violations(lambda t: vk.linear(t, w), x, []) != []


@pytest.mark.parametrize("dtype", [torch.float32])
def test_fast_backend_is_not_invariant(dtype):
    """The baseline the contracts guard against: torch's own CPU matmul changes a row's bits with M."""
    g = torch.Generator().manual_seed(0)
    x, w = _rand(g, 300, 64, dtype=dtype), _rand(g, 96, 64, dtype=dtype)
    with vk.use_backend("fast"):
        bad = row_invariance_violations(lambda t: vk.linear(t, w), x, [])
    if not bad:
        pytest.xfail("this CPU's BLAS happened to be row-invariant at this shape; the perturbed-op test still holds")
    assert bad
