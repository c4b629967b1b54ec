"""Where a decode step's time goes (GPU): the captured graph vs the rest of ``LLMEngine.step``, per batch size.

    python scripts/profiling/profile_decode.py [--shape 1.7b] [--layers N] [--batch 1,64,256] [--no-pack]
                                     [--mixed 64:2048,256:1024] [--block-size 16] [--context 256]
                                     [--draw-in-graph]

Prints, per batch size: the whole step (median wall ms), the decode graph replay alone (CUDA events), the sampling half
(``sample_rows_on_device`` read back: logits, seeded draw, fused logprobs, one host sync) alone, the remainder
(scheduler, step tensors, Python); then, from a torch.profiler trace over a few steps, the number of GPU kernels per
step and the kernels with the most GPU time (graph replays included: CUPTI records the kernels a graph launches), and
the top host-side ops. ``--mixed B:P,...``: steps with prompt tokens instead (they run eagerly): B running requests
decode while a new request's prompt chunk of P tokens prefills in the same step; the same kernel and host tables.
``--no-pack``: the engine with ``pack_weights=False`` (q/k/v and gate/up as separate matmuls).
``--draw-in-graph``: each batch size twice, ``EngineConfig.draw_in_graph`` off then on (the draw as a CUDA graph
replayed after the decode graph; its replay alone is timed too), for an A/B in one process.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import vexact_kernels as vk

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import profiling  # noqa: E402  (benchmarks/profiling.py: the decoding batch, the profile, the kernel table)
import throughput  # noqa: E402  (the benchmark's model builder: random bf16 weights drawn on the GPU)

from vexact_engine import LLM, SamplingParams  # noqa: E402
from vexact_engine.sampler import rows_to_host, sample_rows_on_device  # noqa: E402


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


def fill_draws(batch: int, context: int, prompt_budget: int) -> int:
    """Tokens the first request may draw while ``batch`` prompts of ``context`` tokens prefill at ``prompt_budget``
    prompt tokens a step (the running rows take the rest of the step's budget), with a margin: a request must not
    finish (nor outgrow its KV pages) before the last one decodes."""
    return -(-batch * context // max(1, prompt_budget)) + 16


def kv_pages(seqs: int, tokens_each: int, page: int) -> int:
    """KV pages of ``page`` tokens for ``seqs`` sequences of up to ``tokens_each`` tokens each."""
    return seqs * -(-tokens_each // page)


def profile_batch(
    model,
    batch: int,
    weight_bytes: int,
    label: str,
    pack: bool = True,
    page: int = 16,
    context: int = 256,
    draw: bool = False,
) -> None:
    # a request: a ``context``-token prompt, the tokens it draws while the later prompts prefill, the steps below
    budget = max(2048, 2 * batch)
    draws = fill_draws(batch, context, budget - batch) + 64
    pages = max(4096 // page, kv_pages(batch, context + draws, page))
    llm = LLM(model=model, device="cuda", max_num_seqs=max(8, batch), max_num_batched_tokens=budget,
              num_kv_blocks=pages, block_size=page, pack_weights=pack, draw_in_graph=draw)  # fmt: skip
    prompts = [[1 + (i * 7 + j) % 1000 for j in range(context)] for i in range(batch)]
    params = [SamplingParams(max_tokens=draws, temperature=1.0, top_p=1.0, seed=i, ignore_eos=True)
              for i in range(batch)]  # fmt: skip
    profiling.fill_decode_batch(llm, prompts, params)  # prefill every request; graphs were captured at construction
    llm.step()
    walls = []
    for _ in range(30):
        t = time.perf_counter()
        llm.step()
        walls.append((time.perf_counter() - t) * 1e3)
    runner = llm.runner
    if draw and runner.num_graph_draws < len(walls):
        raise RuntimeError(f"draw_in_graph: {runner.num_graph_draws} steps drew in a graph, of {len(walls)} timed")
    graph_batch = min(b for kind, b in runner._graphs if kind == "decode" and b >= batch)
    graph, out = runner._graphs[("decode", graph_batch)]
    replay = cuda_ms(graph.replay)
    # the same replay started from an idle GPU, as an engine step starts it (after the previous step's read-back):
    # what it costs above the back-to-back figure is the host's graph launch, during which the GPU waits
    idle = statistics.median(synced_ms(graph.replay) for _ in range(20))
    launch = []
    for _ in range(20):
        torch.cuda.synchronize()
        t = time.perf_counter()
        graph.replay()
        launch.append((time.perf_counter() - t) * 1e3)
        torch.cuda.synchronize()
    seqs = llm.running_sequences()[:batch]  # the benchmark's sampling: temperature 1, no top-k / top-p
    hidden = out[: len(seqs)]
    sample = cuda_ms(
        lambda: rows_to_host(sample_rows_on_device(
            model, "invariant", hidden, [s.params for s in seqs], [s.seed for s in seqs],
            [len(s.output_token_ids) for s in seqs],
        ))
    )  # fmt: skip
    drawn = cuda_ms(runner._draws[graph_batch][0].replay) if draw else None
    step = statistics.median(walls)
    how = "draw in the decode graph" if draw else "eager draw"
    print(f"\n##### {label}, {weight_bytes / 2**30:.2f} GiB of weights, batch {batch} (graph of {graph_batch}), {how}")
    print(f"engine step (median wall): {step:.3f} ms = {step / batch * 1e3:.1f} us per token")
    print(f"  decode graph replay alone:          {replay:.3f} ms")
    print(
        f"  the replay from an idle GPU (synced wall): {idle:.3f} ms; host time in graph.replay(): "
        f"{statistics.median(launch):.3f} ms"
    )
    print(f"  sampling alone (logits, draw, logprobs, host sync): {sample:.3f} ms")
    if draw:
        print(f"  draw graph replay alone (what the step runs instead of eager sampling): {drawn:.3f} ms")
    print(f"  the rest (scheduler, step tensors, Python): {step - replay - (drawn if draw else sample):.3f} ms")
    trace_steps(lambda k, engine=llm: engine.step(), 5)
    del llm
    torch.cuda.empty_cache()


def synced_ms(fn) -> float:
    """Wall ms of ``fn()`` between two device syncs."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def trace_steps(run, steps: int) -> None:
    """Profile ``run(k)`` for k < steps; print the GPU kernels per step and the top host ops."""
    prof = profiling.profile_run(run, steps)
    print("\n".join(profiling.kernel_table(prof, steps)))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def profile_mixed(
    model,
    batch: int,
    prompt: int,
    label: str,
    pack: bool = True,
    graphs: bool = True,
    page: int = 16,
    context: int = 256,
) -> None:
    """Steps with prompt tokens: ``batch`` requests decode while one new request's ``prompt``-token chunk prefills;
    as CUDA graphs padded to a token count (``graphs``, the default) or eagerly."""
    draws = fill_draws(batch, context, prompt) + 64
    pages = max(4096 // page, kv_pages(batch + 12, context + draws, page) + kv_pages(12, prompt, page))
    llm = LLM(model=model, device="cuda", max_num_seqs=batch + 1, max_num_batched_tokens=batch + prompt,
              num_kv_blocks=pages, block_size=page, pack_weights=pack,
              cuda_graph_token_sizes=None if graphs else ())  # fmt: skip
    sp = dict(max_tokens=draws, temperature=1.0, top_p=1.0, ignore_eos=True)
    vocab = min(997, model.config.vocab_size - 3)
    prompts = [[1 + (i * 7 + j) % vocab for j in range(context)] for i in range(batch)]
    profiling.fill_decode_batch(llm, prompts, [SamplingParams(seed=i, **sp) for i in range(batch)])

    def mixed_step(k: int) -> float:
        # a finished slot is not needed: max_num_seqs leaves one free, and a request of max_tokens 1 leaves it again
        one = SamplingParams(seed=10_000 + k, **{**sp, "max_tokens": 1})
        llm.add_request([3 + (k * 11 + j) % vocab for j in range(prompt)], one)
        return synced_ms(llm.step)

    for k in range(3):
        mixed_step(k)  # compiles the prefill shapes
    walls = [mixed_step(100 + k) for k in range(10)]
    llm.step()  # a decode-only step for comparison (graph replay)
    dec = [synced_ms(llm.step) for _ in range(10)]
    how = f"CUDA graphs, {llm.runner.num_padded_prompt_steps} steps padded" if graphs else "eager"
    print(f"\n##### {label}, {batch} decoding + a {prompt}-token prompt chunk per step ({how})")
    print(f"step with prompt tokens (median wall, synced): {statistics.median(walls):.3f} ms")
    print(f"decode-only step of the same batch (median wall, synced): {statistics.median(dec):.3f} ms")
    trace_steps(lambda k: mixed_step(200 + k), 3)
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1.7b", help="a shape of benchmarks/throughput.py: 1.7b, 8b, ...")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's own)")
    ap.add_argument("--batch", default="1", help="comma-separated batch sizes (running requests per decode step)")
    ap.add_argument("--no-pack", action="store_true", help="EngineConfig.pack_weights=False: no grouped projections")
    ap.add_argument("--draw-in-graph", action="store_true", help="each batch with draw_in_graph off, then on")
    ap.add_argument("--mixed", default="", help="B:P pairs, comma-separated: B decoding + a P-token prompt chunk")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV page (128: FA4's tile_n at hd128)")
    ap.add_argument(
        "--context",
        type=int,
        default=256,
        help="prompt tokens of each decoding request (the throughput benchmark's contexts average ~700)",
    )
    args = ap.parse_args()
    if args.block_size < 1:
        ap.error(f"--block-size: tokens per KV page must be a positive integer, got {args.block_size}")
    if args.context < 1:
        ap.error(f"--context: prompt tokens must be a positive integer, got {args.context}")
    if args.shape not in throughput.SHAPES:
        ap.error(f"--shape: unknown shape {args.shape!r}; known: {','.join(throughput.SHAPES)}")
    model = throughput.make_model(args.shape, args.layers)
    layers = model.config.num_hidden_layers
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    attn = vk.get_attention_impl()  # $VEXACT_ATTENTION; auto: FA4 where it is installed, which decodes slower
    if args.mixed:
        for pair in args.mixed.split(","):
            b, p = (int(x) for x in pair.split(":"))
            for graphs in (False, True):
                label = (
                    f"{args.shape}-shaped, {layers} layers, {attn} attention, pages of {args.block_size}, "
                    f"contexts {args.context}+"
                )
                profile_mixed(model, b, p, label, not args.no_pack, graphs, args.block_size, args.context)
        return
    for batch in (int(b) for b in args.batch.split(",")):
        label = (
            f"{args.shape}-shaped, {layers} layers, weights {'unpacked' if args.no_pack else 'packed'}, {attn} "
            f"attention, pages of {args.block_size}, contexts {args.context}+"
        )
        for draw in (False, True) if args.draw_in_graph else (False,):
            profile_batch(model, batch, weight_bytes, label, not args.no_pack, args.block_size, args.context, draw)


if __name__ == "__main__":
    main()
