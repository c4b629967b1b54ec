"""Where a batch-1 decode step's time goes (GPU): the captured graph vs the rest of ``LLMEngine.step``.

    python scripts/profile_decode.py [--shape 1.7b] [--layers 28]

Prints: the whole step (median wall ms), the decode graph replay alone (CUDA events), the sampling half
(``sample_rows``: logits, seeded draw, fused logprobs, one host sync) alone, the remainder (scheduler, step tensors,
Python), and the top host-side ops of a torch.profiler trace over a few steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import throughput  # noqa: E402  (the benchmark's model builder: random bf16 weights drawn on the GPU)

from vexact_engine import LLM, SamplingParams  # noqa: E402
from vexact_engine.model_runner import sample_rows  # noqa: E402


def cuda_ms(fn, n: int = 30) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1.7b")
    ap.add_argument("--layers", type=int, default=28)
    args = ap.parse_args()
    model = throughput.make_model(args.shape, args.layers)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    llm = LLM(model=model, device="cuda", max_num_seqs=8, max_num_batched_tokens=512, num_kv_blocks=256)
    llm.add_request(list(range(1, 257)), SamplingParams(max_tokens=400, temperature=1.0, top_p=0.95, seed=0))
    for _ in range(3):
        llm.step()  # prefill, then the first decode steps (graphs already captured at construction)
    walls = []
    for _ in range(40):
        t = time.perf_counter()
        llm.step()
        walls.append((time.perf_counter() - t) * 1e3)
    runner = llm.runner
    graph, out = runner._graphs[1]
    replay = cuda_ms(graph.replay)
    seq = llm.running_sequences()[0]
    hidden = out[:1]
    sample = cuda_ms(
        lambda: sample_rows(model, "invariant", hidden, [seq.params], [seq.seed], [len(seq.output_token_ids)])
    )
    step = statistics.median(walls)
    print(f"{args.shape}-shaped, {args.layers} layers, {weight_bytes / 2**30:.2f} GiB of weights")
    print(f"engine step at batch 1 (median wall): {step:.3f} ms")
    print(f"  decode graph replay alone:          {replay:.3f} ms")
    print(f"  sample_rows alone (logits, draw, logprobs, host sync): {sample:.3f} ms")
    print(f"  the rest (scheduler, step tensors, Python): {step - replay - sample:.3f} ms")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            llm.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=10))


if __name__ == "__main__":
    main()
