"""Triton silu_and_mul: on CPU through the interpreter (small shapes), on the GPU at real shapes."""

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
    from vexact_kernels.triton_ops import activation

    return activation


def _rand(*shape, seed=0, dtype=torch.float32, device="cpu"):
    return (3 * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(dtype).to(device)


def _reference(g, u):
    gd = g.double()
    return gd / (1 + torch.exp(-gd)) * u.double()


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interpreted_matches_float64(dtype):
    ops = _ops()
    g, u = _rand(5, 1100, seed=1, dtype=dtype), _rand(5, 1100, seed=2, dtype=dtype)
    out = ops.triton_silu_and_mul(g, u)
    assert out.dtype == dtype and out.shape == g.shape
    tol = 1e-6 if dtype == torch.float32 else 2.0**-7  # bf16: the interpreter truncates on the final cast
    torch.testing.assert_close(out.double(), _reference(g, u), rtol=tol, atol=1e-6)
    if dtype == torch.float32:  # same formula as the CPU reference; only exp's implementation differs
        torch.testing.assert_close(out, vk.silu_and_mul(g, u), rtol=1e-6, atol=1e-7)


@interp
@settings(max_examples=10, deadline=None)
@given(rows=st.integers(1, 8), seed=st.integers(0, 2**16), data=st.data())
def test_interpreted_rows_and_halves_of_gate_up(rows, seed, data):
    ops = _ops()
    gate_up = _rand(rows, 2 * 40, seed=seed)
    g, u = gate_up[:, :40], gate_up[:, 40:]  # strided views, as a fused gate_up projection gives them
    full = ops.triton_silu_and_mul(g, u)
    assert torch.equal(full, ops.triton_silu_and_mul(g.contiguous(), u.contiguous()))
    sub = torch.tensor(data.draw(st.lists(st.integers(0, rows - 1), min_size=1, max_size=rows), label="rows"))
    assert torch.equal(ops.triton_silu_and_mul(g[sub], u[sub]), full[sub])


@interp
def test_interpreted_backward_matches_float64():
    ops = _ops()
    g, u, dy = _rand(3, 70, seed=3), _rand(3, 70, seed=4), _rand(3, 70, seed=5)
    gt, ut = g.clone().requires_grad_(), u.clone().requires_grad_()
    ops.triton_silu_and_mul(gt, ut).backward(dy)
    gd, ud = g.double().requires_grad_(), u.double().requires_grad_()
    _reference(gd, ud).backward(dy.double())
    torch.testing.assert_close(gt.grad.double(), gd.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ut.grad.double(), ud.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_gpu_every_row_equals_the_single_row_result():
    gen = torch.Generator().manual_seed(0)
    sizes = [1, 3, 64, 16384] + torch.randint(1, 16385, (3,), generator=gen).tolist()
    gate_up = _rand(max(sizes), 2 * 6144, seed=1, dtype=torch.bfloat16, device="cuda")
    g, u = gate_up[:, :6144], gate_up[:, 6144:]
    singles = torch.cat([vk.silu_and_mul(g[i : i + 1], u[i : i + 1]) for i in range(g.shape[0])])
    for m in sizes:
        assert torch.equal(vk.silu_and_mul(g[:m], u[:m]), singles[:m]), f"M={m}"
    torch.testing.assert_close(singles[:512].double(), _reference(g[:512], u[:512]), rtol=2.0**-8, atol=1e-5)


@pytest.mark.gpu
def test_gpu_backward_matches_float64_and_is_deterministic():
    g, u, dy = (_rand(4096, 6144, seed=s, dtype=torch.bfloat16, device="cuda") for s in (2, 3, 4))

    def grads():
        gt, ut = g.clone().requires_grad_(), u.clone().requires_grad_()
        vk.silu_and_mul(gt, ut).backward(dy)
        return gt.grad, ut.grad

    (g1, u1), (g2, u2) = grads(), grads()
    assert torch.equal(g1, g2) and torch.equal(u1, u2)
    gd, ud = g.double().requires_grad_(), u.double().requires_grad_()
    _reference(gd, ud).backward(dy.double())
    torch.testing.assert_close(g1.double(), gd.grad, rtol=2.0**-7, atol=1e-2)
    torch.testing.assert_close(u1.double(), ud.grad, rtol=2.0**-7, atol=1e-2)
