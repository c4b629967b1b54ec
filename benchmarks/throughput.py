"""Engine throughput on the GPU against the engines users would pick instead, side by side in one run (prints a
markdown report; ``--out`` also writes it; ``--results-md`` writes the results file, ``throughput_report.py``).

The headline is the shape RL rollouts spend their time in, as named workloads: ``--workload rl`` (1024
prompts of 128-512 tokens, 1024-2048 generated, batch limits 256 and 512, 8192 tokens per step, VeXact invariant
against vLLM default and vLLM batch-invariant) and ``--workload rl-long`` (256 prompts, 4096-8192 generated, the same
limits); a workload sets those flags, and a flag given on the command line still wins (the results file names it).
On a GPU host: ``scripts/checks/rl_bench_gpu.sh``.

For each model shape (``--models``: Qwen3-8B / 1.7B / 0.6B, Qwen3-30B-A3B, Moonlight-16B-A3B, gpt-oss-20b / 120b, the
Llama, Qwen2.5 and Mistral shapes of ``vexact_models``; random bf16 weights, real HF config shapes, the shape's own
depth unless ``--layers``), on the same prompts, lengths, ``ignore_eos``, sampling settings (temperature 1, no
top-k/top-p, a seed per request) and CUDA graphs on:
- output tokens/s of VeXact ``invariant``, vLLM default (``vllm``), vLLM with ``VLLM_BATCH_INVARIANT=1``
  (``vllm-bi``), each with its ratio to vLLM default (goals: invariant >= 0.85x vLLM default and > vLLM
  batch-invariant) and its fraction of the roofline (``benchmarks/peers.py``: least bytes the run must read / copy
  bandwidth / wall time); VeXact ``fast`` only as the mismatch baseline (no ratio); HF ``generate`` on one
  left-padded batch (its own workload, so its own roofline); ``invariant-draw``: VeXact invariant with
  ``EngineConfig.draw_in_graph`` on (the decode step's draw as a CUDA graph), beside ``invariant`` in the same run;
  ``invariant-async``: VeXact invariant with ``EngineConfig.async_decode`` on (the next step scheduled while the GPU
  runs this one; an engine without that field refuses the mode before any model is built); ``invariant-sync``: with
  it off (the engine's default on CUDA is on, so ``invariant`` is the one-step-ahead loop where the field exists);
  ``invariant-joint``: with ``EngineConfig.split_mixed_steps`` off (a step with decode rows and prompt chunks runs
  as one launch, the default before the split); ``invariant-untuned``: with ``EngineConfig.tune_linears`` off (the
  linear's form by shape, not timed on the GPU at start-up; the same bits); ``invariant-2s``: with
  ``EngineConfig.decode_streams=2`` (decode graphs of 128 rows and up as two half-batch forwards on two streams);
  ``invariant-fine``: decode graphs every 8 rows to 32, 16 to 64, then every 32 (``FINE_GRAPH_SIZES``; the default
  sizes are powers of two to 256, so a step of 129 rows runs at 256); ``invariant-fine-tuned``: the same with the
  linear's forms timed at every decode graph (``EngineConfig.tune_linears_min_rows=1``; the default times 128 rows
  and up); ``invariant-slot`` / ``invariant-lf`` / ``invariant-hf``: the Triton decode attention launched in slot
  order / longest context first alone / with the grid's KV heads first alone, where the default does both
  (``DECODE_LONGEST_FIRST`` / ``DECODE_HEADS_FIRST`` of ``vexact_kernels.triton_ops.attention`` set for that engine:
  launch order only, the same bits); ``invariant-kvsep``: a Qwen3 attention's KV cache write in a launch of its own,
  where the default stores it in the q/k norm + rotary launch (``FUSE_KV_WRITE = False`` of ``vexact_kernels.rotary``:
  the same stores); ``invariant-tma1``: the fused lm_head + logprobs / draw reading its logits tiles through TMA at one
  row too, where the default reads one row through pointers (``LOGPROBS_TMA_MIN_ROWS = 1`` of
  ``vexact_kernels.triton_ops.logprobs``: the same bits);
- decode step time at batch 1 of each engine against the bound ``weight bytes a step reads / copy bandwidth``
  (``peers.decode_weight_bytes``: an MoE step reads k of E routed experts; bandwidth of a device-to-device copy
  measured in the same run, bytes read + written); goal for VeXact <= 1.3x.
vLLM (0.24.0, from ``scripts/staging/vllm_device_wheels.sh``; ``--vllm-site /tmp/vllmsite``) loads the same weights
from an HF checkpoint directory the run writes (``--ckpt-dir``: config.json with the family's architecture, the weights
under their published names; it needs the model's bf16 size free on disk; ``--ckpt-only`` writes it ahead, and a
later run on the same machine with the same shape, layers and seed reuses it), one subprocess per mode and batch limit,
while this process keeps the model's weights on the host; without vLLM its cells say "not installed". vLLM returns
each drawn token's logprob (``SamplingParams(logprobs=0)``, as verl's vLLM rollout asks: RL needs them, and VeXact
always computes them); ``--vllm-logprobs none`` drops them (vLLM then skips its log-softmax over the vocabulary).
First run on a GPU: ``benchmarks/results/throughput-h200.md`` (``--quick``).
Then a GRPO-shaped row (VeXact's own engine): ``--grpo-prompts`` prompts of ``--grpo-prompt-len LO HI`` tokens, each
  sampled ``--grpo-n`` times (n requests share a prompt, distinct seeds), with prefix caching on and off: output
  tokens/s, the prompt tokens served from the cache (hit rate), and whether on and off gave the same tokens and
  logprobs (torch.equal).
``--profile-steps N``: where VeXact's decode step goes, at the batch limit and the workload's mean context: right
after each VeXact engine's timed run, the mean wall time of N decode steps on that engine; once every timed run of the
model is done (torch.profiler leaves CUPTI set up in the process), a new engine's kernel time over N steps under
torch.profiler by kind (attention, GEMM, MoE, sampler/logprobs, norm/rotary/activation, other) and the host gap, in the
results file; then the same row for each vLLM mode that ran, at the batch, context and prompts of VeXact's profile at
that limit, from a vLLM engine in a subprocess of its own (``peers.decode_profile``; ``--no-peer-profile`` leaves it
out). A VeXact run that raises leaves its cells saying so, the other runs go on, and the exit status is 1.
``--rounds N``: the whole sequence of runs N times over, each a new engine and each vLLM run a new process; a row's
tok/s is its median round's, with the rounds' range (vLLM's own tok/s moved by up to 10% between runs of the same
workload on an H200, ``benchmarks/results/throughput-rl-h200.md``).

Workload: ``--num-prompts`` random prompts of ``--prompt-len LO HI`` tokens, each generating a length drawn from
``--gen-len LO HI`` (ignore_eos, so lengths are exact), at each ``--max-num-seqs``. HF generate runs one left-padded
batch of ``--hf-prompts`` prompts for ``--hf-new-tokens`` tokens (it cannot stop rows early; only real tokens
count). Sized to finish in under 8 minutes on an H100 with every peer (estimate; four vLLM engine starts of about a
minute each are most of it); ``--quick`` is a smaller workload for a first look.

Usage: ``PYTHONPATH=<packages' src dirs>:. python benchmarks/throughput.py [--quick] [--models 1.7b,qwen3-30b-a3b]
[--num-prompts 64] [--prompt-len 128 512] [--gen-len 128 256] [--max-num-seqs 64]
[--modes invariant,fast,vllm,vllm-bi,hf] [--vllm-site /tmp/vllmsite] [--grpo-prompts 32] [--grpo-only]
[--block-size 16] [--ckpt-dir DIR [--ckpt-only]] [--out results.md]`` (``--grpo-prompts 0`` skips the GRPO row);
``python benchmarks/throughput.py --workload rl --models 1.7b --vllm-site SITE --profile-steps 20 --results-md
throughput-rl-h100.md``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import datetime
import functools
import gc
import json
import multiprocessing
import os
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import hardware  # benchmarks/hardware.py: copy bandwidth
import peers  # benchmarks/peers.py: vLLM workers, roofline, HF checkpoint
import profiling  # benchmarks/profiling.py: the decoding batch and its step profile
import throughput_report  # benchmarks/throughput_report.py: the --results-md file
import torch
from tqdm.auto import tqdm

import vexact_kernels as vk
from vexact_engine import LLM, EngineConfig, SamplingParams
from vexact_models import (
    DEEPSEEK_V3_SHAPES,
    GPT_OSS_SHAPES,
    LLAMA_SHAPES,
    MISTRAL_SHAPES,
    QWEN2_SHAPES,
    QWEN3_MOE_SHAPES,
    QWEN3_SHAPES,
    random_model,
    tiny_config,
    tiny_deepseek_v3_config,
    tiny_gpt_oss_config,
    tiny_qwen3_config,
    tiny_qwen3_moe_config,
)

SHAPES = {  # name: (family, the config's sizes); every family has peer columns (vLLM and HF generate load each)
    # for a CPU smoke run of the script only: the tiny configs' sizes
    "tiny": ("qwen3", dict(rope_theta=1_000_000.0, tie_word_embeddings=True)),
    "tiny-deepseek": ("deepseek_v3", {}),
    "tiny-qwen3-moe": ("qwen3_moe", {}),
    "tiny-llama": ("llama", {}),
    "tiny-qwen2": ("qwen2", {}),
    "tiny-mistral": ("mistral", {}),
    "tiny-gpt-oss": ("gpt_oss", {}),
    "0.6b": ("qwen3", QWEN3_SHAPES["qwen3-0.6b"]),
    "1.7b": ("qwen3", QWEN3_SHAPES["qwen3-1.7b"]),
    "8b": ("qwen3", QWEN3_SHAPES["qwen3-8b"]),
    # Moonlight-16B-A3B (MLA, DeepSeek MoE)
    "moonlight": ("deepseek_v3", DEEPSEEK_V3_SHAPES["moonlight-16b-a3b"]),
    # the published shapes of the other families, under their vexact_models names
    **{name: ("qwen3_moe", sizes) for name, sizes in QWEN3_MOE_SHAPES.items()},
    **{name: ("llama", sizes) for name, sizes in LLAMA_SHAPES.items()},
    **{name: ("qwen2", sizes) for name, sizes in QWEN2_SHAPES.items()},
    **{name: ("mistral", sizes) for name, sizes in MISTRAL_SHAPES.items()},
    # gpt-oss-20b / 120b: a window of 128 keys on alternate layers, sinks, a biased top-4 MoE (bf16 experts)
    **{name: ("gpt_oss", sizes) for name, sizes in GPT_OSS_SHAPES.items()},
}
CONFIGS = {
    "qwen3": tiny_qwen3_config,
    "qwen3_moe": tiny_qwen3_moe_config,
    "deepseek_v3": tiny_deepseek_v3_config,
    "gpt_oss": tiny_gpt_oss_config,
    **{family: functools.partial(tiny_config, family) for family in ("llama", "qwen2", "mistral")},
}
GIB = 2**30
DEV = torch.device("cuda")


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize(DEV)


def make_model(shape: str, layers: int | None, seed: int = 0):
    """Random bf16 weights drawn on the GPU (drawing 1.7B numbers on the host would take most of the budget);
    ``layers`` None keeps the shape's own depth."""
    family, sizes = SHAPES[shape]
    over = {"torch_dtype": "bfloat16"} | ({} if layers is None else {"num_hidden_layers": layers})
    cfg = CONFIGS[family](**{**sizes, **over})
    return random_model(cfg, seed=seed, embed_std=0.02, device=DEV)


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


