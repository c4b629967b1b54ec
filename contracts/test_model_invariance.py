"""Contract 1b: the whole model's logprobs for a sequence are the same alone or inside a batch of 64 (invariant
backend), and the invariant forward matches the fast backend within bf16 tolerance (it is also correct).

CPU: the tiny models (every family). GPU targets: Qwen3-0.6B-, Qwen3-30B-A3B-, Moonlight-16B-A3B- and
gpt-oss-20b-shaped models with random weights (real HF config shapes; the MoEs with two, three and two layers), and
Llama-3.2-1B, Qwen2.5-7B and Mistral-7B shapes with two layers. The GPU workload's sequences (up to 1023 tokens) need
the real shapes' context: the tiny checkpoints hold 512 positions.
"""

from __future__ import annotations

import pytest
import torch

from contracts.harness import DENSE_SHAPES, GPT_OSS_20B_2L, MOONLIGHT_3L, QWEN3_06B, QWEN3_30B_A3B, skip_on_gpu
from vexact_models import (
    random_model,
    tiny_config,
    tiny_deepseek_v3_config,
    tiny_gpt_oss_config,
    tiny_qwen3_config,
    tiny_qwen3_moe_config,
)
from vexact_trainer import Actor, ActorConfig

GPU_DENSE = {family: shape for family, shape in DENSE_SHAPES.values()}
TINY = {
    "qwen3": tiny_qwen3_config,
    "qwen3_moe": tiny_qwen3_moe_config,
    "deepseek_v3": tiny_deepseek_v3_config,
    "gpt_oss": tiny_gpt_oss_config,
}
GPU_SHAPES = {
    "qwen3": QWEN3_06B,
    "qwen3_moe": {**QWEN3_30B_A3B, "num_hidden_layers": 2},
    "deepseek_v3": MOONLIGHT_3L,
    "gpt_oss": GPT_OSS_20B_2L,
}


FAMILIES = ["qwen3", "qwen3_moe", "llama", "qwen2", "mistral", "deepseek_v3", "gpt_oss"]
# Sequence lengths drawn per target, [lo, hi): the batch-of-64 test's and the invariant-vs-fast test's.
LENGTHS = {"cpu": ((4, 40), (4, 40)), "gpu": ((16, 1024), (16, 512))}


def _config(family: str, device: str):
    """The family's model on ``device``: the tiny config on cpu; on a GPU target the real layer shape (two layers
    for the dense families and Qwen3-30B-A3B, where gpt-oss-20b's two are one sliding of 128 keys and one full)."""
    if device == "cpu":
        return tiny_config(family) if family in GPU_DENSE else TINY[family]()
    if family in GPU_DENSE:
        return tiny_config(family, **{**GPU_DENSE[family], "num_hidden_layers": 2})
    return TINY[family](**GPU_SHAPES[family])


@pytest.fixture(scope="module", params=FAMILIES)
def model(device, request):
    skip_on_gpu(request.param, device)
    cfg = _config(request.param, device)
    # a tied head reads the embedding: at std 1 its logits reach ~60, where bf16 rounding alone exceeds the bound
    embed_std = 0.02 if device != "cpu" else 0.25 if cfg.tie_word_embeddings else 1.0
    return random_model(cfg, seed=7, embed_std=embed_std, device=device)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_target_s_config_holds_its_longest_sequence(family):
    """Each target's config takes the longest sequence its workload draws (the trainer refuses one past
    ``max_position_embeddings``): checked on the cpu target for the GPU targets too, where only configs are built."""
    for device, target in (("cpu", "cpu"), ("cuda", "gpu")):
        longest = max(hi for _, hi in LENGTHS[target]) - 1
        cfg = _config(family, device)
        assert longest <= cfg.max_position_embeddings, (
            f"{family} on {target}: sequences of up to {longest} tokens; max_position_embeddings "
            f"{cfg.max_position_embeddings}"
        )


