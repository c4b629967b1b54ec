"""gpt-oss's MoE in the CPU reference: top-k-then-softmax routing, expert biases, interleaved gate/up and the clamped
SwiGLU (``moe_route(topk_before_softmax=True)``, ``fused_moe``'s optional arguments, ``clamped_swiglu``).

Against transformers' GptOssTopKRouter / GptOssExperts arithmetic in float64 (weights held as transformers holds
them, ``[E, H, 2I]``, passed transposed); batch invariance; ties to the lower index; the defaults leave results
unchanged; gradients; errors. (On CUDA tensors the Triton kernels run them: ``test_triton_moe_gpt_oss.py``.)
"""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import vexact_kernels as vk

moe = importlib.import_module("vexact_kernels.moe")
activation = importlib.import_module("vexact_kernels.activation")

H, INTER, E = 32, 16, 8
ALPHA, LIMIT = 1.702, 7.0


def _experts(seed: int, dtype=torch.float32, e=E, h=H, i=INTER, scale=3.0):
    """transformers' layout: gate_up [E, H, 2I] (gate even columns, up odd), its bias [E, 2I], down [E, I, H], its
    bias [E, H]. ``scale`` large enough that some gate/up values pass the clamp at 7."""
    g = torch.Generator().manual_seed(seed)
    gu = (torch.randn(e, h, 2 * i, generator=g) * scale * h**-0.5).to(dtype)
    gu_b = (torch.randn(e, 2 * i, generator=g) * 2).to(dtype)
    down = (torch.randn(e, i, h, generator=g) * i**-0.5).to(dtype)
    down_b = torch.randn(e, h, generator=g).to(dtype)
    return gu, gu_b, down, down_b


def _run(x, gu, gu_b, down, down_b, w, ids):
    return vk.fused_moe(
        x, gu.transpose(1, 2), down.transpose(1, 2), w, ids, b_gate_up=gu_b, b_down=down_b,
        gate_up_interleaved=True, activation="clamped_swiglu",
    )  # fmt: skip


def _hf_experts64(x, gu, gu_b, down, down_b, w, ids):
    """GptOssExperts.forward's arithmetic, token by token, in float64."""
    x, gu, gu_b, down, down_b, w = (a.double() for a in (x, gu, gu_b, down, down_b, w))
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for r in range(ids.shape[1]):
            e = int(ids[t, r])
            hh = x[t] @ gu[e] + gu_b[e]
            gate, up = hh[::2].clamp(max=LIMIT), hh[1::2].clamp(-LIMIT, LIMIT)
            out[t] += w[t, r] * (((up + 1) * gate * torch.sigmoid(gate * ALPHA)) @ down[e] + down_b[e])
    return out


def _hf_route64(logits, k):
    top, ids = torch.topk(logits.double(), k, dim=-1)
    return torch.softmax(top, dim=1), ids


def test_route_matches_transformers_router():
    logits = torch.randn(50, E, generator=torch.Generator().manual_seed(0)) * 3
    w, ids = vk.moe_route(logits, 4, topk_before_softmax=True)
    w64, ids64 = _hf_route64(logits, 4)
    assert torch.equal(ids, ids64)
    assert w.dtype == torch.float32
    torch.testing.assert_close(w.double(), w64, rtol=1e-6, atol=1e-7)
    with vk.use_backend("fast"):
        wf, idsf = vk.moe_route(logits, 4, topk_before_softmax=True)
    assert torch.equal(idsf, ids)
    torch.testing.assert_close(wf.double(), w64, rtol=1e-6, atol=1e-7)


def test_route_ties_go_to_the_lower_index():
    logits = torch.tensor([[0.0] * 8, [1.0, 5.0, 5.0, 2.0, 5.0, 0.0, 5.0, 5.0], [3.0, 3.0, 1.0, 3.0, 0, 0, 0, 0]])
    _, ids = vk.moe_route(logits, 3, topk_before_softmax=True)
    assert ids.tolist() == [[0, 1, 2], [1, 2, 4], [0, 1, 3]]