class UnsupportedMode(ValueError):
    """A mode this vexact_engine cannot run (raised before any model is built)."""


def engine_settings(mode: str) -> tuple[str, dict]:
    """The backend and extra EngineConfig settings of a VeXact mode: ``invariant-draw`` is ``invariant`` with
    ``draw_in_graph=True`` (the other modes leave it to ``$VEXACT_DRAW_IN_GRAPH``, off by default);
    ``invariant-async`` is ``invariant`` with ``async_decode=True`` (raises :class:`UnsupportedMode` where
    ``EngineConfig`` has no such field)."""
    if mode == "invariant-draw":
        return "invariant", {"draw_in_graph": True}
    if mode in ("invariant-async", "invariant-sync"):
        on = mode == "invariant-async"
        if "async_decode" not in {f.name for f in dataclasses.fields(EngineConfig)}:
            import vexact_engine

            raise UnsupportedMode(
                f"mode {mode} runs EngineConfig(async_decode={on}), and the EngineConfig of this vexact_engine "
                f"({Path(vexact_engine.__file__).parent}) has no field async_decode: leave {mode} out of "
                "--modes, or run an engine that has the field"
            )
        return "invariant", {"async_decode": on}
    if mode == "invariant-joint":
        return "invariant", {"split_mixed_steps": False}
    if mode == "invariant-untuned":
        return "invariant", {"tune_linears": False}
    if mode == "invariant-2s":
        return "invariant", {"decode_streams": 2}
    if mode in ("invariant-fine", "invariant-fine-tuned"):
        extra = {"cuda_graph_batch_sizes": FINE_GRAPH_SIZES}
        return "invariant", extra | ({"tune_linears_min_rows": 1} if mode == "invariant-fine-tuned" else {})
    if mode in KERNEL_MODES:
        return "invariant", {}
    return mode, {}


@contextlib.contextmanager
def kernel_settings(mode: str):
    """The kernel constants of ``mode`` (``KERNEL_MODES``: ``"<module of vexact_kernels>.<NAME>"``) set while its
    engine is built and runs (its CUDA graphs capture what they pick), restored after; nothing for the other modes."""
    import importlib

    settings = []
    for key, value in KERNEL_MODES.get(mode, {}).items():
        module, name = key.rsplit(".", 1)
        settings.append((importlib.import_module(f"vexact_kernels.{module}"), name, value))
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in settings]
    for mod, name, value in settings:
        setattr(mod, name, value)
    try:
        yield
    finally:
        for mod, name, value in saved:
            setattr(mod, name, value)


# invariant-fine: decode graphs every 8 rows to 32, then 16 to 64, then 32: a step pads to the next size, so the
# default's powers of two (1, 2, 4, ..., 128, 256) run a batch of 129 at 256 rows (vLLM captures every 8 rows)
FINE_GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, *range(96, 1025, 32))


def make_engine(model, mode: str, max_num_seqs: int, args, **kw) -> LLM:
    """A VeXact engine of ``mode`` at the run's settings (``kw``: more EngineConfig settings)."""
    kw.setdefault("max_model_len", args.prompt_len[1] + args.gen_len[1])
    mode, extra = engine_settings(mode)
    kw.update(extra)
    return LLM(
        model=model, backend=mode, max_num_seqs=max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
        block_size=args.block_size, **kw,
    )  # fmt: skip


def kv_cache_words(llm) -> str:
    """How big the engine's KV cache is and what it left room for (``LLMEngine.kv_report``), and the device memory
    its CUDA graphs' captures reserved, in words for the run's log."""
    r = llm.kv_report
    words = f"KV cache {r['tokens']} tokens ({r['kv_bytes'] / GIB:.2f} GiB, from {r['source']}"
    if "activation_bytes" in r:
        words += (f": budget {r['budget_bytes'] / GIB:.2f} GiB, weights {r['weights_bytes'] / GIB:.2f} GiB, "
                  f"activation peak {r['activation_bytes'] / GIB:.2f} GiB reserved twice")  # fmt: skip
    return words + f"); CUDA graph captures reserved {llm.runner.capture_reserved_bytes / GIB:.2f} GiB"


def engine_throughput(
    model, mode: str, max_num_seqs: int, prompts, params, args, keep_outputs=False, profile: int = 0, **kw
) -> dict:
    """Output tokens/s of one VeXact engine on the workload (after a warm-up at the batch limit), with the time of
    its decode-only steps and its steps with prompt tokens; ``profile`` > 0: then the wall time of ``profile``
    decode steps of the same engine at a full batch (:func:`decode_wall`), under ``"decode_wall"``."""
    llm = make_engine(model, mode, max_num_seqs, args, **kw)
    # Warm-up at the run's own batch limit: Triton compiles a kernel again for each new specialisation of its integer
    # arguments (1, a multiple of 16, other), and the sampling kernels see row counts the capture warm-up never ran.
    # With 4 warm-up prompts, the first timed run of a process (H100, batch limit 64) waited about 4 s for its first
    # finished request (1.2 s in a process that found the kernels in Triton's disk cache).
    warm = prompts[:max_num_seqs]
    llm.generate(warm, [SamplingParams(max_tokens=16, seed=1, ignore_eos=True)] * len(warm), use_tqdm=False)
    llm.reset_prefix_cache()  # the timed run must not find the warm-up's prompts cached
    before = llm.stats
    # time spent in steps that only decode and in steps with prompt tokens (prefill chunks, mixed with decode rows;
    # both replayed CUDA graphs unless --enforce-eager): a step's time is from its launch to the next launch (to the
    # end of the run for the last), host work included; the engine reads a step back before the next launch, or with
    # async_decode one launch later, so either way the periods add up to the run's stepping time
    steps = {"decode": [0, 0.0], "mixed": [0, 0.0]}
    last: list = [None, None]  # the previous launch's time and kind
    timeline: list[list] = []  # [rows, prompt tokens, seconds] a step (step_buckets)

    def close_step(now: float) -> None:
        if last[0] is not None:
            steps[last[1]][0] += 1
            steps[last[1]][1] += now - last[0]
            timeline[-1][2] = now - last[0]

    def timed_launch(batch, *rest, _launch=llm.runner.launch, **kw):  # what else the engine's loop passes goes through
        now = time.perf_counter()
        close_step(now)
        out = _launch(batch, *rest, **kw)
        prompt = sum(it.num_new_tokens for it in batch if it.num_new_tokens > 1)
        last[0], last[1] = now, "mixed" if prompt else "decode"
        timeline.append([len(batch), prompt, 0.0])
        return out

    llm.runner.launch = timed_launch
    sync()
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    sync()
    close_step(time.perf_counter())
    wall = time.perf_counter() - t
    tokens = sum(len(o.token_ids) for o in outs)
    assert tokens == sum(p.max_tokens for p in params), "a request came back short"
    stats = {k: v - before[k] for k, v in llm.stats.items() if k.endswith("prompt_tokens")}
    res = dict(
        tokens=tokens, wall=wall, tok_s=tokens / wall, preemptions=llm.num_preemptions,
        kv_pages=llm.blocks.num_blocks, graphs=llm.runner.num_graphs, capture_s=llm.runner.capture_seconds,
        graph_draws=llm.runner.num_graph_draws, steps=steps, timeline=timeline, **stats,
        linear_picks=linear_picks(llm.runner),
        outputs=outs if keep_outputs else None,
    )  # fmt: skip
    print(f"{mode}, batch limit {max_num_seqs}: {kv_cache_words(llm)}", flush=True)
    # the wrapper and the runner hold each other, a cycle only a gc pass frees: without this, each engine's KV cache
    # stayed allocated into the next run (on an H100, free memory fell 72.3 -> 65.4 -> 34.6 GiB over two runs)
    del llm.runner.launch
    if profile:
        try:
            res["decode_wall"] = decode_wall(llm, max_num_seqs, args, profile)
        except Exception as e:  # the timed run's numbers stand without it
            res["decode_wall"] = failed(e)
    del llm, outs, timed_launch
    free_memory()
    return res


