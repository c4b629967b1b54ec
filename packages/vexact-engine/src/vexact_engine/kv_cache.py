"""How many KV pages an engine gets, and whether its weights fit the device at all (with the activation peak of a
step measured on the device, :func:`profile_activation_bytes`).

The cache size comes from the first setting that applies (``EngineConfig``): ``num_kv_blocks``, ``kv_cache_bytes``,
the CPU default, or on CUDA what ``gpu_memory_utilization`` leaves after the weights and a measured activation peak.
"""

from __future__ import annotations

import logging

import torch

import vexact_kernels as vk
from vexact_models import AttentionMetadata

from .config import CPU_KV_CACHE_BYTES, EngineConfig
from .model_runner import ModelRunner
from .sampler import sample
from .sampling_params import SamplingParams

log = logging.getLogger("vexact_engine")

_GIB = 1 << 30


def tensor_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's distinct parameters and buffers (tied ones once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def check_model_fits(model: torch.nn.Module, config: EngineConfig, device: torch.device) -> None:
    """Raise ValueError with the figures when the model's weights alone exceed the engine's share of the device."""
    total = torch.cuda.get_device_properties(device).total_memory
    budget = config.gpu_memory_utilization * total
    weights = tensor_bytes(model)
    if weights >= budget:
        raise ValueError(
            f"the model's weights take {weights / _GIB:.2f} GiB but gpu_memory_utilization="
            f"{config.gpu_memory_utilization} allows {budget / _GIB:.2f} GiB of the device's {total / _GIB:.2f} GiB; "
            "raise gpu_memory_utilization (at most 1.0) or use a device with more memory"
        )


def resolve_max_model_len(model_config, config: EngineConfig) -> int:
    """The longest sequence the engine serves: ``config.max_model_len`` within the model's limits (its position
    embeddings, and a sliding window where the kernels do not run it: every family's but gpt-oss's, whose config says
    ``windowed_attention``). Raises ValueError naming the setting."""
    limit = model_config.max_position_embeddings
    window = getattr(model_config, "sliding_window", None)
    if window is not None and not getattr(model_config, "windowed_attention", False):
        # the kernels attend to every earlier key: equal to the model's window only while a sequence fits in it
        if config.max_model_len is not None and config.max_model_len > window:
            raise ValueError(
                f"max_model_len {config.max_model_len} > the model's sliding_window {window}: "
                f"sliding-window attention is not implemented; set max_model_len <= {window}"
            )
        limit = min(limit, window)
    length = min(config.max_model_len or limit, limit)
    if not config.enable_chunked_prefill and config.max_num_batched_tokens < length:
        raise ValueError(
            f"with chunked prefill off, max_num_batched_tokens ({config.max_num_batched_tokens}) must be >= "
            f"max_model_len ({length}): a whole prompt (or a preempted request's recompute) must fit one step"
        )
    return length