def test_route_gradient_flows_through_the_chosen_logits():
    logits = torch.randn(6, E, generator=torch.Generator().manual_seed(1)).requires_grad_()
    w, ids = vk.moe_route(logits, 2, topk_before_softmax=True)
    (w * torch.arange(1.0, 3.0)).sum().backward()
    unchosen = torch.ones_like(logits, dtype=torch.bool).scatter_(1, ids, False)
    assert torch.equal(logits.grad[unchosen], torch.zeros(int(unchosen.sum())))
    assert (logits.grad.gather(1, ids) != 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_match_transformers_in_float64(dtype):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(20, H, generator=g).to(dtype)
    experts = _experts(3, dtype)
    w, ids = vk.moe_route(torch.randn(20, E, generator=g), 4, topk_before_softmax=True)
    out = _run(x, *experts, w, ids)
    assert out.dtype == dtype
    want = _hf_experts64(x, *experts, w, ids)
    tol = 1e-5 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
    with vk.use_backend("fast"):
        fast = _run(x, *experts, w, ids)
    torch.testing.assert_close(fast.double(), want, rtol=tol, atol=tol)


@settings(max_examples=15, deadline=None)
@given(m=st.integers(1, 12), k=st.integers(1, 4), skew=st.sampled_from([0.0, 40.0]), seed=st.integers(0, 2**16))
def test_route_and_experts_are_batch_invariant(m, k, skew, seed):
    """A token's output alone == in the batch == in two chunks, for loads from even to every token on one expert."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, H, generator=g).to(torch.bfloat16)
    logits = torch.randn(m, E, generator=g)
    logits[:, 0] += skew

    def op(rows):
        w, ids = vk.moe_route(logits[rows], k, topk_before_softmax=True)
        return _run(x[rows], *experts, w, ids)

    experts = _experts(seed, torch.bfloat16)
    full = op(slice(None))
    for r in range(m):
        assert torch.equal(op(slice(r, r + 1))[0], full[r])
    cut = m // 2
    assert torch.equal(torch.cat([op(slice(0, cut)), op(slice(cut, None))]), full)


def test_defaults_leave_results_unchanged():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, H, generator=g).to(torch.bfloat16)
    w13 = torch.randn(E, 2 * INTER, H, generator=g).to(torch.bfloat16)
    w2 = torch.randn(E, H, INTER, generator=g).to(torch.bfloat16)
    logits = torch.randn(9, E, generator=g)
    w, ids = vk.moe_route(logits, 2)
    w_, ids_ = vk.moe_route(logits, 2, topk_before_softmax=False)
    assert torch.equal(w, w_) and torch.equal(ids, ids_)
    plain = vk.fused_moe(x, w13, w2, w, ids)
    same = vk.fused_moe(
        x, w13, w2, w, ids, b_gate_up=None, b_down=None, gate_up_interleaved=False, activation="silu"
    )  # fmt: skip
    assert torch.equal(plain, same)
    # a zero bias adds nothing: the bias path is the plain one plus exact zeros
    zb = vk.fused_moe(x, w13, w2, w, ids, b_gate_up=torch.zeros(E, 2 * INTER), b_down=torch.zeros(E, H))
    assert torch.equal(zb, plain)


def test_backward_is_deterministic_and_close_to_float64():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(10, H, generator=g)
    experts = _experts(6)
    logits = torch.randn(10, E, generator=g)
    grads = []
    for fn, dtype in ((_run, torch.float32), (_run, torch.float32), (_hf_experts64, torch.float64)):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (x, *experts, logits)]
        if fn is _run:
            w, ids = vk.moe_route(leaves[-1], 4, topk_before_softmax=True)
        else:
            w, ids = _hf_route64(leaves[-1], 4)
        (fn(*leaves[:-1], w, ids).double() ** 2).sum().backward()
        grads.append([t.grad.double() for t in leaves])
    for a, b, c in zip(*grads, strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-4)


def test_clamped_swiglu_matches_float64_and_its_clamps():
    gate = torch.tensor([-30.0, -7.5, -1.0, 0.0, 0.5, 6.99, 7.0, 7.01, 50.0])
    up = torch.tensor([-50.0, -7.0, -6.9, 0.0, 1.0, 7.0, 7.5, -8.0, 3.0])
    out = vk.clamped_swiglu(gate, up)
    g64, u64 = gate.double().clamp(max=LIMIT), up.double().clamp(-LIMIT, LIMIT)
    want = (u64 + 1) * g64 * torch.sigmoid(g64 * ALPHA)
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-12)  # a few fp32 roundings
    assert torch.equal(vk.clamped_swiglu(gate[7:8], up[7:8]), vk.clamped_swiglu(torch.tensor([7.0]), up[7:8]))
    gate.requires_grad_()
    up.requires_grad_()
    vk.clamped_swiglu(gate, up).sum().backward()
    assert gate.grad[-1] == 0 and up.grad[0] == 0 and up.grad[1] != 0


def test_bad_inputs_are_errors():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, H, generator=g)
    gu, gu_b, down, down_b = _experts(8)
    w, ids = vk.moe_route(torch.randn(3, E, generator=g), 2, topk_before_softmax=True)
    args = (x, gu.transpose(1, 2), down.transpose(1, 2), w, ids)
    with pytest.raises(ValueError, match=r"b_gate_up must be \[8, 32\]"):
        vk.fused_moe(*args, b_gate_up=gu_b[:, :4])
    with pytest.raises(ValueError, match=r"b_down must be \[8, 32\]"):
        vk.fused_moe(*args, b_down=down_b[:4])
    with pytest.raises(ValueError, match="activation must be one of"):
        vk.fused_moe(*args, activation="gelu")
    with pytest.raises(ValueError, match="differ in shape"):
        vk.clamped_swiglu(torch.zeros(3), torch.zeros(4))
