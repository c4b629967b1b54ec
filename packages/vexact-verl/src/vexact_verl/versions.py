"""Policy versions in asynchronous RL: which weights produced each token, the check against them, and staleness.

In verl's ``colocate_async`` and ``separate_async`` trainers a rollout runs on while the trainer steps: verl aborts the
requests in flight, syncs the weights of trainer step ``v`` (``update_weights(global_steps=v)``), and its
``FullyAsyncLLMServerClient`` resubmits each aborted request as the prompt plus the tokens so far. So one response can
hold tokens of several versions. The vexact server stamps every reply with the version of all of its tokens
(``extra_fields["global_steps"]``: the weights the engine held when the request entered it; the engine refuses a
weight update while requests are in it). verl 0.9.1's async client keeps only the first and last version of a
response (``min_global_steps`` / ``max_global_steps``); :class:`VersionedAsyncLLMServerClient` is that client plus
``extra_fields["token_global_steps"]``, one version per response token.

With an exact engine the logprobs a response carries are the trainer's at those versions, bit for bit:
:func:`behavior_check` rescores every token with the trainer at its own version and reports K3 against the behavior
policy (exactly 0.0) and how many tokens differ (0). verl's ``rollout_corr/*`` metrics compare instead with the
trainer's *current* weights, so in async modes they measure staleness, which :func:`staleness_metrics` reports per
step from the versions.

Inside verl's own async trainers the versions reach the actor as follows: the agent-loop manager
:class:`vexact_verl.agent_loop.VersionedAgentLoopManager` (selected by
``actor_rollout_ref.rollout.agent.agent_loop_manager_class``) hands verl's agent loops this client instead of verl's,
verl's agent loop keeps the reply's ``extra_fields`` and stores them in the batch (field ``extra_fields``, one dict
per response), and the actor reads ``extra_fields["token_global_steps"]`` beside ``rollout_log_probs``. Which version
the actor's weights are is recorded when the actor sends them (:func:`publish_version`, called by verl's
``update_weights(global_steps=v)`` on every actor rank whatever the checkpoint-engine backend:
:func:`vexact_verl.registration.register_version_publish`; and by the vexact ``ServerAdapter`` of verl's hybrid worker)
and read with :func:`published_version`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient, LLMServerClient

TOKEN_VERSIONS = "token_global_steps"

_published: int | None = None


def publish_version(version: int | None) -> None:
    """Record that this process's trainer weights were just sent to the rollout as policy version ``version``
    (verl's ``update_weights(global_steps=version)``); ``None`` (verl passed no version) leaves the record as is."""
    global _published
    if version is not None:
        _published = int(version)


def published_version() -> int | None:
    """The version of the weights this process last sent to the rollout; ``None`` before the first sync or where
    verl sent them without a ``global_steps``."""
    return _published


class _SegmentVersions(LLMServerClient):
    """Records, per request, the version and token count of each server reply (one reply per resumed segment)."""

    async def generate(self, request_id, **kwargs):
        out = await super().generate(request_id, **kwargs)
        segments = getattr(self, "_vexact_segments", {}).get(request_id)
        if segments is not None:
            segments.append((out.extra_fields.get("global_steps"), len(out.token_ids)))
        return out


class VersionedAsyncLLMServerClient(FullyAsyncLLMServerClient, _SegmentVersions):
    """verl's ``FullyAsyncLLMServerClient`` (partial rollouts resumed across weight updates, unchanged) whose result
    also carries ``extra_fields["token_global_steps"]``: the policy version of each response token.

    verl's client calls ``super().generate`` once per segment; in this class's method order that call reaches
    :class:`_SegmentVersions` before verl's base client, which records the segment's version and length.
    """

    async def generate(self, request_id, **kwargs):
        if not hasattr(self, "_vexact_segments"):
            self._vexact_segments: dict = {}
        if request_id in self._vexact_segments:
            raise ValueError(f"request id {request_id!r} is already generating on this client")
        self._vexact_segments[request_id] = segments = []
        try:
            out = await super().generate(request_id, **kwargs)
        finally:
            self._vexact_segments.pop(request_id, None)
        versions = [v for v, n in segments for _ in range(n)]
        # verl's client stops at the token budget; a segment never yields more tokens than the response keeps
        out.extra_fields[TOKEN_VERSIONS] = versions[: len(out.token_ids)]
        return out


def staleness_metrics(trainer_version: int, token_versions: Sequence[Sequence[int]]) -> dict[str, float]:
    """``vexact/staleness/*`` of one training step: how many versions each response token is behind the weights the
    trainer holds (``trainer_version``), mean / max / min over tokens; ``mixed_fraction``: the share of responses
    whose tokens span several versions (resumed across a weight update)."""
    flat = [trainer_version - int(v) for vs in token_versions for v in vs]
    if not flat:
        return {}
    mixed = sum(len(set(vs)) > 1 for vs in token_versions)
    if min(flat) < 0:
        ahead = max(map(max, token_versions))
        raise ValueError(f"a token's version {ahead} is ahead of the trainer's {trainer_version}")
    return {
        "vexact/staleness/mean": sum(flat) / len(flat),
        "vexact/staleness/max": float(max(flat)),
        "vexact/staleness/min": float(min(flat)),
        "vexact/staleness/mixed_fraction": mixed / len(token_versions),
    }


def behavior_check(
    behavior_log_probs: Sequence[torch.Tensor],
    token_versions: Sequence[Sequence[int]],
    score: Callable[[int], Sequence[torch.Tensor]],
    held: Iterable[int] | None = None,
) -> dict[str, float]:
    """Rescore each response token with the trainer at the version that produced it and compare with the rollout's.

    ``behavior_log_probs[i]``: response i's logprobs from the rollout (``[R_i]``); ``token_versions[i]``: their
    versions; ``score(v)``: the trainer's logprobs of every response with the weights of version ``v`` (a list of
    ``[R_i]``). Returns ``vexact/behavior/k3`` (mean over tokens of :func:`vexact_trainer.k3_kl`, ``r - 1 - log r``
    with ``r = p_trainer/p_rollout``, in float64: exactly 0.0 iff no token differs), ``vexact/behavior/tokens_differ``
    (fp32 bitwise) and ``vexact/behavior/abs_delta_max``. With ``held`` (the versions whose weights the trainer
    still has) tokens of other versions are left out: ``vexact/behavior/tokens_checked`` / ``tokens_unchecked`` count
    both kinds, and ``score`` is asked for held versions only.
    """
    if len(behavior_log_probs) != len(token_versions):
        raise ValueError(f"{len(behavior_log_probs)} responses' logprobs for {len(token_versions)} version lists")
    versions = torch.nn.utils.rnn.pad_sequence([torch.as_tensor(list(v), dtype=torch.int64) for v in token_versions],
                                                batch_first=True, padding_value=-1)  # fmt: skip
    target = [torch.full((len(v),), float("nan"), dtype=torch.float32) for v in token_versions]
    for i, (lp, v) in enumerate(zip(behavior_log_probs, token_versions, strict=True)):
        if len(lp) != len(v):
            raise ValueError(f"response {i}: {len(lp)} logprobs for {len(v)} token versions")
    seen = sorted({int(v) for vs in token_versions for v in vs})
    available = set(seen if held is None else map(int, held))
    for version in (v for v in seen if v in available):
        scored = score(version)
        for i, rescored in enumerate(scored):
            mask = versions[i, : len(target[i])] == version
            target[i][mask] = rescored.float()[mask]
    beh = torch.cat([torch.as_tensor(lp, dtype=torch.float32) for lp in behavior_log_probs])
    tgt = torch.cat(target)
    if beh.numel() == 0:
        return {}
    checked = torch.cat([torch.as_tensor([int(x) in available for x in v], dtype=torch.bool) for v in token_versions])
    counts = {
        "vexact/behavior/tokens_checked": float(checked.sum().item()),
        "vexact/behavior/tokens_unchecked": float((~checked).sum().item()),
    }
    if not checked.any():
        return counts
    beh, tgt = beh[checked], tgt[checked]
    log_ratio = tgt.double() - beh.double()
    from vexact_trainer import k3_kl  # the trainer's estimator, imported where the actor calls this

    k3 = k3_kl(log_ratio).mean().item()
    return {
        "vexact/behavior/k3": k3,
        "vexact/behavior/tokens_differ": float((tgt != beh).sum().item()),
        "vexact/behavior/abs_delta_max": log_ratio.abs().max().item(),
        **counts,
    }
