"""Profiling shared by the benchmarks and ``scripts/profiling/``: the GPU kernels of a profiled run per step (the table
``scripts/profiling/profile_decode.py`` and ``benchmarks/trainer.py --profile`` print), those kernels' time in buckets
by kind and the wall time of decode steps (``benchmarks/throughput.py --profile-steps``), and an engine brought to a
batch of decoding requests."""

from __future__ import annotations

import re
import statistics
import time

import torch

# Kinds of GPU kernel, by name; the first pattern that matches a (lower-cased) kernel name wins, the rest is "other".
# Names: vexact_kernels' Triton kernels (``_attn_fwd``, ``_matmul_kernel``, ``_grouped_mm_kernel``, ...), FA4's CuTe
# DSL kernels (``kernel_cutlass_kernel_flash_attncute...``), cuBLAS (``nvjet_*``, ``*gemm*``, ``gemv*``) and torch's
# own. FA4's names hold "cutlass" too, so attention is matched before GEMM. ``_combine_kernel`` is matmul.py's split-K
# sum and also moe.py's expert combine: it counts as GEMM, which moves that kernel out of MoE for MoE models.
# vLLM's (``benchmarks/peers.py``'s profile): FA3 (``flash::FlashAttnFwdSm90``, ``FlashAttnFwdCombine``,
# ``prepare_varlen_num_blocks_kernel``), ``reshape_and_cache_flash_kernel``, its CUDA ops (``rms_norm_kernel``,
# ``fused_add_rms_norm_kernel``, ``rotary_embedding_kernel``, ``act_and_mul_kernel``, MoE routing ``topkGating*``),
# Inductor's fusions of the same layers where vLLM compiles them (``triton_red_fused_..._rsqrt_0``: an RMSNorm;
# ``..._silu_...``), the batch-invariant mode's Triton kernels (``matmul_kernel_persistent``, ``bmm_kernel``,
# ``_log_softmax_kernel``, ``_rms_norm_kernel``), the Triton attention's ``reduce_segments``, and the sampler's torch
# kernels: softmax (``cunn_SoftMaxForward``, ``softmax_warp_forward``), the exponential draw
# (``distribution_elementwise_grid_stride_kernel``) and the argmax (``reduce_kernel<..., ArgMaxOps>``), or its Triton
# kernels (``_temperature_kernel``, ``_gumbel_sample_kernel``, ``_topk_topp_kernel``, ``_min_p_kernel``,
# ``_penalties_kernel``). Kernels named for an elementwise functor only (the sampler's division by the temperature and
# by the draw, dtype copies) or for an Inductor fusion whose ops say no kind (a rotary without rsqrt) are "other".
# vLLM's lm_head is a cuBLAS GEMM (GEMM), VeXact's runs inside its logprobs kernel (sampler/logprobs): the two
# engines' rows differ there by construction, and no kernel name tells the lm_head's GEMM from the others.
BUCKETS = ("attention", "GEMM", "MoE", "sampler/logprobs", "norm/rotary/activation", "other")
BUCKET_PATTERNS = (
    ("MoE", r"grouped_mm|grouped_wgrad|_route_kernel|grouped_route|topkgating|moe|expert"),
    (
        "sampler/logprobs",
        r"logprob|gumbel|softmax|sampl|argmax|temperature|distribution_elementwise|exponential|topk_topp|_min_p_|penalt",
    ),
    ("attention", r"attn|attention|flash|fmha|sdpa|_write_kv|paged|reshape_and_cache|reduce_segments"),
    ("norm/rotary/activation", r"rms_norm|layer_norm|layernorm|rsqrt|rotary|rope|silu|gelu|act_and_mul|swiglu"),
    ("GEMM", r"matmul|gemm|gemv|bmm_kernel|nvjet|cublas|cutlass|xmma|_combine_kernel|splitk"),
)
_COMPILED = tuple((bucket, re.compile(pattern)) for bucket, pattern in BUCKET_PATTERNS)


def kernel_bucket(name: str) -> str:
    """The kind of a GPU kernel from its name: one of :data:`BUCKETS`."""
    low = name.lower()
    for bucket, pattern in _COMPILED:
        if pattern.search(low):
            return bucket
    return "other"


def bucket_kernel_times(times: dict[str, float]) -> dict[str, float]:
    """Kernel time summed by kind: ``{kernel name: time}`` -> ``{bucket: time}`` with every bucket of
    :data:`BUCKETS`, in that order (a bucket no kernel fell in holds 0.0)."""
    out = dict.fromkeys(BUCKETS, 0.0)
    for name, t in times.items():
        out[kernel_bucket(name)] += t
    return out


