"""linear: float64-reference accuracy, batch invariance on the invariant backend, errors."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import vexact_kernels as vk

FAST_SETTINGS = settings(max_examples=30, deadline=None)


def _rand(*shape, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def _fp32_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # fp32 accumulation of K exact products: error <= ~log2(K) * 2^-24 * sum |x_k w_k|; 2^-18 leaves headroom.
    return 2.0**-18 * (x.double().abs() @ w.double().abs().T) + 1e-30


@pytest.mark.parametrize("k", [1, 7, 32, 33, 100, 257])
def test_matches_float64_reference_fp32_out(k):
    x, w = _rand(13, k, seed=1), _rand(24, k, seed=2)
    y = vk.linear(x, w, out_dtype=torch.float32)
    assert y.dtype == torch.float32 and y.shape == (13, 24)
    ref = x.double() @ w.double().T
    assert bool(((y.double() - ref).abs() <= _fp32_bound(x, w)).all())


def test_matches_float64_reference_bf16_out_and_bias():
    x, w, b = _rand(9, 70, seed=3), _rand(40, 70, seed=4), _rand(40, seed=5)
    y = vk.linear(x, w, b)
    assert y.dtype == torch.bfloat16
    ref = x.double() @ w.double().T + b.double()
    # one bf16 rounding of a value already within the fp32 bound
    tol = 2.0**-8 * ref.abs() + _fp32_bound(x, w) + 1e-6
    assert bool(((y.double() - ref).abs() <= tol).all())


def test_fp32_inputs_match_float64_reference():
    x, w = _rand(5, 48, seed=6, dtype=torch.float32), _rand(8, 48, seed=7, dtype=torch.float32)
    y = vk.linear(x, w)
    ref = x.double() @ w.double().T
    # fp32 products are rounded too: one more 2^-24 per term
    assert bool(((y.double() - ref).abs() <= 2 * _fp32_bound(x, w)).all())


def test_leading_dims_are_flattened_rows():
    x, w = _rand(2, 3, 40, seed=8), _rand(16, 40, seed=9)
    y = vk.linear(x, w)
    assert y.shape == (2, 3, 16)
    assert torch.equal(y.reshape(6, 16), vk.linear(x.reshape(6, 40), w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_backend_is_close_to_invariant(dtype):
    x, w = _rand(17, 64, seed=10, dtype=dtype), _rand(32, 64, seed=11, dtype=dtype)
    with vk.use_backend("fast"):
        fast = vk.linear(x, w, out_dtype=torch.float32)
    inv = vk.linear(x, w, out_dtype=torch.float32)
    # fast computes in x's dtype (as torch/HF do) and only then casts to out_dtype: bf16 inputs give bf16 precision
    tol = 1e-5 if dtype == torch.float32 else 2.0**-7
    torch.testing.assert_close(fast, inv, rtol=tol, atol=tol)


@FAST_SETTINGS
@given(
    m=st.integers(1, 40),
    k=st.sampled_from([16, 33, 64, 100]),
    n=st.integers(1, 24),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_row_result_independent_of_batch(m, k, n, seed, data):
    x, w, b = _rand(m, k, seed=seed), _rand(n, k, seed=seed + 1), _rand(n, seed=seed + 2)
    full = vk.linear(x, w, b, out_dtype=torch.float32)
    rows = data.draw(st.lists(st.integers(0, m - 1), min_size=1, max_size=m), label="rows")
    idx = torch.tensor(rows)
    assert torch.equal(vk.linear(x[idx], w, b, out_dtype=torch.float32), full[idx])
    cuts = sorted(data.draw(st.sets(st.integers(1, m - 1), max_size=5), label="cuts")) if m > 1 else []
    bounds = [0, *cuts, m]
    chunks = [vk.linear(x[s:e], w, b, out_dtype=torch.float32) for s, e in zip(bounds, bounds[1:], strict=False)]
    assert torch.equal(torch.cat(chunks), full)


def test_row_budget_stepping_does_not_change_values(monkeypatch):
    """The CPU reference walks rows in steps sized by a memory budget; the step must not change any value."""
    mod = importlib.import_module("vexact_kernels.linear")
    x, w = _rand(50, 96, seed=12), _rand(24, 96, seed=13)
    expected = vk.linear(x, w, out_dtype=torch.float32)
    monkeypatch.setattr(mod, "_ROW_BUDGET", vk.LINEAR_BLOCK_K * 24 * 3)  # 3 rows per step
    assert torch.equal(vk.linear(x, w, out_dtype=torch.float32), expected)


def test_fast_backend_fp32_linear_is_not_batch_invariant():
    """Why the invariant backend exists: torch's own fp32 GEMM gives row 0 a different value at M=1 and M=300."""
    x = _rand(300, 256, seed=14, dtype=torch.float32)
    w = _rand(256, 256, seed=15, dtype=torch.float32)
    with vk.use_backend("fast"):
        alone = vk.linear(x[:1], w)
        batched = vk.linear(x, w)[:1]
    assert torch.equal(alone, F.linear(x[:1], w))  # the fast backend really is torch's GEMM
    if torch.equal(alone, batched):
        pytest.xfail("this torch build's fp32 CPU GEMM happened to be batch-invariant at M=1 vs M=300")
    assert not torch.equal(alone, batched)
    # and the invariant backend is not
    assert torch.equal(vk.linear(x[:1], w), vk.linear(x, w)[:1])


@pytest.mark.parametrize("backend", vk.BACKENDS)
def test_integer_inputs_raise_type_error(backend):
    w = _rand(4, 8)
    with vk.use_backend(backend):
        with pytest.raises(TypeError, match="x has dtype torch.int64"):
            vk.linear(torch.ones(2, 8, dtype=torch.int64), w)
        with pytest.raises(TypeError, match="weight has dtype torch.int32"):
            vk.linear(_rand(2, 8), torch.ones(4, 8, dtype=torch.int32))


@pytest.mark.parametrize("backend", vk.BACKENDS)
def test_shape_mismatch_raises_value_error(backend):
    with vk.use_backend(backend), pytest.raises(ValueError, match=r"x has K=8 but weight is \(4, 9\)"):
        vk.linear(_rand(2, 8), _rand(4, 9))
