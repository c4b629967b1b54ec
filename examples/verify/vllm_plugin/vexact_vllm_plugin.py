"""A vLLM general plugin for the peer runs (``benchmarks/peers.py``, the verify pair's vllm arm): bf16 gpt-oss.

vLLM 0.24.0 keeps a fused MoE layer's weights under ``mlp.experts.routed_experts.`` (``w13_weight``, ``w2_weight``,
``w13_bias``, ``w2_bias``). Its gpt-oss loader maps an MXFP4 checkpoint's names there, but its path for every other
checkpoint (``GptOssModel._load_weights_other``: bf16 experts, ``gate_up_proj`` / ``down_proj`` with their biases)
looks them up under ``mlp.experts.`` and stops at the first one: ``KeyError: 'layers.0.mlp.experts.w2_weight'`` when
vLLM loads the checkpoint, ``'layers.0.mlp.experts.w13_weight'`` when verl's rollout syncs the actor's bf16 weights
(both seen on an H200 with the stack of ``scripts/staging/vllm_device_wheels.sh``; vllm-project/vllm#45830). RL
trains gpt-oss in bf16, so neither the throughput peer nor verl's default stack runs gpt-oss without this.

``register`` (the entry point in this folder's ``vexact_vllm_plugin-0.1.dist-info``, found by ``importlib.metadata``
once the folder is on ``PYTHONPATH``; vLLM calls every ``vllm.general_plugins`` entry in each of its processes) wraps
that loader so that an expert weight's name that is not a parameter of the model, and whose ``routed_experts.``
form is, takes that form. Names are all it changes: each tensor reaches vLLM's own loading code as it came. On a
vLLM that already finds the names (or has no such loader) it changes nothing.

``register_step_log`` (a second entry point) serves ``benchmarks/throughput.py``'s step timeline: where
``VEXACT_VLLM_STEP_LOG`` names a file, each call of the v1 scheduler's ``schedule`` appends one line to it, ``TIME
ROWS PROMPT_TOKENS`` (``time.perf_counter()``, the requests the step runs, the tokens of its rows that run more than
one token: prompt chunks). It runs in the engine core's process; the file is line-buffered, so the lines are there
however that process ends. Unset, it patches nothing.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Iterable, Iterator

import torch

EXPERTS = ".mlp.experts."
ROUTED = ".mlp.experts.routed_experts."
PATCHED = "_vexact_routed_names"
STEP_LOG = "VEXACT_VLLM_STEP_LOG"
LOGGED = "_vexact_step_log"


def routed_name(name: str, params: set[str] | frozenset[str]) -> str:
    """``name``, or its ``routed_experts.`` form where only that form is a parameter of the model."""
    if name in params or EXPERTS not in name or ROUTED in name:
        return name
    routed = name.replace(EXPERTS, ROUTED, 1)
    return routed if routed in params else name


def routed_weights(
    weights: Iterable[tuple[str, torch.Tensor]], params: set[str] | frozenset[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        yield routed_name(name, params), tensor


def with_routed_names(load):
    """``GptOssModel._load_weights_other`` with the experts' names mapped (see the module's docstring)."""
    if getattr(load, PATCHED, False):
        return load

    @functools.wraps(load)
    def wrapped(self, *args, **kwargs):
        params = frozenset(name for name, _ in self.named_parameters())
        if "weights" in kwargs:
            kwargs["weights"] = routed_weights(kwargs["weights"], params)
        else:  # (ep_rank_end, ep_rank_start, heads_per_rank, head_start, weights, stacked_params_mapping)
            args = (*args[:4], routed_weights(args[4], params), *args[5:])
        return load(self, *args, **kwargs)

    setattr(wrapped, PATCHED, True)
    return wrapped


def register() -> None:
    """vLLM's plugin hook: patch gpt-oss's bf16 loader where this vLLM has it; anything else is left alone."""
    try:
        from vllm.model_executor.models import gpt_oss
    except ImportError:
        return
    model = getattr(gpt_oss, "GptOssModel", None)
    load = getattr(model, "_load_weights_other", None)
    if load is not None:
        model._load_weights_other = with_routed_names(load)


def step_line(scheduler_output) -> str:
    """One ``schedule`` result as a step-log line (module docstring), time taken now."""
    tokens = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
    prompt = sum(n for n in tokens.values() if n > 1)
    return f"{time.perf_counter():.6f} {len(tokens)} {prompt}\n"


def with_step_log(schedule, path: str):
    """``Scheduler.schedule`` that appends each step's line to ``path`` (opened at the first step, line-buffered)."""
    if getattr(schedule, LOGGED, False):
        return schedule
    out: list = []

    @functools.wraps(schedule)
    def wrapped(self, *args, **kwargs):
        res = schedule(self, *args, **kwargs)
        if not out:
            out.append(open(path, "a", buffering=1))  # noqa: SIM115 - open for the process's life
        out[0].write(step_line(res))
        return res

    setattr(wrapped, LOGGED, True)
    return wrapped


def register_step_log() -> None:
    """vLLM's plugin hook: with ``VEXACT_VLLM_STEP_LOG`` set, log each step of the v1 scheduler (and of any scheduler
    class of vLLM's that defines its own ``schedule``)."""
    path = os.environ.get(STEP_LOG)
    if not path:
        return
    try:
        from vllm.v1.core.sched import scheduler
    except ImportError:
        return
    classes = [scheduler.Scheduler]
    try:
        from vllm.v1.core.sched import async_scheduler

        classes.append(async_scheduler.AsyncScheduler)
    except ImportError:
        pass
    for cls in classes:
        if "schedule" in vars(cls):
            cls.schedule = with_step_log(vars(cls)["schedule"], path)
