"""Parallelism applied from outside the model: FSDP2 (``fully_shard``) per decoder layer and on the root.

The model keeps fp32 master parameters; FSDP's ``MixedPrecisionPolicy`` casts each shard to bf16 (elementwise
round-to-nearest) before the all-gather, so the forward sees exactly ``master.to(bf16)``, the tensors
:func:`vexact_trainer.iter_weight_buckets` exports to the engine. Gradients come back in bf16 and are
reduce-scattered in fp32. FSDP changes who holds a parameter, never the order in which a row is reduced, so the
logprobs do not depend on the world size.
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

import vexact_kernels as vk

# Methods other than forward that read the root's parameters (final norm, lm_head, tied embedding): FSDP must
# unshard the root for them as it does for forward.
FORWARD_METHODS = ("logits", "logprobs")


def init_distributed(device_type: str | None = None, timeout_s: float = 600.0) -> DeviceMesh:
    """A 1-D data-parallel mesh over all ranks, initialising the default process group if needed.

    Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set) the group comes from the environment; otherwise a single-process
    group (world size 1) is made on an in-memory store, so the same FSDP code runs in a notebook, a test or on CI.
    ``device_type``: ``"cuda"`` (NCCL) or ``"cpu"`` (gloo); default: cuda when available.
    """
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"device_type must be 'cuda' or 'cpu', got {device_type!r}")
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device_type 'cuda' asked for but no CUDA device is visible")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        # with a GPU present the group gets both backends, so CPU and CUDA meshes can share one process
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        timeout = timedelta(seconds=timeout_s)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=("dp",))


def _check_master_dtype(model: nn.Module) -> None:
    bad = [(n, p.dtype) for n, p in model.named_parameters() if p.dtype != torch.float32]
    if bad:
        raise ValueError(
            f"parallelize expects fp32 master parameters; {bad[0][0]} is {bad[0][1]} ({len(bad)} such). Build or "
            "load the model in fp32 for training (e.g. vexact_models.load_model(path, dtype='float32')): "
            "FSDP casts to bf16 for compute"
        )


def recompute_on_forward_kernels() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """``context_fn`` of a checkpointed layer: the recomputation in backward runs on the kernels its forward ran on
    (the backend of each op family and the fp32 matmul precision in effect at the forward), whatever is in effect
    when backward runs. Without it a forward under ``vk.use_backend("fast")`` whose backward runs outside that block
    is recomputed on the invariant kernels: other tensors, which torch's checkpoint refuses, or, where their shapes
    happen to agree, gradients of a forward that never ran."""
    backend, precision = vk.backend_map(), vk.get_fp32_matmul_precision()

    @contextlib.contextmanager
    def recompute():
        with vk.use_backend(backend), vk.use_fp32_matmul_precision(precision):
            yield

    return contextlib.nullcontext(), recompute()


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh | None = None,
    *,
    param_dtype: torch.dtype = torch.bfloat16,
    reduce_dtype: torch.dtype = torch.float32,
    activation_checkpointing: bool = False,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Shard ``model`` (a vexact-models causal LM with fp32 parameters) with FSDP2, in place; returns it.

    One FSDP group per decoder layer (all-gathered just before the layer runs) and one for the root (embedding,
    final norm, lm_head; tied embeddings stay one parameter). ``logits`` and ``logprobs`` are registered as FSDP
    forward methods so the root's parameters are unsharded for them too. ``activation_checkpointing`` recomputes
    each decoder layer in backward, on the kernels its forward ran on (:func:`recompute_on_forward_kernels`); the
    kernels are deterministic, so the recomputation is bitwise the forward and the gradients do not change.
    """
    if isinstance(model, FSDPModule):
        raise ValueError("model is already sharded with fully_shard")
    _check_master_dtype(model)
    mesh = mesh or init_distributed()
    # Float *inputs* are not cast: the per-token temperature given to logprobs must stay fp32, as in the engine.
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    layers = model.model.layers
    for i, layer in enumerate(layers):
        if activation_checkpointing:
            layer = checkpoint_wrapper(
                layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT, context_fn=recompute_on_forward_kernels
            )
            layers[i] = layer
        # Every layer (the last one too) reshards after forward: a forward with no backward (scoring under no_grad,
        # a skipped step) must not leave unsharded bf16 tensors registered as the module's parameters.
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    for name in FORWARD_METHODS:
        if hasattr(model, name):
            register_fsdp_forward_method(model, name)
    return model


def rank() -> int:
    """This process's rank in the default group (0 when not distributed)."""
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1
