"""rms_norm: float64-reference accuracy, row invariance on the invariant backend, errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import vexact_kernels as vk

EPS = 1e-6


def _rand(*shape, seed=0, dtype=torch.bfloat16, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(dtype)


def _reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xd = x.double()
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("hidden", [1, 16, 64, 100, 129])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 50.0])
def test_matches_float64_reference(hidden, scale):
    x, w = _rand(11, hidden, seed=1, scale=scale), 1.0 + 0.1 * _rand(hidden, seed=2)
    y32 = vk.rms_norm(x, w, EPS, out_dtype=torch.float32)
    ref = _reference(x, w, EPS)
    torch.testing.assert_close(y32.double(), ref, rtol=2e-6, atol=1e-6)
    y = vk.rms_norm(x, w, EPS)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), ref, rtol=2.0**-8, atol=1e-6)


def test_eps_dominates_tiny_inputs():
    x = torch.zeros(3, 8, dtype=torch.float32)
    x[1, 2] = 1e-8
    y = vk.rms_norm(x, torch.ones(8), eps=1e-6)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y.double(), _reference(x, torch.ones(8), 1e-6), rtol=1e-6, atol=1e-12)


def test_fast_backend_is_close_to_invariant():
    x, w = _rand(7, 96, seed=3), _rand(96, seed=4)
    with vk.use_backend("fast"):
        fast = vk.rms_norm(x, w, EPS, out_dtype=torch.float32)
    torch.testing.assert_close(fast, vk.rms_norm(x, w, EPS, out_dtype=torch.float32), rtol=1e-5, atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(
    m=st.integers(1, 48),
    hidden=st.sampled_from([8, 33, 64, 200]),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_row_result_independent_of_batch(m, hidden, seed, data):
    x, w = _rand(m, hidden, seed=seed), 1.0 + 0.1 * _rand(hidden, seed=seed + 1)
    full = vk.rms_norm(x, w, EPS, out_dtype=torch.float32)
    rows = torch.tensor(data.draw(st.lists(st.integers(0, m - 1), min_size=1, max_size=m), label="rows"))
    assert torch.equal(vk.rms_norm(x[rows], w, EPS, out_dtype=torch.float32), full[rows])
    step = data.draw(st.integers(1, m), label="chunk")
    chunks = [vk.rms_norm(c, w, EPS, out_dtype=torch.float32) for c in x.split(step)]
    assert torch.equal(torch.cat(chunks), full)


def test_leading_dims_do_not_matter():
    x, w = _rand(3, 5, 4, 32, seed=5), _rand(32, seed=6)
    y = vk.rms_norm(x, w, EPS)
    assert y.shape == x.shape
    assert torch.equal(y.reshape(-1, 32), vk.rms_norm(x.reshape(-1, 32), w, EPS))


@pytest.mark.parametrize("backend", vk.BACKENDS)
def test_integer_input_raises_type_error(backend):
    with vk.use_backend(backend), pytest.raises(TypeError, match="rms_norm: x has dtype torch.int64"):
        vk.rms_norm(torch.ones(2, 8, dtype=torch.int64), torch.ones(8), EPS)


@pytest.mark.parametrize("backend", vk.BACKENDS)
def test_weight_shape_mismatch_raises_value_error(backend):
    with vk.use_backend(backend), pytest.raises(ValueError, match=r"weight shape \(7,\) does not match x's last dim 8"):
        vk.rms_norm(_rand(2, 8), torch.ones(7), EPS)


ADD_SHAPES = [(1, 8), (5, 100), (3, 4, 129), (17, 1500)]


@pytest.mark.parametrize("backend", vk.BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", ADD_SHAPES, ids=str)
def test_add_rms_norm_is_the_add_then_rms_norm(shape, dtype, backend):
    x, r = _rand(*shape, seed=1, dtype=dtype, scale=3.0), _rand(*shape, seed=2, dtype=dtype)
    w = (1.0 + 0.1 * _rand(shape[-1], seed=3)).to(dtype)
    with vk.use_backend(backend):
        s, y = vk.add_rms_norm(x, r, w, EPS)
        assert s.dtype == y.dtype == dtype and s.shape == y.shape == x.shape
        assert torch.equal(s, x + r) and torch.equal(y, vk.rms_norm(x + r, w, EPS))


def test_add_rms_norm_under_autograd_is_differentiable():
    x, r = _rand(4, 32, seed=1, dtype=torch.float32), _rand(4, 32, seed=2, dtype=torch.float32)
    w = 1.0 + 0.1 * _rand(32, seed=3, dtype=torch.float32)
    grads = []
    for fused in (True, False):
        xg, rg, wg = (t.clone().requires_grad_() for t in (x, r, w))
        if fused:
            s, y = vk.add_rms_norm(xg, rg, wg, EPS)
        else:
            s = xg + rg
            y = vk.rms_norm(s, wg, EPS)
        (s.sum() + y.square().sum()).backward()
        grads.append((xg.grad, rg.grad, wg.grad))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", vk.BACKENDS)
def test_add_rms_norm_input_errors(backend):
    x, w = _rand(2, 8), torch.ones(8, dtype=torch.bfloat16)
    with vk.use_backend(backend):
        with pytest.raises(ValueError, match=r"residual \(2, 1\) torch.bfloat16 must match x \(2, 8\)"):
            vk.add_rms_norm(x, _rand(2, 1), w, EPS)  # no broadcast
        with pytest.raises(ValueError, match=r"residual \(2, 8\) torch.float32 must match x \(2, 8\) torch.bfloat16"):
            vk.add_rms_norm(x, _rand(2, 8, dtype=torch.float32), w, EPS)  # no promotion
        with pytest.raises(ValueError, match=r"weight shape \(7,\) does not match x's last dim 8"):
            vk.add_rms_norm(x, x, torch.ones(7), EPS)
        with pytest.raises(TypeError, match="rms_norm: x has dtype torch.int64"):
            ints = torch.ones(2, 8, dtype=torch.int64)
            vk.add_rms_norm(ints, ints, torch.ones(8), EPS)
