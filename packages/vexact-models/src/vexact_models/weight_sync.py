"""Weight transport from a trainer to an engine, both ends in one place, so the format is defined once.

Three ways, one module:

- **Packed buckets** (:class:`BucketPacker`, :func:`send_buckets`, :func:`load_bucket`): one byte buffer per bucket
  plus a small list of :class:`TensorSpec` saying where each tensor lies in it. The trainer packs (casting to the
  rollout dtype once, round to nearest even, the cast FSDP applies before the forward), a transport moves the buffer
  (a CUDA IPC handle on one GPU, a ``torch.distributed`` broadcast between GPUs or hosts: :class:`WeightSyncGroup`),
  the engine copies the bytes into its parameters in place. Only the specs (names, shapes, dtypes, offsets: a few KB
  of Python objects) travel as objects; the bytes stay in device buffers. Nothing is rounded after packing: the
  engine receives bit for bit what the sender packed, and a spec whose dtype is not the engine's is refused (the
  receiver never casts).
- **Named buckets** (:func:`named_buckets`, :class:`NamedBuckets`): lists of ``(name, tensor)`` of at most a byte
  bound, for an engine's ``update_weights`` in this process or across a Ray call.
- **Single copy** (:class:`WeightTable`, :class:`DirectWriter`): a colocated trainer writes each weight straight
  into the engine's parameter.

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
import pickle
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from functools import cached_property
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from .errors import CheckpointError
from .layers.moe import checkpoint_pieces, named_weights, stacked_experts, weight_dtype

ALIGN = 256  # each piece starts on a 256-byte boundary: any dtype can view it, copies stay aligned


class TensorSpec(NamedTuple):
    """Where one tensor (or a row range of one) lies in a bucket buffer."""

    name: str  # checkpoint (HF) name
    shape: tuple[int, ...]  # the whole tensor's shape
    dtype: torch.dtype
    offset: int  # byte offset in the bucket
    rows: tuple[int, int] | None = None  # [start, stop) of dim 0 when the tensor is split over buckets

    @property
    def piece_shape(self) -> tuple[int, ...]:
        if self.rows is None:
            return tuple(self.shape)
        return (self.rows[1] - self.rows[0], *self.shape[1:])

    @property
    def nbytes(self) -> int:
        return math.prod(self.piece_shape) * self.dtype.itemsize

    @property
    def completes(self) -> bool:
        """True when this piece is the whole tensor or its last rows."""
        return self.rows is None or self.rows[1] == self.shape[0]


class PackedBucket(NamedTuple):
    """One packed bucket: which buffer of the packer holds it, the specs, and how many bytes are used."""

    index: int
    specs: list[TensorSpec]
    nbytes: int


class BucketPacker:
    """Packs a stream of ``(name, tensor)`` into ``num_buffers`` device buffers of ``bucket_bytes`` each.

    :meth:`buckets` yields a :class:`PackedBucket` whenever one is full. Buffers are used in turn, so with two the
    next bucket is packed while a receiver still reads the last: the caller must be done with a bucket before it
    asks for the bucket after the next (see :func:`send_buckets`). A tensor larger than a bucket is split by rows of
    dim 0 over consecutive buckets; one row larger than a bucket is refused.
    """

    def __init__(
        self,
        bucket_bytes: int,
        device: str | torch.device,
        dtype: torch.dtype = torch.bfloat16,
        num_buffers: int = 2,
    ):
        _check_bucket_bytes(bucket_bytes, ALIGN)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        if num_buffers not in (1, 2):
            raise ValueError(f"num_buffers must be 1 or 2, got {num_buffers!r}")
        self.bucket_bytes = bucket_bytes
        self.dtype = dtype
        self.device = torch.device(device)
        self.buffers = [torch.empty(bucket_bytes, dtype=torch.uint8, device=self.device) for _ in range(num_buffers)]
        self._index, self._specs, self._offset = 0, [], 0

    def buckets(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[PackedBucket]:
        """Pack every tensor; yield each bucket once it is full, and the last one at the end."""
        for name, tensor in named_tensors:
            yield from self.add(name, tensor)
        last = self.finish()
        if last is not None:
            yield last

    def add(self, name: str, tensor: torch.Tensor) -> Iterator[PackedBucket]:
        """Pack one tensor; yields the buckets it fills (none while it fits the current one). Drain it before
        adding the next tensor (an async caller: ``for bucket in packer.add(n, t): await send(bucket)``)."""
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            got = getattr(tensor, "dtype", type(tensor).__name__)
            raise TypeError(f"{name}: weights must be floating-point tensors, got {got}")
        t = tensor.detach()
        shape = tuple(t.shape)
        dtype = weight_dtype(name, self.dtype)
        row = _row_bytes(shape, dtype)
        nbytes = t.numel() * dtype.itemsize
        start = 0
        while True:
            self._offset = -(-self._offset // ALIGN) * ALIGN
            room = self.bucket_bytes - self._offset
            if nbytes - start * row <= room:  # the rest fits
                self._pack(name, t, None if start == 0 else (start, shape[0]))
                return
            if self._specs and (nbytes <= self.bucket_bytes or room < row):
                yield self._next()  # start a fresh bucket rather than split a tensor that fits one
                continue
            if not shape or row > self.bucket_bytes:
                raise ValueError(
                    f"{name} {shape}: one row takes {row} bytes, more than bucket_bytes={self.bucket_bytes}; "
                    "use larger buckets"
                )
            stop = start + room // row
            self._pack(name, t, (start, stop))
            start = stop
            yield self._next()

    def finish(self) -> PackedBucket | None:
        """The last, partly filled bucket (None if empty); the packer starts over afterwards."""
        last = self._next() if self._specs else None
        self._index = 0
        return last

    def _next(self) -> PackedBucket:
        bucket = PackedBucket(self._index, self._specs, self._offset)
        self._index, self._specs, self._offset = (self._index + 1) % len(self.buffers), [], 0
        return bucket

    def _pack(self, name: str, t: torch.Tensor, rows) -> None:
        spec = TensorSpec(name, tuple(t.shape), weight_dtype(name, self.dtype), self._offset, rows)
        src = t if rows is None else t[rows[0] : rows[1]]
        # copy_ casts elementwise (round to nearest even), exactly as tensor.to(dtype)
        dst = self.buffers[self._index][spec.offset : spec.offset + spec.nbytes]
        dst.view(spec.dtype).view(spec.piece_shape).copy_(src)
        self._specs.append(spec)
        self._offset += spec.nbytes

    def synchronize(self) -> None:
        """Wait until the packing copies have landed (before another process reads the buffer)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()


