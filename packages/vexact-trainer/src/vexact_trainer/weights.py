"""Weight export: the exact bf16 tensors the FSDP forward computes with, by HF name, in size-bounded buckets.

FSDP's mixed precision casts each fp32 master shard to bf16 elementwise (round-to-nearest-even) before gathering
it; casting a shard and then gathering equals gathering and then casting, so ``shard.to(bf16).full_tensor()`` is
bitwise the parameter the forward sees. Only bf16 crosses the wire (half the bytes of the fp32 master), except the
persistent fp32 buffers (DeepSeek's ``e_score_correction_bias``, which FSDP does not cast), sent as they are.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from vexact_models import checkpoint_pieces, named_buckets, named_weights, stacked_experts, weight_dtype

from .parallel import rank

# Module-name parts that wrappers insert (activation checkpointing, torch.compile, FSDP1); never part of an HF name.
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
DEFAULT_BUCKET_BYTES = 512 << 20


def hf_name(name: str) -> str:
    """The HF parameter name of a (possibly wrapped) module parameter name."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def iter_weight_buckets(
    model: nn.Module, bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype: torch.dtype = torch.bfloat16
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield buckets ``[(hf_name, full tensor in dtype), ...]`` of at most ``bucket_bytes`` each (a tensor larger
    than the bound travels alone).

    Collective when the model is sharded: every rank must iterate to the end (each full tensor is all-gathered), in
    the same order. Names are the published checkpoint's: stacked expert parameters go out as one tensor per expert
    and projection (views of the gathered tensor). Tied parameters appear once, under their first name
    (``model.embed_tokens.weight``), which is how checkpoints and the engine name them.
    """
    return named_buckets(iter_weights(model, dtype), bucket_bytes)  # stacked experts one expert at a time


def iter_weights(
    model: nn.Module, dtype: torch.dtype = torch.bfloat16, stacked: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full tensor in dtype)`` one at a time (the tensors :func:`iter_weight_buckets` groups): for
    packing into device buckets (``vexact_models.BucketPacker``). Collective like :func:`iter_weight_buckets`.

    ``stacked=True`` yields each parameter whole, a stacked expert tensor (``...mlp.experts.gate_up_proj``,
    ``[E, 2I, H]``) as one tensor instead of one per expert and projection: what verl's ``get_per_tensor_param``
    exports, and what a VeXact engine loads (``load_bucket``, ``update_weights``). A Qwen3-30B-A3B then sends 531
    tensors instead of 18867, so a sync is not bound by one copy launch per expert."""
    whole = stacked_experts(model)  # gpt-oss: checkpoints hold its experts stacked
    for name, p in named_weights(model):
        want = weight_dtype(name, dtype)  # DeepSeek's fp32 bias buffer stays fp32
        t = p.detach() if p.dtype == want else p.detach().to(want)  # one torch call less per tensor where it can
        if isinstance(t, DTensor):
            t = t.full_tensor()
        if stacked:
            yield hf_name(name), t
        else:
            yield from checkpoint_pieces(hf_name(name), t, whole)


def sync_weights_broadcast(model: nn.Module, group, bucket_bytes: int = DEFAULT_BUCKET_BYTES, src_rank: int = 0):
    """Separate placement: broadcast the model's bf16 weights on ``group`` (a ``vexact_models.WeightSyncGroup`` in
    which this trainer's ``src_rank`` is rank 0 and every rollout engine or pipeline stage a receiver, calling
    ``receive_weights``). Every trainer rank calls this (the gathers are collective); ``group`` may be None on the
    ranks other than ``src_rank``. Returns the number of pieces sent on ``src_rank``, None elsewhere."""
    from vexact_models import broadcast_weights

    me = rank()
    if me == src_rank and group is None:
        raise ValueError(f"rank {me} is the source rank but no weight sync group was given")
    if me != src_rank:
        for _ in iter_weights(model):  # take part in the gathers
            pass
        return None
    return broadcast_weights(group, iter_weights(model), bucket_bytes)


def sync_weights(
    model: nn.Module, engine, bucket_bytes: int = DEFAULT_BUCKET_BYTES, src_rank: int = 0
) -> list[str] | None:
    """Send the model's bf16 weights to ``engine.update_weights`` bucket by bucket; returns the names it loaded.

    Every rank calls this (the gathers are collective); only ``src_rank`` talks to the engine (``engine`` may be
    None on the other ranks, which return None). ``engine`` is anything with ``update_weights(named_tensors)`` that
    returns the loaded names: an ``LLMEngine`` in this process, or a proxy to one in another process.
    """
    me = rank()
    if me == src_rank and engine is None:
        raise ValueError(f"rank {me} is the source rank but no engine was given")
    loaded: list[str] = []
    sent = 0
    for bucket in iter_weight_buckets(model, bucket_bytes):
        if me == src_rank:
            loaded += list(engine.update_weights(bucket))
            sent += len(bucket)
    if me != src_rank:
        return None
    if len(loaded) != sent:
        raise RuntimeError(f"the engine loaded {len(loaded)} of the {sent} tensors sent")
    return loaded


def save_hf_checkpoint(
    model: nn.Module, path: str | Path, dtype: torch.dtype = torch.bfloat16, max_shard_bytes: int | None = None
) -> Path | None:
    """Write ``config.json`` + safetensors (HF layout, ``dtype``) of the sharded model; collective, rank 0 writes.

    The weights are the ones :func:`iter_weight_buckets` exports, so an engine loading this directory computes the
    same logprobs as the trainer. Returns the path on rank 0, None elsewhere.
    """
    import dataclasses

    from vexact_models import MODEL_CLASSES, expected_tensors, load_weights, save_checkpoint

    out = None
    if rank() == 0:
        cfg = dataclasses.replace(model.config, torch_dtype=str(dtype).removeprefix("torch."))
        out = MODEL_CLASSES[cfg.model_type](cfg)  # unsharded on CPU; the constructor ties tied weights
    loaded: list[str] = []
    for bucket in iter_weight_buckets(model, dtype=dtype):
        if out is not None:
            loaded += load_weights(out, bucket, strict=False)
    if out is None:
        return None
    missing = sorted(set(expected_tensors(out)) - set(loaded))
    if missing:
        raise RuntimeError(f"the sharded model did not provide {len(missing)} tensor(s), e.g. {missing[:5]}")
    save_checkpoint(out, path, max_shard_bytes=max_shard_bytes)
    return Path(path)
