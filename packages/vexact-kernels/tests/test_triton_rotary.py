"""Triton rotary: on CPU through the interpreter (small shapes), on the GPU at real shapes.

FMA contraction is off in the kernel, so in fp32 it is bitwise the CPU reference; backward is rotation by -sin.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import vexact_kernels as vk
from vexact_kernels.triton_ops import interpreting, triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")
interp = pytest.mark.skipif(not interpreting(), reason="interpreter tests run where TRITON_INTERPRET=1 (no GPU)")


def _ops():
    from vexact_kernels.triton_ops import rotary

    return rotary


def _problem(tokens, heads, head_dim, seed=0, dtype=torch.float32, max_pos=4096):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, heads, head_dim, generator=g).to(dtype)
    pos = torch.randint(0, max_pos, (tokens,), generator=g)
    cos, sin = vk.rope_cos_sin(head_dim, max_pos, 1e6)
    return x, pos, cos, sin


@interp
@pytest.mark.parametrize("heads,head_dim", [(1, 2), (5, 24), (4, 64)])
def test_interpreted_fp32_is_bitwise_the_cpu_reference(heads, head_dim):
    ops = _ops()
    x, pos, cos, sin = _problem(6, heads, head_dim, seed=heads)
    assert torch.equal(ops.triton_apply_rotary(x, pos, cos, sin), vk.apply_rotary(x, pos, cos, sin))
    # a strided view (q out of a fused qkv projection) gives the same values as its contiguous copy
    qkv = torch.randn(6, heads + 2, head_dim)
    q = qkv[:, :heads]
    assert torch.equal(ops.triton_apply_rotary(q, pos, cos, sin), vk.apply_rotary(q.contiguous(), pos, cos, sin))


@interp
def test_interpreted_bf16_close_to_reference():
    ops = _ops()
    x, pos, cos, sin = _problem(4, 3, 32, seed=1, dtype=torch.bfloat16)
    out = ops.triton_apply_rotary(x, pos, cos, sin)
    assert out.dtype == torch.bfloat16
    # the interpreter rounds fp32 -> bf16 toward zero (the GPU rounds to nearest): allow one bf16 ulp
    torch.testing.assert_close(out.float(), vk.apply_rotary(x, pos, cos, sin).float(), rtol=2.0**-7, atol=1e-6)


@interp
@settings(max_examples=10, deadline=None)
@given(tokens=st.integers(1, 9), seed=st.integers(0, 2**16), data=st.data())
def test_interpreted_token_independent_of_batch(tokens, seed, data):
    ops = _ops()
    x, pos, cos, sin = _problem(tokens, 3, 16, seed=seed)
    full = ops.triton_apply_rotary(x, pos, cos, sin)
    rows = torch.tensor(data.draw(st.lists(st.integers(0, tokens - 1), min_size=1, max_size=tokens), label="rows"))
    assert torch.equal(ops.triton_apply_rotary(x[rows], pos[rows], cos, sin), full[rows])


@interp
def test_interpreted_backward_is_inverse_rotation():
    ops = _ops()
    x, pos, cos, sin = _problem(5, 2, 16, seed=2)
    dy = torch.randn(5, 2, 16, generator=torch.Generator().manual_seed(3))
    xt = x.clone().requires_grad_()
    ops.triton_apply_rotary(xt, pos, cos, sin).backward(dy)
    xr = x.clone().requires_grad_()
    vk.apply_rotary(xr, pos, cos, sin).backward(dy)
    torch.testing.assert_close(xt.grad, xr.grad, rtol=1e-6, atol=1e-6)
    # rotating back by -sin undoes the rotation
    torch.testing.assert_close(ops.rotary_launch(ops.rotary_launch(x, pos, cos, sin), pos, cos, sin, inverse=True), x)


def _check_pair(tokens, hq, hk, head_dim, dtype, device, seed=0):
    """q and k rotated in one launch: each bitwise what its own launch gives (also for a strided q view)."""
    ops = _ops()
    q, pos, cos, sin = _problem(tokens, hq + 3, head_dim, seed=seed, dtype=dtype)
    k = torch.randn(tokens, hk, head_dim, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    q, k, pos, cos, sin = (t.to(device) for t in (q, k, pos, cos, sin))
    for qq in (q[:, :hq].contiguous(), q[:, 2 : 2 + hq]):
        qo, ko = ops.triton_apply_rotary_pair(qq, k, pos, cos, sin)
        assert torch.equal(qo, ops.triton_apply_rotary(qq, pos, cos, sin))
        assert torch.equal(ko, ops.triton_apply_rotary(k, pos, cos, sin))
        assert qo.is_contiguous() and ko.is_contiguous()


@interp
@pytest.mark.parametrize("hq,hk,head_dim", [(4, 2, 16), (5, 1, 24), (1, 1, 2), (8, 8, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interpreted_pair_launch_is_bitwise_two_launches(hq, hk, head_dim, dtype):
    _check_pair(5, hq, hk, head_dim, dtype, "cpu", seed=hq * head_dim)


@interp
def test_interpreted_pair_with_autograd_is_two_rotations():
    ops = _ops()
    q, pos, cos, sin = _problem(3, 4, 16, seed=7)
    k = torch.randn(3, 2, 16).requires_grad_()
    qo, ko = ops.triton_apply_rotary_pair(q, k, pos, cos, sin)
    ko.sum().backward()
    assert torch.equal(qo, ops.triton_apply_rotary(q, pos, cos, sin)) and k.grad is not None


def test_public_qk_is_two_apply_rotary():
    q, pos, cos, sin = _problem(6, 4, 32, seed=3)
    k = torch.randn(6, 2, 32, generator=torch.Generator().manual_seed(4))
    for backend in ("invariant", "fast"):
        with vk.use_backend(backend):
            qo, ko = vk.apply_rotary_qk(q, k, pos, cos, sin)
            assert torch.equal(qo, vk.apply_rotary(q, pos, cos, sin))
            assert torch.equal(ko, vk.apply_rotary(k, pos, cos, sin))
    with pytest.raises(ValueError, match="position"):
        vk.apply_rotary_qk(q, k, pos + 4096, cos, sin)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_pair_launch_is_bitwise_two_launches(dtype):
    for tokens, hq, hk in ((1, 16, 8), (300, 32, 8), (7, 28, 4), (64, 12, 2)):
        _check_pair(tokens, hq, hk, 128, dtype, "cuda", seed=tokens)
    q, pos, cos, sin = (t.cuda() for t in _problem(9, 16, 128, seed=5, dtype=dtype))
    k = q[:, :8].contiguous() * 2
    qo, ko = vk.apply_rotary_qk(q, k, pos, cos, sin)
    assert torch.equal(qo, vk.apply_rotary(q, pos, cos, sin)) and torch.equal(ko, vk.apply_rotary(k, pos, cos, sin))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_every_token_equals_the_single_token_result_and_the_cpu_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    sizes = [1, 2, 64, 16384] + torch.randint(1, 16385, (3,), generator=gen).tolist()
    x, pos, cos, sin = _problem(max(sizes), 16, 128, seed=1, dtype=dtype, max_pos=32768)
    xc, pc, cc, sc = x.cuda(), pos.cuda(), cos.cuda(), sin.cuda()
    singles = torch.cat([vk.apply_rotary(xc[i : i + 1], pc[i : i + 1], cc, sc) for i in range(xc.shape[0])])
    for m in sizes:
        assert torch.equal(vk.apply_rotary(xc[:m], pc[:m], cc, sc), singles[:m]), f"tokens={m}"
    # no FMA contraction and correctly rounded casts: bitwise the CPU reference
    assert torch.equal(singles[:256].cpu(), vk.apply_rotary(x[:256], pos[:256], cos, sin))


@pytest.mark.gpu
def test_gpu_backward_matches_autograd_and_is_deterministic():
    x, pos, cos, sin = _problem(4096, 8, 128, seed=2, dtype=torch.bfloat16)
    x, pos, cos, sin = x.cuda(), pos.cuda(), cos.cuda(), sin.cuda()
    dy = torch.randn(x.shape, device="cuda").bfloat16()

    def grad():
        xt = x.clone().requires_grad_()
        vk.apply_rotary(xt, pos, cos, sin).backward(dy)
        return xt.grad

    g1, g2 = grad(), grad()
    assert torch.equal(g1, g2)
    xd = x.double().requires_grad_()
    half = x.shape[-1] // 2
    c, s = cos[pos].double().unsqueeze(1), sin[pos].double().unsqueeze(1)
    x1, x2 = xd[..., :half], xd[..., half:]
    torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1).backward(dy.double())
    torch.testing.assert_close(g1.double(), xd.grad, rtol=2.0**-8, atol=1e-2)
