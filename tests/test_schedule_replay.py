"""benchmarks/schedule_replay.py replays the engine's schedule without the model: the steps it records must be the
steps a real engine schedules for the same workload and cache, and another cache must schedule other steps."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import schedule_replay  # noqa: E402
import throughput  # noqa: E402

from vexact_engine import LLMEngine  # noqa: E402
from vexact_models import random_model, tiny_qwen3_config  # noqa: E402

PAGES = 40  # 160 tokens: 6 requests of up to 72 tokens fill it after a full batch, and the engine preempts


def small_args(sync: bool) -> argparse.Namespace:
    return argparse.Namespace(
        prompt_len=[8, 24], gen_len=[16, 48], num_prompts=12, seed=0, max_num_seqs=6, max_num_batched_tokens=32,
        block_size=4, sync=sync, no_prefix_caching=False,
    )  # fmt: skip


def engine_steps(args, pages: int) -> tuple[list, int]:
    """The steps (requests, prompt tokens) a real engine of a tiny model runs on the workload, and its preemptions."""
    max_len = args.prompt_len[1] + args.gen_len[1]
    eng = LLMEngine(
        model=random_model(tiny_qwen3_config(), seed=3), num_kv_blocks=pages, block_size=args.block_size,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=max_len,
        async_decode=not args.sync,
    )  # fmt: skip
    prompts, params = throughput.workload(args, schedule_replay.WORKLOAD_VOCAB)
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        eng.add_request([t % eng.vocab_size for t in p], sp, request_id=str(i))
    steps, launch = [], eng.runner.launch

    def record(batch, blocks):
        steps.append([len(batch), sum(it.num_new_tokens for it in batch if it.num_new_tokens > 1)])
        return launch(batch, blocks)

    eng.runner.launch = record
    while eng.has_unfinished_requests():
        eng.step()
    return steps, eng.scheduler.num_preemptions


@pytest.mark.parametrize("sync", [False, True], ids=["async_decode", "sync"])
def test_replay_schedules_what_the_engine_schedules(sync):
    args = small_args(sync)
    steps, preemptions = engine_steps(args, PAGES)
    assert preemptions > 0  # the cache is small enough that the schedule depends on it
    r = schedule_replay.replay(args, PAGES)
    assert [t[:2] for t in r["timeline"]] == steps
    assert r["preemptions"] == preemptions
    other = schedule_replay.replay(args, PAGES + 8)  # another cache: other steps
    assert [t[:2] for t in other["timeline"]] != steps


def test_match_finds_a_cache_that_fills_at_the_recorded_step():
    args = small_args(sync=False)
    steps, _ = engine_steps(args, PAGES)
    target = schedule_replay.first_below(steps, args.max_num_seqs)
    assert target is not None
    lo, hi = schedule_replay.page_bounds(args)
    pages = schedule_replay.match_blocks(args, target, lo, hi)
    assert lo <= pages <= PAGES
    assert schedule_replay.replay(args, pages)["first_below"] == target


def test_cli_table_and_bad_input(tmp_path, capsys):
    out = tmp_path / "t.json"
    assert schedule_replay.main(["--workload", "rl", "--num-prompts", "6", "--max-num-seqs", "4", "--kv-tokens",
                                 "40960", "--out", str(out)]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "| replay | 40960 |" in text and "| steps of 4 | steps of 3 | steps of 2 | steps of 1 |" in text
    assert "40960" in out.read_text()
    with pytest.raises(SystemExit):
        schedule_replay.main(["--kv-tokens", "8"])
    assert "--kv-tokens: 8 is less than one page of 16 tokens" in capsys.readouterr().err
    steps = tmp_path / "s.json"
    steps.write_text('{"256 vllm": [[256, 0, 0.1]]}')
    with pytest.raises(SystemExit):
        schedule_replay.main(["--steps", str(steps), "--match", "256 invariant"])
    assert "'256 invariant': not a run of --steps (runs: 256 vllm)" in capsys.readouterr().err
