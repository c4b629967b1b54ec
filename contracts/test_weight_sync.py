"""Contract: after a weight sync the engine's logprobs == the trainer's (on the bf16 cast of its fp32 master),
``torch.equal``, through each transport: the host path (``sync_weights`` -> ``update_weights``), packed buckets loaded
in place (the colocated path's format, in one process; per expert and with stacked experts whole), a
``torch.distributed`` broadcast from the trainer to a one-device engine and to both stages of a pipeline replica (gloo
on CPU), and CUDA IPC handles between two processes on one GPU (gpu-marked; also after a level-2 sleep, wake, sync):
bucket buffers, and the single-copy path where the trainer writes straight into the engine's packed weights (in one
process on CPU). One ulp changed in a bucket fails it.
"""

from __future__ import annotations

import pytest
import torch

from contracts import weight_sync_check as w
from contracts.harness import skip_on_gpu
from vexact_engine import LLM
from vexact_models import BucketPacker, DirectWriter, send_buckets
from vexact_trainer import iter_weights, sync_weights

FAMILIES = ["qwen3", "qwen3_moe", "deepseek_v3"]
# gpt-oss exports its experts stacked under their own names (its checkpoints' layout) on every path
SYNC_FAMILIES = [*FAMILIES, "gpt_oss"]


def _packed_sync(llm, model, perturb: bool = False, stacked: bool = False) -> list[str]:
    packer = BucketPacker(w.BUCKET_BYTES, next(model.parameters()).device)
    loaded = []

    def submit(bucket):
        buf = packer.buffers[bucket.index][: bucket.nbytes]
        for spec in bucket.specs:
            if perturb and spec.name == "model.norm.weight":
                buf[spec.offset] ^= 1  # one ulp of one bf16 weight of the final norm
        loaded.extend(llm.load_bucket(buf, bucket.specs))
        return bucket.index

    send_buckets(iter_weights(model, stacked=stacked), packer, submit, lambda _: None)
    return loaded


def _direct_sync(llm, model, perturb: bool = False, stacked: bool = False) -> list[str]:
    """The single-copy path in one process: the engine's packed buffers stand for the opened IPC handles."""
    table, buffers = llm.begin_weight_write()
    writer = DirectWriter()
    writer.open(table, buffers)

    def export():
        for name, t in iter_weights(model, stacked=stacked):
            if perturb and name == "model.norm.weight":
                t = t.clone()
                t.view(torch.int16)[0] ^= 1  # one ulp of one bf16 weight of the final norm
            yield name, t

    written = writer.write(export())
    return llm.finish_weight_write(table.key, table.mask(written))


@pytest.mark.parametrize("family", SYNC_FAMILIES)
@pytest.mark.parametrize("path", ["host", "packed", "packed-stacked", "direct", "direct-stacked"])
def test_engine_equals_trainer_after_a_sync(device, family, path):
    skip_on_gpu(family, device)
    model = w.master(family, device)
    llm = LLM(model=w.engine_model(family, device), **w.ENGINE)
    assert w.mismatches(model, w.generate(llm))  # the engine starts from other weights
    if path == "host":
        llm.sleep(level=2)  # verl's colocated order: weights discarded, woken, then synced
        llm.wake_up()
        loaded = sync_weights(model, llm, bucket_bytes=w.BUCKET_BYTES)
    elif path.startswith("direct"):  # written straight into the engine's packed weights, in place
        loaded = _direct_sync(llm, model, stacked=path == "direct-stacked")
    else:  # awake: in place, so the decode graphs captured before the sync (on CUDA) replay the new weights
        # packed-stacked: stacked expert tensors whole, as verl's state-dict export sends them (rows split over
        # buckets when one is larger than a bucket)
        loaded = _packed_sync(llm, model, stacked=path == "packed-stacked")
    assert sorted(loaded) == sorted(llm.weight_names())
    assert w.mismatches(model, w.generate(llm)) == []


@pytest.mark.parametrize("path", ["packed", "direct"])
def test_contract_fails_when_a_bucket_changes_one_bit(device, path):
    model = w.master("qwen3", device)
    llm = LLM(model=w.engine_model("qwen3", device), **w.ENGINE)
    (_packed_sync if path == "packed" else _direct_sync)(llm, model, perturb=True)
    assert w.mismatches(model, w.generate(llm))


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_nccl_broadcast_to_an_engine_on_another_gpu(family):
    """Separate placement on GPUs: the trainer on cuda:0 broadcasts its bf16 export over NCCL (a WeightSyncGroup) to an
    engine on cuda:1, which loads each bucket straight from the wire; its logprobs == the trainer's."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs (trainer and engine on different GPUs); {torch.cuda.device_count()} visible")
    results = w.run_broadcast_cuda(family)
    errors = {r: res["error"] for r, res in results.items() if "error" in res}
    assert not errors, errors
    model = w.master(family, "cuda")
    assert results[1]["loaded"] == len(list(iter_weights(model)))
    assert w.mismatches(model, results[1]) == []


def test_broadcast_to_an_engine_and_a_pipeline_replica_gloo(target):
    """Separate placement on CPU: trainer rank 0 broadcasts over gloo to a one-device engine and to both stages of a
    pipeline replica (each stage takes its own layers straight from the wire). Four processes."""
    if target != "cpu":
        pytest.skip("gloo and four processes: the cpu target's; on GPUs the NCCL twin below (two GPUs)")
    results = w.run_broadcast("qwen3", world=4)
    errors = {r: res["error"] for r, res in results.items() if "error" in res}
    assert not errors, errors
    assert set(results) == {0, 1, 2}
    model = w.master("qwen3")
    for rank in (1, 2):
        assert results[rank]["loaded"] == len(list(iter_weights(model))), rank
        assert w.mismatches(model, results[rank]) == [], rank


@pytest.mark.gpu
@pytest.mark.parametrize("sleep_first", [False, True], ids=["awake", "sleep2-wake-sync"])
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_ipc_two_processes_one_gpu(family, sleep_first):
    """Colocated: the trainer process packs into two device buffers, the engine process opens their IPC handles
    and copies each bucket into its parameters in place. The sleep-first case sends stacked experts whole, as
    verl's colocated flow does (state-dict tensors); the awake case one tensor per expert."""
    res = w.run_ipc(family, sleep_first=sleep_first, stacked=sleep_first)
    assert "error" not in res, res.get("error")
    assert res["loaded"] == len(list(iter_weights(w.master(family, "cuda"))))
    assert res["mismatches"] == []
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("sleep_first", [False, True], ids=["awake", "sleep2-wake-sync"])
@pytest.mark.parametrize("family", FAMILIES)
def test_single_copy_two_processes_one_gpu(family, sleep_first):
    """Colocated, single copy: the engine process hands out its packed weight buffers (CUDA IPC handles) and its
    table; the trainer process writes its bf16 export straight into them, then reads every engine tensor back through
    the same views (torch.equal); the engine's outputs equal a fresh engine's with those weights and the trainer's
    logprobs. The sleep-first case is verl's colocated flow (level-2 sleep, wake, sync) with stacked experts whole."""
    res = w.run_direct(family, sleep_first=sleep_first, stacked=sleep_first)
    assert "error" not in res, res.get("error")
    assert res["unequal"] == []
    assert res["loaded"] == len(list(iter_weights(w.master(family, "cuda"))))
    assert res["same_storage"] and res["same_as_fresh_engine"]
    assert res["mismatches"] == []
    torch.cuda.synchronize()
