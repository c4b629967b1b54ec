"""The sampler: seeded per request and token, independent of the batch; top-k / top-p restrict the draw only."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import vexact_kernels as vk
from vexact_engine import LLM, SamplingParams
from vexact_engine.sampler import sample, token_seed, token_seeds
from vexact_models import random_model, tiny_qwen3_config

V = 50


def _logits(b: int, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return scale * torch.randn(b, V, generator=torch.Generator().manual_seed(seed))


def _draw(logits, params, seeds=None, indices=None):
    b = logits.shape[0]
    return sample(logits, params, seeds or list(range(b)), indices or [0] * b)


def test_greedy_is_argmax_with_logprobs_at_temperature_one():
    logits = _logits(6, seed=1)
    tokens, lp = _draw(logits, [SamplingParams(temperature=0)] * 6)
    assert torch.equal(tokens, logits.argmax(-1))
    assert lp.dtype == torch.float32
    assert torch.equal(lp, vk.log_softmax(logits).gather(1, tokens[:, None])[:, 0])


def test_greedy_ties_break_to_the_lowest_index():
    logits = torch.zeros(1, V)
    logits[0, [7, 3, 30]] = 5.0
    tokens, _ = _draw(logits, [SamplingParams(temperature=0)])
    assert tokens.item() == 3
    tokens, _ = _draw(logits, [SamplingParams(top_k=1)], seeds=[123])
    assert tokens.item() == 3


@pytest.mark.parametrize("seed", range(5))
def test_top_k_one_equals_greedy(seed):
    logits = _logits(8, seed=seed)
    greedy_tokens, greedy_lp = _draw(logits, [SamplingParams(temperature=0)] * 8)
    tokens, lp = _draw(logits, [SamplingParams(temperature=1.0, top_k=1)] * 8, seeds=[seed * 10 + i for i in range(8)])
    assert torch.equal(tokens, greedy_tokens)
    assert torch.equal(lp, greedy_lp)  # both at temperature 1


@pytest.mark.parametrize("seed", range(5))
def test_tiny_top_p_equals_greedy(seed):
    logits = _logits(8, seed=seed, scale=0.5)  # flat distributions: the top token holds far more than 1e-6
    greedy_tokens, _ = _draw(logits, [SamplingParams(temperature=0)] * 8)
    tokens, _ = _draw(logits, [SamplingParams(temperature=1.3, top_p=1e-6)] * 8, seeds=[seed + i for i in range(8)])
    assert torch.equal(tokens, greedy_tokens)


def test_top_k_and_top_p_restrict_the_draw_but_not_the_logprob():
    logits = _logits(1, seed=3, scale=1.0)
    top5 = set(logits[0].topk(5).indices.tolist())
    probs = torch.softmax(logits[0].double(), -1)
    order = probs.argsort(descending=True)
    nucleus = set(order[: int((probs[order].cumsum(0) < 0.5).sum()) + 1].tolist())
    seen_k, seen_p = set(), set()
    for s in range(300):
        t, lp = _draw(logits, [SamplingParams(top_k=5)], seeds=[s])
        assert t.item() in top5
        # the reported logprob is over the full vocabulary, not renormalised over the top-k
        assert lp.item() == vk.log_softmax(logits)[0, t.item()].item()
        seen_k.add(t.item())
        t, _ = _draw(logits, [SamplingParams(top_p=0.5)], seeds=[s])
        assert t.item() in nucleus
        seen_p.add(t.item())
    assert seen_k == top5
    assert seen_p == nucleus and len(nucleus) > 1


def test_temperature_scales_the_reported_logprob():
    logits = _logits(2, seed=4)
    tokens, lp = _draw(logits, [SamplingParams(temperature=0.5)] * 2, seeds=[1, 2])
    assert torch.equal(lp, vk.log_softmax(logits, 0.5).gather(1, tokens[:, None])[:, 0])


def test_draws_follow_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -10.0]])
    n = 3000
    counts = torch.zeros(5)
    for s in range(n):
        t, _ = sample(logits, [SamplingParams()], [s], [0])
        counts[t] += 1
    expected = torch.softmax(logits[0], -1) * n
    # each count within 5 standard deviations of its binomial mean
    sd = (expected * (1 - expected / n)).sqrt()
    assert bool(((counts - expected).abs() <= 5 * sd + 1).all()), (counts, expected)


def test_seed_and_token_index_decide_the_draw():
    logits = _logits(1, seed=5, scale=0.1)  # nearly uniform: the noise decides
    draws = {
        (s, i): _draw(logits, [SamplingParams()], seeds=[s], indices=[i])[0].item() for s in range(4) for i in range(4)
    }
    assert len(set(draws.values())) > 4
    for (s, i), tok in draws.items():
        assert _draw(logits, [SamplingParams()], seeds=[s], indices=[i])[0].item() == tok


def test_token_seed():
    assert token_seed(1, 0) == token_seed(1, 0)
    seeds = {token_seed(s, i) for s in range(20) for i in range(-3, 20)}
    assert len(seeds) == 20 * 23
    assert all(0 <= x < 2**63 for x in seeds)


@pytest.mark.parametrize("n", [1, 7, 8, 256])
def test_token_seeds_equal_token_seed(n):
    """The vectorised seeds (numpy's wrapping uint64) are token_seed's, for seeds and indices past 64 bits too."""
    rng = random.Random(n)
    seeds = [rng.getrandbits((3, 20, 63, 64, 70)[i % 5]) for i in range(n)]
    indices = [rng.getrandbits((3, 12, 66)[i % 3]) for i in range(n)]
    got = token_seeds(seeds, indices)
    assert got.dtype == np.int64 and got.tolist() == [token_seed(s, i) for s, i in zip(seeds, indices, strict=True)]


@settings(max_examples=30, deadline=None)
@given(b=st.integers(1, 10), seed=st.integers(0, 2**16), data=st.data())
def test_a_row_is_sampled_the_same_whatever_the_batch(b, seed, data):
    logits = _logits(b, seed=seed)
    kinds = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7),
        SamplingParams(top_k=3),
        SamplingParams(top_p=0.6, temperature=1.2),
    ]
    params = [data.draw(st.sampled_from(kinds), label=f"params {i}") for i in range(b)]
    seeds = [seed + 7 * i for i in range(b)]
    indices = [data.draw(st.integers(0, 50), label=f"index {i}") for i in range(b)]
    tokens, lp = sample(logits, params, seeds, indices)
    rows = data.draw(st.lists(st.integers(0, b - 1), min_size=1, max_size=b), label="rows")
    sub_t, sub_lp = sample(
        logits[rows], [params[r] for r in rows], [seeds[r] for r in rows], [indices[r] for r in rows]
    )
    assert torch.equal(sub_t, tokens[rows]) and torch.equal(sub_lp, lp[rows])


@pytest.fixture(scope="module")
def llm():
    return LLM(model=random_model(tiny_qwen3_config(), seed=9), num_kv_blocks=64)


def test_engine_top_k_one_equals_greedy(llm):
    prompts = [[1, 2, 3, 4], [50, 60, 70]]
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    top1 = llm.generate(prompts, SamplingParams(top_k=1, max_tokens=8, seed=4, ignore_eos=True), use_tqdm=False)
    tiny_p = llm.generate(prompts, SamplingParams(top_p=1e-9, max_tokens=8, seed=5, ignore_eos=True), use_tqdm=False)
    for g, k, p in zip(greedy, top1, tiny_p, strict=True):
        assert k.token_ids == g.token_ids and torch.equal(k.logprobs, g.logprobs)
        assert p.token_ids == g.token_ids and torch.equal(p.logprobs, g.logprobs)
