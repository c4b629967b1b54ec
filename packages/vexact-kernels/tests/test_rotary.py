"""Rotary embedding: HF default-rope reference in float64, position-only dependence, errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import vexact_kernels as vk


def _rand(*shape, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def _hf_reference(x: torch.Tensor, positions: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """Hugging Face's ``q * cos + rotate_half(q) * sin`` with the default rope, in float64."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = positions.double()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    xd = x.double()
    half = head_dim // 2
    rotated = torch.cat([-xd[..., half:], xd[..., :half]], dim=-1)
    return xd * cos + rotated * sin


def test_tables_match_float64():
    cos, sin = vk.rope_cos_sin(16, 300, 10_000.0)
    assert cos.shape == sin.shape == (300, 8) and cos.dtype == torch.float32
    inv = 1.0 / (10_000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))
    freqs = torch.arange(300, dtype=torch.float64)[:, None] * inv
    # fp32 angles up to 300 rad carry ~300 * 2^-24 absolute error
    torch.testing.assert_close(cos.double(), freqs.cos(), rtol=0, atol=5e-5)
    torch.testing.assert_close(sin.double(), freqs.sin(), rtol=0, atol=5e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_hf_reference(dtype):
    head_dim, theta = 32, 1_000_000.0
    cos, sin = vk.rope_cos_sin(head_dim, 128, theta)
    x = _rand(20, 3, head_dim, seed=1, dtype=dtype)
    pos = torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(2))
    y = vk.apply_rotary(x, pos, cos, sin)
    assert y.dtype == dtype and y.shape == x.shape
    rtol = 1e-6 if dtype == torch.float32 else 2.0**-8
    torch.testing.assert_close(y.double(), _hf_reference(x, pos, head_dim, theta), rtol=rtol, atol=1e-4)


def test_position_zero_is_identity_and_norm_is_preserved():
    cos, sin = vk.rope_cos_sin(16, 64, 10_000.0)
    x = _rand(8, 2, 16, seed=3, dtype=torch.float32)
    assert torch.equal(vk.apply_rotary(x, torch.zeros(8, dtype=torch.long), cos, sin), x)
    y = vk.apply_rotary(x, torch.arange(8) * 7, cos, sin)
    pair_norm = lambda t: t[..., :8] ** 2 + t[..., 8:] ** 2  # noqa: E731
    torch.testing.assert_close(pair_norm(y), pair_norm(x), rtol=1e-5, atol=1e-6)
    assert not torch.equal(y, x)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 40), seed=st.integers(0, 2**16), data=st.data())
def test_token_result_depends_only_on_its_position(n, seed, data):
    cos, sin = vk.rope_cos_sin(16, 256, 10_000.0)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, 16, generator=g).to(torch.bfloat16)
    pos = torch.randint(0, 256, (n,), generator=g)
    full = vk.apply_rotary(x, pos, cos, sin)
    rows = torch.tensor(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n), label="rows"))
    assert torch.equal(vk.apply_rotary(x[rows], pos[rows], cos, sin), full[rows])
    # a bigger table (a longer max_position) leaves every existing row of it unchanged
    cos2, sin2 = vk.rope_cos_sin(16, 512, 10_000.0)
    assert torch.equal(cos2[:256], cos) and torch.equal(sin2[:256], sin)


def test_fast_backend_is_transformers_bf16_rotation():
    cos, sin = vk.rope_cos_sin(16, 64, 10_000.0)
    x, pos = _rand(10, 4, 16, seed=4), torch.arange(10) * 3
    with vk.use_backend("fast"):
        fast = vk.apply_rotary(x, pos, cos, sin)
    # HF's apply_rotary_pos_emb: cos/sin cast to x's dtype, x * cos + rotate_half(x) * sin in that dtype
    c = torch.cat([cos[pos], cos[pos]], -1)[:, None].to(x.dtype)
    s = torch.cat([sin[pos], sin[pos]], -1)[:, None].to(x.dtype)
    assert torch.equal(fast, x * c + torch.cat([-x[..., 8:], x[..., :8]], -1) * s)
    inv = vk.apply_rotary(x, pos, cos, sin)
    assert not torch.equal(fast, inv)  # bf16 rounding per product: the mismatch baseline differs in the last bits
    assert torch.allclose(fast.float(), inv.float(), atol=0.05)
    with vk.use_backend("fast"):  # in fp32 the two are the same arithmetic
        fast32 = vk.apply_rotary(x.float(), pos, cos, sin)
    assert torch.equal(fast32, vk.apply_rotary(x.float(), pos, cos, sin))


def test_odd_head_dim_raises():
    with pytest.raises(ValueError, match="head_dim must be even, got 15"):
        vk.rope_cos_sin(15, 8, 10_000.0)


def test_position_beyond_table_raises():
    cos, sin = vk.rope_cos_sin(8, 16, 10_000.0)
    with pytest.raises(ValueError, match="position 16 >= table size 16"):
        vk.apply_rotary(_rand(2, 1, 8), torch.tensor([3, 16]), cos, sin)


def test_integer_input_raises_type_error():
    cos, sin = vk.rope_cos_sin(8, 16, 10_000.0)
    with pytest.raises(TypeError, match="apply_rotary: x has dtype torch.int64"):
        vk.apply_rotary(torch.ones(2, 1, 8, dtype=torch.int64), torch.tensor([0, 1]), cos, sin)
