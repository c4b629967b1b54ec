"""The vexact rollout driven the way verl drives a rollout backend, on a local Ray and the tiny CPU model.

verl's own Hydra config (``ppo_trainer.yaml`` + ``rollout.name=vexact``) and verl's ``LLMServerManager`` build the
replica through verl's registry and launch its server (hybrid mode, next to a stand-in worker actor: verl's trainer
workers need GPUs, which a CPU test cannot have); requests go through verl's load balancer and ``LLMServerClient``,
as the agent loop sends them. A ServerAdapter built through verl's ``(name, mode)`` table does what verl's workers do
around a weight sync (release, resume weights, update_weights from a generator, resume kv_cache). Every logprob
returned is checked against the trainer with ``torch.equal``. The replica runs once per model family: the tiny Qwen3,
then the tiny Qwen3-MoE, whose weight sync carries the experts one tensor per expert as verl's FSDP actor sends them.
"""

from __future__ import annotations

import asyncio
import time
import types
from importlib.metadata import entry_points

import pytest
import torch

pytest.importorskip("verl", reason="verl is not installed: pip install 'vexact-verl[verl]'")
ray = pytest.importorskip("ray")

from verl.workers.rollout.base import get_rollout_class  # noqa: E402
from verl.workers.rollout.llm_server import LLMServerManager  # noqa: E402
from verl.workers.rollout.replica import get_rollout_replica_class  # noqa: E402

import vexact_verl  # noqa: E402  (registers the backend)
from vexact_models import (  # noqa: E402
    default_checkpoint,
    load_model,
    load_weights,
    random_model,
    tiny_qwen3_config,
    tiny_qwen3_moe_config,
)
from vexact_trainer import Actor  # noqa: E402
from vexact_verl.rollout import server_actor_name  # noqa: E402

PROMPTS = [[257, 72, 101, 108, 108, 111], [257, 49, 43, 49, 61], [257, 84, 104, 101], [257, 97] * 5, [257, 10]]
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def family(request) -> str:
    """The checkpoint family the replica serves (one replica at a time: both would take the same actor name)."""
    return request.param


@pytest.fixture(scope="module")
def config(compose_rollout_config, family):
    """verl's own trainer config with the vexact rollout, as `python -m vexact_verl.main_ppo <overrides>` builds it."""
    return compose_rollout_config("trainer.n_gpus_per_node=1", family=family)