def _row_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape[1:]) * dtype.itemsize if shape else dtype.itemsize


def send_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    packer: BucketPacker,
    submit: Callable[[PackedBucket], object],
    wait: Callable[[object], None],
) -> int:
    """Drive a packer with at most one bucket in flight: pack bucket i+1 while the receiver consumes bucket i.

    ``submit(bucket)`` hands a packed bucket to the receiver and returns a token; ``wait(token)`` returns when the
    receiver no longer reads that bucket's buffer. Returns the number of tensor pieces sent.
    """
    # every submitted bucket is waited for, whatever its token (None included: a submit that returns nothing must
    # still be waited for before its buffer is packed again)
    pending, in_flight, count = None, False, 0
    for bucket in packer.buckets(named_tensors):
        packer.synchronize()
        if in_flight:
            wait(pending)  # frees the other buffer, which the packer fills next
        pending, in_flight = submit(bucket), True
        count += len(bucket.specs)
        if len(packer.buffers) == 1:
            wait(pending)
            in_flight = False
    if in_flight:
        wait(pending)
    return count


def _check_bucket_bytes(bucket_bytes, least: int) -> None:
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < least:
        allowed = "a positive integer" if least == 1 else f"an integer >= {least}"
        raise ValueError(f"bucket_bytes must be {allowed}, got {bucket_bytes!r}")


