"""Sampling seeds from the sample, not from arrival order: verl's single-turn agent loop with a per-request seed.

verl 0.9.1's agent loops send no ``seed``, so every rollout backend draws with a seed of its own: the vexact engine
derives one from its seed and the order in which requests reach it, which depends on Ray's and asyncio's scheduling,
on which replica a request lands, and restarts at zero when a job is resumed. Two runs of the same job then sample
different tokens from the first step.

:class:`SeededSingleTurnAgentLoop` is verl's ``SingleTurnAgentLoop`` with one change: the request carries
``seed = sample_seed(rollout.seed, global_steps, index, session_id, raw_prompt)``, i.e. a function of the trainer
step the prompt was drawn at, the prompt's dataset index and content, and which of the ``rollout.n`` samples this is.
The engine keys every draw by (request seed, token index), so the tokens drawn are a function of the sample alone,
whatever the arrival order, the batch or the replica. Select it with
``actor_rollout_ref.rollout.agent.default_agent_loop=vexact_single_turn_agent``: importing this module puts the
name in verl's agent-loop table, and :func:`vexact_verl.register` imports it (in every Ray worker, as for the rollout).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from verl.experimental.agent_loop.agent_loop import register
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop
from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ

AGENT_LOOP_NAME = "vexact_single_turn_agent"


def sample_seed(base: int, step: int, index: int, sample: int, prompt: Any = None) -> int:
    """A 63-bit sampling seed for sample ``sample`` (verl's ``session_id``) of dataset row ``index``, drawn at
    trainer step ``step``.

    ``prompt`` (the raw chat messages) is mixed in so that rows without a distinct ``extra_info.index`` (verl then
    reads 0 for every row) still get distinct seeds. blake2b, not Python's ``hash``: the latter is salted per process.
    """
    if hasattr(prompt, "tolist"):  # a numpy array of messages: its str() would abridge long arrays
        prompt = prompt.tolist()
    text = json.dumps(prompt, sort_keys=True, default=str) if prompt is not None else ""
    key = f"{int(base)}:{int(step)}:{int(index)}:{int(sample)}:{text}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


@register(AGENT_LOOP_NAME)
class SeededSingleTurnAgentLoop(SingleTurnAgentLoop):
    """verl's single-turn agent loop whose request carries a seed derived from the sample (module docstring)."""

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> Any:
        missing = [k for k in ("global_steps", "index", "session_id") if k not in kwargs]
        if missing:
            raise ValueError(
                f"agent loop {AGENT_LOOP_NAME!r} derives each request's seed from the prompt's global_steps, index "
                f"and session_id; this sample has no {missing} (verl's V1 trainer, trainer.use_v1=True, passes them)"
            )
        seed = sample_seed(
            self.rollout_config.seed,
            _scalar(kwargs["global_steps"]),
            _scalar(kwargs["index"]),
            _scalar(kwargs["session_id"]),
            kwargs.get("raw_prompt"),
        )
        return await super().run({**sampling_params, "seed": seed}, **kwargs)


def _scalar(value: Any) -> int:
    """An int from verl's per-sample values (Python or numpy ints, 0-d tensors)."""
    return int(value.item() if hasattr(value, "item") else value)


class VersionedAgentLoopManager(AgentLoopManagerTQ):
    """verl's agent-loop manager of the V1 trainers (``AgentLoopManagerTQ``) whose agent loops talk to the rollout
    through :class:`vexact_verl.versions.VersionedAsyncLLMServerClient`, so that every response carries the policy
    version of each of its tokens (``extra_fields["token_global_steps"]``, stored in the batch with verl's other
    ``extra_fields``) into the actor's step.

    verl's async trainers hand the manager a ``FullyAsyncLLMServerClient``; this manager builds the versioned client
    from that client's own settings (config, load balancer, ``only_hybrid``), so partial rollouts resume exactly as in
    verl. Any other client (the synchronous trainer's, a custom one) is kept as given. Select it with
    ``actor_rollout_ref.rollout.agent.agent_loop_manager_class=vexact_verl.agent_loop.VersionedAgentLoopManager``.
    """

    def __init__(self, *args, llm_client=None, **kwargs):
        super().__init__(*args, llm_client=versioned_client(llm_client), **kwargs)


def versioned_client(client: Any) -> Any:
    """``client`` as a :class:`~vexact_verl.versions.VersionedAsyncLLMServerClient` where it is exactly verl's
    ``FullyAsyncLLMServerClient``; any other client unchanged."""
    from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient

    from .versions import VersionedAsyncLLMServerClient

    if type(client) is not FullyAsyncLLMServerClient:
        return client
    versioned = VersionedAsyncLLMServerClient(
        config=client.config, load_balancer_handle=client._load_balancer, only_hybrid=client._only_hybrid
    )
    versioned.__dict__.update(client.__dict__)  # settings verl set after construction (e.g. a tokenizer)
    return versioned
