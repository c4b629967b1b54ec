"""Parameters re-homed in flat buffers: one contiguous buffer per (device, dtype), every parameter a view of it.

Why: a layer's sibling projections (q/k/v, gate/up) then lie end to end in memory, so inference can run them as one
matmul over a view spanning them (``layers/linear.py: grouped_linear``), bit for bit the separate matmuls, without a
second copy of the weights. Values never change: packing only copies bytes.

Layout: the model's distinct parameters (tied ones once, under their first name) in ``named_parameters()`` order, each
starting at a multiple of :data:`PACK_ALIGN` bytes, with one regrouping: within a run of parameters of sibling modules
(``self_attn.q_proj.weight``, ``self_attn.q_proj.bias``, ``self_attn.k_proj.weight`` ...) the parameters come grouped
by their own name in the order those names first appear (all the siblings' weights, then all their biases), so that
sibling weights, and sibling biases, lie end to end whether or not the layers have biases.

Parameters only: buffers (rotary tables, DeepSeek's fp32 correction bias) stay where they are. The model records the
layout (no tensor: the parameters' views keep the buffers alive, so re-pointing every parameter elsewhere frees
them); :func:`packed_buffers` checks it against the parameters each time, so a model moved or re-allocated since (by
``model.to(...)``, an engine's sleep) reads as not packed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import nn

PACK_ALIGN = 256  # bytes: Triton specialises kernels on 16-byte pointer alignment; every parameter keeps it
_RECORD = "_vexact_packed"


class PackedSlot(NamedTuple):
    """Where one parameter lies in the packed buffers."""

    buffer: int  # index into the list :func:`pack_parameters` returns
    offset: int  # byte offset in that buffer (a multiple of PACK_ALIGN)
    shape: tuple[int, ...]
    dtype: torch.dtype


def _packing_order(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The distinct parameters in ``named_parameters()`` order, siblings regrouped by parameter name (module doc)."""
    out: list[tuple[str, nn.Parameter]] = []
    run: list[tuple[str, nn.Parameter]] = []
    run_parent = None

    def flush():
        first_seen: dict[str, int] = {}
        for name, _ in run:
            first_seen.setdefault(name.rpartition(".")[2], len(first_seen))
        out.extend(sorted(run, key=lambda item: first_seen[item[0].rpartition(".")[2]]))  # stable: module order kept
        run.clear()

    for name, p in model.named_parameters():  # tied parameters once, under their first name
        parent = name.rpartition(".")[0].rpartition(".")[0]  # the module whose children own the parameter
        if parent != run_parent:
            flush()
            run_parent = parent
        run.append((name, p))
    flush()
    return out


