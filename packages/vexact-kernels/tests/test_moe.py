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


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm")
@pytest.mark.parametrize("routing", ["uniform", "skewed", "one_token"])
def test_fast_grouped_plan_equals_the_per_expert_loop(routing):
    """The fast backend's device-planned grouped path (what it runs on a Hopper GPU) computes what its per-expert
    loop computes: rows grouped and padded right, pairs mapped back to their tokens, gradients too (torch's CPU
    ``_grouped_mm`` in fp32 checks the plan here; the GPU test checks bf16 under a CUDA graph)."""
    g = torch.Generator().manual_seed(5)
    t, e, k = {"uniform": (37, 8, 3), "skewed": (37, 8, 3), "one_token": (1, 6, 4)}[routing]
    x = torch.randn(t, H, generator=g).requires_grad_()
    _, w13, w2 = _layer(g, e, dtype=torch.float32)
    w13.requires_grad_(), w2.requires_grad_()
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    if routing == "skewed":  # every token's first choice is expert 0: a group far over the padding unit
        rest = [torch.randperm(e - 1, generator=g)[: k - 1] + 1 for _ in range(t)]
        ids = torch.stack([torch.cat([torch.tensor([0]), r]) for r in rest])
    w = torch.rand(t, k, generator=g).requires_grad_()
    outs, grads = [], []
    for fn in (moe._fused_moe_fast_grouped, moe._fused_moe_fast):
        out = fn(x, w13, w2, w, ids)
        outs.append(out)
        grads.append(torch.autograd.grad(out.square().sum(), (x, w13, w2, w)))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


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


# moe_route_grouped: DeepSeek-V3 routing (sigmoid scores, bias for the selection only, group-limited top-k).

MOONLIGHT = dict(e=64, k=6, n_group=1, topk_group=1, scale=2.446)
DEEPSEEK_V3 = dict(e=256, k=8, n_group=8, topk_group=4, scale=2.5)


def _grouped(logits, shape, bias=None, norm=True, route=None):
    route = route or vk.moe_route_grouped
    kw = dict(n_group=shape["n_group"], topk_group=shape["topk_group"], routed_scaling_factor=shape["scale"])
    return route(logits, shape["k"], bias=bias, norm_topk_prob=norm, **kw)


def _hf_route(logits, shape, bias, norm):
    """transformers' own DeepseekV3MoE.route_tokens_to_experts (ids unsorted: it calls topk with sorted=False)."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = DeepseekV3Config(
        hidden_size=8, moe_intermediate_size=4, n_routed_experts=shape["e"], num_experts_per_tok=shape["k"],
        n_group=shape["n_group"], topk_group=shape["topk_group"], routed_scaling_factor=shape["scale"],
        norm_topk_prob=norm,
    )  # fmt: skip
    layer = DeepseekV3MoE(cfg)
    layer.gate.e_score_correction_bias.copy_(bias)
    ids, w = layer.route_tokens_to_experts(logits)
    return w, ids


def _hf_parity_violations(route, shape, norm, seed=0, t=64):
    """Where ``route`` disagrees with transformers: the chosen sets (HF's ranks are unordered, so both sides are
    sorted by expert id) must be equal; the weights equal within fp32 rounding. Why ``rtol = 2e-6`` (17 * 2^-23):
    transformers' ``torch.sigmoid`` and our ``1 / (1 + exp(-x))`` differ by <= 2 ulp per score; its sum of the
    k <= 8 scores runs in another order (<= k - 1 ulp); the division and the scale add 1 ulp each: <= 12 ulp. A weight
    from the biased score, a lost group mask or a lost renormalisation is off by far more (percent). Measured: at
    most 3.1 * 2^-23 over 2,560 rows of both shapes."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, shape["e"], generator=g) * 2
    bias = torch.randn(shape["e"], generator=g) * 0.5  # large enough that it changes the choice
    hw, hids = _hf_route(logits, shape, bias, norm)
    w, ids = _grouped(logits, shape, bias, norm, route)
    hids, horder = hids.sort(-1)
    sids, order = ids.sort(-1)
    if not torch.equal(hids, sids):
        return [f"ids differ in {int((hids != sids).any(-1).sum())} rows"]
    hw, sw = hw.gather(1, horder), w.gather(1, order)
    if not torch.allclose(sw, hw, rtol=2e-6, atol=0):
        return [f"weights differ by up to {((sw - hw).abs() / hw.abs()).max().item():.3g} (relative)"]
    return []


