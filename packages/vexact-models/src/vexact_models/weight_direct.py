"""Single-copy colocated weight sync: the trainer writes each weight straight into the engine's parameter.

When the engine's parameters live in a few flat device buffers (``pack_parameters``), a trainer on the same GPU can
open those buffers through CUDA IPC handles and copy every exported tensor into its place: one device copy per weight,
against two for packed buckets (the trainer packs, the engine unpacks), and no per-bucket hand-off between the
processes. The engine describes its buffers once per allocation with a :class:`WeightTable` (checkpoint name -> buffer,
byte offset, shape, dtype); the trainer's :class:`DirectWriter` opens them, checks each tensor against its slot and
copies groups of tensors (``copy_tensors``: ``torch._foreach_copy_`` launches, optionally a memcpy per large tensor),
then synchronises its stream before the engine is told the sync is done (the engine runs nothing meanwhile: it is idle
and its server admits no request until then).

Exactness is that of the bucket path: the writer casts with ``copy_`` (round to nearest even, exactly
``tensor.to(dtype)``, the cast FSDP applies before the forward), so the engine holds bit for bit the values the actor
computes with. A tensor whose name, shape or rollout dtype is not the engine's is refused, naming it, before any byte of
its group is written (with ``group_bytes=None``, before any byte of the sync). Parameters keep their storage, so the
engine's captured CUDA graphs stay valid.

The handles are CUDA IPC handles of torch's reductions (``ipc_handle``): each handle is opened once, by one process,
and the engine's memory is only returned to the device once that process has closed it (torch counts the holders), so
the trainer closes its views before the engine sleeps; a re-allocation (a wake after a level-2 sleep) gives the table a
new ``key`` and the trainer opens the new buffers.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import torch
from torch import nn

from .errors import CheckpointError
from .layers import weight_dtype
from .weight_transfer import MEMCPY_MIN_BYTES, copy_tensors, open_ipc_handle, weight_targets


class WeightSlot(NamedTuple):
    """Where one checkpoint-named tensor lies in the engine's buffers (contiguous, ``dtype`` elements)."""

    buffer: int  # index into the table's buffers
    offset: int  # byte offset in that buffer
    shape: tuple[int, ...]
    dtype: torch.dtype
    names: tuple[str, ...]  # the checkpoint names this slot holds (one per expert and projection for a stacked tensor)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class WeightTable:
    """The engine's weights as a trainer on the same GPU writes them: one slot per name it accepts (checkpoint names,
    one per expert and projection, and whole stacked expert tensors, as :func:`weight_targets` accepts them), the size
    of each buffer, and the names accepted but not written (a tied ``lm_head.weight``: the embedding's storage).

    ``key`` changes whenever the engine's weights get new storage; views opened for one key are stale for another.
    """

    key: str
    slots: dict[str, WeightSlot]
    buffer_bytes: tuple[int, ...]
    skip: frozenset[str] = field(default_factory=frozenset)

    @cached_property
    def _index(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.slots)}

    @cached_property
    def _all_names(self) -> list[str]:
        return list(dict.fromkeys(n for slot in self.slots.values() for n in slot.names))

    def mask(self, names: Iterable[str]) -> bytes:
        """The slots written, one bit each in table order: what the trainer sends back to the engine (2.4 KB for a
        Qwen3-30B-A3B's 19398 slots, instead of their names)."""
        bits = torch.zeros(-(-len(self.slots) // 8) * 8, dtype=torch.uint8)
        index = self._index
        bits[torch.tensor([index[n] for n in names], dtype=torch.long)] = 1
        return bytes((bits.view(-1, 8) << torch.arange(8, dtype=torch.uint8)).sum(1).tolist())

    def completed(self, mask: bytes) -> list[str]:
        """The checkpoint names held by the slots set in ``mask`` (:meth:`mask`), each once."""
        if len(mask) != -(-len(self.slots) // 8):
            raise ValueError(f"slot mask of {len(mask)} bytes for a table of {len(self.slots)} slots")
        packed = torch.frombuffer(bytearray(mask), dtype=torch.uint8) if mask else torch.zeros(0, dtype=torch.uint8)
        bits = ((packed.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8)) & 1).flatten()[: len(self.slots)]
        chosen = bits.nonzero().flatten().tolist()
        if len(chosen) == len(self.slots):
            return list(self._all_names)  # a full sync: every name
        slots = list(self.slots.values())
        return list(dict.fromkeys(n for i in chosen for n in slots[i].names))  # a stacked tensor and its pieces


def weight_table(
    model: nn.Module, buffers: Sequence[torch.Tensor] = (), key: str | None = None
) -> tuple[WeightTable, list[torch.Tensor]]:
    """The engine's side: a :class:`WeightTable` of ``model`` and the byte buffers it indexes.

    ``buffers`` are the flat buffers the model's parameters were packed into (``pack_parameters``); every checkpoint
    tensor found in one of them gets a slot there. A tensor outside them (DeepSeek's fp32 ``e_score_correction_bias``
    buffers, which packing leaves alone) gets a buffer of its own, its storage, appended after them; so an unpacked
    model works too, with one buffer per parameter. Returns the table and, per buffer, a 1-D uint8 tensor over its
    whole storage (what :func:`ipc_handle` shares). Raises ValueError for a tensor that is not contiguous in memory.
    """
    storages: dict[int, int] = {}  # storage data_ptr -> buffer index
    views: list[torch.Tensor] = []

    def buffer_of(t: torch.Tensor) -> int:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in storages:
            storages[ptr] = len(views)
            views.append(torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),)))
        return storages[ptr]

    for b in buffers:
        buffer_of(b)
    slots = {}
    for name, (t, names) in weight_targets(model).items():
        if not t.is_contiguous():
            raise ValueError(f"{name} {tuple(t.shape)} is not contiguous in memory: it has no single slot to write")
        index = buffer_of(t)
        offset = t.data_ptr() - t.untyped_storage().data_ptr()
        slots[name] = WeightSlot(index, offset, tuple(t.shape), t.dtype, tuple(names))
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    skip = frozenset({"lm_head.weight"}) if tied and "lm_head.weight" not in slots else frozenset()
    table = WeightTable(key or uuid.uuid4().hex, slots, tuple(v.numel() for v in views), skip)
    return table, views


