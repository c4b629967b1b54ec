"""Engine throughput on the GPU, side by side in one run (prints a markdown report; ``--out`` also writes it).

For each model shape (Qwen3-1.7B and/or 0.6B, random bf16 weights, real HF config shapes):
- output tokens/s of the engine on the ``invariant`` backend, on the ``fast`` backend (cuBLAS + SDPA), and of HF
  transformers ``generate`` (same weights, bf16, sdpa attention, left-padded batches), with ratios; goals:
  invariant >= 0.85x fast and >= 10x HF generate;
- decode step time at batch 1 against the bound ``weight bytes / copy bandwidth`` (bandwidth of a device-to-device
  copy measured in the same run, bytes read + written); goal <= 1.3x;
- a GRPO-shaped row: ``--grpo-prompts`` prompts of ``--grpo-prompt-len LO HI`` tokens, each sampled ``--grpo-n``
  times (n requests share a prompt, distinct seeds), with prefix caching on and off: output tokens/s, the prompt
  tokens served from the cache (hit rate), and whether on and off gave the same tokens and logprobs (torch.equal).

Workload: ``--num-prompts`` random prompts of ``--prompt-len LO HI`` tokens, each generating a length drawn from
``--gen-len LO HI`` (ignore_eos, so lengths are exact), at each ``--max-num-seqs``. HF generate runs one left-padded
batch of ``--hf-prompts`` prompts for ``--hf-new-tokens`` tokens (it cannot stop rows early; only real tokens
count). The defaults finish in about 3-4 minutes on an H100 (most of it the two engines at two batch sizes).

Usage: ``PYTHONPATH=<packages' src dirs>:. python benchmarks/throughput.py [--models 1.7b,0.6b] [--num-prompts 64]
[--prompt-len 128 512] [--gen-len 128 256] [--max-num-seqs 64] [--modes invariant,fast,hf] [--grpo-prompts 32]
[--out results.md]`` (``--grpo-prompts 0`` skips the GRPO row).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import sys
import time

import torch
from tqdm.auto import tqdm

from vexact_engine import LLM, SamplingParams
from vexact_models import QWEN3_SHAPES, Qwen3ForCausalLM, tiny_qwen3_config

SHAPES = {
    # for a CPU smoke run of the script only
    "tiny": dict(rope_theta=1_000_000.0, tie_word_embeddings=True),  # tiny_qwen3_config's sizes
    "0.6b": QWEN3_SHAPES["qwen3-0.6b"],
    "1.7b": QWEN3_SHAPES["qwen3-1.7b"],
}
GIB = 2**30
DEV = torch.device("cuda")


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize(DEV)


def make_model(shape: str, layers: int, seed: int = 0) -> Qwen3ForCausalLM:
    """Random bf16 weights drawn on the GPU (drawing 1.7B numbers on the host would take most of the budget)."""
    cfg = tiny_qwen3_config(**{**SHAPES[shape], "num_hidden_layers": layers, "torch_dtype": "bfloat16"})
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    model = model.to_empty(device=DEV)
    fresh = type(model.model.rotary_emb)(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
    model.model.rotary_emb.cos, model.model.rotary_emb.sin = fresh.cos.to(DEV), fresh.sin.to(DEV)
    model.lm_head.weight = model.model.embed_tokens.weight
    g = torch.Generator(device=DEV).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.1, generator=g)
            elif "embed_tokens" in name:
                p.normal_(0.0, 0.02, generator=g)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5, generator=g)
    return model.eval().requires_grad_(False)


def copy_bandwidth() -> float:
    """Bytes/s of a 2 GiB device-to-device copy, counting bytes read and written."""
    numel = 1 << 30 if DEV.type == "cuda" else 1 << 24
    src = torch.empty(numel, dtype=torch.int16, device=DEV).random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync()
    n = 20
    t = time.perf_counter()
    for _ in range(n):
        dst.copy_(src)
    sync()
    return 2 * src.numel() * src.element_size() * n / (time.perf_counter() - t)


def workload(args, vocab: int):
    g = torch.Generator().manual_seed(args.seed)
    lo, hi = args.prompt_len
    glo, ghi = args.gen_len
    prompts, params = [], []
    for i in range(args.num_prompts):
        n = int(torch.randint(lo, hi + 1, (1,), generator=g))
        prompts.append(torch.randint(0, vocab, (n,), generator=g).tolist())
        params.append(
            SamplingParams(
                temperature=1.0, top_p=1.0, max_tokens=int(torch.randint(glo, ghi + 1, (1,), generator=g)), seed=i,
                ignore_eos=True,
            )
        )  # fmt: skip
    return prompts, params


def free_memory() -> None:
    gc.collect()
    if DEV.type == "cuda":
        sync()
        torch.cuda.empty_cache()


def engine_throughput(model, mode: str, max_num_seqs: int, prompts, params, args, keep_outputs=False, **kw) -> dict:
    kw.setdefault("max_model_len", args.prompt_len[1] + args.gen_len[1])
    llm = LLM(
        model=model, backend=mode, max_num_seqs=max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager, **kw,
    )  # fmt: skip
    warm = prompts[:4]
    llm.generate(warm, [SamplingParams(max_tokens=8, seed=1, ignore_eos=True)] * len(warm), use_tqdm=False)  # warm up
    llm.reset_prefix_cache()  # the timed run must not find the warm-up's prompts cached
    before = llm.stats
    sync()
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    sync()
    wall = time.perf_counter() - t
    tokens = sum(len(o.token_ids) for o in outs)
    assert tokens == sum(p.max_tokens for p in params), "a request came back short"
    stats = {k: v - before[k] for k, v in llm.stats.items() if k.endswith("prompt_tokens")}
    res = dict(
        tokens=tokens, wall=wall, tok_s=tokens / wall, preemptions=llm.num_preemptions,
        kv_pages=llm.blocks.num_blocks, graphs=llm.runner.num_graphs, **stats,
        outputs=outs if keep_outputs else None,
    )  # fmt: skip
    del llm, outs
    free_memory()
    return res


def grpo_workload(args, vocab: int):
    """``--grpo-prompts`` prompts, each repeated ``--grpo-n`` times with its own seed (one GRPO group each)."""
    g = torch.Generator().manual_seed(args.seed + 1)
    lo, hi = args.grpo_prompt_len
    glo, ghi = args.grpo_gen_len
    prompts, params = [], []
    for i in range(args.grpo_prompts):
        prompt = torch.randint(0, vocab, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()
        for j in range(args.grpo_n):
            max_tokens = int(torch.randint(glo, ghi + 1, (1,), generator=g))
            prompts.append(prompt)
            params.append(SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=i * args.grpo_n + j,
                                         ignore_eos=True))  # fmt: skip
    return prompts, params


def grpo_rows(model, modes, args) -> list[str]:
    """The GRPO-shaped workload with prefix caching on and off, per engine mode: a markdown table."""
    prompts, params = grpo_workload(args, model.config.vocab_size)
    limit = args.grpo_max_num_seqs
    lines = [
        f"GRPO-shaped: {args.grpo_prompts} prompts of {args.grpo_prompt_len[0]}-{args.grpo_prompt_len[1]} tokens, "
        f"n = {args.grpo_n} samples each ({len(prompts)} requests), {args.grpo_gen_len[0]}-{args.grpo_gen_len[1]} "
        f"generated tokens each, batch limit {limit}, {args.max_num_batched_tokens} tokens per step.",
        "",
        "| mode | prefix caching | output tok/s | wall s | prompt tokens | from cache | preemptions | on / off | "
        "on == off (torch.equal) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    max_len = args.grpo_prompt_len[1] + args.grpo_gen_len[1]
    for mode in modes:
        runs = {}
        for caching in (True, False):
            runs[caching] = engine_throughput(model, mode, limit, prompts, params, args, keep_outputs=True,
                                              max_model_len=max_len, enable_prefix_caching=caching)  # fmt: skip
        on, off = runs[True], runs[False]
        same = all(a.token_ids == b.token_ids and torch.equal(a.logprobs, b.logprobs)
                   for a, b in zip(on["outputs"], off["outputs"], strict=True))  # fmt: skip
        for caching, r in runs.items():
            hit = r["cached_prompt_tokens"] / max(1, r["prompt_tokens"])
            ratio = f"{on['tok_s'] / off['tok_s']:.2f}" if caching else "-"
            lines.append(
                f"| {mode} | {'on' if caching else 'off'} | {r['tok_s']:.0f} | {r['wall']:.1f} | {r['prompt_tokens']} "
                f"| {r['cached_prompt_tokens']} ({hit:.0%}) | {r['preemptions']} | {ratio} | "
                f"{('yes' if same else 'NO') if caching else '-'} |"
            )
        del runs, on, off
        free_memory()
    return lines + [""]


def decode_step_time(model, mode: str, args) -> float:
    """Median seconds of one decode step at batch 1 (host work included: schedule, prepare, sample, sync)."""
    llm = LLM(model=model, backend=mode, max_num_seqs=1, max_model_len=1024, num_kv_blocks=128,
              enforce_eager=args.enforce_eager)  # fmt: skip
    llm.add_request(list(range(1, 129)), SamplingParams(max_tokens=args.decode_steps + 1, seed=0, ignore_eos=True))
    llm.step()  # prefill
    times = []
    while llm.has_unfinished_requests():
        sync()
        t = time.perf_counter()
        llm.step()
        times.append(time.perf_counter() - t)
    del llm
    free_memory()
    return sorted(times[2:])[len(times[2:]) // 2]


def hf_throughput(model, prompts, args) -> dict:
    import transformers

    hf_cfg = transformers.Qwen3Config(**model.config.to_hf_dict())
    hf_cfg._attn_implementation = "sdpa"
    with torch.device(DEV):
        hf = transformers.Qwen3ForCausalLM(hf_cfg).to(torch.bfloat16).eval()
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all(m == "lm_head.weight" for m in missing), (missing, unexpected)
    hf.tie_weights()
    batch = prompts[: args.hf_prompts]
    width = max(len(p) for p in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(batch):  # left padding
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(DEV), mask.to(DEV)
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        hf.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=4, **kw)  # warm up
        sync()
        t = time.perf_counter()
        n = args.hf_new_tokens
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, **kw)
        sync()
        wall = time.perf_counter() - t
    tokens = (out.shape[1] - width) * len(batch)
    del hf, out
    free_memory()
    return dict(tokens=tokens, wall=wall, tok_s=tokens / wall)


def base_rows(model, weight_bytes: int, bw: float, modes, batch_limits, args) -> list[str]:
    """The random workload at each batch limit per mode (and HF generate), ratios, and the batch-1 decode step."""
    prompts, params = workload(args, model.config.vocab_size)
    lines: list[str] = []
    lines += ["| batch limit | mode | output tok/s | wall s | tokens | preemptions | KV pages | graphs |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    results: dict[tuple[int, str], dict] = {}
    for limit in batch_limits:
        for mode in (m for m in modes if m != "hf"):
            r = engine_throughput(model, mode, limit, prompts, params, args)
            results[(limit, mode)] = r
            lines.append(
                f"| {limit} | {mode} | {r['tok_s']:.0f} | {r['wall']:.1f} | {r['tokens']} | {r['preemptions']} "
                f"| {r['kv_pages']} | {r['graphs']} |"
            )
    hf = hf_throughput(model, prompts, args) if "hf" in modes else None
    if hf:
        lines.append(f"| {args.hf_prompts} (one batch) | HF generate | {hf['tok_s']:.0f} | {hf['wall']:.1f} | "
                     f"{hf['tokens']} | - | - | - |")  # fmt: skip
    lines += ["", "| batch limit | invariant / fast (goal >= 0.85) | invariant / HF generate (goal >= 10) |",
              "| --- | --- | --- |"]  # fmt: skip
    for limit in batch_limits:
        inv, fast = results.get((limit, "invariant")), results.get((limit, "fast"))
        r_fast = f"{inv['tok_s'] / fast['tok_s']:.2f}" if inv and fast else "-"
        r_hf = f"{inv['tok_s'] / hf['tok_s']:.1f}" if inv and hf else "-"
        lines.append(f"| {limit} | {r_fast} | {r_hf} |")
    bound = weight_bytes / bw
    lines += ["", f"Decode step at batch 1 (median of {args.decode_steps}, host work included); bound = weight "
              f"bytes / copy bandwidth = {bound * 1e3:.3f} ms (goal <= 1.3x)", "",
              "| mode | step ms | x bound |", "| --- | --- | --- |"]  # fmt: skip
    for mode in (m for m in modes if m != "hf"):
        t = decode_step_time(model, mode, args)
        lines.append(f"| {mode} | {t * 1e3:.3f} | {t / bound:.2f} |")
    lines.append("")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="1.7b", help=f"comma-separated shapes from {','.join(SHAPES)}")
    ap.add_argument("--layers", type=int, default=28, help="decoder layers (28 in both real models)")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[128, 1024], metavar=("LO", "HI"))
    ap.add_argument("--gen-len", type=int, nargs=2, default=[256, 512], metavar=("LO", "HI"))
    ap.add_argument("--max-num-seqs", default="64,256", help="comma-separated batch limits")
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--modes", default="invariant,fast,hf")
    ap.add_argument("--hf-prompts", type=int, default=64, help="prompts in HF generate's one batch")
    ap.add_argument("--hf-new-tokens", type=int, default=256)
    ap.add_argument("--grpo-prompts", type=int, default=32, help="GRPO row: prompts (0: no GRPO row)")
    ap.add_argument("--grpo-n", type=int, default=8, help="GRPO row: samples per prompt")
    ap.add_argument("--grpo-prompt-len", type=int, nargs=2, default=[512, 2048], metavar=("LO", "HI"))
    ap.add_argument("--grpo-gen-len", type=int, nargs=2, default=[128, 512], metavar=("LO", "HI"))
    ap.add_argument("--grpo-max-num-seqs", type=int, default=256, help="GRPO row: batch limit")
    ap.add_argument("--grpo-only", action="store_true", help="only the GRPO-shaped row")
    ap.add_argument("--decode-steps", type=int, default=64, help="decode steps timed at batch 1")
    ap.add_argument("--enforce-eager", action="store_true", help="engine without CUDA graphs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="also write the markdown report to this file")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only to smoke-test the script with --models tiny")
    args = ap.parse_args(argv)
    global DEV
    DEV = torch.device(args.device)
    if DEV.type == "cuda" and not torch.cuda.is_available():
        print("throughput.py needs a CUDA device", file=sys.stderr)
        return 2
    modes = args.modes.split(",")
    batch_limits = [int(x) for x in args.max_num_seqs.split(",")]
    lines = [
        f"# Engine throughput ({torch.cuda.get_device_name() if DEV.type == 'cuda' else 'CPU'}, "
        f"{datetime.date.today()}, torch {torch.__version__})",
        "",
        f"Run: `{' '.join(sys.argv)}`",
        "",
        f"Workload: {args.num_prompts} prompts of {args.prompt_len[0]}-{args.prompt_len[1]} tokens, "
        f"{args.gen_len[0]}-{args.gen_len[1]} generated tokens each (ignore_eos; temperature 1), batch limits "
        f"{batch_limits}, {args.max_num_batched_tokens} tokens per step, CUDA graphs "
        f"{'off' if args.enforce_eager else 'on'}. HF generate: one left-padded batch of {args.hf_prompts} of the "
        f"same prompts, {args.hf_new_tokens} new tokens each, sdpa attention, bf16. Random weights, "
        f"{args.layers} layers.",
        "",
    ]
    bw = copy_bandwidth()
    lines += [f"Device-to-device copy bandwidth (read + write): {bw / 1e9:.0f} GB/s", ""]
    for shape in tqdm(args.models.split(","), desc="models"):
        model = make_model(shape, args.layers, seed=args.seed)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        lines += [f"## Qwen3-{shape.upper()}-shaped ({weight_bytes / GIB:.2f} GiB of bf16 weights)", ""]
        if not args.grpo_only:
            lines += base_rows(model, weight_bytes, bw, modes, batch_limits, args)
        if args.grpo_prompts > 0:
            lines += grpo_rows(model, [m for m in modes if m != "hf"], args)
        del model
        free_memory()
    report = "\n".join(lines)
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
