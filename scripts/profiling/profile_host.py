"""The engine's host work per decode step, without the model: scheduler, step lists, static-buffer fill, result
bookkeeping. The model's replay and the sampler are replaced by constant-time stubs, so what is timed is the Python a
GPU waits on between two replays (``scripts/profiling/profile_decode.py`` calls it "the rest" on a GPU). Runs on CPU.

    python scripts/profiling/profile_host.py --batch 64,256 [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from vexact_engine import LLM, SamplingParams
from vexact_models import random_model, tiny_qwen3_config


def host_step_ms(batch: int, steps: int, show_profile: bool) -> float:
    model = random_model(tiny_qwen3_config(), seed=0)
    prompt_len, max_tokens = 64, 400  # within the tiny config's 512 positions: no request finishes while timed
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
    t = time.perf_counter()
    for _ in range(steps):
        llm.step()
    ms = (time.perf_counter() - t) / steps * 1e3
    if show_profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(50):
            llm.step()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    return ms


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="64,256", help="comma-separated decode batch sizes")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--profile", action="store_true", help="also print a cProfile of 50 steps")
    args = ap.parse_args()
    for b in (int(x) for x in args.batch.split(",")):
        print(f"decode batch {b}: {host_step_ms(b, args.steps, args.profile):.3f} ms of host work a step")


if __name__ == "__main__":
    main()
