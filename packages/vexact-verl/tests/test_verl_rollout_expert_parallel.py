"""An expert-parallel vexact replica (``rollout.expert_parallel_size=2``) driven by verl, on CPU.

verl's ``LLMServerManager`` builds the replica through verl's registry in hybrid mode next to two stand-in trainer
workers (a replica's world is TP x DP x PP = 2 workers, ``data_parallel_size`` = ``expert_parallel_size`` as verl lays
out expert parallelism). ``VexactReplica.launch_servers`` starts the replica's driver (the ``VexactServer``, EP rank 0,
on the first worker's node and GPU) and one ``VexactStage`` actor for EP rank 1 on the second worker's; the two join a
gloo process group (NCCL on GPUs) and run ``vexact_engine.ExpertParallelLLM(driven=True)`` on the tiny Qwen3-MoE
(8 routed experts, 4 a rank). Checked, ``torch.equal``: tokens and logprobs through verl's client equal a one-device
engine's and the trainer's; then verl's weight-sync sequence through the ``ServerAdapter`` (release = level-2 sleep on
every rank, resume weights, bucketed ``update_weights`` of HF-named tensors, each rank receiving the shared weights
and its own experts, resume kv_cache), and the new weights' tokens and logprobs equal a one-device engine's holding
the same bf16 cast, and the trainer's; requests that arrive while rank 1 still misses its experts wait in the server.

``cpu`` runs the engines on CPU even where GPUs are present; ``cuda`` (marked ``gpu``, two GPUs) gives each stand-in
worker a GPU, so the two ranks run on two GPUs over NCCL, the one-device engine and the trainer on the first
(``scripts/checks/ep_gpu.sh`` runs it).
"""

from __future__ import annotations

import asyncio
import re
import types

import pytest
import torch

pytest.importorskip("verl", reason="verl is not installed: pip install 'vexact-verl[verl]'")
ray = pytest.importorskip("ray")

from verl.workers.rollout.base import get_rollout_class  # noqa: E402
from verl.workers.rollout.llm_server import LLMServerManager  # noqa: E402

import vexact_verl  # noqa: E402,F401  (registers the backend)
from vexact_engine import LLM, SamplingParams  # noqa: E402
from vexact_models import (  # noqa: E402
    default_checkpoint,
    expected_tensors,
    load_model,
    load_weights,
    random_model,
    tiny_checkpoint_config,
)
from vexact_trainer import Actor  # noqa: E402

PROMPTS = [[257, 72, 101, 108, 108, 111], [257, 49, 43, 49, 61], [257, 84, 104, 101], [257, 97] * 5, [257, 10]]
TEMPERATURE = 0.7
MAX_TOKENS = 6


def _sampling(i: int) -> dict:
    """What verl's agent loop sends for request ``i``, with a seed of its own (where it runs changes no bit)."""
    sp = dict(temperature=TEMPERATURE, top_p=1.0, top_k=-1, repetition_penalty=1.0, logprobs=True)
    return dict(sp, max_tokens=MAX_TOKENS, seed=100 + i)


def _one_device(llm: LLM):
    """The one-device engine's outputs for the same prompts and seeds as the requests sent through verl."""
    params = [SamplingParams(temperature=TEMPERATURE, max_tokens=MAX_TOKENS, seed=100 + i) for i in range(len(PROMPTS))]
    return llm.generate(PROMPTS, params, use_tqdm=False)


