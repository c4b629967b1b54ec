"""Logits, log_softmax, logprobs and entropy from hidden states: accuracy, invariance, errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import vexact_kernels as vk

H, V, EPS = 64, 300, 1e-6


def _problem(t: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = (3 * torch.randn(t, H, generator=g)).to(torch.bfloat16)
    norm_w = (1.0 + 0.1 * torch.randn(H, generator=g)).to(torch.bfloat16)
    head = (torch.randn(V, H, generator=g) / H**0.5).to(torch.bfloat16)
    targets = torch.randint(0, V, (t,), generator=g)
    return hidden, norm_w, head, targets


def _logits(t: int, seed: int = 0, scale: float = 5.0) -> torch.Tensor:
    return scale * torch.randn(t, V, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
@pytest.mark.parametrize("backend", vk.BACKENDS)
def test_log_softmax_matches_float64(temperature, backend):
    logits = _logits(9, seed=1)
    with vk.use_backend(backend):
        out = vk.log_softmax(logits, temperature)
    assert out.dtype == torch.float32 and out.shape == logits.shape
    ref = torch.log_softmax(logits.double() / temperature, dim=-1)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_log_softmax_handles_huge_logits_and_minus_inf():
    logits = torch.tensor([[1e30, 0.0, -1e30], [0.0, -torch.inf, 0.0]])
    out = vk.log_softmax(logits)
    assert out[0, 0] == 0.0 and out[0, 1] < -1e29 and out[0, 2] < -1e29
    torch.testing.assert_close(out[1, [0, 2]], torch.full((2,), -0.6931472))
    assert out[1, 1] == -torch.inf


def test_per_row_temperature_equals_scalar_temperature():
    logits = _logits(6, seed=2)
    assert torch.equal(vk.log_softmax(logits, torch.full((6,), 0.7)), vk.log_softmax(logits, 0.7))
    temps = torch.tensor([0.5, 1.0, 1.5, 0.5, 1.0, 2.0])
    mixed = vk.log_softmax(logits, temps)
    for i, t in enumerate(temps.tolist()):
        assert torch.equal(mixed[i : i + 1], vk.log_softmax(logits[i : i + 1], t))


@settings(max_examples=30, deadline=None)
@given(t=st.integers(1, 30), seed=st.integers(0, 2**16), data=st.data())
def test_log_softmax_row_independent_of_batch(t, seed, data):
    logits = _logits(t, seed=seed)
    full = vk.log_softmax(logits, 0.9)
    rows = torch.tensor(data.draw(st.lists(st.integers(0, t - 1), min_size=1, max_size=t), label="rows"))
    assert torch.equal(vk.log_softmax(logits[rows], 0.9), full[rows])


def test_logprobs_from_hidden_is_the_composition_of_the_public_ops():
    hidden, norm_w, head, targets = _problem(12, seed=3)
    lp, ent = vk.logprobs_from_hidden(hidden, norm_w, EPS, head, targets, temperature=0.8, with_entropy=True)
    logp = vk.log_softmax(vk.linear(vk.rms_norm(hidden, norm_w, EPS), head, out_dtype=torch.float32), 0.8)
    logits = vk.linear(vk.rms_norm(hidden, norm_w, EPS), head, out_dtype=torch.float32)
    assert torch.equal(vk.compute_logits(hidden, norm_w, EPS, head), logits)
    assert torch.equal(lp, logp.gather(1, targets[:, None]).squeeze(1))
    assert torch.equal(ent, vk.entropy_from_logprobs(logp))


def test_logprobs_from_hidden_matches_float64_reference():
    hidden, norm_w, head, targets = _problem(16, seed=4)
    lp, ent = vk.logprobs_from_hidden(hidden, norm_w, EPS, head, targets, temperature=1.3, with_entropy=True)
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == (16,)
    hd = hidden.double()
    normed = hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + EPS) * norm_w.double()
    logp = torch.log_softmax((normed @ head.double().T) / 1.3, dim=-1)
    ref_lp = logp.gather(1, targets[:, None]).squeeze(1)
    ref_ent = -(logp.exp() * logp).sum(-1)
    # the kernel rounds the normed hidden state to bf16 (as the model does) before lm_head: ~2^-9 relative per input
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=0.03)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=0, atol=0.03)
    assert bool((lp <= 0).all()) and bool((ent >= 0).all()) and bool((ent <= torch.log(torch.tensor(V)) + 1e-4).all())


def test_entropy_matches_float64():
    logp = vk.log_softmax(_logits(7, seed=5, scale=3.0))
    ent = vk.entropy_from_logprobs(logp)
    ld = logp.double()
    torch.testing.assert_close(ent.double(), -(ld.exp() * ld).sum(-1), rtol=1e-5, atol=1e-5)
    # a one-hot distribution has zero entropy, and -inf logprobs contribute nothing (not nan)
    onehot = torch.full((1, 5), -torch.inf)
    onehot[0, 2] = 0.0
    assert vk.entropy_from_logprobs(onehot).item() == 0.0


@settings(max_examples=30, deadline=None)
@given(t=st.integers(1, 24), chunk=st.integers(1, 30), seed=st.integers(0, 2**16), data=st.data())
def test_logprobs_independent_of_chunk_size_and_batch(t, chunk, seed, data):
    hidden, norm_w, head, targets = _problem(t, seed=seed)
    ref_lp, ref_ent = vk.logprobs_from_hidden(
        hidden, norm_w, EPS, head, targets, 0.9, chunk_size=1024, with_entropy=True
    )
    lp, ent = vk.logprobs_from_hidden(hidden, norm_w, EPS, head, targets, 0.9, chunk_size=chunk, with_entropy=True)
    assert torch.equal(lp, ref_lp) and torch.equal(ent, ref_ent)
    rows = torch.tensor(data.draw(st.lists(st.integers(0, t - 1), min_size=1, max_size=t), label="rows"))
    sub, _ = vk.logprobs_from_hidden(hidden[rows], norm_w, EPS, head, targets[rows], 0.9, chunk_size=chunk)
    assert torch.equal(sub, ref_lp[rows])


def test_no_entropy_unless_asked_and_empty_input():
    hidden, norm_w, head, targets = _problem(3)
    assert vk.logprobs_from_hidden(hidden, norm_w, EPS, head, targets)[1] is None
    lp, ent = vk.logprobs_from_hidden(hidden[:0], norm_w, EPS, head, targets[:0], with_entropy=True)
    assert lp.shape == ent.shape == (0,)


def test_errors():
    hidden, norm_w, head, targets = _problem(4)
    with pytest.raises(ValueError, match="chunk_size must be >= 1, got 0"):
        vk.logprobs_from_hidden(hidden, norm_w, EPS, head, targets, chunk_size=0)
    with pytest.raises(ValueError, match=r"targets must have shape \[4\]"):
        vk.logprobs_from_hidden(hidden, norm_w, EPS, head, targets[:3])
    for bad in (-1, V):
        t = targets.clone()
        t[1] = bad
        with pytest.raises(ValueError, match=rf"target token id out of range \[0, {V}\)"):
            vk.logprobs_from_hidden(hidden, norm_w, EPS, head, t)
    for temp in (0.0, -1.0):
        with pytest.raises(ValueError, match="temperature must be > 0"):
            vk.logprobs_from_hidden(hidden, norm_w, EPS, head, targets, temperature=temp)
    with pytest.raises(ValueError, match=r"one value per row \(4\); got \(3,\)"):
        vk.log_softmax(_logits(4), torch.ones(3))
    with pytest.raises(TypeError, match="logits must be float32, got torch.bfloat16"):
        vk.log_softmax(_logits(4).bfloat16())
    with pytest.raises(TypeError, match="rms_norm: x has dtype torch.int64"):
        vk.compute_logits(torch.ones(2, H, dtype=torch.int64), norm_w, EPS, head)
