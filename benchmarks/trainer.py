"""Trainer forward+backward throughput: invariant kernels vs the fast backend, on a Qwen3-1.7B-shaped model.

``--forward-only`` times verl's ``old_log_prob`` pass instead: the forward and ``model.logprobs`` with the entropy,
under ``torch.no_grad`` (model FLOPs: 2 x matmul weights x tokens + causal attention's forward).

The trainer's real path: FSDP2 (world size 1 unless run under a larger torchrun; bf16 params, fp32 reduce, fp32
master), a packed batch of mixed-length sequences, ``model.logprobs`` on every position, PPO-clip loss, backward.
The optimizer step is not timed (it is elementwise and the same for both backends). Random weights (values do not
change the speed); both backends run the same model, batch and loss, alternating rounds so clocks and caches treat
them alike. Prints a markdown table with MFU (model FLOPs over the bf16 matmul peak measured in the same run, goal
>= 40%) and the ratio ``invariant / fast`` tokens/s (goal >= 0.80); ``fast`` is the plain PyTorch path a verl user
gets (cuBLAS, torch's causal SDPA with GQA, chunked logprobs).

Usage (on the GPU machine)::

    torchrun --standalone --nproc_per_node=1 benchmarks/trainer.py --out benchmarks/results/trainer-h100.md
    # or: PYTHONPATH=<packages' src dirs>:. python benchmarks/trainer.py
"""

from __future__ import annotations

import argparse
import datetime
import math
import statistics
import time

import hardware  # benchmarks/hardware.py: the measured bf16 peak and MFU
import torch
import torch.distributed as dist

from vexact_models import QWEN3_SHAPES, Qwen3ForCausalLM, tiny_qwen3_config
from vexact_trainer import Actor, ActorConfig, init_distributed, pack, parallelize, ppo_clip_loss


def build_model(shape: str, seed: int, device: str) -> Qwen3ForCausalLM:
    """fp32 master weights initialised on the device (fast), scaled like vexact_models.random_model."""
    cfg = tiny_qwen3_config(**QWEN3_SHAPES.get(shape, {}), torch_dtype="float32")
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.normal_(1.0, 0.1, generator=g)
            elif "embed_tokens" in name:
                p.normal_(0.0, 0.02, generator=g)
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=g)
    return model