def _layout(
    entries: list[tuple[str, tuple[int, ...], torch.dtype, torch.device]],
) -> tuple[list[tuple[torch.device, torch.dtype, int]], dict[str, PackedSlot]]:
    """Buffers ``(device, dtype, numel)`` in order of first use and each name's slot."""
    keys: dict[tuple[torch.device, torch.dtype], int] = {}
    ends: list[int] = []
    table: dict[str, PackedSlot] = {}
    for name, shape, dtype, device in entries:
        index = keys.setdefault((device, dtype), len(keys))
        if index == len(ends):
            ends.append(0)
        offset = -(-ends[index] // PACK_ALIGN) * PACK_ALIGN
        table[name] = PackedSlot(index, offset, tuple(shape), dtype)
        numel = 1
        for s in shape:
            numel *= s
        ends[index] = offset + numel * dtype.itemsize
    buffers = [(dev, dt, -(-ends[i] // dt.itemsize)) for (dev, dt), i in keys.items()]
    return buffers, table


def _view(buffer: torch.Tensor, slot: PackedSlot) -> torch.Tensor:
    start = slot.offset // slot.dtype.itemsize
    numel = 1
    for s in slot.shape:
        numel *= s
    return buffer[start : start + numel].view(slot.shape)


def _allocate(device: torch.device, dtype: torch.dtype, numel: int, staged: list[nn.Parameter]) -> torch.Tensor:
    """A flat buffer; where the device cannot hold it beside the parameters still there, ``staged`` (the ones to be
    copied in) move to host memory first, one at a time, so packing never needs two copies on the device."""
    try:
        return torch.empty(numel, dtype=dtype, device=device)
    except torch.OutOfMemoryError:
        if device.type != "cuda":
            raise
    for p in staged:
        if p.device == device:
            p.data = p.data.to("cpu")  # the device storage goes as soon as nothing else holds it
    torch.cuda.empty_cache()
    return torch.empty(numel, dtype=dtype, device=device)


def _record(model: nn.Module, table: dict[str, PackedSlot]) -> None:
    model.__dict__[_RECORD] = table  # a plain attribute: no tensor, not in the state_dict


def pack_parameters(model: nn.Module, device: str | torch.device | None = None) -> list[torch.Tensor]:
    """Re-home every distinct parameter of ``model`` in one flat buffer per (device, dtype); returns the buffers.

    Each parameter's ``.data`` becomes a view of its buffer at a ``PACK_ALIGN``-aligned offset (layout: module doc),
    its values unchanged bit for bit; parameters are copied one at a time and each old storage is let go as it is
    replaced. The buffers are 1-D tensors of the parameters' dtype (padding between parameters is uninitialised);
    :func:`packed_buffers` finds them and the name -> :class:`PackedSlot` table again.

    ``device``: place the buffers there (copying from wherever the parameters are, e.g. a model loaded on the host,
    so the device never holds two copies); default: each parameter's own device. A model already packed (on
    ``device``, when given) is left as is. When a device cannot hold a new buffer beside the parameters it replaces,
    those parameters pass through host memory instead.
    """
    current = packed_buffers(model)
    if current is not None and (device is None or all(b.device == torch.device(device) for b in current[0])):
        return current[0]
    params = _packing_order(model)
    target = None if device is None else torch.device(device)
    specs, table = _layout([(n, tuple(p.shape), p.dtype, target or p.device) for n, p in params])
    buffers = []
    for index, (dev, dtype, numel) in enumerate(specs):
        members = [(n, p) for n, p in params if table[n].buffer == index]
        buffer = _allocate(dev, dtype, numel, [p for _, p in members])
        for name, p in members:
            view = _view(buffer, table[name])
            view.copy_(p.data, non_blocking=True)
            p.data = view
        buffers.append(buffer)
    _record(model, table)
    return buffers


def allocate_packed(
    model: nn.Module, shapes: Mapping[str, tuple[torch.Size, torch.dtype]], device: str | torch.device
) -> list[torch.Tensor]:
    """Point every distinct parameter of ``model`` at a view of new flat buffers on ``device``, laid out as
    :func:`pack_parameters` lays them out, with the shape and dtype ``shapes[name]`` gives; returns the buffers.

    No value is copied: the contents are undefined until the caller loads weights into the parameters (as an engine
    waking from a level-2 sleep does). Raises ``KeyError`` naming a parameter ``shapes`` lacks.
    """
    params = _packing_order(model)
    missing = [n for n, _ in params if n not in shapes]
    if missing:
        raise KeyError(f"allocate_packed: no shape given for parameter(s) {missing[:3]}")
    device = torch.device(device)
    specs, table = _layout([(n, tuple(shapes[n][0]), shapes[n][1], device) for n, _ in params])
    buffers = [torch.empty(numel, dtype=dtype, device=dev) for dev, dtype, numel in specs]
    for name, p in params:
        slot = table[name]
        p.data = _view(buffers[slot.buffer], slot)
    _record(model, table)
    return buffers


def packed_buffers(model: nn.Module) -> tuple[list[torch.Tensor], dict[str, PackedSlot]] | None:
    """``(buffers, {name: PackedSlot})`` of a model :func:`pack_parameters` packed, or None when it was not packed or
    a parameter has been re-homed since (each parameter is checked against its slot)."""
    table = model.__dict__.get(_RECORD)
    if table is None:
        return None
    params = dict(_packing_order(model))
    if params.keys() != table.keys():
        return None
    storages: dict[int, torch.UntypedStorage] = {}
    for name, slot in table.items():
        p = params[name]
        if p.dtype != slot.dtype or tuple(p.shape) != slot.shape or not p.is_contiguous():
            return None
        if p.storage_offset() * p.element_size() != slot.offset:
            return None
        storage = p.untyped_storage()
        first = storages.setdefault(slot.buffer, storage)
        if storage.data_ptr() != first.data_ptr() or storage.device != first.device:
            return None
    dtypes = {slot.buffer: slot.dtype for slot in table.values()}
    buffers = []
    for index in range(len(storages)):
        storage, dtype = storages[index], dtypes[index]
        flat = torch.empty(0, dtype=dtype, device=storage.device)
        buffers.append(flat.set_(storage, 0, (storage.nbytes() // dtype.itemsize,)))
    return buffers, dict(table)
