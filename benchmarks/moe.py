"""Qwen3-MoE benchmark on the GPU: VeXact's invariant MoE against what a user could pick instead, in one run.

Sections (``--only kernel,decode,engine,trainer``; each is time-bounded, and a failure is reported in its place
without stopping the others):

- ``kernel``: ``fused_moe`` (invariant Triton grouped GEMM) at the Qwen3-30B-A3B layer shape (H 2048, I 768, 128
  experts, top-8, bf16, routing = softmax top-8 of random logits) at 1 .. 16384 tokens, against grouped cuBLAS (the
  same grouping: stable sort by expert, host-side counts, one ``torch.mm`` per expert for gate_up and down, the same
  silu-and-mul and fp32-weighted combine) and ``torch._grouped_mm`` (one grouped cuBLAS/CUTLASS call, groups padded
  to 16 rows as torchtitan does); the bound is max(expert bytes touched / copy bandwidth, FLOPs / bf16 mm peak), both
  measured in this run. Goal: ours >= 0.8x grouped cuBLAS at >= 4096 tokens.
- ``decode``: one decode step (one token per sequence, paged KV) of the 30B-A3B model (48 layers, or as many as fit)
  at batch 1 and 64, as a CUDA graph on the model forward + logits, and through the engine (``LLM.step``, host work
  included), against the bound: bytes of the weights the step reads (attention, router, lm_head, the experts its
  routing hits) / copy bandwidth. Goal <= 2x.
- ``engine``: engine output tokens/s of an 8-layer model of the 30B-A3B per-layer shape, invariant vs fast backend,
  with ``benchmarks/throughput.py``'s workload.
- ``trainer``: FSDP2 forward+backward tokens/s and MFU (6 x active params x tokens + causal attention) of a 4-layer
  model of the same shape, invariant vs fast, with ``benchmarks/trainer.py``'s batch and step.

Random weights are drawn on the GPU (``vexact_models.random_model(..., device="cuda")``: linear ~ N(0, 1/fan_in),
norms ~ 1 + N(0, 0.1^2), embeddings ~ N(0, 0.02^2)); values do not change the speed, the routing they produce is
recorded and used for the bounds.

Usage (on the GPU machine; the default run takes about 6-7 minutes on an H100, ``--quick`` about 2-3)::

    PYTHONPATH=<packages' src dirs>:. python benchmarks/moe.py [--quick] [--only kernel,decode] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import math
import statistics
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import hardware  # benchmarks/hardware.py: copy bandwidth, bf16 peaks and MFU
import torch
import torch.nn.functional as F

import vexact_kernels as vk
from vexact_engine import LLM, EngineConfig, SamplingParams
from vexact_models import QWEN3_MOE_SHAPES, AttentionMetadata, random_model, record_router, tiny_qwen3_moe_config

SHAPE_NAME = "qwen3-30b-a3b"
SECTIONS = ("kernel", "decode", "engine", "trainer")
# Each section's share of --budget-s; time a section leaves unused goes to the ones after it.
SECTION_SHARES = {"kernel": 80, "decode": 130, "engine": 120, "trainer": 90}
GIB = 2**30
DEV = torch.device("cuda")


def moe_config(layers: int, smoke: bool, **overrides):
    """The 30B-A3B shape with ``layers`` decoder layers (``smoke``: the tiny MoE, for a CPU run of the script)."""
    base = {} if smoke else dict(QWEN3_MOE_SHAPES[SHAPE_NAME])
    return tiny_qwen3_moe_config(**{**base, "num_hidden_layers": layers, **overrides})


# ---- timing


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize(DEV)


def free_memory() -> None:
    gc.collect()
    if DEV.type == "cuda":
        sync()
        torch.cuda.empty_cache()


class Budget:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def capture(fn):
    """``fn`` captured in a CUDA graph (after two eager warm-up calls on a side stream, which also compile the
    Triton kernels); returns ``(graph, output)``. The output keeps the graph's tensors alive."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def measure_ms(fn, iters: int = 20, warmup: int = 3, graph: bool = True) -> float:
    """Median ms of one call of ``fn``, each call bracketed by CUDA events; ``graph``: replayed from a CUDA graph
    (device time without Python launch overhead, as the engine's decode runs). On CPU: wall clock, eager."""
    if DEV.type != "cuda":
        fn()
        times = []
        for _ in range(max(1, iters // 4)):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    run, keep = fn, None
    if graph:
        g, out = capture(fn)
        run, keep = g.replay, (g, out)
    for _ in range(warmup):
        run()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        run()
        end.record()
    sync()
    del keep
    return statistics.median(s.elapsed_time(e) for s, e in events)


# ---- 1. the fused MoE kernel


def group_pairs(topk_ids: torch.Tensor, num_experts: int, align: int = 1) -> SimpleNamespace:
    """Host-side grouping of the (token, rank) pairs by expert (a stable sort, counts synced to the host), each
    expert's group padded to a multiple of ``align`` rows: ``src [rows]`` (the token each grouped row reads; pad
    rows read token 0), ``pair_row [T*k]`` (the grouped row of each pair), ``counts`` (padded, a host list),
    ``offs`` (int32 group ends on the device, for ``torch._grouped_mm``)."""
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    padded = [-(-c // align) * align for c in counts]
    start_sorted, start_padded, src_idx, dst_idx = 0, 0, [], []
    for c, p in zip(counts, padded, strict=True):
        src_idx.append(torch.arange(start_sorted, start_sorted + c))
        dst_idx.append(torch.arange(start_padded, start_padded + c))
        start_sorted, start_padded = start_sorted + c, start_padded + p
    dst = torch.cat(dst_idx).to(topk_ids.device)  # sorted position -> grouped row
    src = torch.zeros(start_padded, dtype=torch.int64, device=topk_ids.device)
    src[dst] = order // k
    pair_row = torch.empty_like(order)
    pair_row[order] = dst
    offs = torch.tensor(padded, device=topk_ids.device).cumsum(0).to(torch.int32)
    return SimpleNamespace(src=src, pair_row=pair_row, counts=padded, offs=offs, topk=k)


def _combine(y: torch.Tensor, topk_weights: torch.Tensor, plan: SimpleNamespace, dtype) -> torch.Tensor:
    t = topk_weights.shape[0]
    return (y[plan.pair_row].view(t, plan.topk, -1) * topk_weights.unsqueeze(-1)).sum(1).to(dtype)


def grouped_cublas_moe(x, w_gate_up, w_down, topk_weights, plan: SimpleNamespace) -> torch.Tensor:
    """The anchor: one ``torch.mm`` per expert for gate_up and for down over the expert's grouped rows, silu-and-mul,
    fp32-weighted combine (what a user writes around cuBLAS when the grouping is known on the host)."""
    inter = w_down.shape[2]
    xs = x[plan.src]  # [rows, H]
    h = torch.empty(xs.shape[0], 2 * inter, dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(plan.counts):
        if n:
            torch.mm(xs[start : start + n], w_gate_up[e].t(), out=h[start : start + n])
        start += n
    a = F.silu(h[:, :inter]) * h[:, inter:]
    y = torch.empty(xs.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(plan.counts):
        if n:
            torch.mm(a[start : start + n], w_down[e].t(), out=y[start : start + n])
        start += n
    return _combine(y, topk_weights, plan, x.dtype)


def torch_grouped_mm_moe(x, w_gate_up, w_down, topk_weights, plan: SimpleNamespace) -> torch.Tensor:
    """``torch._grouped_mm`` (bf16, sm90+) for both projections over groups padded to 16 rows (torchtitan's way)."""
    inter = w_down.shape[2]
    h = torch._grouped_mm(x[plan.src], w_gate_up.transpose(1, 2), offs=plan.offs)
    a = F.silu(h[:, :inter]) * h[:, inter:]
    y = torch._grouped_mm(a, w_down.transpose(1, 2), offs=plan.offs)
    return _combine(y, topk_weights, plan, x.dtype)


def bench_kernel(ctx, lines: list[str], budget: Budget) -> None:
    cfg = moe_config(3, ctx.smoke)  # sizes only
    hid, inter, num_e, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok
    copies = ctx.args.kernel_layers
    g = torch.Generator(DEV).manual_seed(ctx.args.seed)

    def weight(*shape):
        return torch.empty(shape, dtype=torch.bfloat16, device=DEV).normal_(0.0, shape[-1] ** -0.5, generator=g)

    # `copies` layers' worth of expert weights used in turn inside each timed call, so the experts a call touches
    # come from HBM as in a model (one layer's touched experts would otherwise partly stay in the 50 MB L2).
    w_gu = [weight(num_e, 2 * inter, hid) for _ in range(copies)]
    w_dn = [weight(num_e, hid, inter) for _ in range(copies)]
    use_gmm = DEV.type == "cuda" and not ctx.args.no_grouped_mm and hasattr(torch, "_grouped_mm")
    lines += [
        f"## 1. Fused MoE forward, {SHAPE_NAME} layer shape (H {hid}, I {inter}, {num_e} experts, top-{k}, bf16)",
        "",
        f"Routing: softmax top-{k} (renormalised) of N(0, 1) router logits, per token. Times are per layer: each "
        f"timed call runs {copies} layers (distinct weight copies) back to back, so touched experts stream from HBM; "
        "medians of CUDA-event-timed CUDA-graph replays unless marked eager. **ours** = `vk.fused_moe` (invariant "
        "backend), everything included (its on-device sort / expert offsets / tile schedule, both grouped GEMMs, "
        "silu-and-mul, combine). **cuBLAS** = grouped cuBLAS anchor: the rows gathered by a stable sort by expert, "
        "one `torch.mm` per expert for gate_up and for down, silu-and-mul, fp32-weighted combine; its sort and the "
        "host sync of the counts happen outside the timed graph (the eager column includes them). "
        "**_grouped_mm** = the same with `torch._grouped_mm` for each projection (groups padded to 16 rows). "
        "Bound = max(bytes of the touched experts (distinct experts x 3 x H x I x 2) / copy bandwidth, "
        "FLOPs (6 x T x k x H x I) / measured mm peak).",
        "",
        "| tokens | experts hit | ours ms | cuBLAS ms | ratio cuBLAS/ours | _grouped_mm ms | ours eager ms | "
        "cuBLAS eager ms (incl. sort + sync) | ours TFLOP/s | ours expert GB/s | bound ms | ours x bound | "
        "max abs diff vs cuBLAS |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    large, gmm_error = [], None
    for t in ctx.kernel_tokens:
        if budget.left() < 8:
            lines.append(f"| {t} | skipped: section time budget spent | | | | | | | | | | | |")
            continue
        print(f"[kernel] tokens {t}", flush=True)
        x = torch.randn(t, hid, device=DEV, dtype=torch.bfloat16, generator=g)
        logits = torch.randn(t, num_e, device=DEV, generator=g)
        with vk.use_backend("invariant"):
            tw, ids = vk.moe_route(logits, k, True)
        hit = int(ids.unique().numel())
        plan = group_pairs(ids, num_e)

        def ours(x=x, tw=tw, ids=ids):
            with vk.use_backend("invariant"):
                return [vk.fused_moe(x, w_gu[i], w_dn[i], tw, ids) for i in range(copies)]

        def anchor(x=x, tw=tw, plan=plan):
            return [grouped_cublas_moe(x, w_gu[i], w_dn[i], tw, plan) for i in range(copies)]

        def anchor_full(x=x, tw=tw, ids=ids):
            return [grouped_cublas_moe(x, w_gu[i], w_dn[i], tw, group_pairs(ids, num_e)) for i in range(copies)]

        diff = (ours()[0].float() - anchor()[0].float()).abs().max().item()
        t_ours = measure_ms(ours) / copies
        t_ref = measure_ms(anchor) / copies
        t_gmm = float("nan")
        if use_gmm:
            try:
                plan16 = group_pairs(ids, num_e, align=16)
                t_gmm = measure_ms(lambda x=x, tw=tw, p=plan16: [
                    torch_grouped_mm_moe(x, w_gu[i], w_dn[i], tw, p) for i in range(copies)
                ]) / copies  # fmt: skip
            except Exception as e:  # an older torch or another GPU: report, keep going
                use_gmm, gmm_error = False, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        t_ours_eager = measure_ms(ours, iters=10, graph=False) / copies
        t_ref_eager = measure_ms(anchor_full, iters=10, graph=False) / copies
        flops = 6 * t * k * hid * inter
        bytes_touched = hit * 3 * hid * inter * 2
        bound = max(bytes_touched / ctx.bw, flops / ctx.peak) * 1e3
        ratio = t_ref / t_ours
        if t >= 4096:
            large.append(ratio)
        lines.append(
            f"| {t} | {hit} | {t_ours:.4f} | {t_ref:.4f} | {ratio:.2f} | {t_gmm:.4f} | {t_ours_eager:.4f} | "
            f"{t_ref_eager:.4f} | {flops / t_ours / 1e9:.1f} | {bytes_touched / t_ours / 1e6:.0f} | {bound:.4f} | "
            f"{t_ours / bound:.2f} | {diff:.3g} |"
        )
        del x, logits, tw, ids, plan
    lines.append("")
    if large:
        gm = math.exp(sum(map(math.log, large)) / len(large))
        lines.append(
            f"ours / grouped cuBLAS speed at >= 4096 tokens: geometric mean **{gm:.2f}x**, min {min(large):.2f}x "
            "(goal >= 0.8x)"
        )
    if gmm_error:
        lines.append(f"`torch._grouped_mm` failed, column left NaN from then on: `{gmm_error}`")
    lines.append("")


# ---- 2. decode step of the full model


def weight_bytes_per_layer(cfg) -> tuple[int, int]:
    """(bf16 bytes of one sparse layer's non-expert weights, of one expert's three projections)."""
    hid, d = cfg.hidden_size, cfg.head_dim
    attn = hid * d * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads) + 2 * d + 2 * hid
    router = cfg.num_experts * hid
    return 2 * (attn + router), 2 * 3 * hid * cfg.moe_intermediate_size


def step_bytes(model, routed: list[torch.Tensor], batch: int) -> tuple[int, int]:
    """Bytes of the weights a decode step reads: every non-expert weight (attention, norms, router, dense MLPs,
    lm_head) except the embedding (only ``batch`` rows of it), plus the experts its routing hits; and the number of
    (layer, expert) pairs hit."""
    total = 0
    for name, p in model.named_parameters():
        if ".experts." in name:
            continue
        nbytes = p.numel() * p.element_size()
        total += batch * p.shape[1] * p.element_size() if "embed_tokens" in name else nbytes
    hit = sum(int(ids.unique().numel()) for ids in routed)
    cfg = model.config
    return total + hit * 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2, hit


def decode_inputs(cfg, batch: int, context: int, block_size: int, vocab: int, g):
    """One new token per sequence at position ``context`` (so ``context + 1`` keys), each sequence on its own pages,
    as ``ModelRunner`` lays out a decode step; returns ``(ids, positions, meta, pages per sequence)``."""
    pages = -(-(context + 1) // block_size)
    tables = torch.arange(batch * pages, device=DEV).view(batch, pages)
    meta = AttentionMetadata(
        cu_seqlens=torch.arange(batch + 1, device=DEV),
        slot_mapping=tables[:, context // block_size] * block_size + context % block_size,
        block_tables=tables,
        context_lens=torch.full((batch,), context + 1, device=DEV),
    )
    ids = torch.randint(0, vocab, (batch,), device=DEV, generator=g)
    return ids, torch.full((batch,), context, device=DEV), meta, pages


def engine_decode_ms(model, batches, context: int, steps: int) -> dict[int, float]:
    """Median ms of the engine's decode steps (``LLM.step``: schedule, padded CUDA-graph replay, sample, host sync)
    with ``batch`` sequences of ``context`` prompt tokens, for each of ``batches``; one engine for all."""
    block, budget_tokens = 16, 8192
    pages = -(-(context + steps + 2) // block)
    llm = LLM(
        model=model,
        config=EngineConfig(
            device=DEV.type, backend="invariant", max_num_seqs=max(batches), max_num_batched_tokens=budget_tokens,
            num_kv_blocks=max(batches) * pages + 8, max_model_len=context + steps + 2,
            cuda_graph_batch_sizes=sorted(set(batches)) if DEV.type == "cuda" else None,
        ),
    )  # fmt: skip
    out = {}
    try:
        for batch in batches:
            g = torch.Generator().manual_seed(batch)
            for i in range(batch):
                prompt = torch.randint(0, model.config.vocab_size, (context,), generator=g).tolist()
                llm.add_request(prompt, SamplingParams(max_tokens=steps + 1, seed=i, ignore_eos=True))
            prefill_steps = -(-batch * context // budget_tokens) + 2  # the last chunks mix with the first decodes
            times = []
            while llm.has_unfinished_requests():
                sync()
                t0 = time.perf_counter()
                llm.step()  # ends in a host sync (the sampled tokens)
                times.append((time.perf_counter() - t0) * 1e3)
            out[batch] = statistics.median(times[prefill_steps:] or times[-1:])
            print(
                f"[decode] engine batch {batch}: {out[batch]:.3f} ms/step ({llm.runner.num_graphs} graphs)", flush=True
            )
        return out
    finally:
        del llm
        free_memory()


def bench_decode(ctx, lines: list[str], budget: Budget) -> None:
    args = ctx.args
    full = moe_config(48 if not ctx.smoke else 3, ctx.smoke)
    layer_bytes, expert_bytes = weight_bytes_per_layer(full)
    per_layer = layer_bytes + full.num_experts * expert_bytes
    fixed = 2 * 2 * full.vocab_size * full.hidden_size
    layers = min(args.decode_layers, full.num_hidden_layers)
    note = ""
    if DEV.type == "cuda":
        free = torch.cuda.mem_get_info(DEV)[0]
        fit = int((free - 8 * GIB - fixed) // per_layer)  # 8 GiB: KV cache, activations, graphs, init temporaries
        if fit < layers:
            note = f" (the full model's {full.num_hidden_layers} layers do not fit next to the KV cache: {fit} do)"
            layers = max(1, fit)
    cfg = moe_config(layers, ctx.smoke)
    print(f"[decode] drawing {layers} layers' random weights on {DEV}", flush=True)
    t0 = time.perf_counter()
    model = random_model(cfg, seed=args.seed, embed_std=0.02, device=DEV)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    made = time.perf_counter() - t0
    lines += [
        f"## 2. Decode step, {SHAPE_NAME}, {layers} of {full.num_hidden_layers} layers{note}",
        "",
        f"{weights / GIB:.1f} GiB of bf16 weights drawn on the device by `random_model(cfg, embed_std=0.02, "
        f"device='cuda')` in {made:.0f} s. One new token per sequence at context {args.decode_context} (paged KV, "
        "page 16, each sequence on its own pages). **graph** = the model forward plus logits (`model.logits`, the "
        "lm_head) captured in one CUDA graph on paged-decode AttentionMetadata as `ModelRunner` captures its decode "
        "graphs, median of CUDA-event-timed replays (invariant backend). **engine step** = `LLM.step()` wall time "
        "at that batch (padded-decode CUDA graph, sampling with logits + logprobs, host scheduling and the host "
        f"sync; median of the decode steps of {args.decode_steps}). Bound = bytes of the weights the step reads "
        "(attention, norms, router and lm_head in full, the embedding rows of the batch, and the experts its "
        "routing hits in each layer: (layer, expert) pairs x 3 x H x I x 2) / copy bandwidth; the KV cache read is "
        "shown apart (not in the bound).",
        "",
        "| batch | (layer, expert) pairs hit | weight GB read | KV GB read | bound ms | graph ms | graph x bound | "
        "eager ms | engine step ms | engine x bound |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    g = torch.Generator(DEV).manual_seed(args.seed)
    batches = (1, 64) if not ctx.smoke else (1, 4)
    block = 16
    results = {}
    pages_max = -(-(args.decode_context + 1) // block)
    kv_shape = (max(batches) * pages_max, block, cfg.num_key_value_heads, cfg.head_dim)
    kv = [tuple(torch.zeros(kv_shape, dtype=torch.bfloat16, device=DEV) for _ in "kv") for _ in range(layers)]
    logits_in_graph = True
    for b in batches:
        if budget.left() < 20:
            lines.append(f"| {b} | skipped: section time budget spent | | | | | | | | |")
            continue
        print(f"[decode] batch {b}: graph", flush=True)
        ids, pos, meta, _ = decode_inputs(cfg, b, args.decode_context, block, cfg.vocab_size, g)

        def step(ids=ids, pos=pos, meta=meta, with_logits=True):
            with vk.use_backend("invariant"), torch.no_grad():
                hidden = model(ids, pos, meta, kv)
                return model.logits(hidden) if with_logits else hidden

        with record_router() as rec, torch.no_grad():
            step()
        nbytes, hit = step_bytes(model, [r.topk_ids for r in rec], b)
        if not logits_in_graph:
            nbytes -= model.lm_head.weight.numel() * 2
        try:
            t_graph = measure_ms(lambda s=step, w=logits_in_graph: s(with_logits=w))
        except Exception as e:  # logits not capturable: time the forward alone, and take lm_head out of the bound
            print(f"[decode] forward + logits capture failed ({type(e).__name__}: {e}); forward only", flush=True)
            logits_in_graph = False
            nbytes -= model.lm_head.weight.numel() * 2
            t_graph = measure_ms(lambda s=step: s(with_logits=False))
        t_eager = measure_ms(lambda s=step, w=logits_in_graph: s(with_logits=w), iters=5, warmup=1, graph=False)
        kv_bytes = b * (args.decode_context + 1) * layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
        results[b] = dict(hit=hit, nbytes=nbytes, kv=kv_bytes, bound=nbytes / ctx.bw * 1e3, graph=t_graph,
                          eager=t_eager)  # fmt: skip
    kv.clear()  # the engine below brings its own KV cache
    free_memory()
    engine: dict[int, float] = {}
    if results and budget.left() < 30:
        engine_note = "skipped (time)"
    elif results:
        print("[decode] engine steps", flush=True)
        try:
            engine = engine_decode_ms(model, list(results), args.decode_context, args.decode_steps)
            engine_note = "-"
        except Exception as e:
            engine_note = f"failed: `{type(e).__name__}: {str(e).splitlines()[0][:120]}`"
    for b, r in results.items():
        eng = engine.get(b)
        eng_s = f"{eng:.3f} | {eng / r['bound']:.2f}" if eng is not None else f"{engine_note} | -"
        lines.append(
            f"| {b} | {r['hit']} | {r['nbytes'] / 1e9:.2f} | {r['kv'] / 1e9:.3f} | {r['bound']:.3f} | "
            f"{r['graph']:.3f} | {r['graph'] / r['bound']:.2f} | {r['eager']:.3f} | {eng_s} |"
        )
    lines += ["", "Goal: graph <= 2x bound." + ("" if logits_in_graph else " (logits not captured: forward only.)"), ""]


# ---- 3. engine throughput


def bench_engine(ctx, lines: list[str], budget: Budget) -> None:
    args = ctx.args
    import throughput as tp  # benchmarks/throughput.py: its workload and engine loop are reused, not copied

    tp.DEV = DEV
    cfg = moe_config(args.engine_layers, ctx.smoke)
    model = random_model(cfg, seed=args.seed, embed_std=0.02, device=DEV)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    wl = SimpleNamespace(
        seed=args.seed, num_prompts=args.num_prompts, prompt_len=args.prompt_len, gen_len=args.gen_len,
        max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=False,
    )  # fmt: skip
    prompts, params = tp.workload(wl, cfg.vocab_size)
    limits = [int(x) for x in args.max_num_seqs.split(",")]
    lines += [
        f"## 3. Engine throughput, {args.engine_layers} layers of the {SHAPE_NAME} shape ({weights / GIB:.1f} GiB)",
        "",
        f"`benchmarks/throughput.py`'s workload and engine run (its `workload` and `engine_throughput`): "
        f"{args.num_prompts} random prompts of {args.prompt_len[0]}-{args.prompt_len[1]} tokens, "
        f"{args.gen_len[0]}-{args.gen_len[1]} generated tokens each (ignore_eos, temperature 1), "
        f"{args.max_num_batched_tokens} tokens per step, gpu_memory_utilization {args.gpu_memory_utilization}; wall "
        "time of `generate` after a warm-up, device synced at both ends. The fast backend's MoE (one `F.linear` "
        "per expert hit, the expert list synced to the host) cannot be captured: it runs with `enforce_eager` (no "
        "CUDA graphs, what the engine falls back to after a failed capture); the invariant backend decodes with "
        "CUDA graphs.",
        "",
        "| batch limit | backend | output tok/s | wall s | tokens | preemptions | KV pages | graphs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    res = {}
    for limit in limits:
        for mode in ("invariant", "fast"):
            if budget.left() < 25:
                lines.append(f"| {limit} | {mode} | skipped: section time budget spent | | | | | |")
                continue
            print(f"[engine] batch limit {limit}, {mode}", flush=True)
            # the fast MoE syncs with the host (its expert list), so its decode cannot be captured; the engine would
            # fall back to eager after a failed capture anyway: skip the attempt
            wl.enforce_eager = mode == "fast"
            try:
                r = tp.engine_throughput(model, mode, limit, prompts, params, wl)
            except Exception as e:
                lines.append(f"| {limit} | {mode} | failed: `{type(e).__name__}: {str(e).splitlines()[0][:150]}` "
                             "| | | | | |")  # fmt: skip
                free_memory()
                continue
            res[(limit, mode)] = r
            lines.append(
                f"| {limit} | {mode} | {r['tok_s']:.0f} | {r['wall']:.1f} | {r['tokens']} | {r['preemptions']} | "
                f"{r['kv_pages']} | {r['graphs']} |"
            )
    lines += ["", "| batch limit | invariant / fast tok/s |", "|---|---|"]
    for limit in limits:
        inv, fast = res.get((limit, "invariant")), res.get((limit, "fast"))
        lines.append(f"| {limit} | {inv['tok_s'] / fast['tok_s']:.2f} |" if inv and fast else f"| {limit} | - |")
    lines.append("")
    del model
    free_memory()


# ---- 4. trainer forward + backward


def active_params(cfg) -> int:
    """Parameters one token multiplies through: attention, router, its k experts per layer, and the lm_head (the
    embedding is a lookup)."""
    hid, d = cfg.hidden_size, cfg.head_dim
    attn = hid * d * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    per_layer = attn + cfg.num_experts * hid + cfg.num_experts_per_tok * 3 * hid * cfg.moe_intermediate_size
    return cfg.num_hidden_layers * per_layer + cfg.vocab_size * hid


def bench_trainer(ctx, lines: list[str], budget: Budget) -> None:
    import torch.distributed as dist

    from vexact_trainer import Actor, ActorConfig, init_distributed, parallelize

    args = ctx.args
    import trainer as tb  # benchmarks/trainer.py: its batch and step are reused, not copied

    mesh = init_distributed(DEV.type)
    cfg = moe_config(args.trainer_layers, ctx.smoke, torch_dtype="float32")
    # fp32 master weights (FSDP2 computes in bf16), drawn on the device
    model = random_model(cfg, seed=args.seed, embed_std=0.02, device=DEV).requires_grad_(True).train()
    parallelize(model, mesh)
    batch, mask, adv = tb.make_batch(cfg.vocab_size, args.seqs, args.mean_len, seed=args.seed)
    batch, mask, adv = batch.to(DEV), mask.to(DEV), adv.to(DEV)
    tokens = batch.input_ids.numel()
    backends = ("fast", "invariant")
    actors = {b: Actor(model, ActorConfig(backend=b)) for b in backends}

    def step_ms(b: str) -> float:
        if DEV.type != "cuda":
            t0 = time.perf_counter()
            tb.fwd_bwd(model, actors[b], batch, mask, adv)
            return (time.perf_counter() - t0) * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        tb.fwd_bwd(model, actors[b], batch, mask, adv)
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    times: dict[str, list[float]] = {b: [] for b in backends}
    peak = {}
    for b in backends:
        print(f"[trainer] warm-up {b}", flush=True)
        if DEV.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for _ in range(args.warmup):
            step_ms(b)
        peak[b] = torch.cuda.max_memory_allocated() / GIB if DEV.type == "cuda" else float("nan")
    for r in range(args.rounds):
        if budget.left() < 15 and r > 0:
            break
        for b in backends:
            print(f"[trainer] round {r + 1}, {b}", flush=True)
            times[b] += [step_ms(b) for _ in range(args.iters)]
    lens = batch.seq_lens
    flops = 6 * active_params(cfg) * tokens
    flops += 6 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * sum(n * n for n in lens)
    spec = hardware.device_datasheet_peak(DEV)
    spec_s = f"the data-sheet dense bf16 peak ({spec / 1e12:.0f} TFLOP/s) and " if spec else ""
    lines += [
        f"## 4. Trainer forward+backward, {args.trainer_layers} layers of the {SHAPE_NAME} shape",
        "",
        f"`benchmarks/trainer.py`'s step (`make_batch`, `fwd_bwd`: FSDP2 world size {dist.get_world_size()}, bf16 "
        f"params / fp32 reduce / fp32 master, `model.logprobs` on every position, PPO-clip loss, backward; no "
        f"optimizer step); {args.seqs} packed sequences, {tokens} tokens (lengths {min(lens)}..{max(lens)}); "
        f"median of {len(times['fast'])} CUDA-event-timed steps per backend after {args.warmup} warm-up, "
        f"alternating backends by round. FLOPs per step {flops / 1e12:.2f} T = 6 x {active_params(cfg) / 1e9:.3f} "
        f"B active params (attention, router, top-{cfg.num_experts_per_tok} experts, lm_head) x tokens + causal "
        f"attention 6 x layers x heads x head_dim x sum(len^2). MFU against {spec_s}the measured `torch.mm` peak "
        f"({ctx.peak / 1e12:.0f} TFLOP/s).",
        "",
        "| backend | ms / step | tokens/s | TFLOP/s | MFU (data sheet) | MFU (measured mm peak) | peak GiB |",
        "|---|---|---|---|---|---|---|",
    ]
    med = {b: statistics.median(times[b]) for b in backends}
    for b in backends:
        tflops = flops / (med[b] * 1e-3)
        mfu = f"{hardware.mfu(flops, med[b] * 1e-3, spec):.1%}" if spec else "-"
        lines.append(
            f"| {b} | {med[b]:.1f} | {tokens / (med[b] * 1e-3):,.0f} | {tflops / 1e12:.1f} | {mfu} | "
            f"{hardware.mfu(flops, med[b] * 1e-3, ctx.peak):.1%} | {peak[b]:.1f} |"
        )
    lines += ["", f"invariant / fast tokens/s: **{med['fast'] / med['invariant']:.2f}x**", ""]


# ---- main


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help=f"comma-separated sections of {','.join(SECTIONS)} (default: all)")
    ap.add_argument("--out", help="also write the markdown report here (rewritten after every section)")
    ap.add_argument("--quick", action="store_true", help="smaller settings everywhere (about 2-3 minutes)")
    ap.add_argument("--budget-s", type=float, default=420, help="time for all sections, shared out by weight")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kernel-tokens", default="1,8,64,512,4096,16384")
    ap.add_argument("--kernel-layers", type=int, default=4, help="weight copies used in turn per timed call")
    ap.add_argument("--no-grouped-mm", action="store_true", help="skip the torch._grouped_mm column")
    ap.add_argument("--decode-layers", type=int, default=48, help="capped by what fits next to the KV cache")
    ap.add_argument("--decode-context", type=int, default=512)
    ap.add_argument("--decode-steps", type=int, default=24, help="engine decode steps per batch size")
    ap.add_argument("--engine-layers", type=int, default=8)
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[128, 512], metavar=("LO", "HI"))
    ap.add_argument("--gen-len", type=int, nargs=2, default=[128, 256], metavar=("LO", "HI"))
    ap.add_argument("--max-num-seqs", default="32,128", help="comma-separated engine batch limits")
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--trainer-layers", type=int, default=4)
    ap.add_argument("--seqs", type=int, default=8, help="trainer: sequences per packed batch")
    ap.add_argument("--mean-len", type=int, default=1024, help="trainer: mean sequence length")
    ap.add_argument("--warmup", type=int, default=2, help="trainer warm-up steps per backend")
    ap.add_argument("--rounds", type=int, default=3, help="trainer rounds alternating the backends")
    ap.add_argument("--iters", type=int, default=3, help="trainer timed steps per backend and round")
    ap.add_argument("--cpu-smoke", action="store_true", help=argparse.SUPPRESS)  # tiny shapes on CPU: script bugs
    args = ap.parse_args(argv)
    if args.quick:
        args.kernel_tokens, args.kernel_layers = "1,64,4096", 2
        args.decode_layers, args.decode_steps = 8, 8
        args.engine_layers, args.num_prompts, args.gen_len, args.max_num_seqs = 2, 32, [32, 64], "32"
        args.trainer_layers, args.seqs, args.mean_len, args.rounds, args.iters = 2, 4, 512, 1, 2
    if args.cpu_smoke:
        args.kernel_tokens, args.kernel_layers = "1,8,33", 2
        args.decode_layers, args.decode_context, args.decode_steps = 3, 40, 4
        args.engine_layers, args.num_prompts, args.prompt_len, args.gen_len = 3, 4, [8, 16], [4, 8]
        args.max_num_seqs, args.max_num_batched_tokens = "2,4", 64
        args.trainer_layers, args.seqs, args.mean_len, args.warmup, args.rounds, args.iters = 3, 2, 16, 1, 1, 1
    wanted = [s for s in args.only.split(",") if s] or list(SECTIONS)
    bad = [s for s in wanted if s not in SECTIONS]
    if bad:
        ap.error(f"--only: unknown section(s) {bad}; choose from {list(SECTIONS)}")
    args.sections = [s for s in SECTIONS if s in wanted]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    global DEV
    DEV = torch.device("cpu" if args.cpu_smoke else "cuda")
    if DEV.type == "cuda" and not torch.cuda.is_available():
        print("benchmarks/moe.py needs a CUDA device (no CUDA here); --help lists the options", file=sys.stderr)
        return 2
    import triton

    t_start = time.monotonic()
    device = torch.cuda.get_device_name() if DEV.type == "cuda" else "CPU (smoke run, tiny shapes)"
    ctx = SimpleNamespace(
        args=args, smoke=args.cpu_smoke, kernel_tokens=[int(t) for t in args.kernel_tokens.split(",")]
    )
    print("[setup] copy bandwidth and mm peak", flush=True)
    ctx.bw, ctx.peak = hardware.copy_bandwidth(DEV), hardware.matmul_peak(DEV)
    lines = [
        f"# Qwen3-MoE benchmark ({device}, {datetime.date.today()})",
        "",
        f"torch {torch.__version__}, triton {triton.__version__}; run: `{' '.join(sys.argv)}`",
        "",
        f"Measured in this run: device-to-device copy bandwidth {ctx.bw / 1e9:.0f} GB/s (2 GiB copy, bytes read + "
        f"written, as benchmarks/throughput.py); bf16 `torch.mm` 8192^3: {ctx.peak / 1e12:.0f} TFLOP/s.",
        "",
    ]
    print("\n".join(lines), flush=True)

    def write() -> None:
        if args.out:
            Path(args.out).write_text("\n".join(lines) + "\n")

    write()
    fns = {"kernel": bench_kernel, "decode": bench_decode, "engine": bench_engine, "trainer": bench_trainer}
    pending = list(args.sections)
    budget_end = t_start + args.budget_s
    for name in args.sections:
        share = SECTION_SHARES[name] / sum(SECTION_SHARES[s] for s in pending)
        seconds = max(30.0, (budget_end - time.monotonic()) * share)
        pending.remove(name)
        start, t0 = len(lines), time.monotonic()
        print(f"[{name}] start, {seconds:.0f} s budget", flush=True)
        try:
            fns[name](ctx, lines, Budget(seconds))
        except Exception as e:
            tb = traceback.format_exc().strip().splitlines()[-12:]
            lines += ["", f"**Section {name} failed**: `{type(e).__name__}: {str(e).splitlines()[0][:300]}`", "",
                      "```", *tb, "```", ""]  # fmt: skip
        finally:
            free_memory()
        lines += [f"_{name}: {time.monotonic() - t0:.0f} s of {seconds:.0f} s budgeted_", ""]
        print("\n".join(lines[start:]), flush=True)
        write()
    if "trainer" in args.sections:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    print(f"[done] {time.monotonic() - t_start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