@pytest.mark.parametrize("shape", [MOONLIGHT, DEEPSEEK_V3], ids=["moonlight", "deepseek_v3"])
@pytest.mark.parametrize("norm", [True, False])
def test_grouped_route_matches_transformers(shape, norm):
    assert _hf_parity_violations(None, shape, norm) == []
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, shape["e"], generator=g) * 2
    w, ids = _grouped(logits, shape)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and w.shape == ids.shape == (64, shape["k"])
    choice = torch.sigmoid(logits).gather(1, ids)
    assert (choice[:, :-1] >= choice[:, 1:]).all()  # ranks ordered by the selection score
    torch.testing.assert_close(w.sum(-1), torch.full((64,), shape["scale"]), rtol=1e-6, atol=0)
    with vk.use_backend("fast"):
        fw, fids = _grouped(logits, shape)
    assert torch.equal(fids, ids)
    torch.testing.assert_close(fw, w, rtol=2e-6, atol=0)


def test_grouped_route_softmax_scoring_is_moe_route_when_ungrouped():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(9, 16, generator=g) * 3
    w, ids = vk.moe_route_grouped(logits, 4, scoring_func="softmax")
    ref_w, ref_ids = vk.moe_route(logits, 4, True)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=0)  # the same softmax; only the 1e-20 differs


def _grouped_tie_violations(route):
    """Rows where equal scores or equal group scores did not go to the lower index (E=16 in 4 groups, keep 2)."""
    a, b, c = 3.0, 2.0, -1.0
    logits = torch.tensor(
        [
            [0.0] * 16,  # every expert and group ties: groups 0, 1, experts 0, 1, 2
            [c, c, c, c, a, b, c, c, b, a, c, c, c, c, a, b],  # groups 1, 2, 3 tie (a + b); 1 and 2 kept
            [a, c, c, c, c, c, c, c, c, c, c, a, c, c, a, a],  # group 3 best; 0 and 2 tie, 0 kept (not 11)
        ]
    )
    expect = [[0, 1, 2], [4, 9, 5], [0, 14, 15]]
    _, ids = route(logits, 3, n_group=4, topk_group=2)
    return [r for r in range(3) if ids[r].tolist() != expect[r]]


def test_grouped_route_ties_go_to_the_lower_index():
    assert _grouped_tie_violations(vk.moe_route_grouped) == []
    w, ids = vk.moe_route_grouped(torch.zeros(2, 8), 4, bias=torch.zeros(8), routed_scaling_factor=2.0)
    assert ids.tolist() == [[0, 1, 2, 3]] * 2 and torch.equal(w, torch.full((2, 4), 0.5))


def test_grouped_tie_checker_fails_on_ties_to_the_higher_index():
    def higher_index(logits, k, **kw):  # flipping E reverses both the group order and the order inside groups
        w, ids = vk.moe_route_grouped(logits.flip(-1), k, **kw)
        return w, logits.shape[-1] - 1 - ids

    assert _grouped_tie_violations(higher_index) != []


def test_grouped_parity_checker_fails_on_perturbed_routers():
    def bias_in_weights(logits, k, *, bias, norm_topk_prob, routed_scaling_factor, **kw):
        _, ids = vk.moe_route_grouped(
            logits, k, bias=bias, norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor, **kw
        )
        w = (torch.sigmoid(logits) + bias).gather(1, ids)
        w = w / w.sum(-1, keepdim=True) if norm_topk_prob else w
        return w * routed_scaling_factor, ids

    def groups_ignored(logits, k, *, n_group, topk_group, **kw):
        return vk.moe_route_grouped(logits, k, **kw)

    assert _hf_parity_violations(bias_in_weights, DEEPSEEK_V3, True) != []
    assert _hf_parity_violations(groups_ignored, DEEPSEEK_V3, True) != []


