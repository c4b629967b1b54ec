"""Register ``vexact`` with verl's own extension points (no copy of verl code).

verl 0.9.1 looks a rollout backend up in two tables, in every process that needs it:

- ``RolloutReplicaRegistry`` (``verl/workers/rollout/replica.py``): name -> replica class, used by the driver's
  ``LLMServerManager`` to launch servers;
- ``_ROLLOUT_REGISTRY`` (``verl/workers/rollout/base.py``): ``(name, mode)`` -> ServerAdapter, used inside each
  trainer / checkpoint-engine worker (Ray actors in their own processes).

The invariant actor adds a third table, ``EngineRegistry`` (``verl/workers/engine/base.py``): backend ->
model engine, used inside each trainer worker to build the actor and ref engines (see :mod:`vexact_verl.actor_engine`).
Reproducible runs add a fourth, ``_agent_loop_registry`` (``verl/experimental/agent_loop/agent_loop.py``): agent-loop
name -> class, used inside each agent-loop worker (``vexact_single_turn_agent``, see :mod:`vexact_verl.agent_loop`).

Two of verl's worker methods are wrapped, not copied: ``DetachActorWorker``'s host-copy helpers learn
``strategy=vexact`` (:func:`register_detach_worker`), and the actor's ``update_weights`` records the policy version it
sends (:func:`register_version_publish`).

So registration must happen in the workers too. Three ways, all verl's own: the ``verl.plugins`` entry point this
package declares (verl loads it whenever it is imported, in every process), ``VERL_USE_EXTERNAL_MODULES=vexact_verl``
(same, by environment), or calling :func:`register` yourself (driver-only scripts and tests).
"""

from __future__ import annotations

import functools

ROLLOUT_NAME = "vexact"
SERVER_ADAPTER = "vexact_verl.rollout.ServerAdapter"


def _load_replica():
    from .rollout import VexactReplica

    return VexactReplica


def register() -> None:
    """Make ``rollout.name=vexact`` and ``actor.strategy=vexact`` resolvable by verl in this process. Idempotent."""
    try:
        from verl.workers.rollout import base, replica
    except ImportError as e:  # pragma: no cover - the message is the point
        raise ImportError(
            "vexact_verl.register() needs verl: pip install 'vexact-verl[verl]' (verl==0.9.1 and its pins)"
        ) from e
    # first: verl's engine modules ask for the platform at import time (VERL_PLATFORM=cpu must resolve by then)
    from .cpu_platform import register_platform

    register_platform()
    replica.RolloutReplicaRegistry.register(ROLLOUT_NAME, _load_replica)
    base._ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = SERVER_ADAPTER
    # after the rollout, so that a failure to import verl's engine stack cannot take the rollout backend with it
    register_engine()
    from .checkpoint_engine import register_checkpoint_engine

    register_checkpoint_engine()  # `gloo`: the separate placement on CPU
    register_detach_worker()
    register_version_publish()
    from .tim import install

    install()  # tim/* metrics beside verl's rollout_probs_diff ones
    from . import agent_loop  # noqa: F401  (verl's agent-loop table gets `vexact_single_turn_agent`)


def register_engine() -> None:
    """Make ``actor.strategy=vexact`` (and ``ref.strategy``) resolvable by verl's ``EngineRegistry``, and the
    VeOmni variant (backend ``vexact_veomni``, :mod:`vexact_verl.veomni_engine`). Idempotent."""
    from verl.workers.engine.base import EngineRegistry

    from .actor_engine import DEVICES, ENGINE_BACKEND, MODEL_TYPE, VexactEngineWithLMHead
    from .veomni_engine import VEOMNI_BACKEND, VexactVeOmniEngineWithLMHead

    for backend, cls in ((ENGINE_BACKEND, VexactEngineWithLMHead), (VEOMNI_BACKEND, VexactVeOmniEngineWithLMHead)):
        if backend not in EngineRegistry._engines.get(MODEL_TYPE, {}):
            EngineRegistry.register(model_type=MODEL_TYPE, backend=backend, device=list(DEVICES))(cls)


