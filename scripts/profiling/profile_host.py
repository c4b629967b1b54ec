"""The engine's host work per decode step, without the model: scheduler, step lists, static-buffer fill, result
bookkeeping. The model's replay and the sampler are replaced by constant-time stubs, so what is timed is the Python a
GPU waits on between two replays (``scripts/profiling/profile_decode.py`` calls it "the rest" on a GPU). Runs on CPU.

    python scripts/profiling/profile_host.py --batch 1,64,256 [--steps 60] [--repeats 5] [--chunk 2048] [--profile]
                                             [--draw-in-graph] [--async-decode]

Prints, per batch size, the median and the least of ``--repeats`` means over ``--steps`` steps each (a shared CPU
makes single means noisy; the least is the cleanest run). ``--chunk P``: steps with prompt tokens instead, each the
batch's decode rows plus a new request's whole ``P``-token prompt (the request, of one output token, leaves in the
same step; all of them are queued before the timing). ``--draw-in-graph``: decode steps with the sampler's own
host work, its draw twice: eagerly (``sample_rows_on_device`` with ``model.sample`` a constant-time stub) and from
the static buffers (``EngineConfig.draw_in_graph``, the draw graph's replay a stub); what a GPU would run is left out
of both.
``--async-decode``: the same with ``EngineConfig.async_decode`` (the host work of the one-step-ahead loop, which a GPU
overlaps with the step before; on CPU the read-back waits for nothing).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

from vexact_engine import LLM, SamplingParams
from vexact_models import random_model, tiny_qwen3_config


def host_step_ms(
    batch: int,
    steps: int,
    repeats: int,
    show_profile: bool,
    chunk: int = 0,
    draw: str | None = None,
    async_decode: bool = False,
) -> tuple[float, float]:
    """(median, least) of ``repeats`` means of ``steps`` steps' host work, in ms: decode steps, or with ``chunk``
    each step also prefills a new request's ``chunk``-token prompt. ``draw`` ``"eager"`` or ``"graph"``: the
    sampler's host work is timed too, its draw eagerly or from the static buffers (module doc). ``async_decode``:
    the one-step-ahead loop (each step read back after the next is launched, its rows fed from the drawn tokens)."""
    prompt_len, max_tokens = 64, 440  # within 512 positions
    if 5 + steps * repeats + (50 if show_profile else 0) >= max_tokens:
        raise ValueError(f"--steps {steps} x --repeats {repeats} must stay under {max_tokens - 55} decode steps")
    model = random_model(tiny_qwen3_config(max_position_embeddings=max(512, chunk + 64)), seed=0)
    budget = max(512, batch * prompt_len, batch + chunk)
    llm = LLM(model=model, max_num_seqs=batch + (chunk > 0), max_num_batched_tokens=budget, block_size=16,
              num_kv_blocks=batch * 32 + 2 * (chunk // 16 + 1), cuda_graph_batch_sizes=[batch],
              cuda_graph_token_sizes=[batch + chunk] if chunk else (), draw_in_graph=draw == "graph",
              async_decode=async_decode)  # fmt: skip
    for i in range(batch):
        sp = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, ignore_eos=True)
        llm.add_request([1 + (i * 7 + j) % 200 for j in range(prompt_len)], sp)
    while len(llm.running_sequences()) < batch or any(not s.output_token_ids for s in llm.running_sequences()):
        llm.step()
    if chunk:  # one request a step: admitted when the one before leaves (max_num_seqs), its prompt whole (budget)
        for k in range(5 + steps * repeats + (50 if show_profile else 0)):
            one = SamplingParams(max_tokens=1, temperature=1.0, seed=10_000 + k, ignore_eos=True)
            llm.add_request([3 + (k * 11 + j) % 200 for j in range(chunk)], one)
    runner, hidden = llm.runner, torch.zeros(batch + chunk, model.config.hidden_size)
    runner._replay = lambda key, static, tokens, seqs: hidden[:tokens]
    width = batch + 1  # the decode rows and a new request's prompt (--chunk)
    drawn = torch.stack([torch.full((width,), 5.0, dtype=torch.float64), -torch.ones(width, dtype=torch.float64)])
    if draw is None:
        runner._sample_on_device = lambda rows, items: drawn[:, : len(items)]
    else:
        model.sample = lambda rows, temps, seeds: (drawn[0, : len(rows)].long(), drawn[1, : len(rows)].float())
        runner._replay_draw = lambda size, rows: drawn[:, :size]
    for _ in range(5):
        llm.step()
    means = []
    for _ in range(repeats):  # no request finishes while timed
        t = time.perf_counter()
        for _ in range(steps):
            llm.step()
        means.append((time.perf_counter() - t) / steps * 1e3)
    if show_profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(50):
            llm.step()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    return statistics.median(means), min(means)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="64,256", help="comma-separated decode batch sizes")
    ap.add_argument("--steps", type=int, default=60, help="decode steps per timed mean")
    ap.add_argument("--repeats", type=int, default=5, help="timed means per batch size")
    ap.add_argument("--profile", action="store_true", help="also print a cProfile of 50 steps")
    ap.add_argument("--chunk", type=int, default=0, help="also a new request's prompt of this many tokens a step")
    ap.add_argument("--draw-in-graph", action="store_true", help="the sampler's host work, eager draw vs draw_in_graph")
    ap.add_argument("--async-decode", action="store_true", help="the one-step-ahead loop (EngineConfig.async_decode)")
    args = ap.parse_args()
    if args.draw_in_graph and args.chunk:
        ap.error("--draw-in-graph times decode steps: leave out --chunk")
    for b in (int(x) for x in args.batch.split(",")):
        for draw in ("eager", "graph") if args.draw_in_graph else (None,):
            median, least = host_step_ms(b, args.steps, args.repeats, args.profile, args.chunk, draw, args.async_decode)
            what = f"decode batch {b}" + (f" + a {args.chunk}-token prompt" if args.chunk else "")
            what += ", async_decode" if args.async_decode else ""
            what += {None: "", "eager": ", eager draw", "graph": ", draw in the graph"}[draw]
            print(f"{what}: {median:.3f} ms of host work a step (median of {args.repeats} means of "
                  f"{args.steps} steps; least {least:.3f} ms)")  # fmt: skip


if __name__ == "__main__":
    main()
