"""A step's inputs: plain lists from the scheduled batch (:func:`step_lists`), then device tensors
(:func:`step_tensors`). Shared by the runner's eager and padded steps and by the pipeline's stages."""

from __future__ import annotations

import torch

import vexact_kernels as vk
from vexact_models import AttentionMetadata

from .block_manager import BlockManager
from .scheduler import ScheduledSeq


def step_lists(batch: list[ScheduledSeq], blocks: BlockManager, with_tables: bool = True) -> dict[str, list]:
    """A step's inputs as plain lists (token ids, positions, KV slots, ``cu`` query offsets, context lengths, block
    tables): what a pipeline driver broadcasts, and what :func:`step_tensors` turns into device tensors.
    ``with_tables=False`` leaves the block tables out (the padded decode path keeps its own copy of them).

    A row whose input token is still on the device (``Sequence.num_pending``, ``EngineConfig.async_decode``) gets
    id 0 here; ``feed_dst`` names its token row and ``feed_src`` the row of the last launched step's drawn tokens
    that holds its token (``in_flight.feed_drawn`` copies it in)."""
    ids, positions, slots, cu, ctx, feed_dst, feed_src = [], [], [], [0], [], [], []
    page, offset = blocks.block_size, 0
    add_id, add_pos, add_slot, add_cu, add_ctx = ids.append, positions.append, slots.append, cu.append, ctx.append
    for item in batch:
        seq, n = item.seq, item.num_new_tokens
        start = seq.num_computed_tokens
        if n == 1:
            # a decode row (the common case, 256 a step at a large batch): Sequence.token and BlockManager.slot
            # inline, no list built for its one token
            k = start - len(seq.prompt_token_ids)
            if k < len(seq.output_token_ids):
                add_id(seq.output_token_ids[k] if k >= 0 else seq.prompt_token_ids[start])
            else:  # drawn by the step in flight: the device has it
                feed_dst.append(offset)
                feed_src.append(seq.pending_row)
                add_id(0)
            add_pos(start)
            add_slot(seq.block_table[start // page] * page + start % page)
        else:
            ids += seq.token_ids(start, start + n)
            positions += range(start, start + n)
            slots += blocks.slots(seq, start, start + n)
        offset += n
        add_cu(offset)
        add_ctx(start + n)
    tables = [list(item.seq.block_table) for item in batch] if with_tables else None
    return {"ids": ids, "positions": positions, "slots": slots, "cu": cu, "ctx": ctx, "tables": tables,
            "feed_dst": feed_dst, "feed_src": feed_src}  # fmt: skip


def step_tensors(step: dict[str, list], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """``(input_ids [T], positions [T], paged AttentionMetadata)`` on ``device`` from :func:`step_lists`."""
    width = max(len(t) for t in step["tables"])
    meta = AttentionMetadata(
        cu_seqlens=host_tensor(step["cu"], device),
        slot_mapping=host_tensor(step["slots"], device),
        block_tables=host_tensor([t + [0] * (width - len(t)) for t in step["tables"]], device),
        context_lens=host_tensor(step["ctx"], device),
    )
    ids = host_tensor(step["ids"], device)
    pos = host_tensor(step["positions"], device)
    # their ranges are known here, so the model's input checks read nothing back from the device (vk.tensor_range)
    if step["ids"]:
        vk.record_range(ids, min(step["ids"]), max(step["ids"]))
        vk.record_range(pos, min(step["positions"]), max(step["positions"]))
    return ids, pos, meta


def host_tensor(values: list, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Host values as a ``dtype`` tensor on ``device``. To a GPU through pinned memory, without blocking the host: a
    copy from pageable memory makes the host wait for every step already queued on the stream (on an H200, a step
    that admitted a prompt took 21 ms of host time to launch against 0.9 ms for a decode step, and the one step
    ahead of ``async_decode`` was lost)."""
    t = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