def _assert_equal(outputs, reference, model):
    trainer = Actor(model).compute_log_probs(PROMPTS, [o.token_ids for o in outputs], temperature=TEMPERATURE)
    for i, (out, ref, want) in enumerate(zip(outputs, reference, trainer.logprobs, strict=True)):
        assert out.token_ids, i
        got = torch.tensor(out.log_probs, dtype=torch.float32)  # on the host, as verl's client returns them
        assert out.token_ids == list(ref.token_ids), f"request {i}: {out.token_ids} != {list(ref.token_ids)}"
        assert torch.equal(got, ref.logprobs.cpu()), f"request {i}: replica {got.tolist()} != one device"
        assert torch.equal(got, want.cpu()), f"request {i}: replica {got.tolist()} != trainer {want.tolist()}"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_expert_parallel_replica_equals_one_device_through_a_weight_sync(device, compose_rollout_config, monkeypatch):
    if device == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip(f"an EP=2 replica on GPUs needs 2 GPUs; {torch.cuda.device_count()} visible")
    extra = ["+actor_rollout_ref.rollout.engine_kwargs.vexact.device=cpu"] if device == "cpu" else []
    config = compose_rollout_config(
        "actor_rollout_ref.rollout.expert_parallel_size=2",
        "actor_rollout_ref.rollout.data_parallel_size=2",
        "trainer.n_gpus_per_node=2",
        *extra,
        family="qwen3_moe",
    )
    checkpoint = default_checkpoint("qwen3_moe")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    loop = asyncio.new_event_loop()
    try:

        @ray.remote(num_cpus=0, num_gpus=1 if device == "cuda" else 0)
        class StandInWorker:  # plays a trainer worker whose device (GPU) an EP rank shares
            pass

        workers = types.SimpleNamespace(workers=[StandInWorker.remote() for _ in range(2)], world_size=2)
        mgr = LLMServerManager.create(config, worker_group=workers)
        mgr = loop.run_until_complete(mgr) if asyncio.iscoroutine(mgr) else mgr
        (replica,) = mgr.rollout_replicas
        assert len(replica.stages) == 1

        async def generate(tag):
            client = mgr.get_client()
            calls = [
                client.generate(f"{tag}-{i}", prompt_ids=p, sampling_params=_sampling(i)) for i, p in enumerate(PROMPTS)
            ]
            return await asyncio.gather(*calls)

        ref = LLM(checkpoint, max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=64, block_size=4, device=device)
        old = loop.run_until_complete(generate("old"))
        _assert_equal(old, _one_device(ref), load_model(checkpoint, device=device))

        monkeypatch.setenv("RANK", "0")  # what verl's Worker sets in a trainer process
        monkeypatch.setenv("RAY_LOCAL_WORLD_SIZE", "2")
        rollout = config.actor_rollout_ref
        adapter = get_rollout_class("vexact", "async")(config=rollout.rollout, model_config=rollout.model)
        master = random_model(tiny_checkpoint_config("qwen3_moe"), seed=7).float()  # the trainer's fp32 weights
        hf = expected_tensors(master)  # HF names: one tensor an expert, as verl's actor exports them
        assert any(".experts.7." in n for n in hf)

        async def sync():
            await adapter.release()  # level-2 sleep on both ranks
            await adapter.resume(tags=["weights"])
            adapter.bucket_bytes = 64 << 10  # several buckets
            await adapter.update_weights(((n, t.detach()) for n, t in hf.items()), global_steps=1)
            await adapter.resume(tags=["kv_cache"])
            return await generate("new")

        outs = loop.run_until_complete(sync())
        assert adapter.weight_sync_path == "host"
        statuses = ray.get([s.status.remote() for s in replica.stages])
        assert all(st["serving"] and st["error"] is None for st in statuses), statuses
        new = [(n, t.to(device, torch.bfloat16)) for n, t in hf.items()]  # the adapter's cast (round to nearest even)
        ref.update_weights(new)
        actor_model = load_model(checkpoint, device=device)
        load_weights(actor_model, new)
        _assert_equal(outs, _one_device(ref), actor_model)
        assert [o.extra_fields["global_steps"] for o in outs] == [1] * len(PROMPTS)

        # rank 0's weights loaded, rank 1's experts (4..7) not yet: requests wait in the server, none reaches a step
        server = replica.servers[0]
        rank1 = re.compile(r"\.experts\.[4-7]\.")
        ours = [(n, t.cpu()) for n, t in new if not rank1.search(n)]
        theirs = [(n, t.cpu()) for n, t in new if rank1.search(n)]
        assert theirs

        async def late():
            await adapter.release()
            await adapter.resume(tags=["weights"])
            await server.update_weights.remote(ours)
            await adapter.resume(tags=["kv_cache"])
            waiting = asyncio.ensure_future(generate("late"))
            done, _ = await asyncio.wait([waiting], timeout=2.0)
            assert not done, "a request ran while rank 1 still missed its experts"
            await server.update_weights.remote(theirs)
            return await waiting

        _assert_equal(loop.run_until_complete(late()), _one_device(ref), actor_model)
    finally:
        loop.close()
        ray.shutdown()
