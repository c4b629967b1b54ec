"""The Triton attention with a sliding window and sinks (gpt-oss): forward and backward against a float64 reference
(transformers' eager gpt-oss attention), and packed == chunked prefill == decode == every split launch form, per
query token, torch.equal; a windowed paged query reads no key before its window. On CPU through the interpreter at
small shapes (splits of 64 keys, so windows straddle split boundaries); on the GPU at real shapes (``-m gpu``).
"""

from __future__ import annotations

import pytest
import torch

from vexact_kernels.triton_ops import interpreting, triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")
interp = pytest.mark.skipif(not interpreting(), reason="interpreter tests run where TRITON_INTERPRET=1 (no GPU)")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _ops():
    from vexact_kernels.triton_ops import attention, attention_bwd

    return attention, attention_bwd


def _inputs(lens, hq, hkv, d, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q, k, v = (torch.randn(t, h, d, generator=g).bfloat16().to(device) for h in (hq, hkv, hkv))
    sinks = (torch.randn(hq, generator=g) * 2).to(device)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return q, k, v, sinks, cu


def _reference(q, k, v, lens, window, sinks, scale):
    """transformers' eager gpt-oss attention per sequence, in float64 (differentiable)."""
    g = q.shape[1] // k.shape[1]
    outs, s = [], 0
    for n in lens:
        qd = q[s : s + n].double().transpose(0, 1)
        kd = k[s : s + n].double().repeat_interleave(g, dim=1).transpose(0, 1)
        vd = v[s : s + n].double().repeat_interleave(g, dim=1).transpose(0, 1)
        scores = (qd @ kd.transpose(1, 2)) * scale
        i, j = torch.arange(n, device=q.device)[:, None], torch.arange(n, device=q.device)[None, :]
        keep = j <= i if window is None else (j <= i) & (j > i - window)
        scores = scores.masked_fill(~keep, -torch.inf)
        if sinks is not None:
            scores = torch.cat([scores, sinks.double().view(-1, 1, 1).expand(-1, n, 1)], dim=-1)
        p = torch.softmax(scores, dim=-1)[..., :n]
        outs.append((p @ vd).transpose(0, 1))
        s += n
    return torch.cat(outs)


def _paged(ops, q, k, v, lens, chunks, page, window, sinks, seed, poison=True):
    """Each sequence fed to a paged cache chunk by chunk (a mixed batch per step, pages in a shuffled order). With
    ``poison``, before each step every cached key and value before the earliest position a query of the step can see
    is NaN: a kernel that read one would put NaN in the output."""
    dev = q.device
    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    pages = [-(-n // page) for n in lens]
    order = torch.randperm(sum(pages) + 2, generator=torch.Generator().manual_seed(seed))
    bt = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    used = 0
    for b, p in enumerate(pages):
        bt[b, :p] = order[used : used + p]
        used += p
    kc = torch.zeros(sum(pages) + 2, page, *k.shape[1:], dtype=k.dtype, device=dev)
    vc = torch.zeros_like(kc)
    out = torch.full_like(q, float("nan"))
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
            if poison and window is not None:
                dead = torch.arange(max(0, done[b] - window + 1))
                dead_slots = (bt[b, dead // page].long() * page + dead % page).to(dev)
                kc.view(-1, *k.shape[1:])[dead_slots] = float("nan")
                vc.view(-1, *v.shape[1:])[dead_slots] = float("nan")
            active.append(b)
            cuq.append(cuq[-1] + n)
            ctx.append(done[b] + n)
            done[b] += n
        ridx = torch.tensor(idx, device=dev)
        ops.write_kv_cache(k[ridx], v[ridx], kc, vc, torch.cat(slots).to(dev))
        out[ridx] = ops.attention_paged(
            q[ridx], kc, vc, bt[active].to(dev), torch.tensor(ctx, device=dev), torch.tensor(cuq, device=dev),
            window=window, sinks=sinks,
        )  # fmt: skip
    return out


def _check(lens, hq, hkv, d, page, chunks, window, with_sinks, seed, device="cpu"):
    """packed == chunked prefill == decode (the last tokens one per step), torch.equal, and close to float64."""
    fwd, bwd = _ops()
    q, k, v, sinks, cu = _inputs(lens, hq, hkv, d, seed, device)
    sinks = sinks if with_sinks else None
    packed = bwd.attention_packed(q, k, v, cu, window=window, sinks=sinks)
    assert not packed.isnan().any()
    paged = _paged(fwd, q, k, v, lens, chunks, page, window, sinks, seed)
    assert torch.equal(packed, paged), (packed.float() - paged.float()).abs().max()
    decode_chunks = [[max(1, n - 6)] + [1] * 6 for n in lens]
    decode = _paged(fwd, q, k, v, lens, decode_chunks, page, window, sinks, seed + 1)
    assert torch.equal(packed, decode)
    ref = _reference(q, k, v, lens, window, sinks, d**-0.5)
    torch.testing.assert_close(packed.double(), ref, atol=2e-2, rtol=2e-2)
    return q, k, v, sinks, cu, packed


@interp
@pytest.mark.parametrize(
    ("window", "with_sinks", "page"), [(None, True, 16), (1, False, 3), (40, True, 16), (100, False, 64), (70, True, 7)]
)
def test_interpreted_window_sinks_packed_equals_chunked_and_decode(monkeypatch, window, with_sinks, page):
    """Splits of 64 keys: windows of 40-100 keys start inside, at and across split boundaries."""
    fwd, _ = _ops()
    monkeypatch.setattr(fwd, "SPLIT_N", 64)
    _check([150, 37], 4, 2, 32, page, [[70, 33, 20], [5]], window, with_sinks, seed=window or 0)


def _split_forms(fwd, q, k, v, lens, n_q, page, window, sinks, launch=None):
    """The last ``n_q[b]`` tokens of each sequence as one paged step (a cache holding every key), launched as one
    program per split with the fused combine, with the combine kernel, and one program per tile: all equal, output and
    LSE. Returns the output and the rows of the packed batch it holds."""
    dev = q.device
    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    pages = [-(-n // page) for n in lens]
    bt = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    kc = torch.zeros(sum(pages), page, *k.shape[1:], dtype=k.dtype, device=dev)
    vc = torch.zeros_like(kc)
    used, rows = 0, []
    for b, n in enumerate(lens):
        bt[b, : pages[b]] = torch.arange(used, used + pages[b]).flip(0)
        used += pages[b]
        pos = torch.arange(n)
        slot = (bt[b, pos // page].long() * page + pos % page).to(dev)
        kc.view(-1, *k.shape[1:])[slot] = k[cu[b] : cu[b] + n]
        vc.view(-1, *v.shape[1:])[slot] = v[cu[b] : cu[b] + n]
        rows += range(cu[b] + n - n_q[b], cu[b] + n)
    rows = torch.tensor(rows, device=dev)
    cuq = torch.tensor([0, *torch.tensor(n_q).cumsum(0).tolist()], device=dev)
    ctx = torch.tensor(lens, device=dev)
    lay = fwd.paged_layout(bt.to(dev), ctx, cuq, page, len(rows), q.shape[1], k.shape[1], dev)
    args = (q[rows], kc.flatten(0, 1), vc.flatten(0, 1), lay.table, page, lay.q_start, lay.n_q, lay.ctx, 0.125, True)
    ws = dict(window=window, sinks=sinks, launch=launch)
    forms = [
        fwd._fwd(*args, split_programs=True, fused_combine=True, **ws),
        fwd._fwd(*args, split_programs=True, fused_combine=False, **ws),
        fwd._fwd(*args, split_programs=False, **ws),
    ]
    for o, lse in forms[1:]:
        assert torch.equal(o, forms[0][0]) and torch.equal(lse, forms[0][1])
    if all(n == 1 for n in n_q):  # a decode step: longest first with KV heads first gives the slot order's bits
        slot = fwd._fwd_tiles(lay.n_q, q.shape[1] // k.shape[1], len(rows), launch[0] if launch else fwd.BLOCK_M)
        for split in (True, False):
            o, lse = fwd._fwd(*args, fwd.longest_first(slot, lay.ctx), split_programs=split, heads_first=True, **ws)
            assert torch.equal(o, forms[0][0]) and torch.equal(lse, forms[0][1])
    return forms[0][0], rows


@interp
@pytest.mark.parametrize(("window", "with_sinks"), [(50, True), (130, False)])
def test_interpreted_window_split_launch_forms_and_decode_launch(monkeypatch, window, with_sinks):
    """Every launch form (split programs with either combine, one pass, the decode tile) == the packed forward."""
    fwd, bwd = _ops()
    monkeypatch.setattr(fwd, "SPLIT_N", 64)
    lens = [300, 130, 20]
    q, k, v, sinks, cu = _inputs(lens, 4, 2, 32, seed=7)
    sinks = sinks if with_sinks else None
    packed = bwd.attention_packed(q, k, v, cu, scale=0.125, window=window, sinks=sinks)
    for n_q in ([1, 1, 1], [1, 70, 3]):
        out, rows = _split_forms(fwd, q, k, v, lens, n_q, 16, window, sinks)
        assert torch.equal(out, packed[rows])
    launch = (fwd.DECODE_BLOCK_M, fwd.DECODE_NUM_WARPS, fwd.NUM_STAGES)
    out, rows = _split_forms(fwd, q, k, v, lens, [1, 1, 1], 16, window, sinks, launch=launch)
    assert torch.equal(out, packed[rows])


@interp
def test_interpreted_window_changes_bits_only_where_it_masks():
    """A window at least as long as every sequence, and no window, give the same bits (the window path is the same
    arithmetic on the same tiles); a shorter one changes the queries past it."""
    _, bwd = _ops()
    q, k, v, sinks, cu = _inputs([90, 20], 2, 1, 32, seed=3)
    plain = bwd.attention_packed(q, k, v, cu, sinks=sinks)
    assert torch.equal(bwd.attention_packed(q, k, v, cu, window=90, sinks=sinks), plain)
    short = bwd.attention_packed(q, k, v, cu, window=10, sinks=sinks)
    assert torch.equal(short[:10], plain[:10]) and not torch.equal(short[10:90], plain[10:90])


def _check_backward(lens, hq, hkv, d, window, seed, tol, device="cpu"):
    """dq, dk, dv and d sinks: identical on a second run, close to float64 autograd of the reference."""
    _, bwd = _ops()
    q, k, v, sinks, cu = _inputs(lens, hq, hkv, d, seed, device)
    do = torch.randn(q.shape[0], hq, d, generator=torch.Generator().manual_seed(seed + 1)).bfloat16().to(device)

    def grads(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        s = sinks.detach().to(torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_()
        fn(*leaves, s).backward(do.to(dtype))
        return [t.grad for t in (*leaves, s)]

    ours = grads(lambda a, b, c, s: bwd.attention_packed(a, b, c, cu, window=window, sinks=s), torch.bfloat16)
    again = grads(lambda a, b, c, s: bwd.attention_packed(a, b, c, cu, window=window, sinks=s), torch.bfloat16)
    ref = grads(lambda a, b, c, s: _reference(a, b, c, lens, window, s, d**-0.5), torch.float64)
    for x, y, r in zip(ours, again, ref, strict=True):
        assert torch.equal(x, y)
        torch.testing.assert_close(x.double(), r, atol=tol, rtol=tol)


@interp
@pytest.mark.parametrize("window", [None, 20, 70])
def test_interpreted_window_sinks_backward_matches_float64(window):
    _check_backward([150, 9], 4, 2, 32, window, seed=11, tol=3e-2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(("window", "with_sinks"), [(128, True), (1000, True), (None, True), (700, False)])
@pytest.mark.parametrize("heads", [(64, 8), (8, 8)])
def test_gpu_window_sinks_packed_equals_chunked_and_decode(window, with_sinks, heads):
    lens = [2100, 700, 1]
    chunks = [[512, 1000, 300], [1, 256], []]
    _check(lens, *heads, 64, 16, chunks, window, with_sinks, seed=5, device="cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("window", [128, 600])
def test_gpu_window_split_launch_forms_and_decode_launch(window):
    fwd, bwd = _ops()
    lens = [2000, 1300, 600, 20]
    q, k, v, sinks, cu = _inputs(lens, 64, 8, 64, seed=9, device="cuda")
    packed = bwd.attention_packed(q, k, v, cu, scale=0.125, window=window, sinks=sinks)
    for n_q in ([1, 1, 1, 1], [1, 700, 3, 20]):
        out, rows = _split_forms(fwd, q, k, v, lens, n_q, 16, window, sinks)
        assert torch.equal(out, packed[rows])
    launch = (fwd.DECODE_BLOCK_M, fwd.DECODE_NUM_WARPS, fwd.NUM_STAGES)
    out, rows = _split_forms(fwd, q, k, v, lens, [1, 1, 1, 1], 16, window, sinks, launch=launch)
    assert torch.equal(out, packed[rows])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("window", [None, 128])
def test_gpu_window_sinks_backward_matches_float64(window):
    _check_backward([700, 300], 8, 2, 64, window, seed=13, tol=3e-2, device="cuda")