def _batch(vocab: int, n: int, lo: int, hi: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    prompts = [torch.randint(0, vocab, (max(1, n_ // 3),), generator=g).tolist() for n_ in lens]
    responses = [torch.randint(0, vocab, (n_ - max(1, n_ // 3),), generator=g).tolist() for n_ in lens]
    return prompts, responses


def test_sequence_alone_equals_in_batch_of_64(model, device):
    lo, hi = LENGTHS["cpu" if device == "cpu" else "gpu"][0]
    prompts, responses = _batch(model.config.vocab_size, 64, lo, hi, seed=0)
    actor = Actor(model)
    batched = actor.compute_log_probs(prompts, responses, 1.0).logprobs
    for i in (0, 17, 63):
        alone = actor.compute_log_probs([prompts[i]], [responses[i]], 1.0).logprobs[0]
        assert torch.equal(alone, batched[i]), f"sequence {i}: logprobs alone differ from the batch of 64"
    # a different batch composition around the same sequence
    reordered = actor.compute_log_probs(prompts[::-1], responses[::-1], 1.0).logprobs[::-1]
    assert all(torch.equal(a, b) for a, b in zip(batched, reordered, strict=True))


# The MoE branch's bound on the mean, per family where it is not the 0.03 set from Qwen3-30B-A3B (below). gpt-oss: an
# H200 measured a mean of 0.0413 (99th percentile 0.173) over the 1339 of 1642 tokens that route alike at
# GPT_OSS_20B_2L. That is bf16 rounding, not a fast-path error: on CPU at that shape (its weights drawn there, this
# test's batch) the invariant backend's bf16 forward is itself 0.027 from an fp32 forward of the same weights, the
# fast backend 0.034, the two 0.036 apart (1252 tokens routing alike in all three); the fast attention alone
# (transformers' eager: bf16 scores and softmax, the sink a last column; sinks and window checked against float64)
# moves the mean 0.026, the fast MoE alone 0.007. The bound keeps Qwen3's headroom, about 1.5 times the H200's mean.
# What it resolves there: a fast attention that ignores the window fails (244 tokens route alike, q99 0.43); one that
# drops the sinks does not (mean 0.052: random sinks are small logits); the kernels' test_attention_window_sinks
# holds each backend's sinks and window against float64 and fails on that one.
MOE_MEAN_BOUND = {"gpt_oss": 0.06}


def test_invariant_matches_fast_within_bf16_tolerance(model, device):
    lo, hi = LENGTHS["cpu" if device == "cpu" else "gpu"][1]
    prompts, responses = _batch(model.config.vocab_size, 8, lo, hi, seed=1)
    moe = hasattr(model.config, "num_experts")
    inv = Actor(model).compute_log_probs(prompts, responses, 1.0, with_router=moe)
    fast = Actor(model, ActorConfig(backend="fast")).compute_log_probs(prompts, responses, 1.0, with_router=moe)
    if not moe:
        err = (torch.cat(inv.logprobs) - torch.cat(fast.logprobs)).abs()
        # bf16 logits in the fast path round at ~2^-8 relative; allow that on the largest logprobs
        assert err.max().item() < 0.25 and err.mean().item() < 0.02, (err.max().item(), err.mean().item())
        return
    # MoE: the fast path's bf16 router logits pick other experts at near-ties (at the 30B-A3B shape, within the first
    # few tokens of every sequence), which changes that token's output completely. Compare the tokens whose own
    # experts agree in every layer; they still see flipped tokens through attention, so the bound is on the mean and
    # the 99th percentile, not the max. The mean's bound is 0.03: with the fast path's attention on flash (bf16
    # probabilities before P @ V; before, a 3-D SDPA call ran the fp32 math backend) an H200 measured a mean of 0.0201
    # and a 99th percentile of 0.069 over the 1274 of 1642 tokens that route alike.
    errs, kept, total = [], 0, 0
    for a, b, ra, rb, p in zip(inv.logprobs, fast.logprobs, inv.router, fast.router, prompts, strict=True):
        same = (ra.sort(-1).values == rb.sort(-1).values).all(-1).all(0)  # [positions]
        mask = same[len(p) - 1 : len(p) - 1 + len(a)]  # response token i is predicted at position len(p) - 1 + i
        errs.append((a - b).abs()[mask])
        kept, total = kept + int(mask.sum()), total + len(a)
    err = torch.cat(errs)
    assert kept >= total // 2, f"only {kept} of {total} tokens route alike in both backends"
    q99 = err.quantile(0.99).item()
    bound = MOE_MEAN_BOUND.get(model.config.model_type, 0.03)
    assert q99 < 0.25 and err.mean().item() < bound, (q99, err.mean().item(), bound, kept, total)