class NamedBuckets:
    """Groups ``(name, tensor)`` pairs into buckets (lists) of at most ``bucket_bytes`` of tensor data; a tensor
    larger than that travels alone. :meth:`add` returns the bucket that a tensor closes (the tensors before it, or
    None), :meth:`finish` the last one: a caller whose tensors come from an async generator drives it by hand,
    :func:`named_buckets` does it for an iterable."""

    def __init__(self, bucket_bytes: int):
        _check_bucket_bytes(bucket_bytes, 1)
        self.bucket_bytes = bucket_bytes
        self._bucket: list[tuple[str, torch.Tensor]] = []
        self._size = 0

    def add(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        nbytes = tensor.numel() * tensor.element_size()
        full = None
        if self._bucket and self._size + nbytes > self.bucket_bytes:
            full, self._bucket, self._size = self._bucket, [], 0
        self._bucket.append((name, tensor))
        self._size += nbytes
        return full

    def finish(self) -> list[tuple[str, torch.Tensor]] | None:
        """The last bucket (None if empty); the grouping starts over afterwards."""
        last, self._bucket, self._size = self._bucket or None, [], 0
        return last


def named_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """:class:`NamedBuckets` over an iterable: yields each bucket once the next tensor would overflow it."""
    buckets = NamedBuckets(bucket_bytes)
    for name, tensor in named_tensors:
        full = buckets.add(name, tensor)
        if full is not None:
            yield full
    last = buckets.finish()
    if last is not None:
        yield last


# ---- receiving side


def weight_targets(model: nn.Module) -> dict[str, tuple[torch.Tensor, list[str]]]:
    """Name -> (the tensor a spec of that name is copied into, the checkpoint names it loads). Checkpoint names (one
    per expert for stacked experts) and whole parameter names (a stacked expert tensor at once) are both accepted.
    Rebuild it whenever the model's parameters get new storage (a level-2 sleep and wake)."""
    targets = {name: (t, [name]) for name, t in _pieces(model)}
    stacked = stacked_experts(model)
    for name, p in named_weights(model):
        if name not in targets:
            targets[name] = (p, [piece for piece, _ in checkpoint_pieces(name, p, stacked)])
    return targets


def _pieces(model: nn.Module):
    stacked = stacked_experts(model)
    for name, p in named_weights(model):
        yield from checkpoint_pieces(name, p, stacked)


def load_bucket(
    model: nn.Module,
    buffer: torch.Tensor,
    specs: list[TensorSpec],
    targets: dict | None = None,
    skip: Callable[[str], bool] | None = None,
) -> list[str]:
    """Copy a packed bucket into the model's tensors in place; returns the checkpoint names completed by it.

    Every spec is checked (known name, the target's exact dtype and shape, rows and byte range inside the buffer)
    before any byte is copied, so a bad bucket raises :class:`CheckpointError` naming the tensor and changes
    nothing. ``skip(name)`` marks names the caller knows but does not hold here (another pipeline stage's layers).
    """
    if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise TypeError(f"bucket buffer must be a 1-D uint8 tensor, got {getattr(buffer, 'dtype', type(buffer))}")
    if not isinstance(specs, (list, tuple)):
        raise TypeError(f"bucket specs must be a list of TensorSpec, got {type(specs).__name__}")
    targets = weight_targets(model) if targets is None else targets
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    plan, problems = [], []
    for k, spec in enumerate(specs):
        if not isinstance(spec, TensorSpec):
            raise TypeError(f"bucket spec {k} must be a TensorSpec, got {type(spec).__name__}")
        entry = targets.get(spec.name)
        if entry is None:
            if (skip is not None and skip(spec.name)) or (tied and spec.name == "lm_head.weight"):
                continue
            problems.append(f"{spec.name}: the model has no tensor of that name")
            continue
        dst, names = entry
        problem = _check(spec, dst, buffer.numel())
        if problem:
            problems.append(f"{spec.name}: {problem}")
            continue
        plan.append((spec, dst, names))
    if problems:
        raise CheckpointError(f"bad weight bucket ({len(problems)} of {len(specs)} tensors), nothing loaded: "
                              + "; ".join(problems[:5]))  # fmt: skip
    loaded = []
    groups: dict[tuple, tuple[list, list]] = {}  # (dtype, device) -> (destinations, sources): one copy launch each
    for spec, dst, names in plan:
        src = buffer[spec.offset : spec.offset + spec.nbytes].view(spec.dtype).view(spec.piece_shape)
        dsts, srcs = groups.setdefault((dst.dtype, dst.device), ([], []))
        dsts.append(dst if spec.rows is None else dst[spec.rows[0] : spec.rows[1]])
        srcs.append(src)
        if spec.completes:
            loaded += names
    for dsts, srcs in groups.values():  # byte copies (same dtype on both sides)
        copy_tensors(dsts, srcs)
    return loaded


# A memcpy per tensor from this size up (None: never), one foreach launch for the rest. None by default, from H100 and
# H200 runs of benchmarks/weight_sync.py (results/weight-sync-h100.md, -h200.md): a dense model's sync is bound by the
# host issuing its 310-400 tensors, and the first memcpy into the engine's IPC-opened buffer cost the 1.7B sync about
# 2 ms of host time (H100: 2.62x the copy bound with a memcpy for its 622 MB embedding, 1.93x all in foreach
# launches). A memcpy moves a large tensor at the copy bandwidth where the foreach kernel reaches about 0.7 of it, which
# pays when the copies, not the host, are the bound: 8B 1.19x against 1.50x, stacked 30B-A3B experts 1.14x against
# 1.64x (H200). A caller with such tensors can ask for it (DirectWriter(memcpy_min_bytes=32 << 20)).
MEMCPY_MIN_BYTES: int | None = None


def copy_tensors(
    dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], memcpy_min_bytes: int | None = MEMCPY_MIN_BYTES
) -> None:
    """``dst.copy_(src)`` for each pair, queued on the current stream (``non_blocking``): the values are exactly
    ``copy_``'s (a cast rounds to nearest even, as ``tensor.to(dtype)``), only the launches differ.

    Pairs of one dtype, both contiguous, of at least ``memcpy_min_bytes`` go one by one (a device memcpy, at the copy
    bandwidth); the rest go in one ``torch._foreach_copy_`` (one launch for many tensors, at about 0.7 of the copy
    bandwidth for large ones). ``memcpy_min_bytes=None``: all in the foreach launch.
    """
    small_d, small_s = [], []
    with torch.no_grad():
        for dst, src in zip(dsts, srcs, strict=True):
            if (memcpy_min_bytes is not None and dst.nbytes >= memcpy_min_bytes and dst.dtype == src.dtype
                    and dst.is_contiguous() and src.is_contiguous()):  # fmt: skip
                dst.copy_(src, non_blocking=True)
            else:
                small_d.append(dst)
                small_s.append(src)
        if small_d:
            torch._foreach_copy_(small_d, small_s, non_blocking=True)


