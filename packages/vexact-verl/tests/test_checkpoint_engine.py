"""``vexact_verl.checkpoint_engine.GlooCheckpointEngine``: verl's checkpoint-engine protocol on a gloo group, driven
as verl's ``CheckpointEngineManager`` drives a backend (prepare, build_topology, init_process_group, send/receive,
finalize), here with the sender and two receivers in threads of one process. Bytes in, the same bytes out: every
tensor, split into chunks when larger than a bucket, comes back ``torch.equal`` under its name."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

pytest.importorskip("verl", reason="verl is not installed: pip install 'vexact-verl[verl]'")

from verl.checkpoint_engine import CheckpointEngineRegistry  # noqa: E402

from vexact_verl.checkpoint_engine import GlooCheckpointEngine  # noqa: E402


def weights():
    g = torch.Generator().manual_seed(0)
    yield "embed", torch.randn(40, 8, generator=g, dtype=torch.float32)  # 1280 bytes: split into 3 chunks
    yield "norm", torch.randn(8, generator=g).to(torch.bfloat16)
    yield "ids", torch.arange(5, dtype=torch.int64)
    yield "big", torch.randn(200, generator=g).to(torch.bfloat16)


def test_gloo_engine_moves_every_tensor_bitwise_in_verls_protocol():
    assert CheckpointEngineRegistry.get("gloo") is GlooCheckpointEngine  # importing vexact_verl registers it
    bucket = 512
    actor = [GlooCheckpointEngine(bucket, is_master=True), GlooCheckpointEngine(bucket)]  # actor ranks 0 and 1
    rollout = [GlooCheckpointEngine(bucket), GlooCheckpointEngine(bucket)]
    metadata = [e.prepare() for e in actor + rollout]
    actor_kw, rollout_kw = GlooCheckpointEngine.build_topology(2, 2, metadata)
    assert actor_kw["rank"] == [0, -1] and rollout_kw["rank"] == [1, 2]
    received: dict[int, list] = {}
    errors: list[BaseException] = []

    def run(engine, kw, role, i):
        async def go():
            engine.init_process_group(**kw)
            if role == "actor":
                await engine.send_weights(weights(), global_steps=3)
            else:
                received[i] = [(n, t.clone()) async for n, t in engine.receive_weights(global_steps=3)]
            engine.finalize()

        try:
            asyncio.run(go())
        except BaseException as e:  # surfaced in the main thread
            errors.append(e)

    threads = [
        threading.Thread(target=run, args=(e, {k: v[i] for k, v in kws.items()}, role, i))
        for role, engines, kws in (("actor", actor, actor_kw), ("rollout", rollout, rollout_kw))
        for i, e in enumerate(engines)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    want = list(weights())
    for i in (0, 1):
        assert [n for n, _ in received[i]] == [n for n, _ in want]
        for (_, got), (name, w) in zip(received[i], want, strict=True):
            assert got.dtype == w.dtype and torch.equal(got, w), name


def test_gloo_engine_refuses_a_bad_bucket_size_by_value():
    with pytest.raises(ValueError, match="got 0"):
        GlooCheckpointEngine(0)


def test_the_actor_publishes_the_version_it_sends_through_any_backend():
    """verl's ``ActorRolloutRefWorker.update_weights`` (the actor side of every sync; ``DetachActorWorker`` inherits
    it) records ``global_steps`` in the actor's process before the checkpoint engine sends the weights, whatever the
    backend: the vexact actor's per-version check reads it (``published_version``). verl's own method runs here, on a
    worker whose checkpoint engine is a recorder in place of ``nccl``'s (which needs a GPU)."""
    import inspect
    from types import SimpleNamespace

    from verl.experimental.separation.engine_workers import DetachActorWorker
    from verl.single_controller.base.decorator import MAGIC_ATTR
    from verl.workers.engine_workers import ActorRolloutRefWorker

    from vexact_verl import register, versions

    register()
    register()  # idempotent: one wrapper
    method = ActorRolloutRefWorker.update_weights
    assert method._vexact and not getattr(method.__wrapped__, "_vexact", False)
    assert DetachActorWorker.update_weights is method  # separate_async's actor
    assert inspect.iscoroutinefunction(method)  # Ray runs the worker as an async actor
    assert getattr(method, MAGIC_ATTR) == getattr(method.__wrapped__, MAGIC_ATTR)  # verl's dispatch is unchanged

    sent = []

    class Recorder:
        async def send_weights(self, weights, global_steps=None):
            sent.append((global_steps, versions.published_version(), [n for n, _ in weights]))
            return {"bytes": 1.0}

    worker = SimpleNamespace(
        config=SimpleNamespace(rollout=SimpleNamespace(checkpoint_engine=SimpleNamespace(backend="nccl"))),
        actor=SimpleNamespace(engine=SimpleNamespace(get_per_tensor_param=lambda: (iter(weights()), None))),
        checkpoint_engine=Recorder(),
    )
    for step in (4, 5):
        assert asyncio.run(method(worker, global_steps=step)) == {"bytes": 1.0}
        assert versions.published_version() == step
    assert [(g, p) for g, p, _ in sent] == [(4, 4), (5, 5)]  # published before the weights left
    assert sent[0][2] == [n for n, _ in weights()]
    asyncio.run(method(worker, global_steps=None))  # verl passed no version: the record stays
    assert versions.published_version() == 5