class DirectWriter:
    """The trainer's side: the engine's buffers (opened once per :attr:`WeightTable.key`) and the copies into them.

    ``open(table, buffers)`` takes buffers this process can address (from :meth:`open_handles`, or the engine's own
    tensors when both live in one process, as in the tests); :meth:`write` copies a sync into them; :meth:`close`
    drops the views (do it before the engine frees its weights: sleep, or a re-allocation).
    """

    def __init__(self, memcpy_min_bytes: int | None = MEMCPY_MIN_BYTES):
        self.memcpy_min_bytes = memcpy_min_bytes  # copy_tensors: larger tensors one memcpy each, the rest in one launch
        self.table: WeightTable | None = None
        self.buffers: list[torch.Tensor] = []
        self._views: dict[str, torch.Tensor] = {}
        self._sync: _Sync | None = None
        self.written_mask: bytes | None = None  # the last finished sync's WeightTable.mask, built as it went

    @property
    def key(self) -> str | None:
        """The key of the table whose buffers are open, or None."""
        return self.table.key if self.table is not None else None

    def open(self, table: WeightTable, buffers: Sequence[torch.Tensor]) -> None:
        """Use ``buffers`` (1-D uint8, sized as ``table.buffer_bytes``) for ``table``; closes what was open."""
        sizes = tuple(b.numel() for b in buffers)
        bad = [i for i, b in enumerate(buffers) if b.dtype != torch.uint8 or b.dim() != 1]
        if bad or sizes != tuple(table.buffer_bytes):
            raise ValueError(f"buffers of {sizes} bytes (bad dtype or rank at {bad}) for a table of "
                             f"{tuple(table.buffer_bytes)} bytes")  # fmt: skip
        self.close()
        self.table, self.buffers = table, list(buffers)

    def open_handles(self, table: WeightTable, handles: Sequence, device: torch.device | int | None = None) -> None:
        """Open the engine's CUDA IPC handles (``ipc_handle`` of each buffer of :func:`weight_table`) on ``device``,
        this process's index of the engine's GPU. Each handle is opened once; ask the engine for new ones after
        :meth:`close`."""
        self.close()
        self.open(table, [open_ipc_handle(h, device) for h in handles])

    def close(self) -> None:
        """Drop every view of the engine's buffers (its memory can then be freed)."""
        self.table, self.buffers, self._views, self._sync = None, [], {}, None

    def view(self, name: str) -> torch.Tensor:
        """The engine's tensor ``name`` as this process sees it, through the open buffers (to read back a sync)."""
        if self.table is None or name not in self.table.slots:
            raise KeyError(f"{name!r} has no slot in the open weight table")
        return self._view(name, self.table.slots[name])

    def _view(self, name: str, slot: WeightSlot) -> torch.Tensor:
        view = self._views.get(name)
        if view is None:
            raw = self.buffers[slot.buffer][slot.offset : slot.offset + slot.nbytes]
            view = self._views[name] = raw.view(slot.dtype).view(slot.shape)
        return view

    def write(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        dtype: torch.dtype = torch.bfloat16,
        group_bytes: int | None = None,
        synchronize: bool = True,
    ) -> list[str]:
        """Copy ``(name, tensor)`` pairs into the open buffers; returns the slot names written (pass them to
        :meth:`WeightTable.mask`). :meth:`start`, :meth:`add` per tensor and :meth:`finish` do the same for a caller
        whose tensors come one at a time (an async generator)."""
        self.start(dtype, group_bytes)
        for name, tensor in named_tensors:
            self.add(name, tensor)
        return self.finish(synchronize)

    def start(self, dtype: torch.dtype = torch.bfloat16, group_bytes: int | None = None) -> None:
        """Begin a sync. Each tensor is cast to ``weight_dtype(name, dtype)`` by its copy (round to nearest even) and
        must match its slot: a known name, the same shape, and that dtype equal to the engine's.

        Copies are queued and issued in groups of about ``group_bytes`` source bytes (``torch._foreach_copy_``, one
        launch for many tensors): a bad tensor is refused with :class:`CheckpointError` (by :meth:`finish`) before any
        byte of its group is written, and nothing after it is written either; the caller still hands over the rest
        (its producer may be collective), so every problem is named. ``group_bytes=None``: one group, nothing written
        unless every tensor is good. ``group_bytes=0``: each tensor copied as it comes, for producers that reuse a
        yielded tensor's memory for the next ones (a receiver's bucket buffers); with groups, every source tensor must
        stay unchanged until its group is issued (a trainer's export: fresh gathered tensors or the parameters).
        """
        if self.table is None:
            raise RuntimeError("DirectWriter.start before open: no engine buffers are open")
        if group_bytes is not None and (isinstance(group_bytes, bool) or not isinstance(group_bytes, int)
                                        or group_bytes < 0):  # fmt: skip
            raise ValueError(f"group_bytes must be None or an integer >= 0, got {group_bytes!r}")
        self._sync = _Sync(dtype, group_bytes, len(self.table.slots), self.memcpy_min_bytes)
        self.written_mask = None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """One tensor of the sync: checked now, copied with its group."""
        sync = self._sync
        if sync is None:
            raise RuntimeError("DirectWriter.add before start")
        sync.count += 1
        problem = self._check(name, tensor, sync)
        if problem is not None:
            sync.problems.append(f"{name}: {problem}")
            return
        if sync.problems or name in self.table.skip:
            return  # after a bad tensor nothing more is written; a tied head is the embedding's storage
        sync.seen.add(name)  # (the host issues every tensor of a sync: each torch call here costs ~1-2 us per tensor)
        slot = self.table.slots[name]
        sync.queue.append((self._view(name, slot), tensor))  # copied under no_grad: no detach needed
        sync.pending.append(name)
        sync.pending_slots.append(self.table._index[name])
        sync.queued_bytes += slot.nbytes // slot.dtype.itemsize * tensor.dtype.itemsize  # source bytes (shape checked)
        if sync.group_bytes is not None and sync.queued_bytes >= sync.group_bytes:
            sync.flush()

    def finish(self, synchronize: bool = True) -> list[str]:
        """End the sync: raise :class:`CheckpointError` naming the bad tensors, or issue the last group and return
        the slot names written (and set :attr:`written_mask`, their ``WeightTable.mask``, for the engine).
        ``synchronize``: wait for the copies (the engine may run right after)."""
        sync, self._sync = self._sync, None
        if sync is None:
            raise RuntimeError("DirectWriter.finish before start")
        if sync.problems:
            done = f"{len(sync.written)} tensors of earlier groups were written, nothing after" if sync.written else (
                "nothing written")  # fmt: skip
            raise CheckpointError(f"bad weight sync ({len(sync.problems)} of {sync.count} tensors), {done}: "
                                  + "; ".join(sync.problems[:5]))  # fmt: skip
        sync.flush()
        if synchronize:
            self.synchronize()
        self.written_mask = bytes(sync.bits)
        return sync.written

    def _check(self, name: str, tensor, sync: _Sync) -> str | None:
        table = self.table
        slot = table.slots.get(name)
        if slot is None:
            return None if name in table.skip else "the engine has no tensor of that name"
        if not isinstance(tensor, torch.Tensor) or not tensor.dtype.is_floating_point:
            return f"weights must be floating-point tensors, got {getattr(tensor, 'dtype', type(tensor).__name__)}"
        want = weight_dtype(name, sync.dtype)
        if want != slot.dtype:
            return f"dtype {want} != the engine's {slot.dtype} (the sender casts; the receiver never does)"
        if tensor.shape != slot.shape:
            return f"shape {tuple(tensor.shape)} != the engine's {slot.shape}"
        if name in sync.seen:
            return "sent twice in one sync"
        return None

    def synchronize(self) -> None:
        """Wait until the queued copies have landed (before the engine reads its weights)."""
        devices = {b.device for b in self.buffers if b.device.type == "cuda"}
        for device in devices:
            torch.cuda.current_stream(device).synchronize()