def register_detach_worker() -> None:
    """Let verl's ``separate_async`` trainer save and restore a ``vexact`` actor's weights on the host. Idempotent.

    That trainer runs its actor as ``DetachActorWorker`` (``verl/experimental/separation/engine_workers.py``), which
    keeps the weights of a parameter-sync window on the host (``save_model_to_cpu`` / ``restore_model_from_cpu``, for
    the version-aware ``old_log_prob``) with a helper chosen by ``actor.strategy``, and refuses any strategy it does
    not list. The vexact engine is FSDP2 (verl's ``apply_fsdp2``; DTensor parameters), so it takes verl's FSDP2
    helpers, as ``fsdp2`` and ``veomni`` do; other strategies are left to verl.
    """
    from verl.experimental.separation.engine_workers import DetachActorWorker

    from .actor_engine import ENGINE_BACKEND

    original = DetachActorWorker._get_strategy_handlers
    if getattr(original, "_vexact", False):
        return

    @functools.wraps(original)
    def _get_strategy_handlers(self):
        if self._strategy_handlers is None and self.config.actor.strategy == ENGINE_BACKEND:
            from verl.utils.fsdp_utils import fsdp2_sharded_load_from_cpu, fsdp2_sharded_save_to_cpu

            def save(module):
                state, spec = fsdp2_sharded_save_to_cpu(module)
                if next(module.parameters()).device.type == "cpu":
                    # `.cpu()` of a CPU shard is the shard itself: the saved weights would follow every optimizer
                    # step (verl's CPU-less assumption); a copy keeps them
                    state = {k: (t.clone(), s) for k, (t, s) in state.items()}
                return state, spec

            def restore(module, saved):  # verl unpacks the FSDP2 pair only for the strategies it names
                return fsdp2_sharded_load_from_cpu(module, *saved)

            self._strategy_handlers = (save, restore)
        return original(self)

    _get_strategy_handlers._vexact = True
    DetachActorWorker._get_strategy_handlers = _get_strategy_handlers


def register_version_publish() -> None:
    """Tell the actor which policy version its weights are, whatever carries them to the rollout. Idempotent.

    verl's trainers sync with ``update_weights(global_steps=v)`` on every actor rank
    (``verl/workers/engine_workers.py``, ``ActorRolloutRefWorker``, which ``DetachActorWorker`` inherits), which hands
    the weights to the hybrid rollout (backend ``naive``) or to the checkpoint engine's ``send_weights`` (``nccl``,
    ``gloo``); the rollout side gets ``v`` from verl's ``CheckpointEngineWorker.update_weights``, through the vexact
    ``ServerAdapter``. This records ``v`` in the actor's process before the weights leave
    (:func:`vexact_verl.versions.publish_version`), so the vexact actor's per-version check
    (:meth:`vexact_verl.actor_engine.VexactEngineWithLMHead.check_versions`) knows the version of the weights it holds
    on every backend, not only where a vexact object moves the weights.
    """
    from verl.workers.engine_workers import ActorRolloutRefWorker

    from .versions import publish_version

    original = ActorRolloutRefWorker.update_weights
    if getattr(original, "_vexact", False):
        return

    @functools.wraps(original)  # keeps verl's dispatch attributes (the worker group binds the method by them)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto"):
        publish_version(global_steps)
        return await original(self, global_steps=global_steps, mode=mode)

    update_weights._vexact = True
    ActorRolloutRefWorker.update_weights = update_weights


def is_engine_registered() -> bool:
    """Whether verl's ``EngineRegistry`` knows ``vexact`` (and ``vexact_veomni``) for ``language_model`` here."""
    from verl.workers.engine.base import EngineRegistry

    from .actor_engine import ENGINE_BACKEND, MODEL_TYPE
    from .veomni_engine import VEOMNI_BACKEND

    known = EngineRegistry._engines.get(MODEL_TYPE, {})
    return ENGINE_BACKEND in known and VEOMNI_BACKEND in known


def is_registered() -> bool:
    """Whether both of verl's tables know ``vexact`` in this process."""
    from verl.workers.rollout import base, replica

    in_replicas = ROLLOUT_NAME in replica.RolloutReplicaRegistry._registry
    return in_replicas and (ROLLOUT_NAME, "async") in base._ROLLOUT_REGISTRY