def num_kv_blocks(model: torch.nn.Module, config: EngineConfig, max_model_len: int, report: dict | None = None) -> int:
    """The number of KV pages of ``config.block_size`` tokens for ``model`` under ``config``. ``report``, where
    given, gets how the number was found: ``source`` (the setting that decided it), ``num_blocks``, ``tokens`` and
    ``kv_bytes``; sized from GPU memory, also ``budget_bytes``, ``weights_bytes``, ``activation_bytes`` (the
    profiled peak of one step, reserved twice) and ``free_bytes``."""
    report = {} if report is None else report
    dtype = next(model.parameters()).dtype
    per_block = ModelRunner.kv_bytes_per_block(model.config, config.block_size, dtype)
    device = next(model.parameters()).device
    if config.num_kv_blocks is not None:
        blocks, report["source"] = config.num_kv_blocks, "num_kv_blocks"
    elif config.kv_cache_bytes is not None or device.type != "cuda":
        blocks = max(1, (config.kv_cache_bytes or CPU_KV_CACHE_BYTES) // per_block)
        report["source"] = "kv_cache_bytes" if config.kv_cache_bytes is not None else "the CPU default"
    else:
        report["source"] = "gpu_memory_utilization"
        blocks = _kv_blocks_from_gpu_memory(model, config, max_model_len, device, per_block, report)
    report.update(num_blocks=blocks, tokens=blocks * config.block_size, kv_bytes=blocks * per_block)
    return blocks


def _kv_blocks_from_gpu_memory(
    model: torch.nn.Module, cfg: EngineConfig, max_model_len: int, device: torch.device, per_block: int, report: dict
) -> int:
    """KV pages = (gpu_memory_utilization * total - weights - 2 * activation peak) / page bytes, no more than this
    process can still allocate, and no more than ``max_num_seqs`` sequences of ``max_model_len`` tokens can use. The
    second activation peak covers the CUDA graphs' memory pool (a graph's step has at most ``max_num_batched_tokens``
    tokens, the profiled step's count)."""
    torch.cuda.empty_cache()
    weights = tensor_bytes(model)
    activations = profile_activation_bytes(model, cfg)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    budget = cfg.gpu_memory_utilization * total
    want = budget - weights - 2 * activations
    can = free - 2 * activations
    report.update(budget_bytes=int(budget), weights_bytes=weights, activation_bytes=activations, free_bytes=free)
    figures = (
        f"gpu_memory_utilization={cfg.gpu_memory_utilization} of {total / _GIB:.2f} GiB = {budget / _GIB:.2f} GiB; "
        f"weights {weights / _GIB:.2f} GiB, activation peak {activations / _GIB:.2f} GiB (x2 with the CUDA "
        f"graphs), {free / _GIB:.2f} GiB free on the device"
    )
    kv = min(want, can)
    min_blocks = -(-max_model_len // cfg.block_size)
    if kv < min_blocks * per_block:
        raise ValueError(
            f"no room for a KV cache that holds one sequence of max_model_len {max_model_len} "
            f"({min_blocks * per_block / _GIB:.3f} GiB): {figures}. Raise gpu_memory_utilization, lower "
            "max_num_batched_tokens / max_num_seqs / max_model_len, or free device memory"
        )
    if can < want:
        log.warning("KV cache limited by free device memory (other allocations hold some): %s", figures)
    # More pages than max_num_seqs sequences of max_model_len tokens can use would only take memory from others
    useful = cfg.max_num_seqs * min_blocks
    num_blocks = min(int(kv // per_block), useful)
    log.info(
        "KV cache: %d pages of %d tokens (%.2f GiB%s); %s", num_blocks, cfg.block_size,
        num_blocks * per_block / _GIB, ", all that max_num_seqs x max_model_len can use" if num_blocks == useful
        else "", figures,
    )  # fmt: skip
    return num_blocks


@torch.no_grad()
def profile_activation_bytes(model: torch.nn.Module, config: EngineConfig) -> int:
    """Peak CUDA memory a step of ``max_num_batched_tokens`` tokens adds on top of what is allocated now: a packed
    forward of that many tokens (in ``max_num_seqs`` sequences), then logits, top-k/top-p draws and logprobs of
    ``max_num_seqs`` rows."""
    dev = next(model.parameters()).device
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    t, n = config.max_num_batched_tokens, min(config.max_num_seqs, config.max_num_batched_tokens)
    meta = AttentionMetadata.packed([t // n + (1 if i < t % n else 0) for i in range(n)])
    meta.cu_seqlens = meta.cu_seqlens.to(dev)
    zeros = torch.zeros(t, dtype=torch.int64, device=dev)
    with vk.use_backend(config.backend):
        rows = model(zeros, zeros, meta)[:n].clone()
        logits = model.logits(rows)
        tokens, _ = sample(logits, [SamplingParams(top_p=0.9, top_k=50)] * n, list(range(n)), [0] * n)
        del logits
        model.logprobs(rows, tokens, torch.ones(n, device=dev))
    torch.cuda.synchronize(dev)
    return torch.cuda.max_memory_allocated(dev) - base
