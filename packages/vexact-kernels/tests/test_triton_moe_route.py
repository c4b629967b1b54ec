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