@settings(max_examples=15, deadline=None)
@given(t=st.integers(1, 48), rows=st.data(), shape=st.sampled_from([MOONLIGHT, DEEPSEEK_V3]))
def test_grouped_route_row_alone_equals_row_in_batch(t, rows, shape):
    g = torch.Generator().manual_seed(t)
    logits = (torch.randn(t, shape["e"], generator=g) * 2).bfloat16()
    bias = torch.randn(shape["e"], generator=g) * 0.5
    w, ids = _grouped(logits, shape, bias)
    for r in rows.draw(st.lists(st.integers(0, t - 1), min_size=1, max_size=3)):
        wr, idr = _grouped(logits[r : r + 1], shape, bias)
        assert torch.equal(wr[0], w[r]) and torch.equal(idr[0], ids[r])
    cut = rows.draw(st.integers(0, t))
    parts = [_grouped(p, shape, bias) for p in (logits[:cut], logits[cut:])]
    assert torch.equal(torch.cat([p[0] for p in parts]), w) and torch.equal(torch.cat([p[1] for p in parts]), ids)


def test_grouped_route_gradient_matches_transformers_autograd():
    g = torch.Generator().manual_seed(3)
    shape = dict(e=32, k=4, n_group=4, topk_group=2, scale=2.5)
    logits = torch.randn(6, 32, generator=g, dtype=torch.float64) * 2
    bias = torch.randn(32, generator=g) * 0.5
    upstream = torch.randn(6, 4, generator=g)
    ours = logits.float().requires_grad_(True)
    w, ids = _grouped(ours, shape, bias)
    (w * upstream).sum().backward()
    ref = logits.clone().requires_grad_(True)  # float64: the exact gradient, through torch.sigmoid
    rw = torch.sigmoid(ref).gather(1, ids)
    (rw / rw.sum(-1, keepdim=True) * 2.5 * upstream.double()).sum().backward()
    assert ours.grad.abs().sum() > 0
    torch.testing.assert_close(ours.grad.double(), ref.grad, rtol=1e-5, atol=1e-6)
    far = torch.full((1, 32), -200.0, requires_grad=True)  # exp(200) overflows: the gradient must stay finite
    (_grouped(far, shape)[0] * upstream[:1]).sum().backward()
    assert torch.isfinite(far.grad).all()


def test_grouped_route_bad_inputs_are_errors():
    x = torch.zeros(3, 16)
    ok = dict(n_group=4, topk_group=2)
    for kw, err, match in [
        (dict(n_group=3), ValueError, "n_group"),
        (dict(n_group=0), ValueError, "n_group"),
        (dict(n_group=4.0), ValueError, "n_group"),
        (dict(n_group=4, topk_group=5), ValueError, "topk_group"),
        (dict(n_group=4, topk_group=0), ValueError, "topk_group"),
        (dict(n_group=4, topk_group=True), ValueError, "topk_group"),
        (dict(n_group=16, topk_group=2), ValueError, ">= 2 experts"),
        (dict(ok, bias=torch.zeros(15)), TypeError, "bias"),
        (dict(ok, bias=torch.zeros(16, dtype=torch.bfloat16)), TypeError, "bias"),
        (dict(ok, bias=[0.0] * 16), TypeError, "bias"),
        (dict(ok, norm_topk_prob=1), TypeError, "norm_topk_prob"),
        (dict(ok, routed_scaling_factor=True), TypeError, "routed_scaling_factor"),
        (dict(ok, routed_scaling_factor=torch.tensor(2.5)), TypeError, "routed_scaling_factor"),
        (dict(ok, scoring_func="softplus"), ValueError, "scoring_func"),
    ]:
        with pytest.raises(err, match=match):
            vk.moe_route_grouped(x, 2, **kw)
    for k in (9, 0, True, 2.0):  # two groups of four kept: at most 8 experts
        with pytest.raises(ValueError, match=r"top_k must be an int in \[1, .* = 8\]"):
            vk.moe_route_grouped(x, k, **ok)
    with pytest.raises(ValueError, match=r"\[T, E\]"):
        vk.moe_route_grouped(torch.zeros(16), 2)
    with pytest.raises(TypeError, match="dtype"):
        vk.moe_route_grouped(x.long(), 2)
    w, ids = vk.moe_route_grouped(x[:0], 8, **ok)
    assert w.shape == ids.shape == (0, 8)
