"""The Triton fused MoE with gpt-oss's experts: expert biases, interleaved gate/up, the clamped SwiGLU; forward and
backward against float64 (transformers' GptOssExperts arithmetic; the backward's clamp decisions taken on the
kernel's stored pre-activation) and the CPU reference (tolerance), rows invariant to the batch (torch.equal); the
clamped SwiGLU alone; top-k-then-softmax routing on CUDA. On CPU through the interpreter at tiny shapes; on the GPU
at real shapes (``-m gpu``).
"""

from __future__ import annotations

import pytest
import torch

import vexact_kernels as vk
from vexact_kernels.triton_ops import interpreting, triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")
interp = pytest.mark.skipif(not interpreting(), reason="interpreter tests run where TRITON_INTERPRET=1 (no GPU)")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ALPHA, LIMIT = 1.702, 7.0


def _inputs(seed, t, h, i, e, k, dtype, device="cpu", scale=3.0):
    """transformers' layout (gate_up [E, H, 2I], gate the even columns; down [E, I, H]) with biases; ``scale`` large
    enough that some gate/up values pass the clamp at 7."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    gu = (torch.randn(e, h, 2 * i, generator=g) * scale * h**-0.5).to(dtype)
    gu_b = (torch.randn(e, 2 * i, generator=g) * 2).to(dtype)
    down = (torch.randn(e, i, h, generator=g) * i**-0.5).to(dtype)
    down_b = torch.randn(e, h, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.softmax(torch.randn(t, k, generator=g), dim=-1)
    return [a.to(device) for a in (x, gu, gu_b, down, down_b, w, ids)]


def _triton(x, gu, gu_b, down, down_b, w, ids):
    from vexact_kernels.triton_ops.moe import triton_fused_moe

    return triton_fused_moe(
        x, gu.transpose(1, 2), down.transpose(1, 2), w, ids, b_gate_up=gu_b, b_down=down_b,
        gate_up_interleaved=True, activation="clamped_swiglu",
    )  # fmt: skip


def _cpu_reference(x, gu, gu_b, down, down_b, w, ids):
    return vk.fused_moe(
        x, gu.transpose(1, 2), down.transpose(1, 2), w, ids, b_gate_up=gu_b, b_down=down_b,
        gate_up_interleaved=True, activation="clamped_swiglu",
    )  # fmt: skip


def _hf64(x, gu, gu_b, down, down_b, w, ids, decide=None):
    """GptOssExperts.forward's arithmetic, token by token, in float64 (differentiable). ``decide [T, k, 2I]`` (None:
    the float64 pre-activation itself): the pre-activation whose clamp decisions (pass, with the bounds, or clamp)
    the float64 arithmetic takes."""
    out = []
    for t in range(x.shape[0]):
        acc = torch.zeros_like(x[t])
        for r in range(ids.shape[1]):
            e = int(ids[t, r])
            hh = x[t] @ gu[e] + gu_b[e]
            d = hh.detach() if decide is None else decide[t, r].to(hh.dtype)
            g, u, dg, du = hh[::2], hh[1::2], d[::2], d[1::2]
            gate = torch.where(dg <= LIMIT, g, g.detach().clamp(max=LIMIT))
            up = torch.where((du >= -LIMIT) & (du <= LIMIT), u, u.detach().clamp(-LIMIT, LIMIT))
            acc = acc + w[t, r] * (((up + 1) * gate * torch.sigmoid(gate * ALPHA)) @ down[e] + down_b[e])
        out.append(acc)
    return torch.stack(out)


def _passes(h):
    """Where the clamps of a pre-activation ``[..., 2I]`` (gate even, up odd) pass the gradient: torch's ``clamp``,
    bounds included."""
    p = h[..., 1::2].abs().repeat_interleave(2, dim=-1) <= LIMIT
    p[..., ::2] = h[..., ::2] <= LIMIT
    return p


def _hf64_preactivation(x, gu, gu_b, ids):
    """``[T, k, 2I]`` in float64: ``x[t] @ gu[e] + gu_b[e]`` of each (token, rank)."""
    x, gu, gu_b = x.double(), gu.double(), gu_b.double()
    return torch.stack([torch.bmm(x[:, None], gu[ids[:, r]])[:, 0] + gu_b[ids[:, r]] for r in range(ids.shape[1])], 1)


def _kernel_preactivation(x, gu, gu_b, down, down_b, w, ids):
    """``[T, k, 2I]``: the pre-activation ``x @ gate_up + bias`` as the kernel's forward stores it (x's dtype), the
    value its clamps decide on."""
    from vexact_kernels.triton_ops import interpreting, moe

    t, k = ids.shape
    plan = moe._Plan(ids, gu.shape[0])
    config = moe.pick_config(t * k, interpreting(), x.element_size())
    extras = moe.Extras(gu_b, down_b, True, "clamped_swiglu")
    h = moe._forward(x, gu.transpose(1, 2), down.transpose(1, 2), w.float(), plan, config, extras)[0]
    return h[plan.inv].view(t, k, -1)


def _grads(fn, args, gy, dtype, **kw):
    leaves = [a.detach().to(dtype).requires_grad_() for a in args[:6]]
    fn(*leaves, args[6], **kw).backward(gy.to(dtype))
    return [a.grad for a in leaves]


def _check(args, tol_fwd, tol_bwd):
    x = args[0]
    out = _triton(*args)
    assert out.dtype == x.dtype and out.shape == x.shape
    ref = _hf64(*[a.double() for a in args[:6]], args[6])
    # against the output's scale, as the gradients below: a bf16 row rounds its intermediates at their own magnitude,
    # so an element near zero may sit several of its own ulps off (H200: 0.054 off at a reference of 0.022)
    assert (out.double() - ref).abs().max().item() <= tol_fwd * max(1.0, ref.abs().max().item())
    if x.device.type == "cpu":
        torch.testing.assert_close(out, _cpu_reference(*args), atol=tol_fwd, rtol=tol_fwd)
    # rows invariant to the batch: each row alone, two chunks, reversed
    t = x.shape[0]
    for r in range(min(t, 4)):
        assert torch.equal(_triton(*[a[r : r + 1] for a in args[:1]], *args[1:5], args[5][r : r + 1],
                                   args[6][r : r + 1])[0], out[r])  # fmt: skip
    rev = torch.arange(t - 1, -1, -1, device=x.device)
    assert torch.equal(_triton(x[rev], *args[1:5], args[5][rev], args[6][rev]), out[rev])
    gy = torch.randn(x.shape, generator=torch.Generator().manual_seed(9)).to(x.device)
    ours = _grads(_triton, args, gy, x.dtype)
    again = _grads(_triton, args, gy, x.dtype)
    # The clamps' derivative is a step at the limit: a bf16 pre-activation may fall on the other side of +-7 from
    # float64's (7.0068 rounds to 7.0 and passes) and each such flip moves dx by O(1) (t=96 below: 38 flips, dx off
    # float64's by 3.14 at a scale of 33.7 on the H200, 3.137 in the CPU reference). So the reference takes the
    # clamp decisions the kernel's forward took on its stored pre-activation, as transformers' bf16 GptOssExperts
    # decides on its bf16 one, and float64 arithmetic otherwise; the decisions may differ from float64's only within
    # one ulp of the limit (x's dtype, in [4, 8): 4 eps).
    h = _kernel_preactivation(*args)
    h64 = _hf64_preactivation(*args[:3], args[6])
    flips = _passes(h.double()) != _passes(h64)
    assert ((h64.abs() - LIMIT).abs()[flips] <= 4 * torch.finfo(x.dtype).eps).all()
    ref = _grads(_hf64, args, gy, torch.float64, decide=h)
    names = ("x", "gate_up", "gate_up_bias", "down", "down_bias", "topk_weights")
    for name, a, b, r in zip(names, ours, again, ref, strict=True):
        assert torch.equal(a, b), name
        scale = max(1.0, r.abs().max().item())
        assert (a.double() - r).abs().max().item() <= tol_bwd * scale, name


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interpreted_gpt_oss_experts_forward_backward(dtype):
    args = _inputs(1, 6, 32, 16, 5, 2, dtype)
    tol = (1e-4, 1e-4) if dtype == torch.float32 else (5e-2, 8e-2)
    _check(args, *tol)


@interp
def test_interpreted_defaults_are_the_plain_kernel():
    """No bias, halves, silu: the options' code path gives the bits of the path without them."""
    from vexact_kernels.triton_ops import moe

    x, gu, _, down, _, w, ids = _inputs(2, 5, 32, 16, 4, 2, torch.float32)
    w13, w2 = gu.transpose(1, 2), down.transpose(1, 2)
    plain = moe.triton_fused_moe(x, w13, w2, w, ids)
    zeros = torch.zeros(4, 32)
    assert torch.equal(moe.triton_fused_moe(x, w13, w2, w, ids, b_down=zeros), plain)


