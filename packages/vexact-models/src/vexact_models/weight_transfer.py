"""Weights in packed buckets: one byte buffer per bucket plus a small list of :class:`TensorSpec` saying where each
tensor lies in it. The trainer packs (casting to the rollout dtype once, round to nearest even, the cast FSDP applies
before the forward), a transport moves the buffer (a CUDA IPC handle on one GPU, a ``torch.distributed`` broadcast
between GPUs or hosts), the engine copies the bytes into its parameters in place.

Only the specs (names, shapes, dtypes, offsets: a few KB of Python objects) travel as objects; the bytes stay in
device buffers. Nothing is rounded after packing: the engine receives bit for bit what the sender packed, and a spec
whose dtype is not the engine's is refused (the receiver never casts).

Both sides live here, below the trainer and the engine, so the format is defined once.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from .errors import CheckpointError
from .layers import checkpoint_pieces, named_weights, weight_dtype

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
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < ALIGN:
            raise ValueError(f"bucket_bytes must be an integer >= {ALIGN}, got {bucket_bytes!r}")
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


# ---- receiving side


def weight_targets(model: nn.Module) -> dict[str, tuple[torch.Tensor, list[str]]]:
    """Name -> (the tensor a spec of that name is copied into, the checkpoint names it loads). Checkpoint names (one
    per expert for stacked experts) and whole parameter names (a stacked expert tensor at once) are both accepted.
    Rebuild it whenever the model's parameters get new storage (a level-2 sleep and wake)."""
    targets = {name: (t, [name]) for name, t in _pieces(model)}
    for name, p in named_weights(model):
        if name not in targets:
            targets[name] = (p, [piece for piece, _ in checkpoint_pieces(name, p)])
    return targets


def _pieces(model: nn.Module):
    for name, p in named_weights(model):
        yield from checkpoint_pieces(name, p)


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


__all__ = [
    "BucketPacker",
    "PackedBucket",
    "TensorSpec",
    "WeightSyncGroup",
    "broadcast_weights",
    "copy_tensors",
    "device_uuid",
    "ipc_handle",
    "load_bucket",
    "open_ipc_handle",
    "receive_weights",
    "send_buckets",
    "weight_targets",
]
