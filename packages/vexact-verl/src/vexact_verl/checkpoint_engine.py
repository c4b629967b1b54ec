"""A checkpoint-engine backend over gloo: verl's separate placement (``separate_async``, standalone replicas) on CPU.

verl 0.9.1 syncs a trainer and rollout replicas on other devices through a ``CheckpointEngine``
(``verl/checkpoint_engine/``): the trainer's rank 0 sends the weights in buckets, every rollout worker
(``CheckpointEngineWorker``) receives them and hands ``(name, tensor)`` pairs to its ``ServerAdapter``. Its backends
need a GPU (``nccl``: cupy and NCCL; ``nixl``, ``mooncake``, ``kimi``: their own transports); none runs on a CPU.
:class:`GlooCheckpointEngine` is the same protocol as verl's ``NCCLCheckpointEngine`` (``prepare``,
``build_topology``, ``init_process_group``, ``send_weights``, ``receive_weights``, ``finalize``; weights split into
chunks and merged back with verl's own ``split_weight_chunks`` / ``merge_weight_chunks``), on a gloo process group of
its own, so the separate placement runs, and is tested, on CPU processes.

Registered in verl's ``CheckpointEngineRegistry`` as ``gloo`` by :func:`vexact_verl.register` (so in every process
the plugin reaches) and by importing this module, which verl does for
``actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=vexact_verl.checkpoint_engine``. Select it with
``actor_rollout_ref.rollout.checkpoint_engine.backend=gloo``. It moves bytes only, as verl's NCCL engine does: what a
bucket carries is what the trainer's ``get_per_tensor_param`` yields, bit for bit, and the policy version travels
beside the weights exactly as with ``nccl`` (verl hands ``global_steps`` to the actor's ``update_weights`` and to each
``CheckpointEngineWorker``; :func:`vexact_verl.registration.register_version_publish`), so a CPU run through this
backend takes the version path of a GPU run through ``nccl``.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import socket
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from verl.checkpoint_engine.base import (
    CheckpointEngine,
    CheckpointEngineRegistry,
    TensorMeta,
    merge_weight_chunks,
    split_weight_chunks,
)
from verl.workers.rollout.utils import ensure_async_iterator

log = logging.getLogger("vexact_verl")

BACKEND = "gloo"


@dataclass
class MasterAddress:
    """Where the group meets: the sender's TCP store."""

    host: str
    port: int


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address().strip("[]")
    except Exception:  # outside Ray (a test driving the engine directly)
        return "127.0.0.1"


