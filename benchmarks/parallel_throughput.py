"""Throughput of one MoE replica over several GPUs: expert parallel against pipeline parallel, one GPU and vLLM.

The RL workload of ``benchmarks/throughput.py`` (the same seeded prompts and lengths, ignore_eos, temperature 1) on
the same random bf16 weights, in one run, per batch limit (the sequences in flight in the whole replica):

- ``one``: :class:`vexact_engine.LLM` on the first GPU alone (the others idle), ``max_num_seqs`` = the limit;
- ``ep``: :class:`vexact_engine.ExpertParallelLLM` over every rank, attention data-parallel: prompt ``i`` on rank
  ``i % W``, ``max_num_seqs`` = limit / W on each rank, the routed experts sharded over the ranks;
- ``pp``: :class:`vexact_engine.PipelineLLM`, one stage a rank, the first rank takes every request;
- ``vllm``: vLLM on the same GPUs after the VeXact modes have let them go (``tensor_parallel_size`` = W and
  ``enable_expert_parallel``: vLLM's expert parallelism for MoE; its other settings its defaults), in a subprocess
  (``benchmarks/peers.py``).

Output tok/s is every generated token over the wall time from the first request to the last token (each rank's
clock, the slowest rank's time). Goals (the expert-parallel design's): EP >= 1.6x one GPU and >= 1.3x PP at limit
512, and >= 1.0x vLLM on the same GPUs.

Run under torchrun, one rank per GPU (NCCL with NVLink multicast off, as the GPU hosts require)::

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc_per_node=2 benchmarks/parallel_throughput.py \\
        --model qwen3-30b-a3b --modes one,ep,pp,vllm --num-prompts 512 --max-num-seqs 256,512 --out RESULTS/ep.md

``--device cpu`` runs the tiny shapes on gloo (a smoke run of the wiring: the figures mean nothing there).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import peers  # benchmarks/peers.py: vLLM in a subprocess
import throughput  # benchmarks/throughput.py: the shapes, the workload, the run's commit and command line
import torch
import torch.distributed as dist

from vexact_engine import LLM, ExpertParallelLLM, PipelineLLM, SamplingParams
from vexact_engine.pipeline import stage_layers

MODES = ("one", "ep", "pp", "vllm")
GOALS = {"ep/one": 1.6, "ep/pp": 1.3, "ep/vllm": 1.0}
RL = throughput.WORKLOADS["rl"]


def arg_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-30b-a3b", help=f"a MoE shape of throughput.py: {', '.join(_moe())}")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's own depth)")
    ap.add_argument("--modes", default="one,ep,pp,vllm", help=f"comma-separated from {','.join(MODES)}")
    # the rl workload of throughput.py, with half its prompts (a run of four modes at two limits in one sitting)
    ap.add_argument("--num-prompts", type=int, default=RL["num_prompts"] // 2)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=RL["prompt_len"], metavar=("LO", "HI"))
    ap.add_argument("--gen-len", type=int, nargs=2, default=RL["gen_len"], metavar=("LO", "HI"))
    ap.add_argument(
        "--max-num-seqs", default=RL["max_num_seqs"], help="batch limits: sequences in flight in the replica"
    )
    ap.add_argument("--max-num-batched-tokens", type=int, default=RL["max_num_batched_tokens"])
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-kv-blocks", type=int, default=None, help="KV pages per rank (CPU: required)")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda", help="cuda; cpu (gloo) only to smoke-test the script")
    ap.add_argument("--vllm-site", default=None, help="vLLM's folders for the subprocess's PYTHONPATH")
    ap.add_argument("--vllm-timeout", type=float, default=3600.0)
    ap.add_argument("--out", default=None, help="write the results file here (rank 0)")
    return ap


def _moe() -> list[str]:
    return [s for s, (family, _) in throughput.SHAPES.items() if family in ("qwen3_moe", "deepseek_v3", "gpt_oss")]


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace, world: int) -> list[int]:
    """The batch limits; every bad value refused by name."""
    if args.model not in _moe():
        ap.error(f"--model: {args.model!r} is not a MoE shape of throughput.py; one of {', '.join(_moe())}")
    bad = [m for m in args.modes.split(",") if m not in MODES]
    if bad:
        ap.error(f"--modes: unknown {bad}; allowed: {','.join(MODES)}")
    try:
        limits = [int(x) for x in args.max_num_seqs.split(",")]
    except ValueError:
        ap.error(f"--max-num-seqs: comma-separated integers, got {args.max_num_seqs!r}")
    uneven = [n for n in limits if n < world or n % world]
    if uneven:
        ap.error(f"--max-num-seqs: each limit must be a multiple of the {world} ranks (EP runs limit/{world} a rank); "
                 f"got {uneven}")  # fmt: skip
    if world < 2:
        ap.error(f"run under torchrun with 2 or more ranks (one per GPU); world size is {world}")
    if args.device == "cpu" and args.num_kv_blocks is None:
        ap.error("--device cpu: name the KV pages per rank with --num-kv-blocks")
    return limits


def new_model(args):
    """Random bf16 weights of the shape on this rank's device (the same seed on every rank: every mode computes with
    the same model)."""
    return throughput.make_model(args.model, args.layers, args.seed)


def engine_kw(args, max_num_seqs: int) -> dict:
    kw = dict(
        backend="invariant", max_num_seqs=max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.prompt_len[1] + args.gen_len[1], block_size=args.block_size,
        enforce_eager=args.enforce_eager, gpu_memory_utilization=args.gpu_memory_utilization,
    )  # fmt: skip
    if args.num_kv_blocks is not None:
        kw["num_kv_blocks"] = args.num_kv_blocks
    return kw


def pp_kv_blocks(args, model, limit: int, device: torch.device) -> int:
    """KV pages every pipeline stage can hold (PipelineLLM needs one count for all): this stage's share of
    ``--gpu-memory-utilization`` of the device, less its layers' weights and an activation reserve, over the bytes a
    page takes in its layers; the smallest over the stages, and no more than ``limit`` sequences of the longest
    length need."""
    cfg = model.config
    stage = stage_layers(cfg.num_hidden_layers, dist.get_world_size())[dist.get_rank()]
    per_layer = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    shared = sum(p.numel() * p.element_size() for p in model.parameters()) - per_layer * cfg.num_hidden_layers
    reserve = 2 * 2**30 + args.max_num_batched_tokens * cfg.hidden_size * 64  # activations of one step, generous
    budget = args.gpu_memory_utilization * torch.cuda.get_device_properties(device).total_memory
    budget -= per_layer * len(stage) + shared + reserve
    page = args.block_size * len(stage) * peers.kv_bytes_per_token(cfg) // cfg.num_hidden_layers
    need = limit * -(-(args.prompt_len[1] + args.gen_len[1]) // args.block_size)
    blocks = torch.tensor([max(1, min(int(budget // page), need))], device=device)
    dist.all_reduce(blocks, op=dist.ReduceOp.MIN)
    return int(blocks)


def timed(run) -> tuple[int, float]:
    """``run()``'s generated tokens and wall time on this rank."""
    throughput.sync()
    t = time.perf_counter()
    outs = run()
    throughput.sync()
    return sum(len(o.token_ids) for o in outs), time.perf_counter() - t