def _check(spec: TensorSpec, dst: torch.Tensor, buffer_bytes: int) -> str | None:
    if spec.dtype != dst.dtype:
        return f"dtype {spec.dtype} != the engine's {dst.dtype} (the sender casts; the receiver never does)"
    if tuple(spec.shape) != tuple(dst.shape):
        return f"shape {tuple(spec.shape)} != the engine's {tuple(dst.shape)}"
    if spec.rows is not None:
        start, stop = spec.rows
        if not (dst.dim() and 0 <= start < stop <= dst.shape[0]):
            return f"rows {spec.rows} outside [0, {dst.shape[0] if dst.dim() else 0})"
    if spec.offset < 0 or spec.offset % spec.dtype.itemsize or spec.offset + spec.nbytes > buffer_bytes:
        end = spec.offset + spec.nbytes
        return f"bytes [{spec.offset}, {end}) are not an aligned range of the {buffer_bytes}-byte bucket"
    return None


# ---- CUDA IPC (one GPU, two processes)


def ipc_handle(buffer: torch.Tensor):
    """A picklable handle another process on the same GPU opens with :func:`open_ipc_handle` (no copy)."""
    from torch.multiprocessing.reductions import reduce_tensor

    if buffer.device.type != "cuda":
        raise ValueError(f"CUDA IPC needs a CUDA tensor, got one on {buffer.device}")
    return reduce_tensor(buffer)


def open_ipc_handle(handle, device: torch.device | int | None = None) -> torch.Tensor:
    """The tensor behind :func:`ipc_handle`'s handle, on ``device`` (this process's index of the same GPU: the two
    processes may number their visible GPUs differently)."""
    rebuild, args = handle
    args = list(args)
    if device is not None:
        args[6] = torch.device(device).index if not isinstance(device, int) else device  # rebuild_cuda_tensor's device
    return rebuild(*args)


def device_uuid(device: torch.device | int | None = None) -> str:
    """The GPU's UUID: two processes share a GPU when theirs are equal (their indices may differ)."""
    return str(torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device()).uuid)


# ---- torch.distributed broadcast (separate placement: trainer rank 0 -> every rollout process)