class GlooCheckpointEngine(CheckpointEngine):
    """verl's checkpoint-engine protocol on a private gloo group: actor rank 0 broadcasts, rollout workers receive.

    Args:
        bucket_size: bytes per broadcast (verl's ``update_weights_bucket_megabytes``); a larger tensor is split into
            chunks and merged back on the receiver.
        is_master: actor rank 0, the sender (verl passes it to the trainer's engine only).
        timeout_s: how long a member waits for the others in the group.
    """

    def __init__(self, bucket_size: int, is_master: bool = False, timeout_s: float = 600.0) -> None:
        if int(bucket_size) < 1:
            raise ValueError(f"checkpoint_engine bucket size must be >= 1 byte, got {bucket_size}")
        self.bucket_size = int(bucket_size)
        self.is_master = is_master
        self.timeout = timedelta(seconds=float(timeout_s))
        self.rank: int | None = None
        self.world_size: int | None = None
        self._group = None
        self._store = None
        self._address: MasterAddress | None = None

    def prepare(self) -> MasterAddress | None:
        """The sender picks the group's address (a free port on its node); receivers report nothing."""
        if not self.is_master:
            return None
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        self._address = MasterAddress(_node_ip(), port)
        return self._address

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list):
        """Actor rank 0 is rank 0 of the group; other actor ranks sit out (rank -1) but drain the weight generator,
        which is collective over the actor group; rollout worker i is rank 1 + i."""
        master = metadata[0]
        if not isinstance(master, MasterAddress):
            raise RuntimeError(f"actor rank 0 must be the gloo checkpoint engine's master; it reported {master!r}")
        world_size = 1 + rollout_world_size
        actor = {
            "rank": [0] + [-1] * (actor_wg_world_size - 1),
            "world_size": [world_size] * actor_wg_world_size,
            "master": [master] * actor_wg_world_size,
        }
        rollout = {
            "rank": list(range(1, world_size)),
            "world_size": [world_size] * rollout_world_size,
            "master": [master] * rollout_world_size,
        }
        return actor, rollout

    def init_process_group(self, rank: int, world_size: int, master: MasterAddress) -> None:
        """Join the group of this sync (a fresh one each time: verl's manager rebuilds the topology per sync)."""
        self.rank, self.world_size = rank, world_size
        if rank < 0:
            return
        self._store = dist.TCPStore(master.host, master.port, world_size, is_master=rank == 0, timeout=self.timeout,
                                    wait_for_workers=False)  # fmt: skip
        self._group = dist.ProcessGroupGloo(self._store, rank, world_size, self.timeout)
        self._group.barrier().wait()

    def finalize(self) -> None:
        self._group = None
        self._store = None
        self.rank = self.world_size = None

    def _broadcast(self, tensor: torch.Tensor) -> None:
        self._group.broadcast(tensor, 0).wait()

    def _broadcast_meta(self, meta: dict | None) -> dict:
        """A bucket's ``TensorMeta`` list and flags, pickled, from rank 0 (length first, then the bytes)."""
        length = torch.zeros(1, dtype=torch.int64)
        payload = None
        if self.rank == 0:
            payload = torch.frombuffer(bytearray(pickle.dumps(meta)), dtype=torch.uint8)
            length[0] = payload.numel()
        self._broadcast(length)
        if self.rank != 0:
            payload = torch.empty(int(length[0]), dtype=torch.uint8)
        self._broadcast(payload)
        return meta if self.rank == 0 else pickle.loads(payload.numpy().tobytes())

    @torch.no_grad()
    async def send_weights(self, weights, global_steps: int | None = None):
        """Broadcast the weights in buckets of ``bucket_size`` bytes (a tensor larger than that in chunks)."""
        if self.rank is None:
            raise RuntimeError("send_weights before init_process_group (verl's CheckpointEngineManager calls it)")
        if self.rank < 0:  # not in the group, but producing the weights is collective over the actor ranks
            async for _ in ensure_async_iterator(weights):
                pass
            return {}
        if self.rank != 0:
            raise RuntimeError(f"rank {self.rank} of the gloo checkpoint engine receives; only rank 0 sends")
        start, total = time.perf_counter(), 0
        bucket = torch.empty(self.bucket_size, dtype=torch.uint8)
        metas: list[TensorMeta] = []
        offset = 0

        def flush(is_last: bool):
            self._broadcast_meta({"metas": metas, "length": offset, "is_last": is_last, "global_steps": global_steps})
            if offset:
                self._broadcast(bucket[:offset])

        async for meta, chunk in split_weight_chunks(weights, self.bucket_size):
            if offset + meta.chunk_size > self.bucket_size:
                await asyncio.to_thread(flush, False)
                metas, offset = [], 0
            meta.offset = offset
            bucket[offset : offset + meta.chunk_size].copy_(chunk.detach().reshape(-1).cpu())
            metas.append(meta)
            offset += meta.chunk_size
            total += meta.chunk_size
        await asyncio.to_thread(flush, True)
        seconds = time.perf_counter() - start
        log.info("gloo checkpoint engine: %d bytes sent in %.2f s", total, seconds)
        return {"vexact/weight_sync/bytes": float(total), "vexact/weight_sync/send_s": seconds}

    @torch.no_grad()
    async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """Yield ``(name, tensor)`` as verl's NCCL engine does; a yielded tensor may be a view of the receive buffer,
        valid until the next one is asked for (the vexact ``ServerAdapter`` copies each)."""
        async for name, tensor in merge_weight_chunks(self._receive_chunks(), self.bucket_size):
            yield name, tensor

    async def _receive_chunks(self):
        if self.rank is None or self.rank < 1:
            raise RuntimeError(f"receive_weights on rank {self.rank}: the gloo checkpoint engine's receivers are 1..n")
        bucket = torch.empty(self.bucket_size, dtype=torch.uint8)

        def receive():
            meta = self._broadcast_meta(None)
            if meta["length"]:
                self._broadcast(bucket[: meta["length"]])
            return meta

        while True:
            meta = await asyncio.to_thread(receive)
            for m in meta["metas"]:
                yield m, bucket[m.offset : m.offset + m.chunk_size]
            if meta["is_last"]:
                return


def register_checkpoint_engine() -> None:
    """Put ``gloo`` in verl's ``CheckpointEngineRegistry``. Idempotent."""
    if CheckpointEngineRegistry._registry.get(BACKEND) is not GlooCheckpointEngine:
        CheckpointEngineRegistry.register(BACKEND)(GlooCheckpointEngine)


register_checkpoint_engine()