class _Sync:
    """One sync's state in a :class:`DirectWriter`: the queued group, what was written, the problems found."""

    def __init__(self, dtype: torch.dtype, group_bytes: int | None, num_slots: int, memcpy_min_bytes: int | None):
        self.dtype, self.group_bytes, self.memcpy_min_bytes = dtype, group_bytes, memcpy_min_bytes
        self.queue: list[tuple[torch.Tensor, torch.Tensor]] = []  # (engine view, source)
        self.pending: list[str] = []  # the names queued
        self.pending_slots: list[int] = []  # and their slots' indices in the table
        self.bits = bytearray(-(-num_slots // 8))  # the slots written so far (WeightTable.mask's layout)
        self.queued_bytes = 0
        self.written: list[str] = []
        self.problems: list[str] = []
        self.seen: set[str] = set()
        self.count = 0

    def flush(self) -> None:
        groups: dict[tuple, tuple[list, list]] = {}  # (source dtype, device, engine dtype): one foreach launch each
        for dst, src in self.queue:
            dsts, srcs = groups.setdefault((src.dtype, src.device, dst.dtype), ([], []))
            dsts.append(dst)
            srcs.append(src)
        for dsts, srcs in groups.values():  # copy_ semantics: a cast rounds to nearest even, as tensor.to(dtype)
            copy_tensors(dsts, srcs, self.memcpy_min_bytes)
        self.written += self.pending
        for i in self.pending_slots:
            self.bits[i >> 3] |= 1 << (i & 7)
        self.queue, self.pending, self.pending_slots, self.queued_bytes = [], [], [], 0


__all__ = ["DirectWriter", "WeightSlot", "WeightTable", "weight_table"]
