"""Expert parallelism: an ``ExpertParallelLLM`` over 2 and 4 ranks == one device == the trainer, ``torch.equal``,
on the tiny Qwen3-MoE, DeepSeek-V3 and top-8 Qwen3-MoE checkpoints, eager and with padded decode steps (every rank
padded to the size of the largest rank's decode rows, a rank with no request joining with pad rows); seen failing
with a combine in arrival order, with a pad mark that covers a real row, and with a rank padding to its own size.

The checks live in ``contracts/ep_check.py`` (also the torchrun entry point for GPUs: ``scripts/checks/ep_gpu.sh``
runs them with NCCL on a host with two or more GPUs); here they run in gloo processes on CPU: the selected cases of a
world size in one set of spawned ranks, one case after the other (``ep_check.batch``: a rank spends about 2.5 s on its
imports, most of a small case's time), each test asserting on its own case's summary.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from contracts import ep_check
from vexact_engine import ExpertParallelLLM
from vexact_engine.expert_parallel import expert_shard
from vexact_models import default_checkpoint, load_model


@pytest.fixture
def cpu_only(device):
    if device != "cpu":
        pytest.skip("gloo processes on CPU; on GPUs the same checks run with NCCL: bash scripts/checks/ep_gpu.sh")


# the spawned cases, one set of ranks per world size: xdist keeps them in one worker, which spawns each set once
SPAWNED = pytest.mark.xdist_group("expert_parallel_gloo")
PAD_ROWS = dict(checkpoint="qwen3_moe", graphs=True, perturb="pad_rows")
ARRIVAL = dict(checkpoint="qwen3_moe_top8", perturb="arrival", long=True)
CAPTURE_FAILURE = dict(entry="capture_failure")
FORWARD_AT_START = dict(entry="forward_at_start")
FORWARD_AT_START_FORGET = dict(entry="forward_at_start", forget=True)


def _cases(item: pytest.Item) -> list[tuple[int, dict]]:
    """The (world, ep_check keyword arguments) cases a test of this module asks ``ep_summary`` for."""
    params = item.callspec.params if hasattr(item, "callspec") else {}
    name = getattr(item, "originalname", item.name)
    if name == "test_expert_parallel_equals_one_device_and_trainer":
        return [(params["world"], dict(checkpoint=params["checkpoint"], **params["extra"]))]
    if name == "test_padded_decode_steps_equal_one_device_and_trainer":
        return [(params["world"], dict(checkpoint=params["checkpoint"], graphs=True, **params["extra"]))]
    return {
        "test_padded_steps_contract_fails_when_the_pad_mark_covers_a_real_row": [(2, PAD_ROWS)],
        "test_a_capture_that_fails_on_one_rank_drops_every_ranks_graphs": [(2, CAPTURE_FAILURE)],
        "test_every_rank_runs_the_kv_sizing_forward_at_start": [(2, FORWARD_AT_START), (2, FORWARD_AT_START_FORGET)],
        "test_expert_parallel_contract_fails_with_a_combine_in_arrival_order": [(2, ARRIVAL)],
    }.get(name, [])


def _key(kwargs: dict) -> str:
    return json.dumps(kwargs, sort_keys=True)


@pytest.fixture(scope="module")
def ep_summary(request, tmp_path_factory):
    """``ep_summary(world, kwargs)``: rank 0's summary of ``ep_check`` run with ``kwargs`` over ``world`` gloo ranks.
    The first call for a world spawns its ranks once for every case of that world among the selected tests of this
    module (``ep_check.batch``); a case outside the batch spawns ranks of its own."""
    here = Path(__file__).resolve()
    done: dict[tuple[int, str], dict] = {}

    def summary(world: int, kwargs: dict) -> dict:
        if (world, _key(kwargs)) not in done:
            cases = [c for item in request.session.items if Path(item.path).resolve() == here for w, c in _cases(item)
                     if w == world and (w, _key(c)) not in done]  # fmt: skip
            if (world, _key(kwargs)) not in {(world, _key(c)) for c in cases}:
                cases = [kwargs]
            unique = list({_key(c): c for c in cases}.values())
            out = str(tmp_path_factory.mktemp("ep") / "ep.json")
            got = ep_check.spawn(world, out, entry="batch", cases=unique)["summaries"]
            done.update({(world, _key(c)): s for c, s in zip(unique, got, strict=True)})
        return done[(world, _key(kwargs))]

    return summary


def _assert_ok(summary: dict) -> None:
    assert summary["ok"], summary["checks"]
    assert any(summary["idle_steps"]), "some rank should have stepped with no tokens of its own"


@pytest.mark.parametrize(
    "checkpoint, world, extra",
    [
        ("qwen3_moe", 2, dict(weights=True)),
        ("deepseek_v3", 2, dict(weights=True)),
        ("qwen3_moe_top8", 2, dict(long=True)),
        ("qwen3_moe", 4, {}),
        ("qwen3_moe", 2, dict(weights=True, driven=True)),
        pytest.param("deepseek_v3", 4, dict(weights=True, driven=True), marks=pytest.mark.slow),
        pytest.param("deepseek_v3", 4, {}, marks=pytest.mark.slow),
        pytest.param("qwen3_moe_top8", 4, {}, marks=pytest.mark.slow),
    ],
)
@SPAWNED
def test_expert_parallel_equals_one_device_and_trainer(cpu_only, ep_summary, checkpoint, world, extra):
    """Every token and logprob of each rank's requests == one device's == the trainer's; with ``weights``, also
    after sleep(2), wake and an update_weights to other weights (each rank keeping its own experts); ``driven``: rank
    0 takes the whole workload, the weight lifecycle and two aborts, and spreads the requests over the ranks."""
    _assert_ok(ep_summary(world, dict(checkpoint=checkpoint, **extra)))


@pytest.mark.parametrize(
    "checkpoint, world, extra",
    [
        ("qwen3_moe", 2, dict(weights=True)),
        ("deepseek_v3", 2, dict(weights=True)),
        ("qwen3_moe", 2, dict(idle_rank=True)),
        ("deepseek_v3", 2, dict(idle_rank=True)),
        ("qwen3_moe_top8", 2, dict(long=True)),
        ("qwen3_moe", 2, dict(weights=True, driven=True)),
        ("qwen3_moe", 4, dict(idle_rank=True)),
        pytest.param("deepseek_v3", 4, dict(idle_rank=True, weights=True), marks=pytest.mark.slow),
    ],
)
@SPAWNED
def test_padded_decode_steps_equal_one_device_and_trainer(cpu_only, ep_summary, checkpoint, world, extra):
    """Decode steps padded to the sizes 2 and 3 (``cuda_graph_batch_sizes``; CUDA graphs on a GPU, the same static
    buffers run eagerly here), every rank to the size of the largest rank's decode rows: every token and logprob ==
    one device's (eager) == the trainer's, with ranks of different decode batch sizes; ``idle_rank``: the last rank
    has no request and joins every padded step with pad rows only; ``weights``: also after sleep(2), wake and
    update_weights."""
    summary = ep_summary(world, dict(checkpoint=checkpoint, graphs=True, **extra))
    _assert_ok(summary)
    assert [c["check"] for c in summary["checks"]][-1] == "padded steps", summary["checks"]
    if extra.get("idle_rank"):
        assert summary["padded"][-1]["idle_padded_steps"] > 0, summary["padded"]


@SPAWNED
def test_padded_steps_contract_fails_when_the_pad_mark_covers_a_real_row(cpu_only, ep_summary):
    """A padded step's pad mark one row early: the last real row of each rank's step goes to no expert, and the check
    sees it (the same workload as the passing case above)."""
    summary = ep_summary(2, PAD_ROWS)
    one_device = summary["checks"][0]
    assert one_device["check"] == "ep == one device" and not one_device["ok"], summary["checks"]


def test_padded_steps_fail_when_a_rank_pads_to_its_own_size(cpu_only, tmp_path):
    """Each rank padding to the size of its own decode rows instead of the agreed one: the ranks' exchanges no
    longer have one size, and gloo aborts the run at the first step where the sizes differ (a captured NCCL graph
    would hang or read past its rows)."""
    import torch.multiprocessing as mp

    with pytest.raises(mp.ProcessExitedException, match="SIGABRT"):
        ep_check.spawn(2, str(tmp_path / "ep.json"), checkpoint="qwen3_moe", graphs=True, perturb="own_size")


@SPAWNED
def test_a_capture_that_fails_on_one_rank_drops_every_ranks_graphs(cpu_only, ep_summary):
    """A capture that succeeds everywhere keeps the graphs; one that fails on rank 1 only leaves no rank with graphs
    or graphs to capture lazily (whose warm-up collectives the failed rank would not join)."""
    states = ep_summary(2, CAPTURE_FAILURE)["states"]
    for rank, (kept, dropped) in enumerate(states):
        assert kept == dict(graphs=1, uncaptured=1, error=None), (rank, kept)
        assert dropped["graphs"] == 0 and dropped["uncaptured"] == 0 and dropped["error"], (rank, dropped)
    assert "cannot be captured" in states[1][1]["error"] and "another rank" in states[0][1]["error"], states


@pytest.mark.gpu
@pytest.mark.parametrize(
    "checkpoint, flags",
    [
        ("qwen3_moe", ["--weights"]),
        ("deepseek_v3", ["--weights"]),
        ("qwen3_moe", ["--idle-rank"]),
        ("qwen3_moe_top8", ["--long"]),
    ],
)
def test_cuda_graph_decode_over_nccl_equals_one_gpu_and_trainer(checkpoint, flags):
    """EP=2 over NCCL with decode steps captured as CUDA graphs (the exchange's collectives inside): == one GPU == the
    trainer, every rank captured its graphs (no eager fallback) and replayed them; ``--weights`` also through
    sleep(2), wake (the graphs captured again) and update_weights. ``scripts/checks/ep_gpu.sh`` runs the same cases."""
    import json
    import os
    import subprocess
    import sys

    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"EP=2 over NCCL needs 2 CUDA devices; {torch.cuda.device_count()} visible")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           "contracts.ep_check", "--device", "cuda", "--checkpoint", checkpoint, "--graphs", *flags]  # fmt: skip
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONPATH=os.pathsep.join(sys.path))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert run.returncode == 0 and lines, run.stdout[-4000:] + run.stderr[-4000:]
    summary = json.loads(lines[-1])
    assert summary["ok"] and summary["backend"] == "nccl", summary
    assert all(p["graphs"] > 0 and p["graph_error"] is None for p in summary["padded"]), summary["padded"]


@SPAWNED
def test_every_rank_runs_the_kv_sizing_forward_at_start(cpu_only, ep_summary):
    """On CUDA without num_kv_blocks / kv_cache_bytes the engine runs the model once on max_num_batched_tokens tokens
    at start-up to size its KV cache; every rank does so together, and the sparse layers' exchange must already be
    agreed for it. Seen failing with the agreement dropped (as the replica had it before)."""
    got = ep_summary(2, FORWARD_AT_START)["ranks"]
    assert [(r["ok"], r["rows"]) for r in got] == [(True, ep_check.ENGINE["max_num_batched_tokens"])] * 2, got
    got = ep_summary(2, FORWARD_AT_START_FORGET)["ranks"]
    assert not any(r["ok"] for r in got), got
    assert all("tokens in a sparse layer but the step's exchange holds 0 rows" in r["error"] for r in got), got


@SPAWNED
def test_expert_parallel_contract_fails_with_a_combine_in_arrival_order(cpu_only, ep_summary):
    """Each token's expert rows added as an all-to-all delivers them (by rank, then expert) instead of in its own
    top-k order: the same workload and checkpoint as the passing top-8 case above, and the check sees it."""
    summary = ep_summary(2, ARRIVAL)
    one_device = summary["checks"][0]
    assert one_device["check"] == "ep == one device" and not one_device["ok"], summary["checks"]


def test_expert_parallel_size_must_divide_the_experts():
    assert expert_shard(8, 4, 3) == range(6, 8)
    with pytest.raises(ValueError, match=r"expert_parallel_size=3 does not divide the 8 routed experts"):
        expert_shard(8, 3, 0)
    with pytest.raises(ValueError, match="positive integer"):
        expert_shard(8, 0, 0)


def test_a_rank_receives_the_shared_weights_and_its_own_experts_only():
    """What the driver of a driven replica sends rank 1 of 2 (8 experts): expert ``e`` of 4..7 renamed to ``e - 4``,
    the others' experts left out, a stacked tensor cut to its rows as a copy of its own (the wire carries those rows
    only), every shared weight whole."""
    import torch

    from vexact_engine.expert_parallel import _rank_part

    stacked = torch.arange(8 * 2, dtype=torch.float32).reshape(8, 2)
    named = [
        ("model.layers.0.mlp.experts.3.up_proj.weight", torch.zeros(2)),
        ("model.layers.0.mlp.experts.5.down_proj.weight", torch.ones(2)),
        ("model.layers.1.mlp.experts.gate_up_proj", stacked),
        ("model.layers.0.mlp.gate.weight", torch.full((8, 2), 2.0)),
    ]
    part = dict(_rank_part(named, expert_shard(8, 2, 1)))
    assert sorted(part) == [
        "model.layers.0.mlp.experts.1.down_proj.weight",
        "model.layers.0.mlp.gate.weight",
        "model.layers.1.mlp.experts.gate_up_proj",
    ]
    cut = part["model.layers.1.mlp.experts.gate_up_proj"]
    assert torch.equal(cut, stacked[4:]) and cut.untyped_storage().nbytes() == stacked[4:].numel() * 4


@pytest.fixture
def no_process_group():
    """No default process group: an earlier test of this worker may have left the single-process one that
    ``vexact_trainer.init_distributed`` makes (it keeps it for the process, as a notebook would)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    yield


def test_expert_parallel_needs_a_process_group(no_process_group):
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="process group"):
        ExpertParallelLLM(model=load_model(default_checkpoint("qwen3_moe")), num_kv_blocks=8)


def test_expert_parallel_refuses_a_size_that_does_not_divide_the_experts(monkeypatch, no_process_group):
    """The replica itself, on a one-rank gloo group that says it has 3 ranks: refused before any expert is cut."""
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ep_check._free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 3)
        model = load_model(default_checkpoint("qwen3_moe"))
        with pytest.raises(ValueError, match=r"expert_parallel_size=3 does not divide the 8 routed experts"):
            ExpertParallelLLM(model=model, num_kv_blocks=8)
        assert model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 8  # nothing cut
        monkeypatch.undo()
        with pytest.raises(ValueError, match="invariant moe kernels only"):
            ExpertParallelLLM(model=model, num_kv_blocks=8, backend="fast")
    finally:
        dist.destroy_process_group()