def linear_picks(runner) -> dict:
    """The linear's forms the engine timed at start-up (``EngineConfig.tune_linears``): ``{"M N K": form}`` for
    every projection shape timed (``default``: the pick by shape stood), printed with each form's time."""
    picks = {}
    for (m, n, k, _), res in sorted(getattr(runner, "linear_tuning", {}).items(), key=lambda kv: kv[0][:3]):
        picks[f"{m} {n} {k}"] = res["pick"] or "default"
        times = ", ".join(f"{name} {ms * 1e3:.1f}" for name, ms in sorted(res["ms"].items(), key=lambda kv: kv[1]))
        print(f"  linear M={m} N={n} K={k}: {res['pick'] or 'default'} (us per matmul: {times})"
              + (f"; other bits: {res['differ']}" if res["differ"] else ""), flush=True)  # fmt: skip
    return picks


def profile_batch(llm, limit: int, args, steps: int) -> tuple[int, int]:
    """The batch and context of ``--profile-steps``: ``limit`` requests (fewer where the KV cache cannot hold them
    all) whose prompts are as long as the workload's mean context halfway through a generation (mean prompt + half
    the mean generation), so each decode step attends about what the timed run's steps attended."""
    context = profile_context(limit, llm.max_model_len, args, steps)
    pages = -(-(context + profile_draws(limit, context, args, steps)) // llm.blocks.block_size)
    return max(1, min(limit, llm.blocks.num_blocks // pages)), context


def profile_context(batch: int, max_model_len: int, args, steps: int) -> int:
    """The profiled requests' prompt length (:func:`profile_batch`): mean prompt + half the mean generation, short
    enough that the draws of :func:`profile_draws` fit in ``max_model_len`` for vLLM's profile at the same shape too
    (:func:`peer_profile`: two measurements of ``steps + 1`` steps after the fill; with a generation of 128 tokens
    and prompts of 1024, vLLM's profile at batch 256 ran out of tokens at the context VeXact's alone would take)."""
    (lo, hi), (glo, ghi) = args.prompt_len, args.gen_len
    context = (lo + hi) // 2 + (glo + ghi) // 4
    return max(1, min(context, max_model_len - profile_draws(batch, context, args, peer_profile_steps(steps))))


def peer_profile_steps(steps: int) -> int:
    """Steps a request of vLLM's profile draws after the fill: two measurements of ``steps + 1`` steps, and one more
    an async step may have scheduled (``peers.decode_profile``)."""
    return 2 * steps + 3


def profile_draws(batch: int, context: int, args, steps: int) -> int:
    """Tokens a request of the profiled batch may draw: one a step while the later prompts prefill (the running rows
    take part of each step's token budget), then the timed or profiled steps."""
    budget = max(args.max_num_batched_tokens - batch, args.max_num_batched_tokens // 2)
    return -(-batch * context // budget) + steps + 8


def fill_profile_batch(llm, batch: int, context: int, args, steps: int) -> None:
    """``batch`` requests of ``context`` random prompt tokens (the same in every engine of the run), all decoding."""
    prompts = profile_prompts(batch, context, llm.vocab_size, args)
    draws = profile_draws(batch, context, args, steps)
    params = [SamplingParams(temperature=1.0, top_p=1.0, max_tokens=draws, seed=i, ignore_eos=True)
              for i in range(batch)]  # fmt: skip
    profiling.fill_decode_batch(llm, prompts, params)


def profile_prompts(batch: int, context: int, vocab: int, args) -> list[list[int]]:
    """The profiled batch's prompts: ``batch`` of ``context`` random token ids, drawn as :func:`workload` draws its
    own (from ``--seed`` + 2: the same in every engine of the run, VeXact's and vLLM's)."""
    g = torch.Generator().manual_seed(args.seed + 2)
    return [torch.randint(0, vocab, (context,), generator=g).tolist() for _ in range(batch)]


def decode_wall(llm, limit: int, args, steps: int) -> dict:
    """Mean wall ms of ``steps`` decode steps at the profiled batch and context (:func:`profile_batch`), timed before
    this process runs torch.profiler."""
    batch, context = profile_batch(llm, limit, args, steps)
    fill_profile_batch(llm, batch, context, args, steps)
    return dict(batch=batch, context=context, steps=steps, step_ms=profiling.decode_step_wall(llm, steps))


def decode_kernels(model, mode: str, limit: int, args, wall: dict) -> dict:
    """Where a decode step of ``mode`` goes: a new engine at the batch and context ``wall`` was timed at, its kernel
    time by kind over ``wall["steps"]`` profiled steps (``profiling.decode_step_kernels``), and the host gap: the
    step's wall time - its kernel time (the GPU waiting on the host; negative where kernels overlap)."""
    llm = make_engine(model, mode, limit, args)
    fill_profile_batch(llm, wall["batch"], wall["context"], args, wall["steps"])
    kernels = profiling.decode_step_kernels(llm, wall["steps"])
    del llm
    free_memory()
    return dict(wall, **kernels, host_gap_ms=wall["step_ms"] - kernels["kernel_ms"])


def peer_profile_shape(results: dict, limit: int, modes, args) -> tuple[int, int]:
    """The batch and context of a vLLM profile at batch limit ``limit``: those of VeXact's profile at that limit (the
    first VeXact mode's ``decode_wall``), or without one the limit and :func:`profile_context`."""
    for mode in (m for m in modes if m in ENGINE_MODES):
        wall = results.get((limit, mode))
        if isinstance(wall, dict) and isinstance(wall.get("decode_wall"), dict):
            return wall["decode_wall"]["batch"], wall["decode_wall"]["context"]
    return limit, profile_context(limit, args.prompt_len[1] + args.gen_len[1], args, args.profile_steps)


def peer_profile(
    mode: str, ckpt: Path, limit: int, batch: int, context: int, vocab: int, args, workdir: Path
) -> dict | str:
    """Where a decode step of vLLM ``mode`` goes at ``batch`` requests of ``context`` prompt tokens (VeXact's
    prompts, a seed per request as VeXact's profile gives them), in a subprocess of its own
    (``peers.decode_profile``): the result as :func:`decode_kernels` gives VeXact's, or why there is none."""
    steps = args.profile_steps
    # drawn while the batch fills, then two measurements of steps + 1 steps each
    draws = min(profile_draws(batch, context, args, peer_profile_steps(steps)),
                args.prompt_len[1] + args.gen_len[1] - context)  # fmt: skip
    prompts = profile_prompts(batch, context, vocab, args)
    profile = dict(batch=batch, context=context, steps=steps)
    return peers.run_vllm(mode, ckpt, prompts, [draws] * batch, list(range(batch)), limit, args, workdir, False,
                          profile=profile)  # fmt: skip


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
    """Seconds per decode step at batch 1, host work included: the wall time of ``args.decode_steps`` steps after
    two warm-up steps, from the first launch until the last token is on the host, over the steps. Timed over the run,
    not step by step: with ``async_decode`` a step returns once the next is launched, so one step's own wall time is
    the host's part of it only."""
    max_len = min(1024, model.config.max_position_embeddings)
    pages = -(-max_len // args.block_size) * 2  # twice what the one request can hold
    mode, extra = engine_settings(mode)
    llm = LLM(model=model, backend=mode, max_num_seqs=1, max_model_len=max_len, num_kv_blocks=pages,
              block_size=args.block_size, enforce_eager=args.enforce_eager, **extra)  # fmt: skip
    warm = 2  # the first steps warm up (graph replay, allocator)
    llm.add_request(list(range(1, 129)), SamplingParams(max_tokens=args.decode_steps + warm + 1, seed=0,
                                                        ignore_eos=True))  # fmt: skip
    for _ in range(1 + warm):  # the prefill, then the warm-up steps
        llm.step()
    sync()
    t, steps = time.perf_counter(), 0
    while llm.has_unfinished_requests():
        llm.step()
        steps += 1
    sync()
    wall = time.perf_counter() - t
    del llm
    free_memory()
    if not steps:
        raise RuntimeError("decode_step_time: no decode step ran (was the request rejected?)")
    return wall / steps


# transformers' attention for HF generate: sdpa, except where the family's model has none (gpt-oss: its sinks)
HF_ATTENTION = {"gpt_oss": "eager"}


def hf_attention(family: str) -> str:
    return HF_ATTENTION.get(family, "sdpa")


def hf_model(model):
    """The HF transformers model of ``model``'s family (:func:`hf_attention`, bf16) holding the same weights
    (vexact_models keeps transformers' in-memory names and layouts, stacked experts included)."""
    import transformers

    hf_cfg = transformers.AutoConfig.for_model(**model.config.to_hf_dict())
    hf_cfg._attn_implementation = hf_attention(model.config.model_type)
    with torch.device(DEV):
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16).eval()
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all(m == "lm_head.weight" for m in missing), (missing, unexpected)
    hf.tie_weights()
    return hf


HF_SAMPLING = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=None)


def hf_kwargs(args) -> dict:
    """HF generate's sampling settings; ``--hf-static-cache`` adds the static KV cache, with which transformers
    compiles the decode step (its CUDA-graph path). Off by default: the compile's time is not bounded here."""
    return {**HF_SAMPLING, **({"cache_implementation": "static"} if args.hf_static_cache else {})}


def hf_decode_step(model, args) -> float:
    """HF generate's seconds per decode step at batch 1 (``peers.batch1_step``: prefill cancelled out)."""
    hf = [hf_model(model)]
    ids = torch.arange(1, 129, device=DEV)[None]
    with torch.no_grad():
        step = peers.batch1_step(
            lambda n: hf[0].generate(ids, max_new_tokens=n, min_new_tokens=n, **hf_kwargs(args)), args.decode_steps
        )
    hf.clear()
    free_memory()
    return step


def hf_throughput(model, prompts, args) -> dict:
    hf = hf_model(model)
    batch = prompts[: args.hf_prompts]
    width = max(len(p) for p in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(batch):  # left padding
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(DEV), mask.to(DEV)
    kw = hf_kwargs(args)
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
    return dict(tokens=tokens, wall=wall, tok_s=tokens / wall, prompt_lens=[len(p) for p in batch], gen_len=n)


# VeXact's own backends (fa4: FlashAttention 4 attention; draw: EngineConfig.draw_in_graph on; async:
# EngineConfig.async_decode on, the next step scheduled while the GPU runs this one)
ENGINE_MODES = (
    "invariant", "invariant-fa4", "invariant-draw", "invariant-async", "invariant-sync", "invariant-joint",
    "invariant-untuned", "invariant-2s", "invariant-fine", "invariant-fine-tuned", "invariant-slot", "invariant-lf",
    "invariant-hf", "invariant-kvsep", "invariant-tma1", "fast",
)  # fmt: skip
# the kernel-setting modes: constants of vexact_kernels' modules (speed only) each sets for its engine
KERNEL_MODES = {
    "invariant-slot": {"triton_ops.attention.DECODE_LONGEST_FIRST": False,
                       "triton_ops.attention.DECODE_HEADS_FIRST": False},
    "invariant-lf": {"triton_ops.attention.DECODE_LONGEST_FIRST": True,
                     "triton_ops.attention.DECODE_HEADS_FIRST": False},
    "invariant-hf": {"triton_ops.attention.DECODE_LONGEST_FIRST": False,
                     "triton_ops.attention.DECODE_HEADS_FIRST": True},
    "invariant-kvsep": {"rotary.FUSE_KV_WRITE": False},
    "invariant-tma1": {"triton_ops.logprobs.LOGPROBS_TMA_MIN_ROWS": 1},
}  # fmt: skip
PEER_MODES = ("vllm", "vllm-bi")  # vLLM default, vLLM with VLLM_BATCH_INVARIANT=1
MODE_NAMES = {
    "invariant": "VeXact invariant", "invariant-fa4": "VeXact invariant, FA4 attention",
    "invariant-draw": "VeXact invariant, draw in the decode graph",
    "invariant-async": "VeXact invariant, async decode",
    "invariant-sync": "VeXact invariant, synchronous loop",
    "invariant-joint": "VeXact invariant, mixed steps in one launch",
    "invariant-untuned": "VeXact invariant, linear forms by shape (not timed)",
    "invariant-2s": "VeXact invariant, decode as two half batches on two streams",
    "invariant-fine": "VeXact invariant, decode graphs every 8-32 rows",
    "invariant-fine-tuned": "VeXact invariant, decode graphs every 8-32 rows, forms timed at every one",
    "invariant-slot": "VeXact invariant, decode attention in slot order",
    "invariant-lf": "VeXact invariant, decode attention longest context first only",
    "invariant-hf": "VeXact invariant, decode attention KV heads first only",
    "invariant-kvsep": "VeXact invariant, KV cache write in a launch of its own",
    "invariant-tma1": "VeXact invariant, lm_head tiles through TMA at one row",
    "fast": "VeXact fast (mismatch baseline)", "vllm": "vLLM default",
    "vllm-bi": "vLLM VLLM_BATCH_INVARIANT=1", "hf": "HF generate",
}  # fmt: skip
QUICK = dict(num_prompts=64, prompt_len=[128, 512], gen_len=[64, 128], hf_prompts=32, hf_new_tokens=64, decode_steps=32)
# Named workloads (--workload): the flags each one sets; a flag given on the command line still wins. Both are the
# shape RL rollouts spend their time in: long generations at 256-512 in flight. vLLM's subprocess gets
# 1200 s: a vLLM batch-invariant run of 1.5M tokens with its start takes longer than the default 300.
RL_LIMITS = dict(max_num_seqs="256,512", max_num_batched_tokens=8192, modes="invariant,vllm,vllm-bi", grpo_prompts=0,
                 vllm_timeout=1200)  # fmt: skip
WORKLOADS = {
    "rl": dict(num_prompts=1024, prompt_len=[128, 512], gen_len=[1024, 2048], **RL_LIMITS),
    "rl-long": dict(num_prompts=256, prompt_len=[128, 512], gen_len=[4096, 8192], **RL_LIMITS),
}


def _fa4_worker(what: str, shape: str, args, *rest):
    """In a process of its own (the attention implementation is fixed per process): the same model, FA4 attention."""
    vk.set_attention_impl("fa4")
    model = make_model(shape, args.layers, seed=args.seed)
    if what == "decode":
        return decode_step_time(model, "invariant", args)
    if what == "profile":  # rest: the batch limit and the decode_wall dict
        limit, wall = rest
        return decode_kernels(model, "invariant", limit, args, wall)
    return engine_throughput(model, "invariant", *rest, args, profile=args.profile_steps)


def in_fa4_process(what: str, shape: str, args, *rest):
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(_fa4_worker, what, shape, args, *rest).result()


def print_free_memory(mode: str, limit: int) -> None:
    """Free device memory before an engine starts (each engine sizes its KV cache from it; vLLM refuses to start
    below gpu_memory_utilization)."""
    if DEV.type == "cuda":
        free, total = torch.cuda.mem_get_info(DEV)
        print(f"starting {mode} at batch limit {limit}: {free / GIB:.1f} of {total / GIB:.1f} GiB free", flush=True)


def run_engine(
    model, shape: str, mode: str, limit: int, prompts, params, args, keep_outputs: bool = False, profile: bool = True
) -> dict:
    """One VeXact engine's timed run (``profile``: then its decode steps' wall time for ``--profile-steps``)."""
    print_free_memory(mode, limit)
    if mode == "invariant-fa4":
        return in_fa4_process("throughput", shape, args, limit, prompts, params)
    steps = args.profile_steps if profile else 0
    with kernel_settings(mode):
        return engine_throughput(model, mode, limit, prompts, params, args, keep_outputs, profile=steps)


def median_round(rounds: list) -> dict | str:
    """One (batch limit, mode)'s result over ``--rounds``: the round of median tok/s (the lower middle of an even
    count), with ``tok_s_range`` (the least and most tok/s of the rounds) and ``rounds`` (how many gave numbers), the
    other rounds' profile and outputs dropped; a single round as it is; the first failure where no round gave
    numbers."""
    ok = [r for r in rounds if isinstance(r, dict)]
    if len(rounds) == 1:
        return rounds[0]
    if not ok:
        return next(r for r in rounds if not isinstance(r, dict))
    ranked = sorted(ok, key=lambda r: r["tok_s"])
    mid = dict(ranked[(len(ranked) - 1) // 2])
    last = ok[-1]  # the profile's wall time and the kept outputs come from the last round
    for key in ("decode_wall", "outputs"):
        if key in last:
            mid[key] = last[key]
    mid["tok_s_range"] = (ranked[0]["tok_s"], ranked[-1]["tok_s"])
    mid["rounds"] = len(ok)
    return mid


def decode_step(model, shape: str, mode: str, args) -> float:
    if mode == "invariant-fa4":
        return in_fa4_process("decode", shape, args)
    with kernel_settings(mode):
        return decode_step_time(model, mode, args)


def step_profile(model, shape: str, mode: str, limit: int, args, r) -> dict | str:
    """The results file's profile cell of a VeXact run ``r`` (its results, or why there are none)."""
    wall = r.get("decode_wall", "-") if isinstance(r, dict) else r
    if not isinstance(wall, dict):
        return wall
    try:
        if mode == "invariant-fa4":
            return in_fa4_process("profile", shape, args, limit, wall)
        with kernel_settings(mode):
            return decode_kernels(model, mode, limit, args, wall)
    except Exception as e:
        return failed(e)
    finally:
        free_memory()


def checkpoint_source(shape: str, args) -> dict:
    """What the random weights of ``make_model(shape, args.layers, args.seed)`` depend on: the same values give the
    same tensors (the device's generator draws them)."""
    import vexact_models

    return {
        "shape": shape, "layers": args.layers, "seed": args.seed, "vexact_models": vexact_models.__version__,
        "torch": torch.__version__, "device": torch.cuda.get_device_name(DEV) if DEV.type == "cuda" else DEV.type,
    }  # fmt: skip


def save_checkpoint(model, shape: str, args, workdir: Path) -> Path:
    """The HF checkpoint vLLM loads, in ``workdir``; reused where ``--ckpt-only`` (or an earlier run) wrote it."""
    return peers.save_hf_checkpoint(model, workdir / f"{SHAPES[shape][0]}-{shape}", checkpoint_source(shape, args))


def failed(e: BaseException) -> str:
    """A table cell for a run that raised (the traceback goes to stderr)."""
    traceback.print_exc()
    return f"failed: {type(e).__name__}: {str(e)[:160]}"


def peer_section(
    model, shape: str, args, bw: float, modes, batch_limits, workdir: Path | None, vllm_ver, summary: list | None = None
) -> list[str]:
    """The markdown section of one model shape: throughput per engine and batch limit, ratios to vLLM default,
    roofline fractions, decode step at batch 1 against the weight-bytes bound. A VeXact run that raises leaves its
    cells saying so and the others run. ``summary``: gets the section's numbers as ``throughput_report`` takes them
    (and ``failed``: the runs that raised)."""
    cfg = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_tok = peers.kv_bytes_per_token(cfg)
    prompts, params = workload(args, cfg.vocab_size)
    max_tokens, seeds = [p.max_tokens for p in params], [p.seed for p in params]
    ckpt = None
    vllm_runs = any(m in PEER_MODES for m in modes) and vllm_ver
    if vllm_runs:
        ckpt = save_checkpoint(model, shape, args, workdir)
    results: dict[tuple[int, str], dict | str] = {}
    step_s: dict[str, float | str] = {}
    # vLLM first: its start refuses to run when less than gpu_memory_utilization of the GPU is free, and on an
    # 80 GB H100 what this process had held for VeXact's engines left it 9 GiB (the first H100 peer table's failure)
    one_round = [(limit, m) for m in modes if m in PEER_MODES for limit in batch_limits]
    one_round += [(limit, m) for limit in batch_limits for m in modes if m in ENGINE_MODES]
    # --rounds: the whole sequence again, each run a new engine (a new vLLM process), so that a slow or fast process
    # shows as a spread instead of a ratio
    rounds = max(1, args.rounds)
    runs = [(r, limit, m) for r in range(rounds) for limit, m in one_round]
    per_round: dict[tuple[int, str], list] = {}
    # the model's weights wait on the host while vLLM runs: a full-depth MoE (Qwen3-30B-A3B: 57 GiB of bf16) held
    # here would leave vLLM less than gpu_memory_utilization of the GPU
    offload = bool(vllm_runs) and DEV.type == "cuda"
    on_host = False
    # with both, the draw in the graph is checked against the eager draw: the same tokens and logprobs
    ab = {"invariant", "invariant-draw"} <= set(modes)
    for rnd, limit, mode in runs:
        last = rnd == rounds - 1
        if rounds > 1:
            print(f"round {rnd + 1} of {rounds}: {mode} at batch limit {limit}", flush=True)
        if mode in ENGINE_MODES:
            if on_host:
                model.to(DEV)
                on_host = False
            keep = ab and last and mode in ("invariant", "invariant-draw")
            try:
                r = run_engine(model, shape, mode, limit, prompts, params, args, keep, profile=last)
            except Exception as e:
                r = failed(e)
            per_round.setdefault((limit, mode), []).append(r)
            free_memory()
            continue
        if not vllm_ver:
            per_round.setdefault((limit, mode), []).append(peers.NOT_INSTALLED)
            continue
        if offload and not on_host:
            model.to("cpu")
            on_host = True
            free_memory()
        batch1 = limit == batch_limits[0] and rnd == 0  # batch-1 decode: the first engine of each vLLM mode
        print_free_memory(mode, limit)
        r = peers.run_vllm(mode, ckpt, prompts, max_tokens, seeds, limit, args, workdir, batch1,
                           round_tag=f"round{rnd + 1}" if rounds > 1 else "")  # fmt: skip
        per_round.setdefault((limit, mode), []).append(r)
        if batch1:
            step_s[mode] = r.get("step_s", "-") if isinstance(r, dict) else r
    results.update({key: median_round(rs) for key, rs in per_round.items()})
    if on_host:  # the last run was vLLM's: back for HF generate, the batch-1 steps and the GRPO rows
        model.to(DEV)
    hf = hf_throughput(model, prompts, args) if "hf" in modes else None

    def fraction(r: dict, limit: int) -> float:
        need = peers.roofline_bytes(weight_bytes, kv_tok, [len(p) for p in prompts], max_tokens, limit,
                                    args.max_num_batched_tokens)  # fmt: skip
        return need / bw / r["wall"]

    lines = [
        f"## {SHAPES[shape][0]} {shape}-shaped, {cfg.num_hidden_layers} layers ({weight_bytes / GIB:.2f} GiB of bf16 "
        f"weights, {kv_tok / 1024:.0f} KiB of KV per token)",
        "",
        "| batch limit | engine | output tok/s | / vLLM default | roofline fraction | wall s | tokens |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for limit in batch_limits:
        ref = results.get((limit, "vllm"))
        for mode in (m for m in modes if m != "hf"):
            r = results[(limit, mode)]
            if not isinstance(r, dict):
                lines.append(f"| {limit} | {MODE_NAMES[mode]} | {r} | - | - | - | - |")
                continue
            ratio = f"{r['tok_s'] / ref['tok_s']:.2f}" if isinstance(ref, dict) and mode != "fast" else "-"
            tok_s = throughput_report.tok_s_cell(r)
            lines.append(f"| {limit} | {MODE_NAMES[mode]} | {tok_s} | {ratio} | {fraction(r, limit):.2f} "
                         f"| {r['wall']:.1f} | {r['tokens']} |")  # fmt: skip
    if hf:
        n = hf["gen_len"]
        need = peers.roofline_bytes(weight_bytes, kv_tok, hf["prompt_lens"], [n] * len(hf["prompt_lens"]),
                                    len(hf["prompt_lens"]), args.max_num_batched_tokens)  # fmt: skip
        frac = need / bw / hf["wall"]
        hf_mode = "static cache, compiled" if args.hf_static_cache else "eager"
        lines.append(f"| {args.hf_prompts} (one batch, {n} new tokens) | HF generate ({hf_mode}, "
                     f"{hf_attention(SHAPES[shape][0])} attention) | "
                     f"{hf['tok_s']:.0f} | - | {frac:.2f} | {hf['wall']:.1f} | {hf['tokens']} |")  # fmt: skip
    for limit in batch_limits if ab else []:
        a, b = results[(limit, "invariant")], results[(limit, "invariant-draw")]
        if isinstance(a, dict) and isinstance(b, dict):
            same = all(x.token_ids == y.token_ids and torch.equal(x.logprobs, y.logprobs)
                       for x, y in zip(a.pop("outputs"), b.pop("outputs"), strict=True))  # fmt: skip
            lines += ["", f"Batch limit {limit}: the draw in the decode graph gives the eager draw's tokens and "
                      f"logprobs (torch.equal, every request): {'yes' if same else 'NO'}"]  # fmt: skip
    # the goals measured in this run
    goal_rows = []
    for limit in batch_limits:
        inv, ref, bi = (results.get((limit, m)) for m in ("invariant", "vllm", "vllm-bi"))
        if isinstance(inv, dict) and isinstance(ref, dict):
            vs_bi = f"{inv['tok_s'] / bi['tok_s']:.2f}" if isinstance(bi, dict) else "-"
            goal_rows.append(f"| {limit} | {inv['tok_s'] / ref['tok_s']:.2f} | {vs_bi} |")
    if goal_rows:
        lines += ["", "| batch limit | invariant / vLLM default (goal >= 0.85) | invariant / vLLM batch-invariant "
                  "(goal > 1) |", "| --- | --- | --- |", *goal_rows]  # fmt: skip
    split = [
        (limit, mode, r["steps"])
        for (limit, mode), r in results.items()
        if mode in ENGINE_MODES and isinstance(r, dict) and "steps" in r
    ]
    if split:
        lines += ["", "Where VeXact's wall time goes: steps that only decode (CUDA graph replay) and steps with prompt "
                  "tokens (prefill chunks with the running decode rows, CUDA graphs padded to a token count), host "
                  "time included.", "",
                  "| batch limit | engine | decode-only steps | ms / step | steps with prompt tokens | ms / step | "
                  "share of wall in steps with prompt tokens | CUDA graphs (capture s, at start and each wake_up) |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for limit, mode, st in split:
            (nd, td), (nm, tm) = st["decode"], st["mixed"]
            r = results[(limit, mode)]
            graphs = f"{r.get('graphs', '-')} ({r.get('capture_s', 0.0):.1f} s)"
            if r.get("graph_draws"):
                graphs += f"; {r['graph_draws']} steps drew in a graph"
            picked = {shape: form for shape, form in (r.get("linear_picks") or {}).items() if form != "default"}
            if r.get("linear_picks"):
                graphs += (f"; linear forms timed at {len(r['linear_picks'])} shapes, off the default at "
                           f"{len(picked)}" + (f" ({', '.join(f'{k}: {v}' for k, v in picked.items())})"
                                               if picked else ""))  # fmt: skip
            lines.append(f"| {limit} | {MODE_NAMES[mode]} | {nd} | {td / max(nd, 1) * 1e3:.2f} | {nm} | "
                         f"{tm / max(nm, 1) * 1e3:.2f} | {tm / r['wall']:.2f} | {graphs} |")  # fmt: skip
    for limit in batch_limits:
        lines += steps_by_batch_lines(results, limit, modes)
    timelines = {f"{limit} {m}": r["timeline"] for (limit, m), r in results.items()
                 if isinstance(r, dict) and r.get("timeline")}  # fmt: skip
    if timelines and args.out:  # each step's [rows, prompt tokens, seconds], for a plot of the runs side by side
        path = Path(args.out).with_name(f"{Path(args.out).stem}-steps-{shape}.json")
        path.write_text(json.dumps(timelines))
        lines += ["", f"Every step of these runs: `{path.name}` (by \"batch limit mode\": [requests, prompt tokens, "
                  "seconds] a step)."]  # fmt: skip
    step_bytes = peers.decode_weight_bytes(model)
    bound = step_bytes / bw
    lines += ["", f"Decode step at batch 1 (host work included); bound = weight bytes one step reads "
              f"({step_bytes / GIB:.2f} GiB: every weight, but only the k routed experts of each MoE layer and one "
              f"row of an untied input embedding) / copy bandwidth = {bound * 1e3:.3f} ms (goal for VeXact <= 1.3x). "
              f"VeXact: wall time of {args.decode_steps} steps / {args.decode_steps}; vLLM and HF: (time of 1 + "
              f"{args.decode_steps} tokens - time of 1 token) / {args.decode_steps}, best of 3.",
              "", "| engine | step ms | x bound |", "| --- | --- | --- |"]  # fmt: skip
    for mode in modes:
        if mode in ENGINE_MODES:
            try:
                t = decode_step(model, shape, mode, args)
            except Exception as e:
                t = failed(e)
            free_memory()
        elif mode in PEER_MODES:
            t = step_s.get(mode, peers.NOT_INSTALLED if not vllm_ver else "-")
        else:
            t = hf_decode_step(model, args)
        cells = f"{t * 1e3:.3f} | {t / bound:.2f}" if isinstance(t, float) else f"{t} | -"
        lines.append(f"| {MODE_NAMES[mode]} | {cells} |")
        if isinstance(t, str) and t.startswith("failed"):
            results[("batch 1", mode)] = t
    lines.append("")
    # the profiles last: torch.profiler leaves CUPTI set up in this process, which may slow what runs after it
    profiles = {}
    if args.profile_steps:
        for limit in batch_limits:
            profiles[limit] = {m: step_profile(model, shape, m, limit, args, results[(limit, m)])
                               for m in modes if m in ENGINE_MODES}  # fmt: skip
    if args.profile_steps and vllm_runs and not args.no_peer_profile:
        if DEV.type == "cuda":  # the weights wait on the host, as for the timed vLLM runs
            model.to("cpu")
            free_memory()
        for limit, mode in ((limit, m) for limit in batch_limits for m in modes if m in PEER_MODES):
            r = results[(limit, mode)]
            if not isinstance(r, dict):  # no timed run: its reason
                profiles[limit][mode] = r
                continue
            batch, context = peer_profile_shape(results, limit, modes, args)
            print_free_memory(f"{mode} (profile)", limit)
            try:
                profiles[limit][mode] = peer_profile(mode, ckpt, limit, batch, context, cfg.vocab_size, args, workdir)
            except Exception as e:
                profiles[limit][mode] = failed(e)
        model.to(DEV)
    if summary is not None:
        rows = {limit: {m: report_row(results[(limit, m)], m, fraction, limit) for m in modes if m != "hf"}
                for limit in batch_limits}  # fmt: skip
        bad = [f"{mode} ({limit}): {r}" for (limit, mode), r in results.items() if str(r).startswith("failed")]
        bad += [f"profile of {mode} ({limit}): {p}" for limit, cells in profiles.items() for mode, p in cells.items()
                if str(p).startswith("failed") and isinstance(results[(limit, mode)], dict)]  # fmt: skip
        model_name = f"{SHAPES[shape][0]} {shape}-shaped, {cfg.num_hidden_layers} layers"
        summary.append(dict(model=model_name, rows=rows, profiles=profiles, failed=bad))
    return lines


def batch_ranges(limit: int) -> list[tuple[int, int]]:
    """Ranges of requests a step runs, for the table of steps by batch size: the full batch, then quarters of the
    batch limit down to a sixteenth, then below, and one request alone."""
    edges = [limit, limit, 3 * limit // 4, limit // 2, limit // 4, limit // 16, 2, 1]
    out = [(limit, limit)] if limit > 1 else []
    for lo, hi in zip(edges[2:], edges[1:-1], strict=True):
        lo, hi = max(lo, 2), min(hi - 1, limit - 1)  # hi: below the range above
        if lo <= hi and (lo, hi) not in out:
            out.append((lo, hi))
    out.append((1, 1))
    return out


def step_buckets(timeline: list, limit: int) -> dict[tuple[str, tuple[int, int]], list]:
    """A run's steps (``[rows, prompt tokens, seconds]`` each) by kind (``"all"``: every step; ``"decode"``: no
    prompt tokens; ``"prompt"``: with prompt tokens) and range of rows (:func:`batch_ranges`; past the limit: in the
    full batch's range; a step of no rows: ``(0, 0)``): ``[steps, seconds]`` each."""
    ranges = batch_ranges(limit)
    out: dict[tuple[str, tuple[int, int]], list] = {}
    for rows, prompt, sec in timeline:
        rng = (0, 0) if rows < 1 else next((r for r in ranges if r[0] <= min(rows, limit) <= r[1]), ranges[0])
        for kind in ("all", "prompt" if prompt else "decode"):
            cell = out.setdefault((kind, rng), [0, 0.0])
            cell[0] += 1
            cell[1] += sec
    return out


def steps_by_batch_lines(results: dict, limit: int, modes) -> list[str]:
    """The table of each engine's timed steps by kind and batch size at one batch limit (VeXact: from its launches;
    vLLM: from the plugin's step log, ``peers.read_step_log``), with the seconds the first VeXact mode spends there
    beyond vLLM default; [] where no run has a timeline."""
    runs = {m: results[(limit, m)] for m in modes if m != "hf" and (limit, m) in results}
    runs = {m: r for m, r in runs.items() if isinstance(r, dict) and r.get("timeline")}
    if not runs:
        return []
    buckets = {m: step_buckets(r["timeline"], limit) for m, r in runs.items()}
    ours = next((m for m in runs if m in ENGINE_MODES), None)
    diff = ours is not None and "vllm" in runs
    order = {"all": 0, "decode": 1, "prompt": 2}
    keys = sorted({k for b in buckets.values() for k in b}, key=lambda k: (order[k[0]], -k[1][1]))
    head = ["steps", "requests a step", *(MODE_NAMES[m] for m in runs)]
    if diff:
        head.append(f"{MODE_NAMES[ours]} - vLLM default, s")
    lines = ["", f"Steps by batch size at batch limit {limit}: steps, mean ms a step, seconds in all (a step's time is "
             "from its launch, or for vLLM its schedule call, to the next one's, host work included); \"with prompt "
             "tokens\": the step runs prompt chunks, with or without decode rows. Both engines launch a step before "
             "the one before it is done (VeXact's async_decode, vLLM's async scheduling), so time a step leaves to the "
             "GPU shows in the step after it: compare the engines by the rows of all steps.", "",
             "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]  # fmt: skip
    for kind, (lo, hi) in keys:
        name = {"all": "all steps", "decode": "decode only", "prompt": "with prompt tokens"}[kind]
        cells = [name, str(lo) if lo == hi else f"{lo}-{hi}"]
        for m in runs:
            n, sec = buckets[m].get((kind, (lo, hi)), [0, 0.0])
            cells.append(f"{n} x {sec / n * 1e3:.2f} ms = {sec:.2f} s" if n else "-")
        if diff:
            a, b = (buckets[m].get((kind, (lo, hi)), [0, 0.0])[1] for m in (ours, "vllm"))
            cells.append(f"{a - b:+.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    totals = ["whole run", "-"]
    seconds = {m: sum(x[2] for x in r["timeline"]) for m, r in runs.items()}
    for m in runs:
        totals.append(f"{len(runs[m]['timeline'])} steps, {seconds[m]:.2f} s of {runs[m]['wall']:.2f} s wall")
    if diff:
        totals.append(f"{seconds[ours] - seconds['vllm']:+.2f}")
    lines.append("| " + " | ".join(totals) + " |")
    return lines


def report_row(r: dict | str, mode: str, fraction, limit: int) -> dict | str:
    """One row of the results file (``throughput_report``) from a run's results, or the reason it has none."""
    if not isinstance(r, dict):
        return r
    row = dict(tok_s=r["tok_s"], roofline=fraction(r, limit), wall=r["wall"], preemptions=r.get("preemptions", "-"))
    if r.get("tok_s_range"):
        row["tok_s_range"] = tuple(r["tok_s_range"])
    if "steps" in r:
        n, t = r["steps"]["decode"]
        row["decode_ms"] = t / n * 1e3 if n else None
    if mode == "fast":
        row["baseline"] = True  # the mismatch baseline: no ratio to vLLM
    return row


def arg_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="1.7b", help=f"comma-separated shapes from {','.join(SHAPES)}")
    ap.add_argument(
        "--layers",
        type=int,
        default=None,
        help="decoder layers (default: the shape's own: 28 in Qwen3-0.6B and 1.7B, 36 in Qwen3-8B, 48 in "
        "Qwen3-30B-A3B, 27 in Moonlight)",
    )
    preset = ap.add_mutually_exclusive_group()
    preset.add_argument("--quick", action="store_true", help=f"a smaller workload for a first look: {QUICK}")
    preset.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        help="a named workload: sets the flags below to its values, except those given on the command line; "
        + "; ".join(f"{name}: {preset}" for name, preset in WORKLOADS.items()),
    )
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[128, 1024], metavar=("LO", "HI"))
    ap.add_argument("--gen-len", type=int, nargs=2, default=[128, 384], metavar=("LO", "HI"))
    ap.add_argument("--max-num-seqs", default="64,256", help="comma-separated batch limits")
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--modes", default="invariant,fast,vllm,vllm-bi,hf", help=f"comma-separated from {MODE_NAMES}")
    ap.add_argument("--hf-prompts", type=int, default=64, help="prompts in HF generate's one batch")
    ap.add_argument("--hf-new-tokens", type=int, default=256)
    ap.add_argument("--grpo-prompts", type=int, default=32, help="GRPO row: prompts (0: no GRPO row)")
    ap.add_argument("--grpo-n", type=int, default=8, help="GRPO row: samples per prompt")
    ap.add_argument("--grpo-prompt-len", type=int, nargs=2, default=[512, 2048], metavar=("LO", "HI"))
    ap.add_argument("--grpo-gen-len", type=int, nargs=2, default=[128, 512], metavar=("LO", "HI"))
    ap.add_argument("--grpo-max-num-seqs", type=int, default=256, help="GRPO row: batch limit")
    ap.add_argument("--grpo-only", action="store_true", help="only the GRPO-shaped row")
    ap.add_argument("--hf-static-cache", action="store_true", help="HF generate with a static cache (compiled)")
    ap.add_argument("--decode-steps", type=int, default=64, help="decode steps timed at batch 1")
    ap.add_argument(
        "--rounds", type=int, default=1,
        help="run every engine and vLLM mode this many times, in turn (each a new engine, vLLM a new process); each "
        "row reports the median round's tok/s and the rounds' range, ratios divide medians",
    )  # fmt: skip
    ap.add_argument("--enforce-eager", action="store_true", help="engines without CUDA graphs")
    ap.add_argument(
        "--block-size",
        type=int,
        default=EngineConfig.block_size,
        help="tokens per KV page of VeXact's engines (vLLM keeps its own); 128 is FA4's tile_n at head_dim 128, the "
        "page size its TMA path takes",
    )
    ap.add_argument("--vllm-site", help="directory holding vLLM (scripts/staging/vllm_device_wheels.sh: /tmp/vllmsite)")
    ap.add_argument("--vllm-timeout", type=int, default=300, help="seconds for one vLLM subprocess")
    ap.add_argument(
        "--vllm-logprobs",
        choices=("sampled", "none"),
        default="sampled",
        help="what vLLM returns beside each token: 'sampled' (default) its logprob (SamplingParams(logprobs=0), as "
        "verl's vLLM rollout asks and as VeXact always gives), 'none' no logprobs (vLLM then skips the log-softmax "
        "over the vocabulary)",
    )
    ap.add_argument("--ckpt-dir", help="where the HF checkpoint for vLLM and the worker logs go (default: a temp dir)")
    ap.add_argument("--ckpt-only", action="store_true",
                    help="only write each --models shape's HF checkpoint into --ckpt-dir and exit (no vLLM needed); a "
                    "later run with the same --ckpt-dir, --layers and --seed on this machine reuses it")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="also write the markdown report to this file")
    ap.add_argument(
        "--results-md",
        help="also write the results file (throughput-rl-<gpu>.md style: date, GPU, commit, command, then per model "
        "and batch limit each mode's tok/s, ratios to vLLM default and batch-invariant, roofline fraction, decode-only "
        "step ms, and with --profile-steps where the decode step goes)",
    )
    ap.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="where VeXact's decode step goes: this many decode steps at the batch limit and the workload's mean "
        "context timed after each VeXact run, then as many profiled (torch.profiler) after every timed run: kernel "
        "time by kind and the host gap, in --results-md; then the same for each vLLM mode that ran, at the same batch "
        "and context",
    )
    ap.add_argument(
        "--no-peer-profile",
        action="store_true",
        help="with --profile-steps, profile VeXact's decode step only, not vLLM's (each vLLM profile starts an engine "
        "of its own: about a minute per mode and batch limit)",
    )
    ap.add_argument("--note", action="append", default=[], help="a line for the results file's header (repeatable)")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only to smoke-test the script with --models tiny")
    return ap


def vllm_logprobs_words(args) -> str:
    """What the results say vLLM returned beside each token (``--vllm-logprobs``)."""
    if args.vllm_logprobs == "sampled":
        return "vLLM returns each drawn token's logprob (logprobs=0, as verl's vLLM rollout asks; VeXact always does)"
    return "vLLM returns no logprobs (VeXact still computes each drawn token's)"


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, with ``--quick`` or ``--workload NAME`` expanded: the preset's values replace the flags'
    defaults, and flags given on the command line keep their values. ``args.preset_overrides``: those flags that
    differ from the preset ({dest: value}). The namespace pickles (the invariant-fa4 worker process gets it)."""
    ap = arg_parser()
    args = ap.parse_args(argv)
    preset = WORKLOADS[args.workload] if args.workload else QUICK if args.quick else {}
    if preset:
        ap.set_defaults(**preset)
        args = ap.parse_args(argv)
    args.preset_overrides = {k: getattr(args, k) for k, v in preset.items() if getattr(args, k) != v}
    return args


def git_commit() -> str:
    """The checkout's commit (``$VEXACT_COMMIT`` where set: a copy of the tree without ``.git``), marked when tracked
    files differ from it."""
    if os.environ.get("VEXACT_COMMIT"):
        return os.environ["VEXACT_COMMIT"]
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=30)  # fmt: skip
        if head.returncode != 0:
            return "unknown (not a git checkout: set VEXACT_COMMIT)"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=30).stdout.strip()  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({type(e).__name__}: set VEXACT_COMMIT)"
    return head.stdout.strip() + (" with uncommitted changes to tracked files" if dirty else "")


# the environment that changes what a run measures: named in front of the command in the results file
RUN_ENV = ("CUDA_VISIBLE_DEVICES", "VEXACT_ATTENTION", "VEXACT_DRAW_IN_GRAPH")


def command_line(argv) -> str:
    """The command as run: the environment variables of :data:`RUN_ENV` that are set, then the script and its
    arguments."""
    env = [f"{k}={shlex.quote(os.environ[k])}" for k in RUN_ENV if k in os.environ]
    script = Path(__file__).resolve().relative_to(Path(__file__).resolve().parents[1])
    return " ".join([*env, "python", str(script), shlex.join(argv)]).strip()


def results_meta(args, argv, gpu: str, vllm_ver: str | None, bw: float, batch_limits) -> dict:
    """The results file's header: date, GPU, commit, command, the workload and what else the numbers depend on."""
    name = f"the {args.workload} workload" if args.workload else "the workload"
    notes = []
    if args.preset_overrides:
        changed = ", ".join(f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                            for k, v in args.preset_overrides.items())  # fmt: skip
        notes.append(f"Flags in place of {args.workload or 'quick'}'s own: {changed}")
    notes += args.note
    if args.profile_steps and len(args.models.split(",")) > 1:
        notes.append(
            "--profile-steps with several models: a later model's timed runs follow an earlier one's torch.profiler "
            "runs in this process (CUPTI left set up); one model a run keeps them apart"
        )
    if args.rounds > 1:
        notes.append(
            f"{args.rounds} rounds: every mode ran {args.rounds} times in turn, each a new engine (vLLM a new "
            "process); a row's tok/s is its median round's, with the rounds' least and most in brackets; ratios "
            "divide medians"
        )
    notes.append(
        f"torch {torch.__version__}, vLLM {vllm_ver or peers.NOT_INSTALLED}; VeXact's attention: "
        f"`{vk.get_attention_impl()}`; device-to-device copy bandwidth (read + write) {bw / 1e9:.0f} GB/s"
    )
    return dict(
        title="Engine throughput against vLLM" + (f", workload {args.workload}" if args.workload else ""),
        date=str(datetime.date.today()), gpu=gpu, commit=git_commit(), command=command_line(argv), notes=notes,
        mode_names=MODE_NAMES,
        workload=(
            f"Workload: {name}, {args.num_prompts} prompts of {args.prompt_len[0]}-{args.prompt_len[1]} random "
            f"tokens, {args.gen_len[0]}-{args.gen_len[1]} generated tokens each (ignore_eos; temperature 1, no "
            f"top-k/top-p, a seed per request), batch limits {', '.join(map(str, batch_limits))}, "
            f"{args.max_num_batched_tokens} tokens per step, CUDA graphs {'off' if args.enforce_eager else 'on'}, "
            f"VeXact's KV pages of {args.block_size} tokens, random bf16 weights, {args.layers or 'all'} layers; "
            "vLLM loads the same weights from an HF checkpoint, one subprocess per mode and batch limit, "
            f"gpu_memory_utilization {args.gpu_memory_utilization}; {vllm_logprobs_words(args)}."
        ),
    )  # fmt: skip


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    ap = arg_parser()  # for its errors
    if args.block_size < 1:
        ap.error(f"--block-size: tokens per KV page must be a positive integer, got {args.block_size}")
    modes = args.modes.split(",")
    bad = [m for m in modes if m not in MODE_NAMES]
    if bad:
        ap.error(f"--modes: unknown {bad}; allowed: {','.join(MODE_NAMES)}")
    if args.profile_steps < 0:
        ap.error(f"--profile-steps: decode steps to profile must be >= 0, got {args.profile_steps}")
    if args.rounds < 1:
        ap.error(f"--rounds: runs of each mode must be >= 1, got {args.rounds}")
    for mode in modes:
        try:
            engine_settings(mode)
        except UnsupportedMode as e:
            ap.error(f"--modes: {e}")
    global DEV
    DEV = torch.device(args.device)
    if DEV.type == "cuda" and not torch.cuda.is_available():
        print("throughput.py needs a CUDA device", file=sys.stderr)
        return 2
    shapes = args.models.split(",")
    for shape in shapes:
        if shape not in SHAPES:
            ap.error(f"--models: unknown shape {shape!r}; known: {','.join(SHAPES)}")
    if args.ckpt_only:
        if not args.ckpt_dir:
            ap.error("--ckpt-only writes the checkpoints into --ckpt-dir: name it")
        for shape in shapes:
            model = make_model(shape, args.layers, seed=args.seed)
            print(f"{shape}: {save_checkpoint(model, shape, args, Path(args.ckpt_dir))}")
            del model
            free_memory()
        return 0
    batch_limits = [int(x) for x in args.max_num_seqs.split(",")]
    vllm_ver = peers.vllm_version(args.vllm_site) if any(m in PEER_MODES for m in modes) else None
    workdir = None  # the HF checkpoint and the vLLM workers' specs, results and logs
    if vllm_ver:
        workdir = Path(args.ckpt_dir or tempfile.mkdtemp(prefix="vexact-peers-"))
        workdir.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name() if DEV.type == "cuda" else "CPU"
    lines = [
        f"# Engine throughput against vLLM ({gpu}, "
        f"{datetime.date.today()}, torch {torch.__version__}, vLLM {vllm_ver or peers.NOT_INSTALLED})",
        "",
        f"Run: `{command_line(argv)}`",
        "",
        f"Workload: {args.num_prompts} prompts of {args.prompt_len[0]}-{args.prompt_len[1]} random tokens, "
        f"{args.gen_len[0]}-{args.gen_len[1]} generated tokens each (ignore_eos; temperature 1, no top-k/top-p, a "
        f"seed per request), batch limits {batch_limits}, {args.max_num_batched_tokens} tokens per step, CUDA graphs "
        f"{'off' if args.enforce_eager else 'on'}, VeXact's KV pages of {args.block_size} tokens; the same prompts, "
        "lengths and seeds in every engine. vLLM loads "
        f"the same weights from an HF checkpoint directory (skip_tokenizer_init, token-id prompts), one subprocess "
        f"per mode and batch limit, gpu_memory_utilization {args.gpu_memory_utilization}; "
        f"{vllm_logprobs_words(args)}. HF generate: one "
        f"left-padded batch of {args.hf_prompts} of the same prompts, {args.hf_new_tokens} new tokens each, sdpa "
        f"attention (eager for gpt-oss), bf16, {'static cache (compiled)' if args.hf_static_cache else 'eager'}. "
        f"Random weights, {args.layers or 'all'} layers. Roofline fraction: least bytes the run must "
        "read (a full weight pass per decode step at the batch limit + the KV each step attends + a weight pass per "
        "prefill chunk) / copy bandwidth / wall time (benchmarks/peers.py). VeXact fast is the mismatch baseline "
        "only, not a speed anchor.",
        "",
        f"VeXact's attention on CUDA: `{vk.get_attention_impl()}` (`$VEXACT_ATTENTION`); rows without top-k/top-p "
        "draw with the fused sampling kernel.",
        "",
    ]
    bw = hardware.copy_bandwidth(DEV)
    lines += [f"Device-to-device copy bandwidth (read + write): {bw / 1e9:.0f} GB/s", ""]
    meta = results_meta(args, argv, gpu, vllm_ver, bw, batch_limits)
    summary: list[dict] = []
    for shape in tqdm(shapes, desc="models"):
        model = make_model(shape, args.layers, seed=args.seed)
        if not args.grpo_only:
            lines += peer_section(model, shape, args, bw, modes, batch_limits, workdir, vllm_ver, summary)
        if args.grpo_prompts > 0:
            lines += grpo_rows(model, [m for m in modes if m in ("invariant", "fast")], args)
        del model
        free_memory()
        if args.results_md:  # after each model: a later model's failure keeps the earlier tables
            Path(args.results_md).write_text(throughput_report.results_markdown(meta, summary) + "\n")
    report = "\n".join(lines)
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report + "\n")
    bad = [line for sec in summary for line in sec["failed"]]
    if bad:
        print("runs that raised (their cells say so):\n  " + "\n  ".join(bad), file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
