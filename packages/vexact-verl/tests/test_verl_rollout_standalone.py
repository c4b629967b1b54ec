"""The vexact rollout in verl's *standalone* mode: no trainer worker group, so verl's ``LLMServerManager`` calls
``init_standalone`` on each replica, which makes its own resource pool and a group of verl's
``CheckpointEngineWorker`` (holding the vexact ``ServerAdapter``); ``VexactReplica.launch_servers`` then places the
server beside that worker. All on CPU through ``vexact_verl.cpu_platform`` (``VERL_PLATFORM=cpu`` in Ray's workers,
one declared GPU slot).

The replica serves the tiny Llama (llama3 rope, tied head): a family other than Qwen3 through ``rollout.name=vexact``
(the tiny Qwen3 and Qwen3-MoE run in ``test_verl_rollout.py``).

Checked: requests through verl's load balancer and client come back with logprobs equal to the trainer's, bitwise;
standalone replicas sleep at level 1 (weights kept on the host), and after ``sleep``/``wake_up`` new requests are
still equal to the trainer. Not checked here: a weight update in standalone mode, which arrives through a
checkpoint-engine transport (NCCL and the like) from a separate trainer.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("verl", reason="verl is not installed: pip install 'vexact-verl[verl]'")
ray = pytest.importorskip("ray")

from verl.plugin.platform import platform_manager  # noqa: E402
from verl.workers.rollout.llm_server import LLMServerManager  # noqa: E402

from vexact_models import default_checkpoint, load_model  # noqa: E402
from vexact_trainer import Actor  # noqa: E402
from vexact_verl import register  # noqa: E402
from vexact_verl.cpu_platform import CPUPlatform  # noqa: E402

PROMPTS = [[257, 72, 101, 108], [257, 49, 43, 49, 61], [257, 10], [257, 120, 61, 51, 52, 53]]
TEMPERATURE = 0.8
FAMILY = "llama"


@pytest.fixture
def standalone(monkeypatch, compose_rollout_config):
    register()
    monkeypatch.setattr(platform_manager, "_current_platform", CPUPlatform())  # this process: the driver
    ray.init(num_cpus=4, num_gpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"VERL_PLATFORM": "cpu"}})  # fmt: skip
    config = compose_rollout_config(
        "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1", family=FAMILY
    )
    loop = asyncio.new_event_loop()
    try:
        mgr = LLMServerManager.create(config, worker_group=None)
        mgr = loop.run_until_complete(mgr) if asyncio.iscoroutine(mgr) else mgr
        yield mgr, loop
    finally:
        loop.close()
        ray.shutdown()


def test_standalone_replica_serves_trainer_exact_logprobs_across_sleep(standalone):
    mgr, loop = standalone
    (replica,) = mgr.rollout_replicas
    assert replica.rollout_mode.value == "standalone"
    sampling = dict(temperature=TEMPERATURE, top_p=1.0, top_k=-1, repetition_penalty=1.0, logprobs=True)

    async def generate(tag):
        client = mgr.get_client()
        return await asyncio.gather(
            *[client.generate(f"{tag}-{i}", prompt_ids=p, sampling_params=sampling) for i, p in enumerate(PROMPTS)]
        )

    actor = Actor(load_model(default_checkpoint(FAMILY)))

    def assert_trainer_equal(outputs):
        trainer = actor.compute_log_probs(PROMPTS, [o.token_ids for o in outputs], temperature=TEMPERATURE)
        for i, (out, want) in enumerate(zip(outputs, trainer.logprobs, strict=True)):
            assert out.token_ids, i
            assert torch.equal(torch.tensor(out.log_probs, dtype=torch.float32), want), i

    assert_trainer_equal(loop.run_until_complete(generate("before")))
    loop.run_until_complete(replica.sleep())  # level 1 in standalone mode: weights to host memory, KV freed
    loop.run_until_complete(replica.wake_up())
    assert_trainer_equal(loop.run_until_complete(generate("after")))