class WeightSyncGroup:
    """A process group of its own between the sender (rank 0) and the receivers, beside any default group the
    processes already have (a trainer's FSDP group, a pipeline's stage group). NCCL on CUDA, gloo on CPU.

    Every member constructs it with the same ``host``/``port``/``world_size`` and its own ``rank``; rank 0 hosts the
    rendezvous store. ``device`` is where buckets live (CUDA for NCCL; gloo moves host tensors).
    """

    def __init__(
        self, host: str, port: int, rank: int, world_size: int, device: str | torch.device = "cpu",
        timeout_s: float = 600.0,
    ):  # fmt: skip
        if not 0 <= rank < world_size:
            raise ValueError(f"weight sync rank {rank} outside [0, {world_size})")
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
        self.store = dist.PrefixStore("vexact_weight_sync", store)
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(self.store, rank, world_size, opts)
            self.pg._set_sequence_number_for_group()
            self.pg.eager_connect_single_device(self.device)  # the communicator now, not at the first bucket
        else:
            self.pg = dist.ProcessGroupGloo(self.store, rank, world_size, timeout)
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"

    def broadcast(self, tensor: torch.Tensor, src: int = 0):
        """Start a broadcast from ``src``; returns the work (``.wait()`` it; on NCCL that orders the current stream
        after it without blocking the host)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        return self.pg.broadcast([tensor], opts)

    def send_meta(self, meta) -> None:
        """Rank 0: broadcast a small picklable object (a bucket's specs; None ends a sync)."""
        data = pickle.dumps(meta)
        self.broadcast(torch.tensor([len(data)], dtype=torch.int64, device=self.device)).wait()
        self.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)).wait()

    def recv_meta(self):
        """The other ranks: the object rank 0 sent with :meth:`send_meta`."""
        n = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.broadcast(n).wait()
        data = torch.empty(int(n.item()), dtype=torch.uint8, device=self.device)
        self.broadcast(data).wait()
        return pickle.loads(data.cpu().numpy().tobytes())  # noqa: S301 (this group's rank 0, the trainer)

    def close(self) -> None:
        shutdown = getattr(self.pg, "shutdown", None)
        if shutdown is not None:
            shutdown()


def broadcast_weights(
    group: WeightSyncGroup, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
    dtype: torch.dtype = torch.bfloat16,
) -> int:  # fmt: skip
    """Rank 0 of ``group``: pack and broadcast the weights to every receiver (:func:`receive_weights`), two buffers
    in turn so the next bucket is packed while the last is on the wire. Returns the number of pieces sent."""
    if group.rank != 0:
        raise RuntimeError(f"broadcast_weights runs on rank 0 of the weight sync group, this is rank {group.rank}")
    packer = BucketPacker(bucket_bytes, group.device, dtype)

    def submit(bucket: PackedBucket):
        group.send_meta((bucket.specs, bucket.nbytes))
        return group.broadcast(packer.buffers[bucket.index][: bucket.nbytes])

    def wait(work) -> None:
        work.wait()
        if group.device.type == "cuda":
            torch.cuda.current_stream(group.device).synchronize()  # before the packer writes into that buffer

    count = send_buckets(named_tensors, packer, submit, wait)
    group.send_meta(None)  # end of this sync
    return count


def receive_weights(group: WeightSyncGroup, load: Callable[[torch.Tensor, list[TensorSpec]], list[str]]) -> list[str]:
    """A receiver of :func:`broadcast_weights`: each bucket lands in a device buffer and goes to ``load(buffer,
    specs)`` (e.g. :func:`load_bucket` or an engine's ``load_bucket``). Returns the names loaded. A ``load`` that
    raises stops loading but the bucket stream is still drained, so the sender and the other receivers finish."""
    buffers: dict[int, torch.Tensor] = {}
    loaded, error, turn = [], None, 0
    while True:
        meta = group.recv_meta()
        if meta is None:
            break
        specs, nbytes = meta
        buf = buffers.get(turn)
        if buf is None or buf.numel() < nbytes:
            buf = buffers[turn] = torch.empty(nbytes, dtype=torch.uint8, device=group.device)
        view = buf[:nbytes]
        group.broadcast(view).wait()
        turn ^= 1
        if error is None:
            try:
                loaded += load(view, specs)
            except Exception as e:  # keep draining: the group must stay in step
                error = e
    if group.device.type == "cuda":
        torch.cuda.current_stream(group.device).synchronize()
    if error is not None:
        raise error
    return loaded


# ---- single copy (a colocated trainer writes into the engine's packed parameters)


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


__all__ = [
    "ALIGN",
    "BucketPacker",
    "DirectWriter",
    "MEMCPY_MIN_BYTES",
    "NamedBuckets",
    "PackedBucket",
    "TensorSpec",
    "WeightSlot",
    "WeightSyncGroup",
    "WeightTable",
    "broadcast_weights",
    "copy_tensors",
    "device_uuid",
    "ipc_handle",
    "load_bucket",
    "named_buckets",
    "open_ipc_handle",
    "receive_weights",
    "send_buckets",
    "weight_table",
    "weight_targets",
]
