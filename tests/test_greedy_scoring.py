"""Greedy rollouts (the engine's temperature 0) are scored by the trainer at temperature 1, bit for bit; the Actor
refuses temperature 0 with a message that says so."""

from __future__ import annotations

import pytest
import torch

from vexact_engine import LLM, SamplingParams
from vexact_models import default_checkpoint
from vexact_trainer import Actor, BadRolloutError, load_rollouts, rollouts_from_outputs, rollouts_to_jsonl


def test_greedy_rollouts_score_exactly_at_temperature_one():
    llm = LLM(default_checkpoint(), max_num_seqs=4, max_num_batched_tokens=64)
    outs = llm.generate([[17, 42, 7], [5, 6]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert all(o.ok for o in outs)
    prompts, responses = [o.prompt_token_ids for o in outs], [o.token_ids for o in outs]
    actor = Actor(llm.model)
    scored = actor.compute_log_probs(prompts, responses, temperature=1.0)
    assert all(torch.equal(o.logprobs, lp) for o, lp in zip(outs, scored.logprobs, strict=True))
    other = actor.compute_log_probs(prompts, responses, temperature=0.7)
    assert not torch.equal(outs[0].logprobs, other.logprobs[0])  # the temperature matters: 1.0 is the right one
    with pytest.raises(ValueError, match=r"temperature 0 \(greedy\).*score greedy rollouts with temperature=1.0"):
        actor.compute_log_probs(prompts, responses, temperature=0)


def test_a_greedy_rollout_file_recorded_at_temperature_zero_is_refused_with_the_fix(tmp_path):
    llm = LLM(default_checkpoint(), max_num_seqs=4, max_num_batched_tokens=64)
    outs = llm.generate([[17, 42, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    rollouts_to_jsonl(rollouts_from_outputs(outs, 0.0), tmp_path / "greedy.jsonl")
    with pytest.raises(BadRolloutError, match=r"greedy.jsonl:1: temperature 0\.0 .*record 1.0 for them"):
        load_rollouts(tmp_path / "greedy.jsonl")
    rollouts_to_jsonl(rollouts_from_outputs(outs, 1.0), tmp_path / "greedy1.jsonl")
    rollouts, errors = load_rollouts(tmp_path / "greedy1.jsonl")
    assert len(rollouts) == 1 and not errors
