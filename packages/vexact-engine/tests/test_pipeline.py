"""Pipeline parallelism: stages of consecutive layers on several ranks give one device's tokens and logprobs, bitwise.

CPU: two (or three) processes over gloo. GPU: ``torchrun --nproc_per_node=2 scripts/checks/pp_check.py`` on a two-GPU
host (``tests/test_pp_check.py`` runs that script over gloo here, and on two GPUs when marked ``gpu``)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vexact_engine import LLM, SamplingParams
from vexact_engine.pipeline import PipelineLLM, stage_layers
from vexact_models import random_model, tiny_qwen3_config

LAYERS = 5
ENGINE = dict(max_num_seqs=3, max_num_batched_tokens=24, block_size=4, num_kv_blocks=14)  # tight: forces preemption


def _workload():
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 256, (int(n),), generator=g).tolist() for n in torch.randint(3, 30, (7,), generator=g)]
    params = [SamplingParams(max_tokens=10, temperature=[0.0, 0.8, 1.1][i % 3], seed=i, top_p=0.9) for i in range(7)]
    return prompts, params


def _model():
    return random_model(tiny_qwen3_config(num_hidden_layers=LAYERS), seed=3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _stage(rank: int, world: int, port: int):
    """This rank's PipelineLLM on a gloo group that is torn down afterwards."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        yield PipelineLLM(model=_model(), **ENGINE)
        # all ranks tear the group down together: on gloo a rank whose peers had already destroyed theirs aborted
        # ("terminate called without an active exception", about one run in three)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # reached only when the rank's work succeeded: leave without the interpreter's teardown, where a gloo rank can
    # abort now and then after the barrier (seen in CI; pp_check.py does the same)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _rank_main(rank: int, world: int, port: int, out_path: str) -> None:
    with _stage(rank, world, port) as llm:
        if llm.is_driver:
            prompts, params = _workload()
            outs = llm.generate(prompts, params, use_tqdm=False)
            llm.shutdown()
            with open(out_path, "w") as f:
                json.dump(
                    {
                        "tokens": [o.token_ids for o in outs],
                        "logprobs": [o.logprobs.tolist() for o in outs],
                        "preemptions": llm.num_preemptions,
                    },
                    f,
                )
        else:
            assert llm.serve() > 0


def test_stage_layers():
    assert stage_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_layers(4, 4) == [range(i, i + 1) for i in range(4)]
    with pytest.raises(ValueError, match="pipeline stages"):
        stage_layers(2, 3)


@pytest.mark.parametrize("world", [2, 3])
def test_pipeline_equals_one_device_bitwise(tmp_path, world):
    out = tmp_path / "pp.json"
    mp.start_processes(_rank_main, args=(world, _free_port(), str(out)), nprocs=world, start_method="spawn")
    got = json.loads(out.read_text())
    prompts, params = _workload()
    ref = LLM(model=_model(), **ENGINE).generate(prompts, params, use_tqdm=False)
    assert got["preemptions"] > 0, "the workload should preempt (recompute through every stage)"
    for i, o in enumerate(ref):
        assert got["tokens"][i] == o.token_ids, f"request {i}: tokens differ from one device"
        assert torch.equal(torch.tensor(got["logprobs"][i], dtype=torch.float32), o.logprobs), f"request {i}"


def test_pipeline_needs_a_process_group_and_a_fixed_cache():
    with pytest.raises(RuntimeError, match="process group"):
        PipelineLLM(model=_model(), **ENGINE)


def _rank_main_weights(rank: int, world: int, port: int, out_path: str) -> None:
    """Sleep (both levels), wake and a bucketed weight update, driven from rank 0 through every stage."""
    with _stage(rank, world, port) as llm:
        if not llm.is_driver:
            llm.serve()
            return
        prompts, params = _workload()
        res = {}
        llm.sleep(1)
        llm.wake_up()
        res["after_level1"] = [o.logprobs.tolist() for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.sleep(2)
        llm.wake_up()
        rid = llm.add_request(prompts[0], params[0])  # requests may queue while weights are missing
        try:
            llm.step()
        except RuntimeError as e:
            res["pending_error"] = str(e)
        llm.abort_request(rid)
        new = random_model(tiny_qwen3_config(num_hidden_layers=LAYERS), seed=11).state_dict()
        items = sorted(new.items())
        try:
            llm.update_weights([("model.layers.99.mlp.up_proj.weight", items[0][1])])
        except ValueError as e:
            res["unknown_error"] = str(e)
        loaded = []
        for i in range(0, len(items), 7):  # buckets
            loaded += llm.update_weights(items[i : i + 7])
        res["loaded"] = sorted(loaded)
        outs = llm.generate(prompts, params, use_tqdm=False)
        res["tokens"] = [o.token_ids for o in outs]
        res["logprobs"] = [o.logprobs.tolist() for o in outs]
        llm.shutdown()
        with open(out_path, "w") as f:
            json.dump(res, f)


def test_pipeline_sleep_wake_and_weight_update_equal_one_device(tmp_path):
    out = tmp_path / "pp.json"
    mp.start_processes(_rank_main_weights, args=(2, _free_port(), str(out)), nprocs=2, start_method="spawn")
    got = json.loads(out.read_text())
    prompts, params = _workload()
    before = LLM(model=_model(), **ENGINE).generate(prompts, params, use_tqdm=False)
    for i, o in enumerate(before):
        assert torch.equal(torch.tensor(got["after_level1"][i], dtype=torch.float32), o.logprobs), f"request {i}"
    # level 2 dropped every stage's weights: the driver refuses to step until all of them are back, its own
    # and those of the other stage (layers 3 and 4 live there)
    assert "other pipeline stages" in got["pending_error"] and "not reloaded yet" in got["pending_error"]
    assert "does not have" in got["unknown_error"]
    new = random_model(tiny_qwen3_config(num_hidden_layers=LAYERS), seed=11)
    assert got["loaded"] == sorted(new.state_dict())
    ref = LLM(model=new, **ENGINE).generate(prompts, params, use_tqdm=False)
    for i, o in enumerate(ref):
        assert got["tokens"][i] == o.token_ids, f"request {i}: tokens differ from one device with the new weights"
        assert torch.equal(torch.tensor(got["logprobs"][i], dtype=torch.float32), o.logprobs), f"request {i}"
