"""The invariant actor's forward: verl's packed micro-batch scored by the shared vexact model.

:func:`packed_log_probs` is the forward the ``vexact`` model-engine backend for verl
(``actor_rollout_ref.actor.strategy=vexact``, :class:`vexact_verl.actor_engine.VexactEngineWithLMHead`, a subclass of
verl's ``FSDPEngineWithLMHead`` registered with ``EngineRegistry``) runs in ``forward_step``: it takes verl's own
micro-batch tensors (jagged nested ``input_ids`` / ``position_ids``, per-sequence temperature) and returns ``log_probs``
(and entropy) in verl's layout, computed by the same model code and kernels as the vexact engine, so verl's recomputed
``old_log_prob`` equals the rollout's ``log_probs`` bitwise. It holds no numerics of its own: the model and
``model.logprobs`` do.
"""

from __future__ import annotations

import torch

import vexact_kernels as vk
from vexact_models import AttentionMetadata
from vexact_trainer import check_temperatures


def packed_log_probs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    *,
    with_entropy: bool = False,
    backend: str = "invariant",
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-position next-token logprobs of verl's packed batch, as jagged nested tensors with ``input_ids``' offsets.

    ``input_ids``: jagged nested ``[B, (L_i)]`` (verl's no-padding layout); ``position_ids``: the same layout (or the
    flat ``[T]`` values); ``temperature``: a scalar or one value per sequence ``[B]``. Position ``j`` of a sequence
    holds ``log p(token j+1 | tokens <= j)`` at that temperature, as verl's FSDP engine lays it out (labels are the
    packed ids rolled left by one, so a sequence's last position is scored against the next sequence's first token;
    verl never reads that position).
    """
    if not (input_ids.is_nested and input_ids.layout == torch.jagged):
        raise TypeError(f"input_ids must be a jagged nested tensor (verl's no-padding layout), got {input_ids.layout}")
    offsets = input_ids.offsets()
    ids = input_ids.values()
    pos = position_ids.values() if position_ids.is_nested else position_ids
    if pos.shape != ids.shape:
        raise ValueError(f"position_ids hold {tuple(pos.shape)} values for {tuple(ids.shape)} input ids")
    lens = offsets[1:] - offsets[:-1]
    # a NaN would pass the kernel's `t <= 0` check and give NaN logprobs: the trainer's check, by value and index
    given = temperature
    if isinstance(temperature, torch.Tensor):
        given = temperature.flatten() if temperature.numel() > 1 else temperature.reshape(()).item()
    check_temperatures(given, len(lens))
    if isinstance(temperature, torch.Tensor) and temperature.numel() > 1:
        if temperature.numel() != len(lens):
            raise ValueError(f"{temperature.numel()} temperatures for {len(lens)} sequences")
        temperature = torch.repeat_interleave(temperature.to(torch.float32).flatten(), lens, output_size=len(ids))
    elif isinstance(temperature, torch.Tensor):
        temperature = float(temperature.item())
    targets = torch.roll(ids, shifts=-1)
    meta = AttentionMetadata(cu_seqlens=offsets.to(torch.int64))
    with vk.use_backend(backend):
        hidden = model(ids, pos, meta)
        lp, ent = model.logprobs(hidden, targets, temperature, chunk_size, with_entropy)
    lp = torch.nested.nested_tensor_from_jagged(lp, offsets)
    if ent is not None:
        ent = torch.nested.nested_tensor_from_jagged(ent, offsets)
    return lp, ent