def kernel_events(prof) -> list:
    """The GPU events of a finished ``torch.profiler.profile`` that are kernels and copies, not the ranges user
    annotations (FSDP's, record_function's) draw on the GPU row."""
    return [
        e
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
    ]


def kernel_times(prof) -> dict[str, float]:
    """Microseconds of GPU time per kernel name over the whole profiled run (graph replays included: CUPTI records
    the kernels a graph launches)."""
    out: dict[str, float] = {}
    for e in kernel_events(prof):
        out[e.name] = out.get(e.name, 0.0) + e.device_time
    return out


def kernel_table(prof, steps: int, top: int = 18) -> list[str]:
    """Lines: kernels and kernel time per step, then the ``top`` kernels by time (count, us per step, us each), from a
    finished ``torch.profiler.profile`` over ``steps`` steps."""
    kernels = kernel_events(prof)
    gpu_us = sum(e.device_time for e in kernels) / steps
    lines = [f"  GPU kernels per step: {len(kernels) / steps:.0f}, {gpu_us / 1e3:.3f} ms of kernel time per step"]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.device_time)
    lines.append(f"  {'kernel':<60} {'per step':>8} {'us/step':>9} {'us each':>8}")
    for name, times in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(
            f"  {name[:60]:<60} {len(times) / steps:>8.0f} {sum(times) / steps:>9.1f} {statistics.mean(times):>8.2f}"
        )
    return lines


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profile_run(run, steps: int):
    """``run(k)`` for k < steps under ``torch.profiler`` (CPU and, where there is one, CUDA activities), device synced
    at the end; the finished profile. On CPU it records no kernels (a smoke of the callers)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for k in range(steps):
            run(k)
        _sync()
    return prof


def fill_decode_batch(llm, prompts, params) -> int:
    """Add the requests and step the engine until every one of them is running and has drawn at least two tokens
    (its prompt prefilled, a decode step behind it): the next steps decode only. Returns the steps it took."""
    for prompt, p in zip(prompts, params, strict=True):
        llm.add_request(prompt, p)
    n, steps = len(prompts), 0
    while len(llm.running_sequences()) < n or any(len(s.output_token_ids) < 2 for s in llm.running_sequences()):
        if not llm.has_unfinished_requests():
            raise RuntimeError(f"fill_decode_batch: the requests finished before all {n} were decoding")
        llm.step()
        steps += 1
    return steps


def decode_step_wall(llm, steps: int) -> float:
    """Mean wall ms of the engine's next ``steps`` decode steps, host work included (one step first, so that every
    timed step follows a decode step; device synced at both ends). The engine must hold a decoding batch
    (:func:`fill_decode_batch`) with ``steps + 1`` tokens left to draw. Time it in a process that has not run
    ``torch.profiler`` yet: kineto leaves CUPTI set up after a profile, and a profile slowed the later work of a
    training process by 10-20% (pytorch/pytorch#144455)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    llm.step()
    _sync()
    t = time.perf_counter()
    for _ in range(steps):
        llm.step()
    _sync()
    return (time.perf_counter() - t) * 1e3 / steps


def decode_step_kernels(llm, steps: int, top: int = 8) -> dict:
    """GPU kernel time of the engine's next ``steps`` decode steps under ``torch.profiler`` (one step first), in ms
    per step: ``kernel_ms`` in all, ``buckets`` by kind (:func:`bucket_kernel_times`) and the ``top`` costliest
    kernels as (name, ms, bucket). The engine must hold a decoding batch with ``steps + 1`` tokens left to draw. The
    device is synced after the first step, so that an engine whose step returns before its kernels end (vLLM's async
    scheduling, VeXact's ``async_decode``) leaves none of that step's kernels in the profile."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    llm.step()
    _sync()
    kernels = kernel_times(profile_run(lambda k: llm.step(), steps))
    buckets = {b: us / steps / 1e3 for b, us in bucket_kernel_times(kernels).items()}
    best = sorted(kernels.items(), key=lambda kv: -kv[1])[:top]
    return dict(
        steps=steps, kernel_ms=sum(buckets.values()), buckets=buckets,
        top_kernels=[(name, us / steps / 1e3, kernel_bucket(name)) for name, us in best],
    )  # fmt: skip