def make_batch(vocab: int, n_seqs: int, mean_len: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(mean_len // 2, mean_len * 3 // 2 + 1, (n_seqs,), generator=g).tolist()
    prompts, responses = [], []
    for n in lens:
        p = max(1, n // 4)  # a quarter prompt, the rest response (loss on the response only)
        seq = torch.randint(0, vocab, (n,), generator=g).tolist()
        prompts.append(seq[:p])
        responses.append(seq[p:])
    batch = pack(prompts, responses, vocab, 1 << 30)
    mask = torch.zeros(sum(lens))
    start = 0
    for p, n in zip(batch.prompt_lens, batch.seq_lens, strict=True):
        mask[start + p - 1 : start + n - 1] = 1
        start += n
    adv = torch.randn(sum(lens), generator=g)
    return batch, mask, adv


def fwd_bwd(model, actor: Actor, batch, mask, adv) -> None:
    lp, _ = actor.forward_packed(batch, 1.0)
    loss = ppo_clip_loss(lp, lp.detach(), adv, mask).loss
    loss.backward()
    model.zero_grad(set_to_none=True)


def fwd_only(model, actor: Actor, batch, mask, adv) -> None:
    """verl's old_log_prob pass: logprobs and entropy of every position, no graph kept."""
    with torch.no_grad():
        actor.forward_packed(batch, 1.0, with_entropy=True)


def model_flops(model, seq_lens: list[int], forward_only: bool = False) -> float:
    """FLOPs of one forward+backward: 6 x (matmul weights, lm_head included: logprobs on every position) x tokens,
    plus causal attention (QK^T and PV over half of each sequence's n^2 scores, backward 2.5x the forward, as in
    benchmarks/attention.py). Norms, rotary and the elementwise ops are left out, as MFU conventions do.
    ``forward_only``: 2 x matmul weights x tokens plus the attention's forward."""
    cfg = model.config
    matmul = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in n)
    if cfg.tie_word_embeddings:
        matmul += cfg.vocab_size * cfg.hidden_size  # the tied head is a matmul too
    tokens = sum(seq_lens)
    attn_fwd = sum(2 * n * n * cfg.head_dim * cfg.num_attention_heads for n in seq_lens) * cfg.num_hidden_layers
    if forward_only:
        return 2 * matmul * tokens + attn_fwd
    return 6 * matmul * tokens + 3.5 * attn_fwd


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_steps(fn, iters: int) -> list[float]:
    out = []
    for _ in range(iters):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        out.append(time.perf_counter() - t0)
    return out


def profile_backends(model, actors, batch, mask, adv, steps: int, med: dict[str, float], step=fwd_bwd) -> list[str]:
    """Per backend: the GPU kernels of ``steps`` profiled steps, beside the step time measured before."""
    import profiling  # benchmarks/profiling.py
    from torch.profiler import ProfilerActivity, profile

    out = ["", "## Where a step's time goes (torch.profiler, GPU kernels per step)", ""]
    for b, actor in actors.items():
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            for _ in range(steps):
                step(model, actor, batch, mask, adv)
            _sync()
        out += [f"### {b}: {med[b] * 1e3:.1f} ms a step (timed above)", "", "```"]
        out += profiling.kernel_table(prof, steps, top=24) + ["```", ""]
        # the host side (stdout only): what the step's Python and launches cost, and where it waits for the GPU
        print(f"host ops, {b} ({steps} steps):", prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
        by_shape = prof.key_averages(group_by_input_shape=True)
        print(f"ops by input shape, {b}:", by_shape.table(sort_by="self_device_time_total", row_limit=40))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--shape", default="qwen3-1.7b", choices=sorted(QWEN3_SHAPES) + ["tiny"], help="tiny: CPU smoke run"
    )
    ap.add_argument("--seqs", type=int, default=8, help="sequences per packed batch")
    ap.add_argument("--mean-len", type=int, default=1024, help="mean sequence length (uniform in [0.5, 1.5] x)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds alternating the backends")
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--out", default=None, help="write the markdown table here (rank 0)")
    ap.add_argument(
        "--forward-only", action="store_true",
        help="time verl's old_log_prob pass (forward + logprobs with entropy, no_grad) instead of forward+backward",
    )  # fmt: skip
    ap.add_argument(
        "--profile", type=int, default=0, metavar="STEPS",
        help="after timing, profile STEPS steps of each backend and print its GPU kernels per step (rank 0)",
    )  # fmt: skip
    ap.add_argument(
        "--no-tma-column-major", action="store_true",
        help="the backward's column-major operands through the pointer matmul (the form before; speed only)",
    )  # fmt: skip
    args = ap.parse_args()
    if args.no_tma_column_major:
        from vexact_kernels.triton_ops import matmul as mm

        mm.TMA_COLUMN_MAJOR = False
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and args.shape != "tiny":
        raise SystemExit("benchmarks/trainer.py needs a CUDA device (on CPU only --shape tiny, as a smoke run)")

    mesh = init_distributed(device)
    model = build_model(args.shape, 0, device)
    parallelize(model, mesh, activation_checkpointing=args.activation_checkpointing)
    batch, mask, adv = make_batch(model.config.vocab_size, args.seqs, args.mean_len, seed=dist.get_rank())
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    batch, mask, adv = batch.to(dev), mask.to(dev), adv.to(dev)
    tokens = batch.input_ids.numel()
    backends = ("fast", "invariant")
    actors = {b: Actor(model, ActorConfig(backend=b)) for b in backends}
    times: dict[str, list[float]] = {b: [] for b in backends}
    peak: dict[str, float] = {}
    step = fwd_only if args.forward_only else fwd_bwd
    for b in backends:
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        time_steps(lambda b=b: step(model, actors[b], batch, mask, adv), args.warmup)
        peak[b] = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    for _ in range(args.rounds):
        for b in backends:
            times[b] += time_steps(lambda b=b: step(model, actors[b], batch, mask, adv), args.iters)

    ws = dist.get_world_size()
    med = {b: statistics.median(times[b]) for b in backends}
    tps = {b: tokens * ws / med[b] for b in backends}
    flops = model_flops(model, list(batch.seq_lens), args.forward_only)
    peak_flops = hardware.matmul_peak(device) if device == "cuda" else float("nan")  # the MFU denominator
    mfu = {b: hardware.mfu(flops, med[b], peak_flops) for b in backends}
    ratio = tps["invariant"] / tps["fast"]
    cfg = model.config
    lines = [
        f"# Trainer {'forward only (old_log_prob)' if args.forward_only else 'forward+backward'}, "
        f"{torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}, "
        f"{datetime.date.today()}",
        f"torch {torch.__version__}, triton {__import__('triton').__version__}; world size {ws}",
        f"model: {args.shape}-shaped (hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, vocab "
        f"{cfg.vocab_size}, tied {cfg.tie_word_embeddings}), FSDP2 bf16 params / fp32 reduce / fp32 master; "
        f"activation checkpointing {'on' if args.activation_checkpointing else 'off'}",
        f"batch per rank: {args.seqs} packed sequences, {tokens} tokens (lengths {min(batch.seq_lens)}.."
        f"{max(batch.seq_lens)}); "
        + (
            "logprobs and entropy on every position under no_grad; "
            if args.forward_only
            else "logprobs on every position, PPO-clip loss on the response part; "
        )
        + f"median of {args.rounds} x {args.iters} steps",
        "",
        f"MFU: model FLOPs ({flops / 1e12:.1f} TFLOP per step and rank: {2 if args.forward_only else 6} x matmul "
        "weights x tokens + causal "
        f"attention) / step time / measured bf16 matmul peak ({peak_flops / 1e12:.0f} TFLOP/s, 8192^3 cuBLAS, same "
        "run). fast = plain PyTorch: cuBLAS linears, torch's causal SDPA with GQA per sequence (flash/cuDNN), chunked "
        "logprobs.",
        "",
        "| backend | ms / step | tokens/s (all ranks) | MFU | peak GiB |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {b} | {med[b] * 1e3:.1f} | {tps[b]:,.0f} | {mfu[b]:.1%} | {peak[b]:.1f} |" for b in backends]
    lines += ["", f"invariant / fast tokens/s: **{ratio:.2f}x** (goal >= 0.80x)"]
    if args.profile and device == "cuda":
        lines += profile_backends(model, actors, batch, mask, adv, args.profile, med, step)
    text = "\n".join(lines) + "\n"
    if dist.get_rank() == 0:
        print(text, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
