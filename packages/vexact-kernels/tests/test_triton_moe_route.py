"""The Triton routing kernel (CUDA's moe_route): through the interpreter on CPU, on the GPU where there is one."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import vexact_kernels as vk
from vexact_kernels.triton_ops import interpreting, triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")
interp = pytest.mark.skipif(not interpreting(), reason="interpreter tests run where TRITON_INTERPRET=1 (no GPU)")


def _route(logits, k, norm):
    from vexact_kernels.triton_ops.moe_route import triton_moe_route

    return triton_moe_route(logits, k, norm)


@interp
@settings(max_examples=12, deadline=None)
@given(t=st.integers(1, 12), e=st.sampled_from([4, 8, 60, 128]), data=st.data(), norm=st.booleans())
def test_interpreted_route_matches_reference_and_is_row_invariant(t, e, data, norm):
    k = data.draw(st.integers(1, min(8, e)))
    g = torch.Generator().manual_seed(t * 131 + e + k)
    logits = torch.randn(t, e, generator=g) * 3
    logits[0, : min(3, e)] = 2.5  # ties: the lower index wins
    w, ids = _route(logits, k, norm)
    ref_w, ref_ids = vk.moe_route(logits, k, norm)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)
    for i in {0, t - 1}:
        wi, idi = _route(logits[i : i + 1], k, norm)
        assert torch.equal(wi[0], w[i]) and torch.equal(idi[0], ids[i])


@interp
def test_interpreted_route_backward_is_the_softmax_gradient():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 8, generator=g, requires_grad=True)
    upstream = torch.randn(5, 3, generator=g)
    w, _ = _route(logits, 3, True)
    (w * upstream).sum().backward()
    ref_logits = logits.detach().clone().requires_grad_(True)
    ref_w, _ = vk.moe_route(ref_logits, 3, True)
    (ref_w * upstream).sum().backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_gpu_route_row_invariant_ties_and_graph_capturable():
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(4096, 128, generator=g, device="cuda")
    logits[7, 10:20] = 9.0  # ten-way tie at the top
    w, ids = vk.moe_route(logits, 8, True)
    assert ids[7].tolist() == list(range(10, 18))
    for rows in ([0], [7], list(range(5, 300)), list(range(4000, 4096))):
        wi, idi = vk.moe_route(logits[rows], 8, True)
        assert torch.equal(wi, w[rows]) and torch.equal(idi, ids[rows])
    ref_w, ref_ids = vk.moe_route(logits.cpu(), 8, True)
    agree = (ids.cpu() == ref_ids).all(-1).float().mean().item()
    assert agree > 0.999, agree  # the CPU reference's exp may break a near-tie the other way
    static = logits[:64].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gw, gids = vk.moe_route(static, 8, True)
    static.copy_(logits[64:128])
    graph.replay()
    assert torch.equal(gw, w[64:128]) and torch.equal(gids, ids[64:128])


# moe_route_grouped (DeepSeek-V3 routing) on CUDA: the grouped kernel.


def _grouped_route(logits, k, bias=None, n_group=1, topk_group=1, norm=True, scale=1.0, scoring="sigmoid"):
    from vexact_kernels.triton_ops.moe_route import triton_moe_route_grouped

    return triton_moe_route_grouped(logits, k, bias, n_group, topk_group, norm, scale, scoring)


def _exp_agreeing_values():
    """Logits whose ``exp(-x)`` has the same bits in torch and in numpy (the interpreter's ``tl.exp``), on arrays and
    on scalars. On these the sigmoid scores agree bit for bit, so everything after them (the group sums, the masks,
    the k selection rounds, the rank-order renormalisation, the scale) is compared with ``torch.equal``."""
    import numpy as np

    x = torch.randn(1024, generator=torch.Generator().manual_seed(0)) * 2
    n = (-x).numpy()
    ok = (torch.exp(-x) == torch.from_numpy(np.exp(n))) & (
        torch.exp(-x) == torch.from_numpy(np.exp(n.astype(np.float64)).astype(np.float32))
    )
    scalar = torch.tensor([bool(np.exp(v) == np.float32(np.exp(np.float64(v)))) for v in n])
    return x[ok & scalar]


_GROUPED_SHAPES = [(64, 6, 1, 1, 2.446), (32, 4, 4, 2, 2.5), (24, 3, 4, 2, 1.0), (12, 5, 3, 3, 1.0), (16, 3, 8, 3, 1.0)]


@interp
@settings(max_examples=8, deadline=None)
@given(t=st.integers(1, 6), shape=st.sampled_from(_GROUPED_SHAPES), norm=st.booleans(), with_bias=st.booleans())
def test_interpreted_grouped_route_is_the_cpu_reference_bitwise(t, shape, norm, with_bias):
    e, k, n_group, topk_group, scale = shape
    pool = _exp_agreeing_values()
    g = torch.Generator().manual_seed(t * 7 + e)
    logits = pool[torch.randint(0, len(pool), (t, e), generator=g)]
    logits[0] = 0.0  # every expert and group ties: the lower indices win
    if t > 1 and n_group > 2:  # groups 0, 1 and the last tie on a + b: with topk_group = 2 the last is dropped
        a, b, c = logits[1, :3].sort(descending=True).values.tolist()
        gs = e // n_group
        logits[1] = c
        logits[1, [1, 0, gs, gs + 1, e - gs, e - gs + 1]] = torch.tensor([a, b, a, b, a, b])
    bias = (torch.randn(e, generator=g) * 0.3) if with_bias else None
    kw = dict(bias=bias, n_group=n_group, topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=scale)
    ref_w, ref_ids = vk.moe_route_grouped(logits, k, **kw)
    w, ids = _grouped_route(logits, k, bias, n_group, topk_group, norm, scale)
    assert torch.equal(ids, ref_ids) and torch.equal(w, ref_w)
    for i in {0, t - 1}:
        wi, idi = _grouped_route(logits[i : i + 1], k, bias, n_group, topk_group, norm, scale)
        assert torch.equal(wi[0], w[i]) and torch.equal(idi[0], ids[i])


@interp
def test_interpreted_grouped_route_softmax_scoring():
    """Softmax scores: the ids are the reference's; the weights agree to fp32 rounding (numpy's sum over the row
    is not the reference's pairwise tree, and its exp is not torch's)."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 32, generator=g) * 3
    kw = dict(n_group=4, topk_group=2, routed_scaling_factor=2.5, scoring_func="softmax")
    ref_w, ref_ids = vk.moe_route_grouped(logits, 5, **kw)
    w, ids = _grouped_route(logits, 5, None, 4, 2, True, 2.5, "softmax")
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=0)