@pytest.fixture(scope="module")
def manager(ray_local, config, loop):
    @ray.remote(num_cpus=0)
    class StandInWorker:  # plays the trainer worker whose device the server shares
        pass

    workers = types.SimpleNamespace(workers=[StandInWorker.remote()], world_size=1)
    mgr = LLMServerManager.create(config, worker_group=workers)  # verl's @auto_await: runs it when no loop is running
    mgr = loop.run_until_complete(mgr) if asyncio.iscoroutine(mgr) else mgr
    yield mgr
    # the next family's server takes the same name (verl's adapter finds its server by name): free it first
    for rep in mgr.rollout_replicas:
        ray.kill(rep.server_handle, no_restart=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            ray.get_actor(server_actor_name(0, 0))
        except ValueError:
            break
        time.sleep(0.1)


@pytest.fixture(scope="module")
def replica(manager):
    (rep,) = manager.rollout_replicas
    return rep


@pytest.fixture(scope="module")
def adapter(replica, config, monkeypatch_module):
    monkeypatch_module.setenv("RANK", "0")  # what verl's Worker sets in a trainer process
    monkeypatch_module.setenv("RAY_LOCAL_WORLD_SIZE", "1")
    ref = config.actor_rollout_ref
    return get_rollout_class("vexact", "async")(config=ref.rollout, model_config=ref.model, device_mesh=None)


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def sampling(**kw):
    return dict(dict(temperature=TEMPERATURE, top_p=1.0, top_k=-1, repetition_penalty=1.0, logprobs=True), **kw)


async def generate_all(server, prompts, tag, **kw):
    """Straight to the server actor, as verl's client does once the load balancer picked it."""
    refs = [server.generate.remote(prompt_ids=p, sampling_params=sampling(**kw), request_id=f"{tag}-{i}")
            for i, p in enumerate(prompts)]  # fmt: skip
    return await asyncio.gather(*refs)


async def generate_via_verl(manager, prompts, tag, **kw):
    """Through verl's load balancer and LLMServerClient, as the agent loop sends requests."""
    client = manager.get_client()
    return await asyncio.gather(
        *[client.generate(f"{tag}-{i}", prompt_ids=p, sampling_params=sampling(**kw)) for i, p in enumerate(prompts)]
    )


def assert_trainer_equal(model, prompts, outputs):
    """Each output's rollout logprobs == the trainer's recomputation, bitwise."""
    for out in outputs:
        assert out.stop_reason == "completed" and out.token_ids
    trainer = Actor(model).compute_log_probs(prompts, [o.token_ids for o in outputs], temperature=TEMPERATURE)
    for i, (out, want) in enumerate(zip(outputs, trainer.logprobs, strict=True)):
        got = torch.tensor(out.log_probs, dtype=torch.float32)
        assert torch.equal(got, want), f"request {i}: rollout {got.tolist()} != trainer {want.tolist()}"


def test_registered_through_verls_own_extension_points():
    from vexact_verl.rollout import ServerAdapter, VexactReplica

    assert vexact_verl.is_registered()
    assert get_rollout_replica_class("vexact") is VexactReplica
    assert get_rollout_class("vexact", "async") is ServerAdapter
    # verl loads this entry point on `import verl` in every process (its Ray workers too)
    assert "vexact_verl.plugin" in [ep.value for ep in entry_points(group="verl.plugins") if ep.name == "vexact"]


def check_registered_in_a_fresh_ray_worker_by_importing_verl():
    """verl's workers are separate processes: `import verl` alone must register vexact there (entry point)."""

    @ray.remote(num_cpus=0)
    def probe():
        import sys

        already = "vexact_verl" in sys.modules
        from verl.workers.rollout.base import _ROLLOUT_REGISTRY
        from verl.workers.rollout.replica import RolloutReplicaRegistry

        return already, ("vexact", "async") in _ROLLOUT_REGISTRY and "vexact" in RolloutReplicaRegistry._registry

    already, registered = ray.get(probe.remote())
    assert registered and not already


def check_generate_matches_trainer_bitwise(manager, replica, loop, family):
    server = replica.server_handle
    outs = loop.run_until_complete(generate_via_verl(manager, PROMPTS, "gen"))
    assert_trainer_equal(load_model(default_checkpoint(family)), PROMPTS, outs)
    assert all(len(o.token_ids) <= 8 for o in outs)  # response_length caps max_tokens when none is given
    stats = ray.get(server.get_stats.remote())
    assert stats["max_in_flight"] > 1, stats  # the concurrent calls shared engine steps
    # logprobs only when asked (verl's calculate_log_probs), as vLLM's server
    (plain,) = loop.run_until_complete(generate_all(server, PROMPTS[:1], "nolp", logprobs=False, max_tokens=3))
    assert plain.log_probs is None and 1 <= len(plain.token_ids) <= 3


def check_bad_sampling_params_are_refused_by_name(replica, loop):
    server = replica.server_handle
    with pytest.raises(ValueError, match="repetition_penalty"):
        loop.run_until_complete(generate_all(server, PROMPTS[:1], "rep", repetition_penalty=1.1))
    with pytest.raises(ValueError, match="min_p"):
        loop.run_until_complete(generate_all(server, PROMPTS[:1], "minp", min_p=0.1))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        loop.run_until_complete(generate_all(server, [[257, 9999]], "vocab"))


def check_sleep_abort_wake_update_weights(replica, adapter, loop, family):
    """verl's weight-sync sequence on a sleeping engine, with an abort in between; then new weights, bitwise."""
    from verl.workers.engine.fsdp.utils import unfuse_moe_params

    server = replica.server_handle
    make_config = tiny_qwen3_moe_config if family == "qwen3_moe" else tiny_qwen3_config

    async def scenario():
        await adapter.release()  # engine.sleep(level=2): hybrid mode re-sends every weight after it
        # a request that arrives while asleep waits; aborting it returns what it has (nothing) as 'aborted'
        pending = server.generate.remote(prompt_ids=PROMPTS[0], sampling_params=sampling(), request_id="asleep")
        await asyncio.sleep(0.2)
        assert (await replica.abort_request("asleep"))["aborted"]
        out = await pending
        assert out.stop_reason == "aborted" and out.token_ids == []
        # a closed gate that rejects: the caller is told to re-route, nothing reaches the engine
        await replica.abort_all_requests(reject_request=True)
        rejected = await server.generate.remote(prompt_ids=PROMPTS[0], sampling_params=sampling(), request_id="gate")
        assert rejected.stop_reason == "aborted"
        await replica.resume_generation()

        # the actor's fp32 master weights; the engine must end up with their bf16 cast
        master = random_model(make_config(torch_dtype="float32"), seed=7)
        await adapter.resume(tags=["weights"])
        adapter.bucket_bytes = 64 << 10  # several buckets for the 245 kB model (the MoE: 400 kB)
        # what verl's FSDP actor sends (get_per_tensor_param): stacked MoE experts split one tensor per expert
        named = unfuse_moe_params(((n, p.detach()) for n, p in master.named_parameters()), family)
        await adapter.update_weights(named, global_steps=3)
        await adapter.resume(tags=["kv_cache"])
        return master, await generate_all(server, PROMPTS, "new")

    master, outs = loop.run_until_complete(scenario())
    stats = ray.get(server.get_stats.remote())
    assert stats["weight_buckets"] > 1, stats
    assert all(o.extra_fields["global_steps"] == 3 for o in outs)
    actor_model = load_model(default_checkpoint(family))  # bf16 like the FSDP forward
    load_weights(actor_model, [(n, p.to(torch.bfloat16)) for n, p in master.named_parameters()])
    assert_trainer_equal(actor_model, PROMPTS, outs)
    # and the old weights would not have produced them (the update took effect)
    old = Actor(load_model(default_checkpoint(family))).compute_log_probs(
        PROMPTS, [o.token_ids for o in outs], temperature=TEMPERATURE
    )
    assert any(not torch.equal(torch.tensor(o.log_probs), w) for o, w in zip(outs, old.logprobs, strict=True))


def test_replica_served_the_way_verl_drives_its_vllm_backend(manager, replica, adapter, loop, family):
    """One test per family, one Ray cluster: the checks share the replica and run in this order (the last one changes
    its weights), whichever xdist worker runs it. The family-independent checks run once."""
    if family == "qwen3":
        check_registered_in_a_fresh_ray_worker_by_importing_verl()
    check_generate_matches_trainer_bitwise(manager, replica, loop, family)
    if family == "qwen3":
        check_bad_sampling_params_are_refused_by_name(replica, loop)
    check_sleep_abort_wake_update_weights(replica, adapter, loop, family)
