"""What admitting a prompt costs a full decode batch: the host time to launch a step with prompt tokens against a
decode-only step, and the wall time of each step around it.

    PYTHONPATH=<packages' src dirs>:. python benchmarks/admission_step.py --shape 1.7b        # on a GPU
    PYTHONPATH=<packages' src dirs>:. python benchmarks/admission_step.py --shape tiny        # CPU smoke run

An engine at its batch limit (256 on a GPU) decodes requests of 320 random tokens; then, every fourth step, one
request is aborted and a new 320-token prompt takes its slot, so that step holds 255 decode rows and one prompt
chunk. Printed: the mean wall time of the decode-only steps and of the steps that admit a prompt, the wall time of a
run of steps (kind, ms, whether it ran a padded prompt launch), and the mean host time inside ``ModelRunner.launch``
per kind. With ``async_decode`` (the default on CUDA) a step's launch returns before its kernels run, so a launch
that takes long waits on the device: a copy from pageable memory, say, which waits for every step already queued.
``--joint`` runs the step with prompt tokens as one launch (``EngineConfig.split_mixed_steps=False``).
"""

from __future__ import annotations

import argparse
import time

import torch

from vexact_engine import LLM, SamplingParams

PROMPT_LEN = 320


def build(shape: str, joint: bool) -> tuple[LLM, int, int]:
    """The engine, its batch limit and the requests' max_tokens."""
    if shape == "tiny":  # CPU: the tiny checkpoint's sizes, padded steps run eagerly
        from vexact_models import random_model, tiny_qwen3_config

        model = random_model(tiny_qwen3_config())
        kw = dict(max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=512, max_model_len=256,
                  cuda_graph_batch_sizes=[1, 2, 4, 8], cuda_graph_token_sizes=[16, 32, 64])  # fmt: skip
        return LLM(model=model, split_mixed_steps=not joint, **kw), 8, 100
    import throughput

    model = throughput.make_model(shape, None)
    kw = dict(max_num_seqs=256, max_num_batched_tokens=8192, gpu_memory_utilization=0.85, max_model_len=2560)
    return LLM(model=model, split_mixed_steps=not joint, **kw), 256, 2000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="1.7b", help="a benchmarks/throughput.py shape, or tiny (CPU)")
    ap.add_argument("--joint", action="store_true", help="steps with prompt tokens in one launch")
    ap.add_argument("--steps", type=int, default=40, help="timed steps, one in four admitting a prompt")
    args = ap.parse_args()
    llm, batch, max_tokens = build(args.shape, args.joint)
    vocab = llm.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt_len = PROMPT_LEN if args.shape != "tiny" else 20

    def add(rid: str, seed: int) -> None:
        prompt = torch.randint(0, vocab, (prompt_len,), generator=g).tolist()
        llm.add_request(prompt, SamplingParams(max_tokens=max_tokens, seed=seed, ignore_eos=True), request_id=rid)

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    for i in range(batch):
        add(f"r{i}", i)
    for _ in range(30):  # every request admitted and decoding
        llm.step()
    sync()
    runner = llm.runner
    launches: dict[str, list[float]] = {}
    launch = runner.launch

    def timed_launch(batch_items, blocks):
        t = time.perf_counter()
        out = launch(batch_items, blocks)
        kind = "admits" if any(it.num_new_tokens != 1 for it in batch_items) else "decode"
        launches.setdefault(kind, []).append(time.perf_counter() - t)
        return out

    runner.launch = timed_launch
    steps = []
    for s in range(20 + args.steps):
        admit = s >= 20 and s % 4 == 0
        if admit:
            llm.abort_request(next(iter(llm._seqs)))
            add(f"n{s}", 1000 + s)
        before = runner.num_padded_prompt_steps
        t = time.perf_counter()
        llm.step()
        steps.append(
            ("admits" if admit else "decode", time.perf_counter() - t, runner.num_padded_prompt_steps - before)
        )
    sync()
    del runner.launch
    for kind in ("decode", "admits"):
        ts = [t for k, t, _ in steps if k == kind]
        print(f"{kind}: {len(ts)} steps, mean {1e3 * sum(ts) / len(ts):.2f} ms, max {1e3 * max(ts):.2f} ms")
    print("steps (kind, ms, padded prompt launches):",
          [(k, round(t * 1e3, 1), p) for k, t, p in steps[20:40]])  # fmt: skip
    for kind, ts in launches.items():
        print(f"launch, {kind}: {len(ts)} launches, mean host time {1e3 * sum(ts) / len(ts):.2f} ms")
    print(f"split steps {runner.num_split_steps}, padded prompt launches {runner.num_padded_prompt_steps}, "
          f"graph error {runner.graph_error}")  # fmt: skip


if __name__ == "__main__":
    main()