@interp
def test_interpreted_grouped_route_backward_matches_the_reference_autograd():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 32, generator=g, requires_grad=True)
    bias = torch.randn(32, generator=g) * 0.5
    upstream = torch.randn(5, 4, generator=g)
    w, ids = _grouped_route(logits, 4, bias, 4, 2, True, 2.5)
    (w * upstream).sum().backward()
    ref_logits = logits.detach().clone().requires_grad_(True)
    ref_w, ref_ids = vk.moe_route_grouped(ref_logits, 4, bias=bias, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    (ref_w * upstream).sum().backward()
    assert torch.equal(ids, ref_ids) and logits.grad.abs().sum() > 0
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "e, k, n_group, topk_group, scale", [(64, 6, 1, 1, 2.446), (256, 8, 8, 4, 2.5)], ids=["moonlight", "deepseek_v3"]
)
def test_gpu_grouped_route_row_invariant_ties_and_graph_capturable(e, k, n_group, topk_group, scale):
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(4096, e, generator=g, device="cuda") * 2
    bias = torch.randn(e, generator=g, device="cuda") * 0.5
    kw = dict(bias=bias, n_group=n_group, topk_group=topk_group, routed_scaling_factor=scale)
    w, ids = vk.moe_route_grouped(logits, k, **kw)
    for rows in ([0], [7], list(range(5, 300)), list(range(4000, 4096))):
        wi, idi = vk.moe_route_grouped(logits[rows], k, **kw)
        assert torch.equal(wi, w[rows]) and torch.equal(idi, ids[rows])
    wb, idb = vk.moe_route_grouped(logits.bfloat16(), k, **kw)
    wb1, idb1 = vk.moe_route_grouped(logits.bfloat16()[100:101], k, **kw)
    assert torch.equal(wb1[0], wb[100]) and torch.equal(idb1[0], idb[100])
    _, tie_ids = vk.moe_route_grouped(torch.zeros(3, e, device="cuda"), k, **{**kw, "bias": None})
    assert tie_ids.tolist() == [list(range(k))] * 3
    ref_w, ref_ids = vk.moe_route_grouped(logits.cpu(), k, **{**kw, "bias": bias.cpu()})
    same = (ids.cpu() == ref_ids).all(-1)
    assert same.float().mean().item() > 0.999, same.float().mean().item()  # GPU exp may break a near-tie otherwise
    torch.testing.assert_close(w.cpu()[same], ref_w[same], rtol=1e-5, atol=0)
    static = logits[:64].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gw, gids = vk.moe_route_grouped(static, k, **kw)
    static.copy_(logits[64:128])
    graph.replay()
    assert torch.equal(gw, w[64:128]) and torch.equal(gids, ids[64:128])
    lg = logits[:32].clone().requires_grad_(True)
    up = torch.randn(32, k, generator=g, device="cuda")
    (vk.moe_route_grouped(lg, k, **kw)[0] * up).sum().backward()
    ref_lg = logits[:32].cpu().requires_grad_(True)
    (vk.moe_route_grouped(ref_lg, k, **{**kw, "bias": bias.cpu()})[0] * up.cpu()).sum().backward()
    torch.testing.assert_close(lg.grad.cpu(), ref_lg.grad, rtol=1e-4, atol=1e-5)
