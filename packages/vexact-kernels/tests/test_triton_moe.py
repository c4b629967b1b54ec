"""The Triton fused MoE (CUDA's fused_moe): through the interpreter on CPU (tiny shapes), on the GPU at the
Qwen3-30B-A3B layer shape."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import vexact_kernels as vk
from vexact_kernels.triton_ops import interpreting, triton_available

moe = importlib.import_module("vexact_kernels.moe")  # the package re-exports functions of the same names

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")
interp = pytest.mark.skipif(not interpreting(), reason="interpreter tests run where TRITON_INTERPRET=1 (no GPU)")


def _ops():
    from vexact_kernels.triton_ops import moe

    return moe


def _weights(g, e, h, i, dtype, device="cpu"):
    w13 = (torch.randn(e, 2 * i, h, generator=g) * h**-0.5).to(dtype).to(device)
    w2 = (torch.randn(e, h, i, generator=g) * i**-0.5).to(dtype).to(device)
    return w13, w2


def _routing(g, t, e, k, skew="random", device="cpu"):
    """``(weights [T, k] fp32, ids [T, k])``: random distinct experts, or every token on the same k experts (``hot``),
    so expert loads run from 0 to all tokens."""
    if skew == "hot":
        ids = torch.arange(k).repeat(t, 1)
    else:
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else torch.zeros(0, k)
    w = torch.rand(t, k, generator=g)
    return w.to(device), ids.long().to(device)


def _reference64(x, w13, w2, w, ids):
    """float64, pair by pair (no intermediate rounding)."""
    i = w2.shape[2]
    x, w13, w2, w = (a.double() for a in (x, w13, w2, w))
    out = []
    for t in range(x.shape[0]):
        acc = torch.zeros_like(x[t])
        for r in range(ids.shape[1]):
            e = int(ids[t, r])
            hh = w13[e] @ x[t]
            acc = acc + w[t, r] * (w2[e] @ (F.silu(hh[:i]) * hh[i:]))
        out.append(acc)
    return torch.stack(out) if out else x.new_zeros(x.shape)


def _from_dense_kernels(x, w13, w2, w, ids):
    """The same arithmetic composed of the dense kernels, pair by pair: the grouped GEMMs must give these bits."""
    from vexact_kernels.triton_ops import activation, matmul

    i = w2.shape[2]
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=torch.float32, device=x.device)
        for r in range(ids.shape[1]):
            e = int(ids[t, r])
            hh = matmul.matmul(x[t : t + 1], w13[e])
            a = activation.silu_and_mul_fwd(hh[:, :i], hh[:, i:])
            acc = acc + w[t, r] * matmul.matmul(a, w2[e], out_dtype=torch.float32)[0]
        rows.append(acc.to(x.dtype))
    return torch.stack(rows)


def _invariance_violations(fn, x, w, ids, cuts):
    """Which of: each row alone, the rows in ``cuts`` chunks, a reversed batch, differs bitwise from the full batch."""
    full = fn(x, w, ids)
    bad = [
        f"row {r} alone"
        for r in range(x.shape[0])
        if not torch.equal(fn(x[r : r + 1], w[r : r + 1], ids[r : r + 1])[0], full[r])
    ]
    bounds = [0, *cuts, x.shape[0]]
    pieces = torch.cat([fn(x[a:b], w[a:b], ids[a:b]) for a, b in zip(bounds, bounds[1:], strict=False) if b > a])
    if not torch.equal(pieces, full):
        bad.append(f"chunks {cuts}")
    rev = torch.arange(x.shape[0] - 1, -1, -1)
    if not torch.equal(fn(x[rev], w[rev], ids[rev]), full[rev]):
        bad.append("reversed")
    return bad


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interpreted_close_to_float64_and_to_the_cpu_reference(dtype):
    moe = _ops()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 40, generator=g).to(dtype)
    w13, w2 = _weights(g, 5, 40, 24, dtype)
    w, ids = _routing(g, 6, 5, 3)
    out = moe.triton_fused_moe(x, w13, w2, w, ids)
    assert out.dtype == dtype and out.shape == x.shape
    ref = _reference64(x, w13, w2, w, ids)
    tol = 1e-5 if dtype == torch.float32 else 4e-2  # bf16: gate/up and the activation are rounded to bf16
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(out, vk.fused_moe(x, w13, w2, w, ids), rtol=tol, atol=tol)


@interp
def test_interpreted_bits_are_the_dense_kernels_bits():
    """A pair row is reduced exactly as matmul reduces a row: K = 1100 spans two fixed splits of 1024. (fp32: the
    interpreter's casts to bf16 truncate, torch's round, and the dense composition casts its output with torch.)"""
    moe = _ops()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 1100, generator=g)
    w13, w2 = _weights(g, 3, 1100, 8, torch.float32)
    w, ids = _routing(g, 2, 3, 2)
    assert torch.equal(moe.triton_fused_moe(x, w13, w2, w, ids), _from_dense_kernels(x, w13, w2, w, ids))


@interp
@settings(max_examples=6, deadline=None)
@given(
    t=st.integers(1, 9),
    e=st.sampled_from([4, 8, 128]),
    skew=st.sampled_from(["random", "hot"]),
    data=st.data(),
)
def test_interpreted_rows_invariant_to_batch_chunks_and_expert_loads(t, e, skew, data):
    """Expert loads from 0 to all tokens (``hot``: every token on the same experts, the others get none)."""
    moe = _ops()
    k = data.draw(st.integers(1, min(8 if e < 128 else 2, e)), label="k")
    g = torch.Generator().manual_seed(t * 1000 + e * 10 + k)
    x = torch.randn(t, 32, generator=g).bfloat16()
    w13, w2 = _weights(g, e, 32, 16, torch.bfloat16)
    w, ids = _routing(g, t, e, k, skew)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, t - 1)), max_size=3), label="cuts")) - {t})

    def fn(xx, ww, ii):
        return moe.triton_fused_moe(xx, w13, w2, ww, ii)

    assert _invariance_violations(fn, x, w, ids, cuts) == []


@interp
def test_interpreted_tile_config_does_not_change_bits():
    moe = _ops()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(10, 48, generator=g).bfloat16()
    w13, w2 = _weights(g, 4, 48, 40, torch.bfloat16)
    w, ids = _routing(g, 10, 4, 2)
    outs = [moe.triton_fused_moe(x, w13, w2, w, ids, config=cfg) for cfg in [(16, 32, 4, 1), (32, 16, 4, 1)]]
    assert torch.equal(outs[0], outs[1])


def _grads(fn, x, w13, w2, w, ids, gy):
    leaves = [a.detach().clone().requires_grad_(True) for a in (x, w13, w2, w)]
    fn(*leaves, ids).backward(gy)
    return [a.grad for a in leaves]


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interpreted_backward_close_and_deterministic(dtype):
    moe = _ops()
    g = torch.Generator().manual_seed(4)
    x = torch.randn(7, 40, generator=g).to(dtype)
    w13, w2 = _weights(g, 6, 40, 24, dtype)
    w, ids = _routing(g, 7, 6, 3)
    ids[:, 0] = 2  # one expert gets every token (a token may meet it twice: still a valid routing)
    gy = torch.randn(7, 40, generator=g).to(dtype)
    a = _grads(moe.triton_fused_moe, x, w13, w2, w, ids, gy)
    b = _grads(moe.triton_fused_moe, x, w13, w2, w, ids, gy)
    assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
    ref = _grads(_reference64, x.double(), w13.double(), w2.double(), w.double(), ids, gy.double())
    cpu = _grads(vk.fused_moe, x, w13, w2, w, ids, gy)  # the CPU reference's autograd
    tol = 1e-5 if dtype == torch.float32 else 6e-2
    for name, p, r, c in zip(("x", "w_gate_up", "w_down", "topk_weights"), a, ref, cpu, strict=True):
        assert p.dtype == (torch.float32 if name == "topk_weights" else dtype), name
        scale = r.abs().max().item()
        assert (p.double() - r).abs().max().item() <= tol * max(1.0, scale), name
        assert (p.double() - c.double()).abs().max().item() <= tol * max(1.0, scale), name


@interp
def test_interpreted_only_the_needed_grads_and_empty_batch():
    moe = _ops()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 32, generator=g)
    w13, w2 = _weights(g, 4, 32, 16, torch.float32)
    w, ids = _routing(g, 3, 4, 2)
    w = w.requires_grad_(True)
    moe.triton_fused_moe(x, w13, w2, w, ids).sum().backward()
    assert w.grad is not None and w.grad.shape == (3, 2)
    assert moe.triton_fused_moe(x[:0], w13, w2, w[:0], ids[:0]).shape == (0, 32)


def _plan_cases(device):
    """Routings for the plan checks: uniform, skewed onto a few experts, and with pairs held elsewhere (id ``E``)."""
    g = torch.Generator().manual_seed(7)
    cases = []
    for i, (t, k, e) in enumerate([(1, 8, 128), (3, 2, 4), (100, 6, 60), (256, 8, 128), (300, 4, 64), (1024, 8, 128)]):
        ids = torch.randint(0, e if i % 2 else max(1, e // 8), (t, k), generator=g)
        if i % 3 == 2:
            ids = torch.where(torch.rand(t, k, generator=g) < 0.3, torch.full_like(ids, e), ids)
        cases.append((ids.to(device), e))
    return cases


def _check_plan_kernels(device):
    """The plan kernels' integers == torch's stable-sort plan (offsets, tok, inv, the tile schedule at two tile
    heights), over every case; and the comparison can fail: a grouping that is not stable (pairs of an expert in
    reverse order) gives another ``inv``."""
    ops = _ops()
    for ids, e in _plan_cases(device):
        assert ids.numel() <= ops.PLAN_KERNEL_MAX_PAIRS
        ref, dev = ops._Plan(ids, e, device_kernels=False), ops._Plan(ids, e, device_kernels=True)
        for name in ("offsets", "tok", "inv"):
            assert torch.equal(getattr(ref, name), getattr(dev, name)), name
        for bm in (16, 64):
            (n_ref, e_ref, f_ref), (n_dev, e_dev, f_dev) = ref.tiles(bm), dev.tiles(bm)
            assert n_ref == n_dev and torch.equal(e_ref, e_dev) and torch.equal(f_ref, f_dev), bm
    ids, e = _plan_cases(device)[3]
    flat = ids.reshape(-1).cpu()
    order = sorted(range(flat.numel()), key=lambda p: (int(flat[p]), -p))
    unstable = torch.empty(flat.numel(), dtype=torch.int64)
    unstable[torch.tensor(order)] = torch.arange(flat.numel())
    assert not torch.equal(unstable, ops._Plan(ids, e, device_kernels=True).inv.cpu())


@interp
def test_interpreted_plan_kernels_equal_the_sorted_plan():
    _check_plan_kernels("cpu")


@pytest.mark.gpu
def test_gpu_plan_kernels_equal_the_sorted_plan():
    _check_plan_kernels("cuda")


def test_bad_inputs_are_errors():
    moe = _ops()
    x, w13, w2 = torch.zeros(2, 8), torch.zeros(3, 6, 8), torch.zeros(3, 8, 3)
    w, ids = torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.long)
    # shapes, dtypes and ids are the public op's checks (tests/test_moe.py); here what only the kernel checks
    with pytest.raises(ValueError, match="config"):
        moe.triton_fused_moe(x, w13, w2, w, ids, config=(8, 16, 4, 1))


# GPU: the Qwen3-30B-A3B MoE layer (H = 2048, E = 128, k = 8, I = 768), bf16.
QWEN3_MOE = dict(h=2048, e=128, k=8, i=768)


def _gpu_layer(t, seed=0, skew=0.0):
    g = torch.Generator().manual_seed(seed)
    h, e, k, i = QWEN3_MOE["h"], QWEN3_MOE["e"], QWEN3_MOE["k"], QWEN3_MOE["i"]
    x = torch.randn(t, h, generator=g).bfloat16().cuda()
    w13, w2 = _weights(g, e, h, i, torch.bfloat16, "cuda")
    logits = torch.randn(t, e, generator=g).cuda()
    logits[:, :k] += skew  # skew: the first k experts take most tokens, most others none
    w, ids = vk.moe_route(logits, k, True)
    return x, w13, w2, w, ids


@pytest.mark.gpu
@pytest.mark.parametrize("skew", [0.0, 100.0])
def test_gpu_rows_invariant_to_batch_and_chunks(skew):
    x, w13, w2, w, ids = _gpu_layer(4096, seed=1, skew=skew)
    full = vk.fused_moe(x, w13, w2, w, ids)
    alone = torch.cat([vk.fused_moe(x[r : r + 1], w13, w2, w[r : r + 1], ids[r : r + 1]) for r in range(24)])
    assert torch.equal(alone, full[:24])
    for m in (1, 2, 3, 7, 8, 17, 32, 33, 64, 255, 256, 257, 511, 512, 513, 1000, 2048, 4095):
        assert torch.equal(vk.fused_moe(x[:m], w13, w2, w[:m], ids[:m]), full[:m]), f"first {m} tokens"
    gen = torch.Generator().manual_seed(7)
    for _ in range(3):
        cuts = sorted(set(torch.randint(1, 4096, (5,), generator=gen).tolist()))
        bounds = [0, *cuts, 4096]
        chunks = [vk.fused_moe(x[a:b], w13, w2, w[a:b], ids[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
        assert torch.equal(torch.cat(chunks), full), f"chunks at {cuts}"
    idx = torch.randperm(4096, generator=gen)[:300].cuda()
    assert torch.equal(vk.fused_moe(x[idx], w13, w2, w[idx], ids[idx]), full[idx])


@pytest.mark.gpu
def test_gpu_close_to_fp32_and_bits_of_the_dense_kernels():
    moe = _ops()
    x, w13, w2, w, ids = _gpu_layer(512, seed=2)
    out = vk.fused_moe(x, w13, w2, w, ids)
    with vk.use_backend("fast"):
        ref = vk.fused_moe(x.float(), w13.float(), w2.float(), w, ids)
    err = (out.float() - ref).norm() / ref.norm()
    assert err < 1e-2, err
    with vk.use_backend("fast"):
        fast = vk.fused_moe(x, w13, w2, w, ids)
    assert not torch.equal(fast, out)  # the baseline really is a different computation
    rows = [0, 1, 100, 511]
    assert torch.equal(moe.triton_fused_moe(x[rows], w13, w2, w[rows], ids[rows]), out[rows])
    assert torch.equal(_from_dense_kernels(x[rows], w13, w2, w[rows], ids[rows]), out[rows])


@pytest.mark.gpu
def test_gpu_every_config_gives_the_same_bits():
    moe = _ops()
    extra = [(16, 32, 4, 6), (32, 64, 4, 4), (64, 64, 4, 6), (128, 256, 8, 3), (64, 128, 8, 3)]
    for t, skew in ((1, 0.0), (37, 0.0), (300, 100.0), (4096, 0.0)):
        x, w13, w2, w, ids = _gpu_layer(t, seed=3, skew=skew)
        outs = [moe.triton_fused_moe(x, w13, w2, w, ids, config=cfg) for cfg in (*moe.CONFIGS, *extra)]
        for cfg, o in zip((*moe.CONFIGS, *extra)[1:], outs[1:], strict=True):
            assert torch.equal(o, outs[0]), f"config {cfg} changed bits at T={t}"


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 64])
def test_gpu_cuda_graph_replay_with_new_routing_equals_eager(t):
    x, w13, w2, w, ids = _gpu_layer(3 * t, seed=4)
    sx, sw, sids = x[:t].clone(), w[:t].clone(), ids[:t].clone()
    vk.fused_moe(sx, w13, w2, sw, sids)  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        vk.fused_moe(sx, w13, w2, sw, sids)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = vk.fused_moe(sx, w13, w2, sw, sids)
    for step in range(3):
        s = slice(step * t, (step + 1) * t)
        sx.copy_(x[s])
        sw.copy_(w[s])
        sids.copy_(ids[s] if step != 2 else torch.arange(8, device="cuda").repeat(t, 1))  # then all on 8 experts
        graph.replay()
        eager = vk.fused_moe(sx, w13, w2, sw, sids)
        assert torch.equal(out, eager), f"replay {step}"


@pytest.mark.gpu
def test_gpu_backward_deterministic_and_close_to_fp32():
    x, w13, w2, w, ids = _gpu_layer(1024, seed=5, skew=2.0)
    gy = torch.randn(x.shape, generator=torch.Generator().manual_seed(6)).bfloat16().cuda()
    runs = [_grads(vk.fused_moe, x, w13, w2, w, ids, gy) for _ in range(2)]
    for name, p, q in zip(("x", "w_gate_up", "w_down", "topk_weights"), *runs, strict=True):
        assert torch.equal(p, q), f"d{name} differs run to run"
    with vk.use_backend("fast"):
        ref = _grads(vk.fused_moe, x.float(), w13.float(), w2.float(), w, ids, gy.float())
    for name, p, r in zip(("x", "w_gate_up", "w_down", "topk_weights"), runs[0], ref, strict=True):
        err = (p.float() - r).norm() / r.norm()
        assert err < 2e-2, (name, err.item())


@pytest.mark.gpu
def test_gpu_fp32_inputs_invariant_and_close():
    """fp32 activations and weights (tl.dot's default tf32 products, as in matmul): rows invariant, close to fp32."""
    x, w13, w2, w, ids = _gpu_layer(600, seed=8, skew=3.0)
    x, w13, w2 = x.float(), w13.float(), w2.float()
    full = vk.fused_moe(x, w13, w2, w, ids)
    assert torch.equal(
        torch.cat([vk.fused_moe(x[r : r + 1], w13, w2, w[r : r + 1], ids[r : r + 1]) for r in range(4)]), full[:4]
    )
    assert torch.equal(
        torch.cat(
            [vk.fused_moe(x[a : a + 100], w13, w2, w[a : a + 100], ids[a : a + 100]) for a in range(0, 600, 100)]
        ),
        full,
    )
    with vk.use_backend("fast"):
        ref = vk.fused_moe(x, w13, w2, w, ids)
    assert (full - ref).norm() / ref.norm() < 5e-3


@pytest.mark.gpu
def test_gpu_fast_backend_moe_is_captured_by_a_cuda_graph():
    """The fast backend's MoE (the mismatch baseline) runs without a host sync on Hopper: a CUDA graph captures it and
    its replay equals the eager call (the engine's fast mode captures its decode step; the verl DeepSeek pair's fast
    run fell back to eager decode when the experts were a per-expert loop with ``.tolist()``)."""
    if not moe._grouped_mm_ok(torch.zeros(1, dtype=torch.bfloat16, device="cuda")):
        pytest.skip("torch._grouped_mm needs bf16 on compute capability 9.0+")
    x, w13, w2, w, ids = _gpu_layer(64, seed=3)
    with vk.use_backend("fast"):
        eager = vk.fused_moe(x, w13, w2, w, ids)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            vk.fused_moe(x, w13, w2, w, ids)  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = vk.fused_moe(x, w13, w2, w, ids)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    with vk.use_backend("invariant"):
        torch.testing.assert_close(out.float(), vk.fused_moe(x, w13, w2, w, ids).float(), rtol=5e-2, atol=5e-2)
