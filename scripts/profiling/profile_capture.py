"""CUDA graph capture at start-up and at every wake_up (GPU): what a verl iteration pays to wake the engine.

    python scripts/profiling/profile_capture.py [--shape 1.7b] [--max-num-seqs 256] [--tokens 4096] [--cycles 2]

The engine captures every graph (decode batch sizes and token counts of the steps with prompt tokens) at start-up. A
``wake_up`` brings the KV cache and the packed weights back at new addresses, so the graphs are captured again: all
of them at the wake_up (``graph_recapture="eager"``), or the largest of each kind there and the others at their first
step (``"lazy"``, the default). Per ``sleep(level=1)`` / ``wake_up`` cycle and per setting, in one run: the wake_up's
wall time and how many graphs it captured, then a GRPO-like rollout (``--prompts`` prompts x ``--n`` samples of
``--max-tokens`` tokens, ``ignore_eos``) and how many graphs its steps captured, and the sum of both (the part of a
verl step that the setting changes). The rollout's tokens and logprobs are compared bit for bit with the ones the
same requests gave before the first sleep.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import throughput  # noqa: E402  (the benchmark's model builder: random bf16 weights drawn on the GPU)

from vexact_engine import LLM, SamplingParams, cuda_graphs  # noqa: E402


def rollout(llm: LLM, args) -> list[tuple[list[int], torch.Tensor]]:
    prompts = [[1 + (i * 13 + j) % 997 for j in range(args.prompt_len - i % 5)] for i in range(args.prompts)]
    prompts = [p for p in prompts for _ in range(args.n)]  # n samples of each prompt (their pages shared)
    params = [SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=i, ignore_eos=True)
              for i in range(len(prompts))]  # fmt: skip
    return [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1.7b")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=4096, help="max_num_batched_tokens")
    ap.add_argument("--cycles", type=int, default=2, help="sleep / wake_up cycles per setting")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--prompt-len", type=int, default=92)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("scripts/profiling/profile_capture.py needs a CUDA device", file=sys.stderr)
        return 2
    model = throughput.make_model(args.shape, None)
    t0 = time.perf_counter()
    llm = LLM(model=model, device="cuda", max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.tokens)
    runner = llm.runner
    print(f"##### {args.shape}-shaped, max_num_seqs {args.max_num_seqs}, max_num_batched_tokens {args.tokens}: "
          f"{runner.num_graphs} CUDA graphs; rollout {args.prompts} prompts x {args.n} samples, "
          f"{args.max_tokens} tokens each")  # fmt: skip
    print(f"start-up: engine built in {time.perf_counter() - t0:.2f} s, capture {runner.capture_seconds:.2f} s "
          f"({cuda_graphs.WARMUPS_FIRST_CAPTURE} warm-up runs per shape)")  # fmt: skip
    want = rollout(llm, args)
    totals = {}
    for mode in ("eager", "lazy"):
        llm.config.graph_recapture = mode
        for cycle in range(args.cycles):
            llm.sleep(level=1)
            torch.cuda.synchronize()
            t = time.perf_counter()
            llm.wake_up()
            torch.cuda.synchronize()
            wake, at_wake = time.perf_counter() - t, runner.num_graphs
            t = time.perf_counter()
            got = rollout(llm, args)
            torch.cuda.synchronize()
            gen = time.perf_counter() - t
            same = all(a[0] == b[0] and torch.equal(a[1], b[1]) for a, b in zip(got, want, strict=True))
            verdict = "the same bits" if same else "DIFFER"
            totals.setdefault(mode, []).append(wake + gen)
            print(f"{mode:5s} cycle {cycle + 1}: wake_up {wake:.2f} s ({at_wake} graphs), rollout {gen:.2f} s "
                  f"({runner.captured_at_steps} graphs captured at their first step), sum {wake + gen:.2f} s; "
                  f"capture {runner.capture_seconds:.2f} s in all; outputs {verdict}")  # fmt: skip
    eager, lazy = (sum(totals[m]) / len(totals[m]) for m in ("eager", "lazy"))
    print(f"wake_up + rollout, mean over cycles: eager {eager:.2f} s, lazy {lazy:.2f} s, lazy / eager "
          f"{lazy / eager:.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
