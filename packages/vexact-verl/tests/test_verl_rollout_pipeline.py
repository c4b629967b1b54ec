"""A pipeline-parallel vexact replica (``rollout.pipeline_model_parallel_size=2``) driven by verl, on CPU.

verl's ``LLMServerManager`` builds the replica through verl's registry in hybrid mode next to two stand-in trainer
workers (a replica's world is TP x DP x PP = 2 workers). ``VexactReplica.launch_servers`` starts the pipeline's
driver (the ``VexactServer``, stage 0, on the first worker's node and GPU) and one ``VexactStage`` actor for stage 1
on the second worker's; the two join a gloo process group (NCCL on GPUs). Checked, ``torch.equal``: logprobs through
verl's client equal the trainer's; then verl's weight-sync sequence through the ``ServerAdapter`` (release = level-2
sleep on every stage, resume weights, bucketed ``update_weights`` that the driver routes to the stage holding each
layer, resume kv_cache), and the new weights' logprobs equal the trainer's on their bf16 cast.
"""

from __future__ import annotations

import asyncio
import types

import pytest
import torch

pytest.importorskip("verl", reason="verl is not installed: pip install 'vexact-verl[verl]'")
ray = pytest.importorskip("ray")

from verl.workers.rollout.base import get_rollout_class  # noqa: E402
from verl.workers.rollout.llm_server import LLMServerManager  # noqa: E402

import vexact_verl  # noqa: E402,F401  (registers the backend)
from vexact_models import default_checkpoint, load_model, load_weights, random_model, tiny_qwen3_config  # noqa: E402
from vexact_trainer import Actor  # noqa: E402

PROMPTS = [[257, 72, 101, 108, 108, 111], [257, 49, 43, 49, 61], [257, 84, 104, 101], [257, 97] * 5, [257, 10]]
TEMPERATURE = 0.7


def _assert_trainer_equal(model, outputs):
    trainer = Actor(model).compute_log_probs(PROMPTS, [o.token_ids for o in outputs], temperature=TEMPERATURE)
    for i, (out, want) in enumerate(zip(outputs, trainer.logprobs, strict=True)):
        assert out.token_ids, i
        got = torch.tensor(out.log_probs, dtype=torch.float32)
        assert torch.equal(got, want), f"request {i}: rollout {got.tolist()} != trainer {want.tolist()}"


def test_pipeline_parallel_replica_equals_trainer_through_a_weight_sync(compose_rollout_config, monkeypatch):
    config = compose_rollout_config(
        "actor_rollout_ref.rollout.pipeline_model_parallel_size=2", "trainer.n_gpus_per_node=2"
    )
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    loop = asyncio.new_event_loop()
    try:

        @ray.remote(num_cpus=0)
        class StandInWorker:  # plays a trainer worker whose device a stage shares
            pass

        workers = types.SimpleNamespace(workers=[StandInWorker.remote() for _ in range(2)], world_size=2)
        mgr = LLMServerManager.create(config, worker_group=workers)
        mgr = loop.run_until_complete(mgr) if asyncio.iscoroutine(mgr) else mgr
        (replica,) = mgr.rollout_replicas
        assert len(replica.stages) == 1
        sampling = dict(temperature=TEMPERATURE, top_p=1.0, top_k=-1, repetition_penalty=1.0, logprobs=True)

        async def generate(tag):
            client = mgr.get_client()
            return await asyncio.gather(
                *[client.generate(f"{tag}-{i}", prompt_ids=p, sampling_params=sampling) for i, p in enumerate(PROMPTS)]
            )

        _assert_trainer_equal(load_model(default_checkpoint()), loop.run_until_complete(generate("old")))

        monkeypatch.setenv("RANK", "0")  # what verl's Worker sets in a trainer process
        monkeypatch.setenv("RAY_LOCAL_WORLD_SIZE", "2")
        ref = config.actor_rollout_ref
        adapter = get_rollout_class("vexact", "async")(config=ref.rollout, model_config=ref.model, device_mesh=None)
        master = random_model(tiny_qwen3_config(torch_dtype="float32"), seed=7)

        async def sync():
            await adapter.release()  # level-2 sleep on both stages
            await adapter.resume(tags=["weights"])
            adapter.bucket_bytes = 64 << 10  # several buckets
            await adapter.update_weights(((n, p.detach()) for n, p in master.named_parameters()), global_steps=1)
            await adapter.resume(tags=["kv_cache"])
            return await generate("new")

        outs = loop.run_until_complete(sync())
        statuses = ray.get([s.status.remote() for s in replica.stages])
        assert all(st["serving"] and st["error"] is None for st in statuses), statuses
        actor_model = load_model(default_checkpoint())
        load_weights(actor_model, [(n, p.to(torch.bfloat16)) for n, p in master.named_parameters()])
        _assert_trainer_equal(actor_model, outs)
    finally:
        loop.close()
        ray.shutdown()
