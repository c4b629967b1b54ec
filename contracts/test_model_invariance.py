"""Contract 1b: the whole model's logprobs for a sequence are the same alone or inside a batch of 64 (invariant
backend), and the invariant forward matches the fast backend within bf16 tolerance (it is also correct).

CPU: the tiny models (dense and MoE). GPU targets: Qwen3-0.6B- and Qwen3-30B-A3B-shaped models with random weights
(real HF config shapes; the MoE with two layers).
"""

from __future__ import annotations

import pytest
import torch

from contracts.harness import QWEN3_06B, QWEN3_30B_A3B
from vexact_models import random_model, tiny_qwen3_config, tiny_qwen3_moe_config
from vexact_trainer import Actor, ActorConfig


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def model(device, request):
    if request.param == "qwen3":
        cfg = tiny_qwen3_config() if device == "cpu" else tiny_qwen3_config(**QWEN3_06B)
    else:  # GPU: the real Qwen3-30B-A3B layer shape, two layers
        gpu = {**QWEN3_30B_A3B, "num_hidden_layers": 2}
        cfg = tiny_qwen3_moe_config() if device == "cpu" else tiny_qwen3_moe_config(**gpu)
    return random_model(cfg, seed=7, embed_std=1.0 if device == "cpu" else 0.02, device=device)


def _batch(vocab: int, n: int, lo: int, hi: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    prompts = [torch.randint(0, vocab, (max(1, n_ // 3),), generator=g).tolist() for n_ in lens]
    responses = [torch.randint(0, vocab, (n_ - max(1, n_ // 3),), generator=g).tolist() for n_ in lens]
    return prompts, responses


def test_sequence_alone_equals_in_batch_of_64(model, device):
    lo, hi = (4, 40) if device == "cpu" else (16, 1024)
    prompts, responses = _batch(model.config.vocab_size, 64, lo, hi, seed=0)
    actor = Actor(model)
    batched = actor.compute_log_probs(prompts, responses, 1.0).logprobs
    for i in (0, 17, 63):
        alone = actor.compute_log_probs([prompts[i]], [responses[i]], 1.0).logprobs[0]
        assert torch.equal(alone, batched[i]), f"sequence {i}: logprobs alone differ from the batch of 64"
    # a different batch composition around the same sequence
    reordered = actor.compute_log_probs(prompts[::-1], responses[::-1], 1.0).logprobs[::-1]
    assert all(torch.equal(a, b) for a, b in zip(batched, reordered, strict=True))


def test_invariant_matches_fast_within_bf16_tolerance(model, device):
    lo, hi = (4, 40) if device == "cpu" else (16, 512)
    prompts, responses = _batch(model.config.vocab_size, 8, lo, hi, seed=1)
    moe = hasattr(model.config, "num_experts")
    inv = Actor(model).compute_log_probs(prompts, responses, 1.0, with_router=moe)
    fast = Actor(model, ActorConfig(backend="fast")).compute_log_probs(prompts, responses, 1.0, with_router=moe)
    keep = [slice(None)] * len(prompts)
    if moe:  # compare each sequence up to the first token whose experts differ between the two (a routing flip)
        flips = zip(inv.router, fast.router, prompts, strict=True)
        keep = [slice(0, _before_first_flip(a, b, len(p))) for a, b, p in flips]
        assert sum(s.stop for s in keep) >= 8, "routing flips before any response token: nothing to compare"
    err = torch.cat([(a[s] - b[s]).abs() for a, b, s in zip(inv.logprobs, fast.logprobs, keep, strict=True)])
    # bf16 logits in the fast path round at ~2^-8 relative; allow that on the largest logprobs
    assert err.max().item() < 0.25 and err.mean().item() < 0.02, (err.max().item(), err.mean().item())


def _before_first_flip(ids_a: torch.Tensor, ids_b: torch.Tensor, prompt_len: int) -> int:
    """Response tokens predicted before the first position whose chosen experts differ in some layer: that token's
    state, and every later one's through attention, then differs by far more than bf16 rounding."""
    differ = (ids_a.sort(-1).values != ids_b.sort(-1).values).any(-1).any(0).nonzero()  # [layers, len, k] -> positions
    first = int(differ[0]) if len(differ) else ids_a.shape[1]
    return max(0, first - prompt_len + 1)  # response token i is predicted at position prompt_len - 1 + i
