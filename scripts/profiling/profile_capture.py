"""CUDA graph capture at start-up and at every wake_up (GPU): what a verl iteration pays to wake the engine.

    python scripts/profiling/profile_capture.py [--shape 1.7b] [--max-num-seqs 256] [--tokens 4096] [--cycles 2]

The engine captures every graph (decode batch sizes and token counts of the steps with prompt tokens) at start-up and
again at each ``wake_up``, since the KV cache comes back at new addresses. Prints the start-up capture, then per
``sleep(level=1)`` / ``wake_up`` cycle the wake_up's wall time and its capture time, with
``WARMUPS_RECAPTURE`` eager warm-up runs per shape, then the same with ``WARMUPS_FIRST_CAPTURE`` (the form before)
for comparison, in one run. After each wake_up the same seeded requests are generated again and compared, tokens and
logprobs bit for bit, with the ones generated before the first sleep.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import throughput  # noqa: E402  (the benchmark's model builder: random bf16 weights drawn on the GPU)

from vexact_engine import LLM, SamplingParams, model_runner  # noqa: E402


def outputs(llm: LLM) -> list[tuple[list[int], torch.Tensor]]:
    prompts = [[1 + (i * 13 + j) % 997 for j in range(100 + 37 * i)] for i in range(8)]
    params = [SamplingParams(max_tokens=24, temperature=1.0, seed=i, ignore_eos=True) for i in range(8)]
    return [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1.7b")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=4096, help="max_num_batched_tokens")
    ap.add_argument("--cycles", type=int, default=2, help="sleep / wake_up cycles per warm-up setting")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("scripts/profiling/profile_capture.py needs a CUDA device", file=sys.stderr)
        return 2
    model = throughput.make_model(args.shape, None)
    t0 = time.perf_counter()
    llm = LLM(model=model, device="cuda", max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.tokens)
    runner = llm.runner
    print(f"##### {args.shape}-shaped, max_num_seqs {args.max_num_seqs}, max_num_batched_tokens {args.tokens}: "
          f"{len(runner._graphs)} CUDA graphs")  # fmt: skip
    print(f"start-up: engine built in {time.perf_counter() - t0:.2f} s, capture {runner.capture_seconds:.2f} s "
          f"({model_runner.WARMUPS_FIRST_CAPTURE} warm-up runs per shape)")  # fmt: skip
    want = outputs(llm)
    default = model_runner.WARMUPS_RECAPTURE
    for warmups in (default, model_runner.WARMUPS_FIRST_CAPTURE):
        model_runner.WARMUPS_RECAPTURE = warmups
        for cycle in range(args.cycles):
            llm.sleep(level=1)
            torch.cuda.synchronize()
            t = time.perf_counter()
            llm.wake_up()
            torch.cuda.synchronize()
            wake = time.perf_counter() - t
            same = all(a[0] == b[0] and torch.equal(a[1], b[1]) for a, b in zip(outputs(llm), want, strict=True))
            verdict = "the same bits" if same else "DIFFER"
            print(f"wake_up {cycle + 1}, {warmups} warm-up run(s) per shape: {wake:.2f} s, of which capture "
                  f"{runner.capture_seconds:.2f} s; outputs after it {verdict}")  # fmt: skip
    model_runner.WARMUPS_RECAPTURE = default
    return 0


if __name__ == "__main__":
    sys.exit(main())