@interp
def test_interpreted_clamped_swiglu_close_to_the_cpu_reference():
    g = torch.Generator().manual_seed(3)
    gate, up = torch.randn(5, 24, generator=g) * 6, torch.randn(5, 24, generator=g) * 6
    gate[0, :4], up[1, :4], up[2, :4] = LIMIT, LIMIT, -LIMIT  # at the bounds, where bf16 values often sit
    gate.requires_grad_(), up.requires_grad_()
    from vexact_kernels.triton_ops.activation import triton_clamped_swiglu

    out = triton_clamped_swiglu(gate, up, ALPHA, LIMIT)
    torch.testing.assert_close(out, vk.clamped_swiglu(gate, up), atol=1e-5, rtol=1e-5)
    out.sum().backward()
    g64, u64 = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
    gc, uc = g64.clamp(max=LIMIT), u64.clamp(-LIMIT, LIMIT)
    ((uc + 1) * gc * torch.sigmoid(gc * ALPHA)).sum().backward()
    torch.testing.assert_close(gate.grad.double(), g64.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(up.grad.double(), u64.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@gpu
def test_gpu_gpt_oss_experts_forward_backward():
    args = _inputs(4, 96, 256, 128, 16, 4, torch.bfloat16, device="cuda")
    _check(args, 5e-2, 8e-2)


@pytest.mark.gpu
@gpu
def test_gpu_public_ops_take_the_gpt_oss_options():
    """The public fused_moe, clamped_swiglu and top-k-then-softmax routing on CUDA tensors: the Triton bits, rows
    invariant to the batch, routing close to float64."""
    args = _inputs(5, 40, 128, 64, 8, 2, torch.bfloat16, device="cuda")
    x, gu, gu_b, down, down_b, w, ids = args
    out = _cpu_reference(*args)  # the public op, here on CUDA tensors
    assert torch.equal(out, _triton(*args))
    gate, up = torch.randn(2, 40, 64, device="cuda").bfloat16().unbind(0)
    act = vk.clamped_swiglu(gate * 6, up * 6)
    assert torch.equal(act[3:4], vk.clamped_swiglu(gate[3:4] * 6, up[3:4] * 6))
    logits = torch.randn(50, 32, device="cuda")
    tw, tids = vk.moe_route(logits, 4, topk_before_softmax=True)
    top, ref_ids = torch.topk(logits.double(), 4, dim=-1)
    assert torch.equal(tids, ref_ids)
    torch.testing.assert_close(tw.double(), torch.softmax(top, dim=-1), atol=1e-6, rtol=1e-6)
    one_w, one_ids = vk.moe_route(logits[7:8], 4, topk_before_softmax=True)
    assert torch.equal(one_w[0], tw[7]) and torch.equal(one_ids[0], tids[7])


def _route_logits(device="cpu"):
    """Router logits for the top-k-then-softmax kernel: gpt-oss-20b's 32 experts and 120b's 128, a width that is not
    a power of two; ties (runs of equal values, +-0.0), a wide spread (terms whose exp is tiny) and a NaN row."""
    g = torch.Generator().manual_seed(11)
    rows = {e: torch.randn(24, e, generator=g) * 3 for e in (32, 128, 20)}
    for x in rows.values():
        x[0] = 0.0
        x[1, ::3] = 1.5
        x[2, :4] = torch.tensor([-0.0, 0.0, -0.0, 0.0])
        x[2, 4:] = -1.0
        x[3] *= 40.0
        x[4, 5] = float("nan")
    return {e: x.to(device) for e, x in rows.items()}


def _route_kernel(logits, k):
    from vexact_kernels.moe import _topk_softmax_weights
    from vexact_kernels.triton_ops.moe_route import triton_moe_route_topk_first

    return triton_moe_route_topk_first(logits, k, _topk_softmax_weights)


def _route_torch(logits, k):
    """The invariant backend's torch ops on CUDA (``moe._route_topk_softmax``), here on any device."""
    from vexact_kernels.moe import _top_ids, _topk_softmax_weights

    ids = _top_ids(logits.float(), k)
    return _topk_softmax_weights(logits, ids), ids


@interp
@pytest.mark.parametrize("k", [1, 3, 4])
def test_interpreted_route_topk_first_kernel(k):
    """The kernel's ids are the stable sort's first k (ties and NaN as torch orders them), its weights the softmax
    over those k (numpy's exp here, so close, not equal), a row's result the same alone as in the batch, and its
    router gradient the torch expression's, bit for bit."""
    for e, logits in _route_logits().items():
        w, ids = _route_kernel(logits, k)
        want_w, want_ids = _route_torch(logits, k)
        assert torch.equal(ids, want_ids), e
        ok = ~torch.isnan(logits).any(dim=1)
        torch.testing.assert_close(w[ok], want_w[ok], atol=1e-6, rtol=1e-6)
        for r in (0, 3, 17):
            one_w, one_ids = _route_kernel(logits[r : r + 1], k)
            assert torch.equal(one_ids[0], ids[r]) and torch.equal(one_w[0], w[r])
        leaf = logits[ok].clone().requires_grad_()
        gw = torch.randn(int(ok.sum()), k, generator=torch.Generator().manual_seed(e))
        (_route_kernel(leaf, k)[0] * gw).sum().backward()
        ref = logits[ok].clone().requires_grad_()
        (_route_torch(ref, k)[0] * gw).sum().backward()
        assert torch.equal(leaf.grad, ref.grad), e
    assert _route_kernel(torch.empty(0, 32), 4)[1].shape == (0, 4)


@pytest.mark.gpu
@gpu
def test_gpu_route_topk_first_kernel_gives_the_torch_ops_bits(monkeypatch):
    """What ``moe.ROUTE_TOPK_FIRST_KERNEL`` (on by default) stands on: on CUDA the kernel's weights and ids are
    the torch ops' bit for bit (libdevice's expf against torch's exp, ``div_rn`` against torch's division), for
    finite logits, and the router gradient is theirs; ``vk.moe_route`` takes the kernel when the switch is on."""
    from vexact_kernels import moe

    for e, logits in _route_logits("cuda").items():
        ok = ~torch.isnan(logits).any(dim=1)
        big = torch.randn(4096, e, device="cuda", generator=torch.Generator("cuda").manual_seed(e)) * 4
        for x in (logits[ok], big, big.bfloat16().float()):
            for k in (1, 3, 4):
                w, ids = _route_kernel(x, k)
                want_w, want_ids = _route_torch(x, k)
                assert torch.equal(ids, want_ids), (e, k)
                assert torch.equal(w, want_w), (e, k, (w - want_w).abs().max().item())
    x = big.requires_grad_()
    monkeypatch.setattr(moe, "ROUTE_TOPK_FIRST_KERNEL", True)
    w, ids = vk.moe_route(x, 4, topk_before_softmax=True)
    gw = torch.randn_like(w)
    (g_kernel,) = torch.autograd.grad((w * gw).sum(), x)
    monkeypatch.setattr(moe, "ROUTE_TOPK_FIRST_KERNEL", False)
    w2, ids2 = vk.moe_route(x, 4, topk_before_softmax=True)
    (g_torch,) = torch.autograd.grad((w2 * gw).sum(), x)
    assert torch.equal(ids, ids2) and torch.equal(w, w2) and torch.equal(g_kernel, g_torch)