def combined(device: torch.device, tokens: int, wall: float) -> tuple[int, float]:
    """Every rank's tokens summed, the slowest rank's wall time (a collective: every rank calls it)."""
    both = torch.tensor([float(tokens), wall], dtype=torch.float64, device=device)
    dist.all_reduce(both[:1])
    dist.all_reduce(both[1:], op=dist.ReduceOp.MAX)
    return int(both[0]), float(both[1])


def run_mode(mode: str, limit: int, args, prompts, params, device: torch.device) -> dict:
    """One VeXact mode at one batch limit on every rank: ``{"tokens", "wall", "tok_s"}``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    warm_n = min(4, len(prompts))
    warm = [SamplingParams(max_tokens=8, seed=1, ignore_eos=True)] * warm_n
    tokens, wall = 0, 0.0
    if mode == "one":  # the first rank alone; the others wait in the collective below
        llm = LLM(model=new_model(args), **engine_kw(args, limit)) if rank == 0 else None
        if llm is not None:
            llm.generate(prompts[:warm_n], warm, use_tqdm=False)
            tokens, wall = timed(lambda: llm.generate(prompts, params, use_tqdm=False))
    elif mode == "ep":  # every rank its share, stepping together (the exchange is collective)
        llm = ExpertParallelLLM(model=new_model(args), **engine_kw(args, limit // world))
        mine = list(range(rank, len(prompts), world))
        llm.generate([prompts[i] for i in mine[:warm_n]], warm[: len(mine[:warm_n])], use_tqdm=False)
        dist.barrier()
        tokens, wall = timed(
            lambda: llm.generate([prompts[i] for i in mine], [params[i] for i in mine], use_tqdm=False)
        )
    elif mode == "pp":  # the driver times the run; the other stages serve it until it shuts down
        model, kw = new_model(args), engine_kw(args, limit)
        if "num_kv_blocks" not in kw:  # every stage must hold the same pages
            kw["num_kv_blocks"] = pp_kv_blocks(args, model, limit, device)
        llm = PipelineLLM(model=model, **kw)
        model = None
        if llm.is_driver:
            llm.generate(prompts[:warm_n], warm, use_tqdm=False)
            tokens, wall = timed(lambda: llm.generate(prompts, params, use_tqdm=False))
            llm.shutdown()
        else:
            llm.serve()
    else:
        raise ValueError(f"not a VeXact mode: {mode!r}")
    tokens, wall = combined(device, tokens, wall)
    llm = None  # the engine and its model go before the next mode builds its own
    throughput.free_memory()
    want = sum(p.max_tokens for p in params)
    if tokens != want:
        raise RuntimeError(f"{mode} at limit {limit}: {tokens} tokens generated, the workload asks {want}")
    return {"tokens": tokens, "wall": wall, "tok_s": tokens / wall}


def run_vllm(limit: int, args, prompts, params, workdir: Path, world: int) -> dict | str:
    """vLLM over the same ``world`` GPUs (tensor parallel with its expert parallelism), first rank only, once every
    VeXact engine has let its GPU go."""
    if args.device != "cuda":
        return "not run: vLLM needs CUDA"
    model = new_model(args)
    ckpt = throughput.save_checkpoint(model, args.model, args, workdir)
    del model
    throughput.free_memory()
    shim = argparse.Namespace(**vars(args), decode_steps=0)
    seeds = [p.seed for p in params]
    return peers.run_vllm(
        "vllm", ckpt, prompts, [p.max_tokens for p in params], seeds, limit, shim, workdir, False,
        parallel={"tensor_parallel_size": world, "enable_expert_parallel": True},
    )  # fmt: skip


def report(args, argv, results: dict, limits: list[int], world: int, gpu: str) -> str:
    """The results file: date, GPU, commit, command, the workload, a table per batch limit, the goals."""
    lines = [
        f"# One MoE replica over {world} GPUs: expert parallel, pipeline parallel, one GPU, vLLM ({gpu})",
        "",
        f"- Date: {datetime.date.today()}",
        f"- GPU: {world}x {gpu}",
        f"- Commit: {throughput.git_commit()}",
        f"- Command: `torchrun --standalone --nproc_per_node={world} benchmarks/parallel_throughput.py "
        f"{' '.join(argv)}`",
        "",
        f"Workload: {args.num_prompts} prompts of {args.prompt_len[0]}-{args.prompt_len[1]} random tokens, "
        f"{args.gen_len[0]}-{args.gen_len[1]} generated tokens each (ignore_eos, temperature 1, a seed per request), "
        f"{args.model} shape{'' if args.layers is None else f' at {args.layers} layers'}, random bf16 weights. "
        f"Batch limit: sequences in flight in the whole replica (EP: limit/{world} a rank). Output tok/s: every "
        "generated token over the slowest rank's wall time.",
        "",
    ]
    for limit in limits:
        row = results.get(limit, {})
        lines += [f"## Batch limit {limit}", "", "| mode | GPUs | output tok/s | / one GPU | / PP | / vLLM | wall s |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for mode in (m for m in MODES if m in row):
            r = row[mode]
            gpus = 1 if mode == "one" else world
            if isinstance(r, str):
                lines.append(f"| {mode} | {gpus} | {r} | | | | |")
                continue
            ratio = [
                f"{r['tok_s'] / row[o]['tok_s']:.2f}" if isinstance(row.get(o), dict) else "-"
                for o in ("one", "pp", "vllm")
            ]
            lines.append(f"| {mode} | {gpus} | {r['tok_s']:.0f} | {' | '.join(ratio)} | {r['wall']:.1f} |")
        lines.append("")
    ep_rows = {k: results.get(max(limits), {}) for k in GOALS}
    goal_lines = []
    for key, goal in GOALS.items():
        num, den = key.split("/")
        row = ep_rows[key]
        if isinstance(row.get(num), dict) and isinstance(row.get(den), dict):
            got = row[num]["tok_s"] / row[den]["tok_s"]
            goal_lines.append(f"- {key} at limit {max(limits)}: {got:.2f}x (goal >= {goal}x): "
                              f"{'met' if got >= goal else 'missed'}")  # fmt: skip
    return "\n".join(lines + goal_lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = arg_parser()
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("parallel_throughput.py needs CUDA devices (or --device cpu for a smoke run)", file=sys.stderr)
        return 2
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(hours=2))
    rank, world = dist.get_rank(), dist.get_world_size()
    limits = check_args(ap, args, world)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    throughput.DEV = device  # throughput's helpers (weights, sync, free memory) work on this rank's device
    family = throughput.SHAPES[args.model][0]
    vocab = throughput.CONFIGS[family](**throughput.SHAPES[args.model][1]).vocab_size
    prompts, params = throughput.workload(args, vocab)
    modes = args.modes.split(",")
    results: dict[int, dict] = {n: {} for n in limits}
    for limit in limits:
        for mode in (m for m in MODES if m in modes and m != "vllm"):
            results[limit][mode] = run_mode(mode, limit, args, prompts, params, device)
            if rank == 0:
                print(f"{mode} at limit {limit}: {json.dumps(results[limit][mode])}", flush=True)
    gpu = torch.cuda.get_device_name() if cuda else "CPU"
    # every rank done with its engines before any rank tears its group down: once, on the CPU suite, a rank that left
    # first aborted at exit ("terminate called without an active exception") while the other was still in the group
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return 0
    if "vllm" in modes:  # the other ranks have exited and let their GPUs go
        workdir = Path(tempfile.mkdtemp(prefix="parallel-vllm-"))
        for limit in limits:
            results[limit]["vllm"] = run_vllm(limit, args, prompts, params, workdir, world)
            print(f"vllm at limit {limit}: {results[limit]['vllm']}", flush=True)
    text = report(args, argv, results, limits, world, gpu)
    print(text, flush=True)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
