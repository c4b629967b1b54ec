"""The per-version behavior check on its own, on CPU: tokens of two policy versions, each compared with the trainer at
its own version (K3 exactly 0.0), a mislabeled token caught, tokens of a version whose weights are gone counted as
unchecked; and the versioned client that verl's async trainers get through ``VersionedAgentLoopManager``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("verl", reason="verl is not installed: pip install 'vexact-verl[verl]'")

from vexact_models import default_checkpoint, load_model  # noqa: E402
from vexact_trainer import Actor  # noqa: E402
from vexact_verl.versions import behavior_check, staleness_metrics  # noqa: E402

PROMPTS = [[257, 72, 101, 108], [257, 49, 43, 49, 61]]
RESPONSES = [[3, 4, 5, 6, 7, 8], [9, 10, 11, 12]]
TEMPERATURE = 0.9


@pytest.fixture(scope="module")
def two_versions():
    """The trainer's logprobs of the responses at version 0 (the tiny checkpoint) and version 1 (its weights moved)."""
    model = load_model(default_checkpoint("qwen3"))

    def score():
        return Actor(model).compute_log_probs(PROMPTS, RESPONSES, temperature=TEMPERATURE).logprobs

    v0 = score()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.full_like(p, 1e-2))
    v1 = score()
    assert all(not torch.equal(a, b) for a, b in zip(v0, v1, strict=True))
    return {0: v0, 1: v1}


def rollout(scored: dict, versions: list[list[int]]) -> list[torch.Tensor]:
    """Behavior logprobs of an exact rollout: each token's at the version that produced it."""
    return [torch.stack([scored[v][i][j] for j, v in enumerate(vs)]) for i, vs in enumerate(versions)]


VERSIONS = [[0, 0, 0, 1, 1, 1], [0, 1, 1, 1]]  # both resumed across a weight update


def test_every_token_at_its_own_version_is_exact(two_versions):
    behavior = rollout(two_versions, VERSIONS)
    m = behavior_check(behavior, VERSIONS, two_versions.__getitem__)
    assert m["vexact/behavior/k3"] == 0.0 and m["vexact/behavior/tokens_differ"] == 0, m
    assert m["vexact/behavior/tokens_checked"] == 10 and m["vexact/behavior/tokens_unchecked"] == 0
    # all at the current weights: the stale tokens differ, which is staleness, not mismatch
    current = behavior_check(behavior, [[1] * len(v) for v in VERSIONS], two_versions.__getitem__)
    assert current["vexact/behavior/k3"] > 0.0 and current["vexact/behavior/tokens_differ"] == 4, current


def test_a_mislabeled_version_fails_the_check(two_versions):
    behavior = rollout(two_versions, VERSIONS)
    wrong = [list(v) for v in VERSIONS]
    wrong[0][2] = 1  # a token of version 0 said to be of version 1
    m = behavior_check(behavior, wrong, two_versions.__getitem__)
    assert m["vexact/behavior/k3"] > 0.0 and m["vexact/behavior/tokens_differ"] == 1, m


def test_tokens_of_a_version_not_held_are_counted_not_checked(two_versions):
    behavior = rollout(two_versions, VERSIONS)
    asked = []

    def score(v):
        asked.append(v)
        return two_versions[v]

    m = behavior_check(behavior, VERSIONS, score, held=[1])
    assert asked == [1]
    assert m["vexact/behavior/k3"] == 0.0 and m["vexact/behavior/tokens_differ"] == 0, m
    assert m["vexact/behavior/tokens_checked"] == 6 and m["vexact/behavior/tokens_unchecked"] == 4
    none = behavior_check(behavior, [[0] * len(v) for v in VERSIONS], score, held=[1])
    assert "vexact/behavior/k3" not in none and none["vexact/behavior/tokens_unchecked"] == 10


def test_staleness_counts_versions_behind():
    m = staleness_metrics(2, [[0, 0, 1], [2, 2]])
    assert m["vexact/staleness/max"] == 2.0 and m["vexact/staleness/min"] == 0.0
    assert m["vexact/staleness/mean"] == (2 + 2 + 1) / 5 and m["vexact/staleness/mixed_fraction"] == 0.5
    with pytest.raises(ValueError, match="ahead"):
        staleness_metrics(0, [[1]])


def test_the_manager_gives_verls_agent_loops_the_versioned_client(compose_rollout_config):
    from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient, LLMServerClient

    from vexact_verl.agent_loop import versioned_client
    from vexact_verl.versions import VersionedAsyncLLMServerClient

    config = compose_rollout_config()
    given = FullyAsyncLLMServerClient(config=config, load_balancer_handle=None, only_hybrid=True)
    given.tokenizer = "set by verl after construction"
    client = versioned_client(given)
    assert type(client) is VersionedAsyncLLMServerClient and isinstance(client, FullyAsyncLLMServerClient)
    assert client.config is config and client._only_hybrid and client.tokenizer == given.tokenizer
    other = LLMServerClient(config=config, load_balancer_handle=None)
    assert versioned_client(other) is other  # the synchronous trainer's client: kept as given
