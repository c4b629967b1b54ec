"""The engine's host work per decode step, without the model: scheduler, step lists, static-buffer fill, result
bookkeeping. The model's replay and the sampler are replaced by constant-time stubs, so what is timed is the Python a
GPU waits on between two replays (``scripts/profiling/profile_decode.py`` calls it "the rest" on a GPU). Runs on CPU.

    python scripts/profiling/profile_host.py --batch 1,64,256 [--steps 60] [--repeats 5] [--profile]

Prints, per batch size, the median and the least of ``--repeats`` means over ``--steps`` steps each (a shared CPU
makes single means noisy; the least is the cleanest run).
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


def host_step_ms(batch: int, steps: int, repeats: int, show_profile: bool) -> tuple[float, float]:
    """(median, least) of ``repeats`` means of ``steps`` decode steps' host work, in ms."""
    model = random_model(tiny_qwen3_config(), seed=0)
    prompt_len, max_tokens = 64, 440  # within the tiny config's 512 positions
    if 5 + steps * repeats + (50 if show_profile else 0) >= max_tokens:
        raise ValueError(f"--steps {steps} x --repeats {repeats} must stay under {max_tokens - 55} decode steps")
    llm = LLM(model=model, max_num_seqs=batch, max_num_batched_tokens=max(512, batch * prompt_len), block_size=16,
              num_kv_blocks=batch * 32, cuda_graph_batch_sizes=[batch], cuda_graph_token_sizes=())  # fmt: skip
    for i in range(batch):
        sp = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, ignore_eos=True)
        llm.add_request([1 + (i * 7 + j) % 200 for j in range(prompt_len)], sp)
    while len(llm.running_sequences()) < batch or any(not s.output_token_ids for s in llm.running_sequences()):
        llm.step()
    runner, hidden = llm.runner, torch.zeros(batch, model.config.hidden_size)
    runner._replay = lambda key, static, tokens, seqs: hidden[:tokens]
    runner.sample = lambda rows, items: [(it, 5, -1.0) for it in items]
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
    args = ap.parse_args()
    for b in (int(x) for x in args.batch.split(",")):
        median, least = host_step_ms(b, args.steps, args.repeats, args.profile)
        print(f"decode batch {b}: {median:.3f} ms of host work a step (median of {args.repeats} means of "
              f"{args.steps} steps; least {least:.3f} ms)")  # fmt: skip


if __name__ == "__main__":
    main()
