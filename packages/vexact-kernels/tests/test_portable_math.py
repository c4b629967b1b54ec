"""portable_math: the CPU reference's elementary functions, the same bits on every machine.

The canary holds each primitive to stored bits on hard inputs (``assets/portable_math_canary.safetensors``), so a
machine where one differs fails here with the primitive and the input named, before any golden fixture does.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vexact_kernels import portable_math as pm


def test_canary_bits_on_this_cpu():
    bad = pm.canary_mismatches()
    assert not bad, "the CPU reference's primitives give other bits on this CPU:\n" + "\n".join(bad)


def test_canary_names_a_one_ulp_change(monkeypatch):
    """The canary can fail: an exp one ulp off on a single input is caught and the input named."""
    real = pm._exp_impl

    def nudged(x):
        y = real(x)
        if x.numel() > 100:
            y = y.clone()
            y.view(torch.int32)[100] += 1
        return y

    monkeypatch.setattr(pm, "_exp_impl", nudged)
    bad = pm.canary_mismatches()
    assert len(bad) == 1 and bad[0].startswith("exp differs on this CPU at x="), bad
    assert "1 of " in bad[0]


def test_canary_catches_torch_sqrt_where_it_differs(monkeypatch):
    """torch's float32 sqrt (a vector math library, 1 ulp) in place of the portable one: on a CPU where it is not
    correctly rounded on the hard inputs, the canary names sqrt."""
    monkeypatch.setattr(pm, "_sqrt_impl", torch.sqrt)
    bad = [b for b in pm.canary_mismatches() if b.startswith("sqrt")]
    x = torch.from_numpy(np.random.default_rng(0).integers(1, 0x7F800000, 1 << 16).astype(np.uint32).view(np.float32))
    torch_cr = torch.equal(torch.sqrt(x), _sqrt_correctly_rounded(x))
    if torch_cr and not bad:
        pytest.skip("torch.sqrt float32 is correctly rounded on this CPU's inputs: nothing for the canary to catch")
    assert bad, "torch.sqrt differs from the correctly rounded sqrt on this CPU, but the canary did not say so"


def _sqrt_correctly_rounded(x: torch.Tensor) -> torch.Tensor:
    # numpy's long double sqrt (64-bit mantissa, correctly rounded) rounded once more to float32: exact for sqrt,
    # since 64 >= 2 * 24 + 2
    return torch.from_numpy(np.sqrt(x.numpy().astype(np.longdouble)).astype(np.float32))


def test_sqrt_correctly_rounded_on_a_large_batch():
    """A contiguous batch large enough for torch's float64 sqrt to take its vector-library branch: the float32
    results are still the correctly rounded ones (the module docstring's argument)."""
    x = torch.from_numpy(np.random.default_rng(1).integers(1, 0x7F800000, 1 << 18).astype(np.uint32).view(np.float32))
    assert torch.equal(pm.sqrt(x), _sqrt_correctly_rounded(x))


def test_special_values():
    inf, nan = math.inf, math.nan
    e = pm.exp(torch.tensor([-inf, inf, 0.0, -0.0, -200.0, 200.0]))
    assert e.tolist() == [0.0, inf, 1.0, 1.0, 0.0, inf]
    assert bool(pm.exp(torch.tensor([nan])).isnan())
    lg = pm.log(torch.tensor([0.0, -0.0, 1.0, inf, 2.0**-149]))
    assert lg[:4].tolist() == [-inf, -inf, 0.0, inf]
    assert float(lg[4]) == pytest.approx(-149 * math.log(2), rel=1e-7)
    assert pm.log(torch.tensor([-1.0, nan])).isnan().all()
    assert pm.sqrt(torch.tensor([0.0, 4.0, inf])).tolist() == [0.0, 2.0, inf]
    assert pm.sqrt(torch.tensor([-1.0])).isnan().all()
    s, c = pm.sincos(torch.tensor([0.0]))
    assert (s.item(), c.item()) == (0.0, 1.0)


def test_float64_accuracy():
    """The float64 paths (rotary frequencies, pow_of) agree with the C library's far below float32's resolution."""
    x = torch.linspace(-200, 200, 10001, dtype=torch.float64)
    ref = torch.tensor([math.exp(v) for v in x.tolist()], dtype=torch.float64)
    assert torch.allclose(pm.exp(x), ref, rtol=5e-13, atol=0)
    y = torch.logspace(-300, 300, 10001, dtype=torch.float64)
    assert torch.allclose(pm.log(y), torch.tensor([math.log(v) for v in y.tolist()], dtype=torch.float64), rtol=1e-15)
    assert pm.log_scalar(1e6) == pytest.approx(math.log(1e6), rel=1e-15)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 300), i=st.integers(0, 299), seed=st.integers(0, 2**31 - 1))
def test_position_invariant(n, i, seed):
    """A value's result does not depend on where it sits in the tensor (vector body or scalar tail) or on its
    neighbours."""
    i = i % n
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 30
    for fn in (pm.exp, pm.log, pm.sqrt, lambda t: pm.sincos(t)[0]):
        arg = x.abs() if fn in (pm.log, pm.sqrt) else x
        full = fn(arg)
        assert torch.equal(full[i : i + 1], fn(arg[i : i + 1].clone()))


def test_gradients_match_torch_formulas():
    x = torch.rand(257, dtype=torch.float32) + 0.5
    g = torch.rand_like(x)
    for fn, want in [
        (pm.exp, lambda y: g * y),  # torch's own backward formulas, each one IEEE operation
        (pm.log, lambda y: g / x),
        (pm.sqrt, lambda y: g / (2.0 * y)),
    ]:
        xr = x.clone().requires_grad_()
        y = fn(xr)
        y.backward(g)
        assert torch.equal(xr.grad, want(y.detach())), fn


def test_off_cpu_calls_torch():
    m = torch.empty(3, 4, device="meta")
    assert pm.exp(m).is_meta and pm.log(m).is_meta and pm.sqrt(m).is_meta
    assert pm.pow_of(1e4, torch.empty(4, device="meta")).is_meta


def test_bad_input_named():
    with pytest.raises(ValueError, match="base must be a positive finite number, got -2.0"):
        pm.pow_of(-2.0, torch.zeros(3))
    with pytest.raises(ValueError, match=r"\|x\| up to 2000000.0"):
        pm.sincos(torch.tensor([2e6]))
    with pytest.raises(TypeError, match="expects a float32 or float64 tensor, got torch.bfloat16"):
        pm.exp(torch.zeros(2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="positive finite number, got 0.0"):
        pm.log_scalar(0.0)
