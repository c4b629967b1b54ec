"""MoE training forward+backward: VeXact's invariant MoE path against the plain-PyTorch ``torch._grouped_mm`` path.

Two shapes, each a few decoder layers of a published MoE (``--layers``, default 4) with its real vocabulary and lm_head:

- ``qwen3-30b-a3b``: hidden 2048, 32 query / 4 KV heads of 128, every layer sparse: 128 experts of width 768, top-8
  (softmax, renormalised);
- ``moonlight-16b-a3b`` (DeepSeek-V3 family): hidden 2048, MLA (16 heads, no q LoRA, KV latent 512, q/k heads of
  128 + 64 rope, values of 128), layer 0 a dense MLP of 11264, the others sparse: 64 routed experts of width 1408,
  top-6 by sigmoid scores + correction bias, grouped routing (``n_group`` 1, ``topk_group`` 1, as published), scaled
  by 2.446, plus 2 shared experts (one dense MLP of 2 x 1408).

Each shape runs three backends on one model (same weights, batch and loss), alternating by round so clocks and caches
treat them alike:

- ``ours``: ``backend="invariant"``, the trainer's path as it trains today (``vexact_trainer.Actor`` under FSDP2,
  world size 1 unless run under a larger torchrun: bf16 params, fp32 reduce, fp32 master);
- ``anchor``: ``backend="fast"``, the fastest plain-PyTorch path: cuBLAS linears, torch's SDPA, and the experts as
  torchtitan runs them: pairs sorted by expert on the device, groups padded to 16 rows, int32 offsets, one bf16
  ``torch._grouped_mm`` per projection, forward and backward (``vexact_kernels.moe._fused_moe_fast_grouped``); the
  same routing function (softmax / grouped sigmoid top-k), computed with ``torch.topk``;
- ``ours+gmm``: ``backend="fast:moe"``, ours with only the MoE (routing and experts) swapped for the anchor's: how
  much of the gap is the expert kernels.

On CPU (``--device cpu --shape tiny``: the tiny checkpoints' shapes, a smoke run of the script) ``torch._grouped_mm``
has no kernel, so the anchor's experts fall back to a per-expert ``F.linear`` loop; the table says so.

FLOPs of one step (the MFU numerator; forward 2 x, backward 4 x the multiply-adds)::

    flops = 6 * tokens * (dense + lm_head + routed) + 3.5 * layers * sum_seq(heads * (d_qk + d_v) * len^2)
    dense  = every 2-D weight of the decoder layers a token multiplies through: attention projections (MLA's
             included), the router, shared experts, dense MLPs
    lm_head = vocab * hidden (logprobs on every position); the embedding is a lookup, not counted
    routed = per sparse layer top_k * 3 * hidden * moe_intermediate (only the experts a token is routed to)

The attention term is causal (half of len^2 scores), QK^T and PV forward, backward 2.5 x the forward (as
``benchmarks/trainer.py``). Norms, rotary, the softmax and the elementwise ops are left out, as MFU conventions do.
MFU is against the data-sheet dense bf16 peak (``hardware.BF16_DATASHEET_PEAK``) with the bf16 ``torch.matmul`` peak
measured in the same run (8192^3) beside it.

The profile table (``--profile STEPS``, default 2) lists ours' top GPU kernels by time and their share of the step.

Usage (on the GPU machine; both shapes: about 3-4 minutes on an H100, an estimate)::

    PYTHONPATH=<packages' src dirs>:. python benchmarks/moe_train.py --out benchmarks/results/moe-train-h100.md
    PYTHONPATH=<packages' src dirs>:. python benchmarks/moe_train.py --device cpu --shape tiny   # CPU smoke run
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import hardware  # benchmarks/hardware.py: bf16 peaks and MFU
import torch

from vexact_models import (
    DEEPSEEK_V3_SHAPES,
    QWEN3_MOE_SHAPES,
    random_model,
    tiny_deepseek_v3_config,
    tiny_qwen3_moe_config,
)

SHAPES = ("qwen3-30b-a3b", "moonlight-16b-a3b")
BACKENDS = {"ours": "invariant", "anchor": "fast", "ours+gmm": "fast:moe"}


def shape_config(shape: str, layers: int, tiny: bool):
    """The fp32-master config of ``shape`` with ``layers`` decoder layers (``tiny``: the tiny checkpoint's sizes)."""
    if shape == "qwen3-30b-a3b":
        base = {} if tiny else dict(QWEN3_MOE_SHAPES[shape])
        over = {"mlp_only_layers": ()}  # every layer sparse, as published
        return tiny_qwen3_moe_config(**{**base, **over, "num_hidden_layers": layers, "torch_dtype": "float32"})
    if shape == "moonlight-16b-a3b":
        base = {} if tiny else dict(DEEPSEEK_V3_SHAPES[shape])
        return tiny_deepseek_v3_config(**{**base, "num_hidden_layers": layers, "torch_dtype": "float32"})
    raise ValueError(f"unknown shape {shape!r}; choose from {SHAPES}")


def attention_dims(cfg) -> tuple[int, int, int]:
    """(heads, query/key head dim, value head dim) of the attention core."""
    if cfg.model_type == "deepseek_v3":
        return cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    return cfg.num_attention_heads, cfg.head_dim, cfg.head_dim


def step_flops(model, seq_lens: list[int]) -> tuple[float, dict[str, float]]:
    """FLOPs of one forward+backward (the module docstring's formula) and its parts, counted from the parameters
    (before FSDP wraps them): 2-D weights are dense, the stacked 3-D expert weights count k / E of their size."""
    cfg = model.config
    k = cfg.num_experts_per_tok
    num_e = getattr(cfg, "num_experts", None) or cfg.n_routed_experts
    dense = routed = 0
    for name, p in model.named_parameters():
        if "embed_tokens" in name or name.startswith("lm_head."):
            continue
        if p.dim() == 3:  # experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]
            routed += p.numel() * k // num_e
        elif p.dim() == 2:
            dense += p.numel()
    head = cfg.vocab_size * cfg.hidden_size  # the lm_head, tied or not
    tokens = sum(seq_lens)
    heads, d_qk, d_v = attention_dims(cfg)
    attn = 3.5 * cfg.num_hidden_layers * sum(heads * (d_qk + d_v) * n * n for n in seq_lens)
    parts = {"dense": 6.0 * tokens * dense, "lm_head": 6.0 * tokens * head, "routed": 6.0 * tokens * routed,
             "attention": attn}  # fmt: skip
    return sum(parts.values()), parts


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def step_seconds(fn, device: str) -> float:
    if device != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e-3


def profile_table(prof, steps: int, step_s: float, top: int, device: str) -> list[str]:
    """Markdown rows: the ``top`` GPU kernels (and copies) by time per step, with their share of the timed step (on
    CPU, the top operators by self CPU time: a smoke run of the table)."""
    if device == "cuda":
        events = [
            e
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
        ]
        by_name: dict[str, list[float]] = {}
        for e in events:
            by_name.setdefault(e.name, []).append(e.device_time)  # us
        rows = [(name, len(ts), sum(ts)) for name, ts in by_name.items()]
        what, count = "GPU kernel", len(events)
    else:
        rows = [(e.key, e.count, e.self_cpu_time_total) for e in prof.key_averages()]
        what, count = "CPU operator (self)", sum(r[1] for r in rows)
    total_ms = sum(r[2] for r in rows) / steps / 1e3
    lines = [
        f"{what} time {total_ms:.1f} ms per step ({count / steps:.0f} {what.split()[0]} events) of the "
        f"{step_s * 1e3:.1f} ms step ({total_ms / (step_s * 1e3):.0%}"
        + ("; the rest is the GPU idle, waiting on the host)." if device == "cuda" else ")."),
        "",
        f"| {what.split()[1]} | calls / step | ms / step | share of step |",
        "|---|---|---|---|",
    ]
    for name, n, us in sorted(rows, key=lambda r: -r[2])[:top]:
        ms = us / steps / 1e3
        short = (name if len(name) <= 90 else name[:87] + "...").replace("|", "\\|")
        lines.append(f"| `{short}` | {n / steps:.0f} | {ms:.2f} | {ms / (step_s * 1e3):.1%} |")
    return lines


def bench_shape(shape: str, args, tb, mesh, device: str, peaks: tuple[float | None, float]) -> list[str]:
    from vexact_trainer import Actor, ActorConfig, parallelize

    tiny = args.shape == "tiny"
    cfg = shape_config(shape, args.layers, tiny)
    model = random_model(cfg, seed=args.seed, embed_std=0.02, device=device).requires_grad_(True).train()
    batch, mask, adv = tb.make_batch(cfg.vocab_size, args.seqs, args.mean_len, seed=args.seed)
    flops, parts = step_flops(model, list(batch.seq_lens))  # before FSDP: plain parameters
    parallelize(model, mesh, reshard_after_forward=args.reshard_after_forward)
    batch, mask, adv = batch.to(device), mask.to(device), adv.to(device)
    tokens = batch.input_ids.numel()
    actors = {b: Actor(model, ActorConfig(backend=spec)) for b, spec in BACKENDS.items()}

    def step(b: str) -> None:
        tb.fwd_bwd(model, actors[b], batch, mask, adv)

    times: dict[str, list[float]] = {b: [] for b in BACKENDS}
    mem: dict[str, float] = {}
    for b in BACKENDS:
        print(f"[{shape}] warm-up {b}", flush=True)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for _ in range(args.warmup):
            step_seconds(lambda b=b: step(b), device)
        mem[b] = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    for r in range(args.rounds):
        for b in BACKENDS:
            print(f"[{shape}] round {r + 1}, {b}", flush=True)
            times[b] += [step_seconds(lambda b=b: step(b), device) for _ in range(args.iters)]
    med = {b: statistics.median(times[b]) for b in BACKENDS}

    spec, measured = peaks
    heads, d_qk, d_v = attention_dims(cfg)
    k = cfg.num_experts_per_tok
    num_e = getattr(cfg, "num_experts", None) or cfg.n_routed_experts
    inter = cfg.moe_intermediate_size
    if device != "cuda":
        grouped = "per-expert F.linear loop (no torch._grouped_mm kernel on CPU)"
    elif torch.cuda.get_device_capability() < (9, 0):
        grouped = "per-expert F.linear loop (torch._grouped_mm's bf16 kernel needs compute capability 9.0+)"
    else:
        grouped = "torch._grouped_mm, bf16, groups padded to 16 rows"
    lines = [
        f"## {shape}: {cfg.num_hidden_layers} layers",
        "",
        f"hidden {cfg.hidden_size}, {heads} heads (q/k {d_qk}, v {d_v}), {num_e} experts of width {inter}, top-{k}"
        + (
            f", {cfg.n_shared_experts} shared, grouped routing (n_group {cfg.n_group}, topk_group {cfg.topk_group}),"
            f" first {cfg.first_k_dense_replace} layer(s) dense"
            if cfg.model_type == "deepseek_v3"
            else ""
        )
        + f"; vocab {cfg.vocab_size}. Batch: {args.seqs} packed sequences, {tokens} tokens (lengths "
        f"{min(batch.seq_lens)}..{max(batch.seq_lens)}); median of {len(times['ours'])} steps per backend after "
        f"{args.warmup} warm-up, backends alternating by round. Anchor experts: {grouped}. FSDP2 "
        f"reshard_after_forward {'on' if args.reshard_after_forward else 'off'}.",
        "",
        f"FLOPs per step {flops / 1e12:.4g} T: dense layer weights {parts['dense'] / 1e12:.4g} T, lm_head "
        f"{parts['lm_head'] / 1e12:.4g} T, routed experts {parts['routed'] / 1e12:.4g} T, attention core "
        f"{parts['attention'] / 1e12:.4g} T.",
        "",
        "| backend | kernels | ms / step | tokens/s | TFLOP/s | MFU (data sheet) | MFU (measured mm peak) | peak GiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for b, spec_name in BACKENDS.items():
        tflops = flops / med[b]
        mfu_spec = f"{hardware.mfu(flops, med[b], spec):.1%}" if spec else "-"
        lines.append(
            f"| {b} | `{spec_name}` | {med[b] * 1e3:.1f} | {tokens / med[b]:,.0f} | {tflops / 1e12:.1f} | {mfu_spec} "
            f"| {hardware.mfu(flops, med[b], measured):.1%} | {mem[b]:.1f} |"
        )
    lines += [
        "",
        f"ours / anchor tokens/s: **{med['anchor'] / med['ours']:.2f}x**; ours / ours+gmm: "
        f"{med['ours+gmm'] / med['ours']:.2f}x",
        "",
    ]
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profile(activities=acts) as prof:
            for _ in range(args.profile):
                step("ours")
            _sync(device)
        lines += [f"### Where ours' step goes ({args.profile} profiled steps, torch.profiler)", ""]
        lines += profile_table(prof, args.profile, med["ours"], args.top, device) + [""]
    return lines


def attention_impl(device: str) -> str:
    """The attention implementation the invariant backend runs (``triton`` or ``fa4``; CPU runs the reference)."""
    import vexact_kernels as vk

    return vk.get_attention_impl() if device == "cuda" else "cpu reference"


def commit() -> str:
    """``$COMMIT`` when set (a copy of the tree without its git directory), else git's short HEAD."""
    if os.environ.get("COMMIT"):
        return os.environ["COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument(
        "--shape", default="all", choices=("all", *SHAPES, "tiny"),
        help="all: both real shapes; tiny: both families at the tiny checkpoints' sizes (CPU smoke run)",
    )  # fmt: skip
    ap.add_argument("--layers", type=int, default=None, help="decoder layers per model (default 4; tiny: 2)")
    ap.add_argument("--seqs", type=int, default=16, help="sequences per packed batch")
    ap.add_argument("--mean-len", type=int, default=1024, help="mean sequence length (uniform in [0.5, 1.5] x)")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up steps per backend")
    ap.add_argument("--rounds", type=int, default=3, help="rounds alternating the backends")
    ap.add_argument("--iters", type=int, default=3, help="timed steps per backend and round")
    ap.add_argument("--profile", type=int, default=2, metavar="STEPS", help="profiled steps of ours (0: none)")
    ap.add_argument("--top", type=int, default=20, help="kernels in the profile table")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True,
                    help="FSDP2's reshard_after_forward for every group (vexact_trainer.parallelize's default: on; off "
                    "keeps each layer's bf16 weights from forward to backward: one all-gather copy and cast less a "
                    "step, more memory)")  # fmt: skip
    ap.add_argument("--out", help="write the markdown report here (rewritten after each shape)")
    args = ap.parse_args(argv)
    if args.shape == "tiny":  # a smoke run: one timed step per backend unless asked for more
        given = set(sys.argv[1:] if argv is None else argv)
        args.layers = 2 if args.layers is None else args.layers
        for opt, name, value in (("--seqs", "seqs", 2), ("--mean-len", "mean_len", 16), ("--warmup", "warmup", 1),
                                 ("--rounds", "rounds", 1), ("--iters", "iters", 1), ("--profile", "profile", 1),
                                 ("--top", "top", 8)):  # fmt: skip
            if opt not in given:
                setattr(args, name, value)
    args.layers = 4 if args.layers is None else args.layers
    for name in ("layers", "seqs", "mean_len", "rounds", "iters"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.mean_len < 2:
        ap.error(f"--mean-len must be >= 2, got {args.mean_len}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is visible (on CPU run --device cpu --shape tiny)")
    if args.device == "cpu" and args.shape != "tiny":
        ap.error(f"--device cpu runs only --shape tiny (a smoke run), got --shape {args.shape}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch.distributed as dist

    from vexact_trainer import init_distributed

    device = args.device
    import trainer as tb  # benchmarks/trainer.py: its batch and step are reused, not copied

    mesh = init_distributed(device)
    gpu = torch.cuda.get_device_name() if device == "cuda" else "CPU (smoke run, tiny shapes)"
    peaks = hardware.device_datasheet_peak(device), hardware.matmul_peak(device)
    spec_s = f"{peaks[0] / 1e12:.0f} TFLOP/s" if peaks[0] else "none for this device"
    cmd = " ".join(["python", "benchmarks/moe_train.py", *(sys.argv[1:] if argv is None else argv)])
    lines = [
        f"# MoE training forward+backward: ours vs torch._grouped_mm ({gpu})",
        "",
        f"Date {datetime.date.today()}, GPU {gpu}, commit {commit()}, torch {torch.__version__}, world size "
        f"{dist.get_world_size()}, attention `{attention_impl(device)}` (`$VEXACT_ATTENTION`; under `fa4`, MLA and "
        "heads under 32 run the Triton kernels).",
        "",
        f"Command: `{cmd}`",
        "",
        f"bf16 peak: data sheet {spec_s}; measured in this run (torch.matmul {hardware.MATMUL_N[device]}^3) "
        f"{peaks[1] / 1e12:.3g} TFLOP/s.",
        "Step: `benchmarks/trainer.py`'s `fwd_bwd` (`Actor.forward_packed`: logprobs on every position, PPO-clip "
        "loss on the response part, backward; no optimizer step). FLOP formula: the docstring of "
        "`benchmarks/moe_train.py`.",
        "",
    ]

    def write() -> None:
        if args.out and dist.get_rank() == 0:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text("\n".join(lines) + "\n")

    shapes = SHAPES if args.shape in ("all", "tiny") else (args.shape,)
    for shape in shapes:
        lines += bench_shape(shape, args, tb, mesh, device, peaks)
        write()
        gc.collect()  # the shape's model and FSDP state go before the next one is built
        if device == "cuda":
            torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        print("\n".join(lines), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
