"""EngineConfig.tune_linears: the engine times the invariant linear's forms at its decode graphs' projection shapes
and captures the graphs with the fastest; the same tokens and logprobs as with the default pick, and as the trainer's.
On CPU only the setting's validation runs (no graphs, nothing to time)."""

from __future__ import annotations

import pytest
import torch

from vexact_engine import LLM, EngineConfig, SamplingParams
from vexact_models import random_model, tiny_qwen3_config


def test_tune_linears_is_a_bool():
    assert EngineConfig().tune_linears is True
    with pytest.raises(TypeError, match=r"EngineConfig.tune_linears must be True or False, got 'yes'"):
        EngineConfig(tune_linears="yes")


def test_tune_linears_min_rows_is_a_positive_integer_or_none():
    assert EngineConfig().tune_linears_min_rows is None
    assert EngineConfig(tune_linears_min_rows=1).tune_linears_min_rows == 1
    for bad in (0, -8, True, 2.0):
        with pytest.raises(ValueError, match=rf"EngineConfig.tune_linears_min_rows must be a positive integer, got "
                                             rf"{bad!r}"):  # fmt: skip
            EngineConfig(tune_linears_min_rows=bad)


def test_cpu_engine_times_nothing():
    eng = LLM(model=random_model(tiny_qwen3_config(), seed=1), num_kv_blocks=64)
    eng.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert eng.runner.linear_picks == {} and eng.runner.linear_tuning == {}


@pytest.mark.gpu
def test_gpu_tuned_engine_gives_the_default_picks_bits_and_the_trainers():
    """256 requests decode in the 256-row graph of a model with projections of K = 1024-3072 (K splits): with the
    forms timed and picked, tokens and logprobs equal the default pick's engine and the trainer's, bitwise; every
    projection shape at M = 256 was timed, no form differed."""
    from vexact_trainer import Actor

    cfg = tiny_qwen3_config(hidden_size=1024, intermediate_size=3072, num_attention_heads=8, num_key_value_heads=4,
                            head_dim=128, num_hidden_layers=3)  # fmt: skip
    model = random_model(cfg, seed=5, device="cuda", embed_std=0.05)
    g = torch.Generator().manual_seed(5)
    lens = torch.randint(4, 40, (256,), generator=g)
    prompts = [torch.randint(0, 256, (int(n),), generator=g).tolist() for n in lens]
    params = [SamplingParams(temperature=1.0, max_tokens=6, seed=i, ignore_eos=True) for i in range(256)]
    kw = dict(device="cuda", max_num_seqs=256, max_num_batched_tokens=2048, num_kv_blocks=1024,
              cuda_graph_batch_sizes=(8, 256))  # fmt: skip
    tuned = LLM(model=model, **kw)
    outs = tuned.generate(prompts, params, use_tqdm=False)
    ref = LLM(model=model, tune_linears=False, **kw).generate(prompts, params, use_tqdm=False)
    runner = tuned.runner
    assert runner.graph_error is None and runner.num_padded_steps > 0
    shapes = {key[:3] for key in runner.linear_tuning}
    assert {(256, 1024 + 2 * 512, 1024), (256, 1024, 1024), (256, 2 * 3072, 1024), (256, 1024, 3072)} <= shapes
    assert not any(key[0] == 8 for key in runner.linear_tuning)  # below LINEAR_TUNE_MIN_M: the pick by shape
    assert not any(r["differ"] for r in runner.linear_tuning.values())
    for a, b in zip(outs, ref, strict=True):
        assert a.token_ids == b.token_ids and torch.equal(a.logprobs, b.logprobs), a.request_id
    # every decode graph timed, the 8-row one (the few requests left at a rollout's end) too: the same bits
    every = LLM(model=model, tune_linears_min_rows=1, **kw)
    for a, b in zip(every.generate(prompts, params, use_tqdm=False), ref, strict=True):
        assert a.token_ids == b.token_ids and torch.equal(a.logprobs, b.logprobs), a.request_id
    assert {(8, 1024, 1024), (8, 1024, 3072)} <= {key[:3] for key in every.runner.linear_tuning}
    assert not any(r["differ"] for r in every.runner.linear_tuning.values())
    scored = Actor(model).compute_log_probs(prompts, [o.token_ids for o in outs], 1.0)
    for o, lp in zip(outs, scored.logprobs, strict=True):
        assert torch.equal(o.logprobs, lp.cpu())
