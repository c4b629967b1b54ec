"""The vexact rollout through verl's registry on a GPU: placement, sleep frees device memory, weight sync from CUDA
tensors (written in place into the engine's packed weights through CUDA IPC handles: the test process shares the
server's GPU), and logprobs == the vexact trainer on the same GPU, bitwise. Needs verl + Ray on the GPU machine
(scripts/staging/verl_device_wheels.sh)."""

from __future__ import annotations

import asyncio
import types

import pytest
import torch

pytestmark = pytest.mark.gpu

pytest.importorskip("verl", reason="verl is not installed: pip install 'vexact-verl[verl]'")
ray = pytest.importorskip("ray")

from verl.workers.config import HFModelConfig, RolloutConfig  # noqa: E402
from verl.workers.rollout.base import get_rollout_class  # noqa: E402
from verl.workers.rollout.replica import get_rollout_replica_class  # noqa: E402

import vexact_verl  # noqa: E402,F401  (registers the backend)
from vexact_models import default_checkpoint, load_model, load_weights, random_model, tiny_qwen3_config  # noqa: E402
from vexact_trainer import Actor  # noqa: E402

PROMPTS = [[257, *range(65, 65 + n)] for n in (3, 17, 40, 8, 25, 60, 5, 33)]
TEMPERATURE = 0.9


def test_rollout_on_gpu_equals_trainer_through_a_weight_sync(monkeypatch):
    ray.init(num_cpus=4, num_gpus=1, include_dashboard=False, log_to_driver=True)
    try:
        _scenario(monkeypatch)
    finally:
        ray.shutdown()


def _scenario(monkeypatch):
    loop = asyncio.new_event_loop()

    @ray.remote(num_gpus=0.5)
    class StandInWorker:  # the trainer rank whose GPU the server shares
        pass

    rollout = RolloutConfig(name="vexact", tensor_model_parallel_size=1, prompt_length=64, response_length=32,
                            max_num_seqs=16, max_num_batched_tokens=512, gpu_memory_utilization=0.2,
                            calculate_log_probs=True)  # fmt: skip
    model_cfg = HFModelConfig(path=str(default_checkpoint()))
    replica = get_rollout_replica_class("vexact")(replica_rank=0, config=rollout, model_config=model_cfg,
                                                  gpus_per_node=1)  # fmt: skip
    loop.run_until_complete(replica.init_hybrid(types.SimpleNamespace(workers=[StandInWorker.remote()])))
    server = replica.server_handle
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("RAY_LOCAL_WORLD_SIZE", "1")
    adapter = get_rollout_class("vexact", "async")(config=rollout, model_config=model_cfg, device_mesh=None)
    params = dict(temperature=TEMPERATURE, top_p=1.0, top_k=-1, repetition_penalty=1.0, logprobs=True)

    async def generate(tag):
        refs = [server.generate.remote(prompt_ids=p, sampling_params=dict(params), request_id=f"{tag}-{i}")
                for i, p in enumerate(PROMPTS)]  # fmt: skip
        return await asyncio.gather(*refs)

    def check(model, outs):
        want = Actor(model.cuda()).compute_log_probs(PROMPTS, [o.token_ids for o in outs], temperature=TEMPERATURE)
        for i, (o, w) in enumerate(zip(outs, want.logprobs, strict=True)):
            assert torch.equal(torch.tensor(o.log_probs, dtype=torch.float32), w.cpu()), f"request {i}"

    outs = loop.run_until_complete(generate("a"))
    check(load_model(default_checkpoint()), outs)
    awake = ray.get(server.get_stats.remote())["device_bytes"]
    assert awake > 0  # the engine lives on the GPU

    master = random_model(tiny_qwen3_config(torch_dtype="float32"), seed=11).cuda()

    async def sync():
        await adapter.release()
        asleep = (await server.get_stats.remote())["device_bytes"]
        await adapter.resume(tags=["weights"])
        await adapter.update_weights(((n, p.detach()) for n, p in master.named_parameters()), global_steps=1)
        await adapter.resume(tags=["kv_cache"])
        return asleep

    asleep = loop.run_until_complete(sync())
    assert asleep < awake, (asleep, awake)  # sleep gave weights and KV back
    assert adapter._ipc is True  # this process shares the server's GPU: the weights went through CUDA IPC handles
    assert adapter.weight_sync_path == "direct"  # straight into the engine's packed weights, a single copy
    assert adapter._direct.key is None  # views closed: the engine's next sleep frees its weights
    outs = loop.run_until_complete(generate("b"))
    actor_model = load_model(default_checkpoint())
    load_weights(actor_model, [(n, p.to(torch.bfloat16)) for n, p in master.named_parameters()])
    check(actor_model, outs)
    loop.close()
