"""Replay the engine's schedule of an RL workload at chosen KV cache sizes, on the CPU, without the model's arithmetic.

The engine's own loop runs (``LLMEngine.step``: the scheduler, the block manager and its prefix cache, preemption by
recompute, ``async_decode``'s one-step-late read-back), with the runner's launch replaced by a seeded random draw for
every row that samples. The model is a tiny Qwen3 whose KV pages stand in for the real model's: which requests run in
a step depends on the workload, the batch limit, the step's token budget, the page size and the number of pages, and
not on the model. So a replay at the page count of a GPU run gives that run's steps (requests and prompt tokens a
step), and a replay at another count shows what that cache would have scheduled.

``--steps FILE.json`` (the steps a ``benchmarks/throughput.py`` run records, ``[requests, prompt tokens, seconds]``
a step for each "limit mode") adds each recorded run's row to the table; with ``--match``, the page count whose replay
first runs below the batch limit at the same step as the recorded run (found by bisection: a larger cache runs
longer at a full batch), i.e. the KV cache that run had, is replayed to the end and printed beside it.

    python benchmarks/schedule_replay.py --workload rl-long --max-num-seqs 256 --kv-tokens 1074304 \
        --steps benchmarks/results/steps-rl-long-h200-1.7b.json --match "256 invariant"

Prints a markdown table: KV tokens, steps, the first step below the limit, preemptions, prompt tokens computed
(recomputes included), keys attended (each step's rows' context lengths, summed over the steps: the KV the steps
read) and the steps by requests a step (the ranges of ``throughput.py``'s step tables).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput  # noqa: E402  benchmarks/throughput.py: the workloads and the step ranges

from vexact_engine import LLMEngine  # noqa: E402
from vexact_engine.in_flight import LaunchedStep  # noqa: E402
from vexact_models import random_model, tiny_qwen3_config  # noqa: E402

WORKLOAD_VOCAB = 151_936  # the workload's prompts are drawn as throughput.py draws them (Qwen3's vocabulary)


def replay_engine(args, num_blocks: int, seed: int = 0) -> LLMEngine:
    """An engine of a tiny model with ``num_blocks`` KV pages, the run's scheduling settings, and a launch that draws
    a random token for each row that samples."""
    max_len = args.prompt_len[1] + args.gen_len[1]
    model = random_model(tiny_qwen3_config(max_position_embeddings=max_len), seed=0)
    eng = LLMEngine(
        model=model, num_kv_blocks=num_blocks, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=max_len,
        async_decode=not args.sync, enable_prefix_caching=not args.no_prefix_caching,
    )  # fmt: skip
    rng = random.Random(seed)
    vocab = model.config.vocab_size

    def launch(batch, blocks):
        items = [it for it in batch if it.is_last_chunk]
        both = torch.tensor([[float(rng.randrange(vocab)) for _ in items], [0.0] * len(items)], dtype=torch.float64)
        return LaunchedStep(items, both, read_later=False)

    eng.runner.launch = launch
    return eng


def replay(args, num_blocks: int, stop_below_limit: bool = False) -> dict:
    """The steps the engine schedules for the workload with ``num_blocks`` pages: ``timeline`` ([requests, prompt
    tokens, 0.0] a step), ``preemptions``, ``context`` (the keys the steps' rows attend, summed: the KV the steps
    read) and ``first_below`` (the first step after the first full batch with fewer requests than the limit; None if
    none). ``stop_below_limit``: stop at that step."""
    eng = replay_engine(args, num_blocks)
    prompts, params = throughput.workload(args, WORKLOAD_VOCAB)
    vocab = eng.vocab_size
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        eng.add_request([t % vocab for t in p], sp, request_id=str(i))
    timeline, first_below, full, context = [], None, False, 0
    launch = eng.runner.launch

    def record(batch, blocks):
        nonlocal first_below, full, context
        rows = len(batch)
        context += sum(it.seq.num_computed_tokens + it.num_new_tokens for it in batch)
        timeline.append([rows, sum(it.num_new_tokens for it in batch if it.num_new_tokens > 1), 0.0])
        full = full or rows >= args.max_num_seqs
        if full and first_below is None and rows < args.max_num_seqs:
            first_below = len(timeline) - 1
        return launch(batch, blocks)

    eng.runner.launch = record
    while eng.has_unfinished_requests() and not (stop_below_limit and first_below is not None):
        eng.step()
    return dict(timeline=timeline, preemptions=eng.scheduler.num_preemptions, first_below=first_below, context=context)


def first_below(timeline: list, limit: int) -> int | None:
    full = False
    for i, (rows, *_) in enumerate(timeline):
        full = full or rows >= limit
        if full and rows < limit:
            return i
    return None


def page_bounds(args) -> tuple[int, int]:
    """The fewest pages that hold the workload's longest request, and the pages that hold every request at its
    longest at once (from there on nothing is preempted and more pages change nothing)."""
    prompts, params = throughput.workload(args, WORKLOAD_VOCAB)
    peaks = [-(-(len(p) + sp.max_tokens) // args.block_size) for p, sp in zip(prompts, params, strict=True)]
    return max(peaks), sum(peaks)


def match_blocks(args, target: int, lo: int, hi: int) -> int:
    """The fewest pages in [lo, hi] whose replay runs a full batch for at least ``target`` steps (bisection)."""
    with tqdm(total=max(1, (hi - lo).bit_length()), desc="matching the cache size", leave=False) as bar:
        while lo < hi:
            mid = (lo + hi) // 2
            below = replay(args, mid, stop_below_limit=True)["first_below"]
            if below is None or below >= target:
                hi = mid
            else:
                lo = mid + 1
            bar.update(1)
    return lo


def row(name: str, kv: str, timeline: list, limit: int, preemptions, context="-") -> str:
    buckets = throughput.step_buckets(timeline, limit)
    counts = [buckets.get(("all", r), [0])[0] for r in throughput.batch_ranges(limit)]
    below = first_below(timeline, limit)
    prompt = sum(t[1] for t in timeline)
    return (f"| {name} | {kv} | {len(timeline)} | {'-' if below is None else below} | {preemptions} | {prompt} | "
            f"{context} | "
            + " | ".join(str(c) for c in counts) + " |")  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=sorted(throughput.WORKLOADS), default="rl-long")
    ap.add_argument("--num-prompts", type=int, help="default: the workload's")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="the batch limit (default 256)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0, help="the workload's seed (throughput.py --seed)")
    ap.add_argument("--kv-tokens", type=int, nargs="*", default=[], help="KV cache sizes to replay, in tokens")
    ap.add_argument("--steps", help="a throughput.py steps JSON: its runs' rows go in the table")
    ap.add_argument("--match", nargs="*", default=[], help="runs of --steps ('256 invariant') to find the cache of")
    ap.add_argument("--sync", action="store_true", help="read each step back before the next (async_decode off)")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--out", help="write every replayed timeline here (JSON, keyed by KV tokens)")
    args = ap.parse_args(argv)
    preset = throughput.WORKLOADS[args.workload]
    args.prompt_len, args.gen_len = preset["prompt_len"], preset["gen_len"]
    args.num_prompts = args.num_prompts or preset["num_prompts"]
    for name in ("num_prompts", "max_num_seqs", "max_num_batched_tokens", "block_size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    bad = [k for k in args.kv_tokens if k < args.block_size]
    if bad:
        ap.error(f"--kv-tokens: {bad[0]} is less than one page of {args.block_size} tokens")
    recorded = json.loads(Path(args.steps).read_text()) if args.steps else {}
    missing = [m for m in args.match if m not in recorded]
    if missing:
        ap.error(f"--match {missing[0]!r}: not a run of --steps (runs: {', '.join(recorded) or 'none'})")
    limit = args.max_num_seqs
    ranges = throughput.batch_ranges(limit)
    names = [f"{lo}" if lo == hi else f"{lo}-{hi}" for lo, hi in ranges]
    print(f"Workload {args.workload}: {args.num_prompts} prompts of {args.prompt_len[0]}-{args.prompt_len[1]} tokens, "
          f"{args.gen_len[0]}-{args.gen_len[1]} generated (seed {args.seed}), batch limit {limit}, "
          f"{args.max_num_batched_tokens} tokens a step, pages of {args.block_size} tokens, "
          f"{'synchronous' if args.sync else 'async_decode'} loop\n")  # fmt: skip
    print("| run | KV tokens | steps | first step below the limit | preemptions | prompt tokens computed | "
          "keys attended | "
          + " | ".join(f"steps of {n}" for n in names) + " |")  # fmt: skip
    print("| --- " * (7 + len(names)) + "|")
    out = {}
    for name, steps in recorded.items():
        print(row(f"recorded: {name}", "-", steps, limit, "-"), flush=True)
        if name in args.match:
            target = first_below(steps, limit)
            if target is None:
                print(f"| {name}: never below the limit after a full batch; nothing to match |", flush=True)
                continue
            pages = match_blocks(args, target, *page_bounds(args))
            r = replay(args, pages)
            out[str(pages * args.block_size)] = r["timeline"]
            print(row(f"replay, the cache of {name}", str(pages * args.block_size), r["timeline"], limit,
                      r["preemptions"], r["context"]), flush=True)  # fmt: skip
    for kv in tqdm(args.kv_tokens, desc="replays", leave=False):
        pages = kv // args.block_size
        r = replay(args, pages)
        out[str(pages * args.block_size)] = r["timeline"]
        print(row("replay", str(pages * args.block_size), r["timeline"], limit, r["preemptions"], r["context"]),
              flush=True)  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
