"""moe_route + fused_moe, the public API, on CPU (the exact reference of the invariant backend, and the fast one)."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import vexact_kernels as vk

moe = importlib.import_module("vexact_kernels.moe")  # the package re-exports functions of the same names

H, INTER = 32, 16


def _layer(g, e, dtype=torch.bfloat16, h=H, i=INTER):
    w_gate = (torch.randn(e, h, generator=g) * h**-0.5).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * h**-0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) * i**-0.5).to(dtype)
    return w_gate, w13, w2


def _reference64(x, w13, w2, w, ids):
    """float64, pair by pair, no intermediate rounding."""
    i = w2.shape[2]
    x, w13, w2, w = (a.double() for a in (x, w13, w2, w))
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for r in range(ids.shape[1]):
            e = int(ids[t, r])
            hh = w13[e] @ x[t]
            out[t] += w[t, r] * (w2[e] @ (F.silu(hh[:i]) * hh[i:]))
    return out


def _batch_violations(op, x, cuts, subset):
    """The checks of batch invariance: each row alone, the rows in chunks, a subset of rows, against the full batch."""
    full = op(x)
    bad = [f"row {r} alone" for r in range(x.shape[0]) if not torch.equal(op(x[r : r + 1])[0], full[r])]
    bounds = [0, *cuts, x.shape[0]]
    if not torch.equal(torch.cat([op(x[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]), full):
        bad.append(f"chunks at {cuts}")
    if subset and not torch.equal(op(x[subset]), full[subset]):
        bad.append(f"rows {subset}")
    return bad


def _rank_order_violations(x, w13, w2, w, ids):
    """Tokens whose output is not ``((0 + w_0 y_0) + w_1 y_1) + ...`` in rank order (fp32 x, so each ``y_r`` comes
    back exactly from a k = 1 call with weight 1)."""
    ys = [vk.fused_moe(x, w13, w2, torch.ones_like(w[:, :1]), ids[:, r : r + 1]) for r in range(ids.shape[1])]
    expect = torch.zeros_like(x)
    for r, y in enumerate(ys):
        expect = expect + w[:, r : r + 1] * y
    out = vk.fused_moe(x, w13, w2, w, ids)
    return [t for t in range(x.shape[0]) if not torch.equal(out[t], expect[t])]


def _tie_violations(route):
    """Rows where equal logits did not go to the lower expert index."""
    logits = torch.tensor(
        [[0.0] * 8, [1.0, 5.0, 5.0, 2.0, 5.0, 0.0, 5.0, 5.0], [3.0, 3.0, 1.0, 3.0, 0.0, 0.0, 0.0, 0.0]]
    )
    expect = [[0, 1, 2], [1, 2, 4], [0, 1, 3]]
    _, ids = route(logits, 3)
    return [r for r in range(3) if ids[r].tolist() != expect[r]]


@st.composite
def _case(draw):
    e = draw(st.sampled_from([4, 8, 16, 128]))
    k = draw(st.integers(1, min(8, e)))
    m = draw(st.integers(1, 12))
    skew = draw(st.sampled_from([0.0, 4.0, 60.0]))  # 60: every token on the hot experts, all others get none
    hot = draw(st.lists(st.integers(0, e - 1), min_size=1, max_size=k, unique=True))
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, m - 1)), max_size=3))) - {m})
    subset = draw(st.lists(st.integers(0, m - 1), max_size=m))
    return e, k, m, skew, hot, cuts, subset


@settings(max_examples=40, deadline=None)
@given(case=_case(), norm=st.booleans())
def test_route_and_experts_are_batch_invariant(case, norm):
    """Routing + experts: a token's output alone == in the batch == in any chunk == in any subset, for expert loads
    from 0 to all tokens, any k and E."""
    e, k, m, skew, hot, cuts, subset = case
    g = torch.Generator().manual_seed(m * 1009 + e * 31 + k)
    x = torch.randn(m, H, generator=g).bfloat16()
    w_gate, w13, w2 = _layer(g, e)
    bias = torch.zeros(e)
    bias[hot] = skew

    def op(t):
        w, ids = vk.moe_route(vk.linear(t, w_gate, out_dtype=torch.float32) + bias, k, norm)
        return vk.fused_moe(t, w13, w2, w, ids)

    assert _batch_violations(op, x, cuts, subset) == []


def test_ties_go_to_the_lower_expert_index():
    assert _tie_violations(vk.moe_route) == []
    w, ids = vk.moe_route(torch.zeros(2, 6), 4, True)
    assert ids.tolist() == [[0, 1, 2, 3]] * 2 and torch.equal(w, torch.full((2, 4), 0.25))


@pytest.mark.parametrize("norm", [False, True])
def test_route_weights_close_to_float64(norm):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(20, 60, generator=g) * 3
    w, ids = vk.moe_route(logits, 6, norm)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64
    probs = torch.softmax(logits.double(), dim=-1)
    top = torch.sort(probs, dim=-1, descending=True, stable=True)
    assert torch.equal(ids, top.indices[:, :6])
    ref = top.values[:, :6]
    ref = ref / ref.sum(-1, keepdim=True) if norm else ref
    torch.testing.assert_close(w.double(), ref, rtol=1e-6, atol=1e-7)
    if norm:
        torch.testing.assert_close(w.sum(-1), torch.ones(20), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_close_to_float64(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 40, generator=g).to(dtype)
    w_gate, w13, w2 = _layer(g, 8, dtype, h=40, i=24)
    w, ids = vk.moe_route(vk.linear(x, w_gate, out_dtype=torch.float32), 3)
    out = vk.fused_moe(x, w13, w2, w, ids)
    assert out.dtype == dtype and out.shape == x.shape
    tol = 1e-5 if dtype == torch.float32 else 4e-2  # bf16: gate/up and the activation are rounded to bf16
    torch.testing.assert_close(out.double(), _reference64(x, w13, w2, w, ids), rtol=tol, atol=tol)
    assert _rank_order_violations(x.float(), w13.float(), w2.float(), w, ids) == []


def test_fast_and_invariant_differ_but_are_close():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(32, 64, generator=g).bfloat16()
    w_gate, w13, w2 = _layer(g, 8, h=64, i=48)
    logits = vk.linear(x, w_gate, out_dtype=torch.float32)
    w, ids = vk.moe_route(logits, 4)
    inv = vk.fused_moe(x, w13, w2, w, ids)
    with vk.use_backend("fast"):
        fast = vk.fused_moe(x, w13, w2, w, ids)
        fw, fids = vk.moe_route(logits, 4)
    assert not torch.equal(inv, fast)
    torch.testing.assert_close(inv.float(), fast.float(), rtol=5e-2, atol=5e-2)
    assert torch.equal(fids, ids)
    torch.testing.assert_close(fw, w, rtol=1e-5, atol=1e-6)


def test_bad_inputs_are_errors():
    x = torch.zeros(3, H)
    w13, w2 = torch.zeros(4, 2 * INTER, H), torch.zeros(4, H, INTER)
    w, ids = torch.ones(3, 2), torch.zeros(3, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="top_k"):
        vk.moe_route(torch.zeros(3, 4), 5)
    with pytest.raises(ValueError, match="top_k"):
        vk.moe_route(torch.zeros(3, 4), 0)
    with pytest.raises(ValueError, match=r"\[T, E\]"):
        vk.moe_route(torch.zeros(3), 1)
    with pytest.raises(TypeError, match="dtype"):
        vk.moe_route(torch.zeros(3, 4, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="expected"):
        vk.fused_moe(x[None], w13, w2, w, ids)
    with pytest.raises(ValueError, match="do not agree"):
        vk.fused_moe(x, w13, torch.zeros(4, H, INTER + 1), w, ids)
    with pytest.raises(ValueError, match="do not agree"):
        vk.fused_moe(torch.zeros(3, H + 1), w13, w2, w, ids)
    with pytest.raises(ValueError, match="must both be"):
        vk.fused_moe(x, w13, w2, torch.ones(3, 3), ids)
    with pytest.raises(TypeError, match="cast them first"):
        vk.fused_moe(x.bfloat16(), w13, w2, w, ids)
    with pytest.raises(TypeError, match="int32 or int64"):
        vk.fused_moe(x, w13, w2, w, ids.float())
    with pytest.raises(ValueError, match=r"in \[0, 4\)"):
        vk.fused_moe(x, w13, w2, w, torch.full((3, 2), 4))
    with pytest.raises(ValueError, match=r"in \[0, 4\)"):
        vk.fused_moe(x, w13, w2, w, torch.full((3, 2), -1))
    assert vk.fused_moe(x[:0], w13, w2, w[:0], ids[:0]).shape == (0, H)


def _grads(x, w13, w2, w, ids, gy, fn=vk.fused_moe):
    leaves = [a.detach().clone().requires_grad_(True) for a in (x, w13, w2, w)]
    fn(*leaves, ids).backward(gy)
    return [a.grad for a in leaves]


def test_reference_backward_is_deterministic_and_close_to_float64():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(10, H, generator=g)
    _, w13, w2 = _layer(g, 6, torch.float32)
    w = torch.rand(10, 3, generator=g)
    ids = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(10)])
    ids[:, 0] = 5  # one expert gets every token
    gy = torch.randn(10, H, generator=g)
    a, b = _grads(x, w13, w2, w, ids, gy), _grads(x, w13, w2, w, ids, gy)
    assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
    ref = _grads(x.double(), w13.double(), w2.double(), w.double(), ids, gy.double(), fn=_reference64)
    for p, r in zip(a, ref, strict=True):
        torch.testing.assert_close(p.double(), r, rtol=1e-5, atol=1e-5)


def test_router_gradient_flows_through_the_weights():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(5, 8, generator=g, requires_grad=True)
    x = torch.randn(5, H, generator=g)
    _, w13, w2 = _layer(g, 8, torch.float32)
    w, ids = vk.moe_route(logits, 2)
    vk.fused_moe(x, w13, w2, w, ids).square().sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


# The checkers above can fail: each is shown failing once on a deliberately perturbed op.


def test_batch_checker_fails_on_a_load_dependent_expert_gemm(monkeypatch):
    """torch's own CPU F.linear blocks its reduction by the row count (an expert's load), like a grouped cuBLAS call
    picking its kernel by M: a token's output then depends on the other tokens' routing."""
    monkeypatch.setattr(moe, "_linear_reference", lambda a, b: F.linear(a.float(), b.float()))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(12, H, generator=g)
    w_gate, w13, w2 = _layer(g, 4, torch.float32)

    def op(t):
        w, ids = vk.moe_route(vk.linear(t, w_gate, out_dtype=torch.float32), 2)
        return vk.fused_moe(t, w13, w2, w, ids)

    assert _batch_violations(op, x, [5], [3, 1, 7]) != []


def test_rank_order_checker_fails_on_a_combine_in_expert_order(monkeypatch):
    real = moe._fused_moe_reference

    def expert_order(x, w13, w2, w, ids):
        perm = torch.argsort(ids, dim=1, stable=True)
        return real(x, w13, w2, w.gather(1, perm), ids.gather(1, perm))

    g = torch.Generator().manual_seed(6)
    x = torch.randn(16, H, generator=g)
    _, w13, w2 = _layer(g, 8, torch.float32)
    w = torch.rand(16, 4, generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:4] for _ in range(16)])
    assert _rank_order_violations(x, w13, w2, w, ids) == []
    monkeypatch.setattr(moe, "_fused_moe_reference", expert_order)
    assert _rank_order_violations(x, w13, w2, w, ids) != []


def test_tie_checker_fails_on_ties_to_the_higher_index():
    def higher_index(logits, k):
        flipped = logits.flip(-1)
        w, ids = vk.moe_route(flipped, k)
        return w, logits.shape[-1] - 1 - ids

    assert _tie_violations(higher_index) != []
