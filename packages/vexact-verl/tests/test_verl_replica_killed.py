"""A rollout replica whose server process is killed (SIGKILL) in the middle of generation, on CPU.

Its in-flight requests, sent as verl's agent loop sends them (load balancer and ``LLMServerClient``), fail within a
timeout with an error naming the replica's server actor (``vexact_server_<replica>_<node>``); the driver's next call
on the replica (verl's ``sleep_replicas`` after sampling) fails the same way instead of hanging. The batch those
requests belonged to is never trained on: :class:`vexact_verl.replay.OrderedReplayBuffer` refuses a batch with a
failed group (``test_replay_order.py``), where verl's default pads the missing trajectories.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import types

import pytest

pytest.importorskip("verl", reason="verl is not installed: pip install 'vexact-verl[verl]'")
ray = pytest.importorskip("ray")

from verl.workers.rollout.llm_server import LLMServerManager  # noqa: E402

from vexact_verl import register  # noqa: E402
from vexact_verl.rollout import server_actor_name  # noqa: E402

pytestmark = pytest.mark.slow  # about a minute on 2 cores: Ray, the engine, and Ray noticing the death

TIMEOUT_S = 60  # far above the few seconds Ray takes to report a dead actor; a hang would run into it
PROMPTS = [[257, 72, 101, 108], [257, 49, 43, 49, 61], [257, 10]]


@pytest.fixture
def replica(compose_rollout_config):
    register()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    # responses long enough that the kill lands while every request is still decoding
    config = compose_rollout_config(
        "trainer.n_gpus_per_node=1",
        "actor_rollout_ref.rollout.response_length=200",
        "actor_rollout_ref.rollout.engine_kwargs.vexact.num_kv_blocks=256",
    )
    loop = asyncio.new_event_loop()
    try:

        @ray.remote(num_cpus=0)
        class StandInWorker:  # plays the trainer worker whose device the server shares
            pass

        workers = types.SimpleNamespace(workers=[StandInWorker.remote()], world_size=1)
        mgr = LLMServerManager.create(config, worker_group=workers)
        mgr = loop.run_until_complete(mgr) if asyncio.iscoroutine(mgr) else mgr
        yield mgr, loop
    finally:
        loop.close()
        ray.shutdown()


def test_killed_replica_fails_its_requests_and_the_driver_naming_it(replica):
    mgr, loop = replica
    (rep,) = mgr.rollout_replicas
    server = rep.server_handle
    name = server_actor_name(0, 0)
    pid = ray.get(server.__ray_call__.remote(lambda self: os.getpid()))
    sampling = dict(temperature=1.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, logprobs=True, ignore_eos=True)

    async def generate_then_kill():
        client = mgr.get_client()
        calls = [asyncio.ensure_future(client.generate(f"kill-{i}", prompt_ids=p, sampling_params=sampling))
                 for i, p in enumerate(PROMPTS)]  # fmt: skip
        deadline = time.monotonic() + TIMEOUT_S
        while (await server.get_stats.remote())["steps"] < 3:  # every request is in the engine, decoding
            assert time.monotonic() < deadline, "the server never started stepping"
            await asyncio.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), TIMEOUT_S)

    start = time.monotonic()
    results = loop.run_until_complete(generate_then_kill())
    assert time.monotonic() - start < TIMEOUT_S
    for i, r in enumerate(results):
        assert isinstance(r, ray.exceptions.RayActorError), (i, r)  # no request came back as a short output
        assert name in str(r), (i, str(r))
    with pytest.raises(ray.exceptions.RayActorError, match=name):
        loop.run_until_complete(asyncio.wait_for(rep.sleep(), TIMEOUT_S))
