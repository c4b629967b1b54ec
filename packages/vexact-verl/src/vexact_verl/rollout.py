"""verl's two rollout extension points, filled in for vexact.

- :class:`VexactReplica` (verl's ``RolloutReplica``): launches one :class:`~vexact_verl.server.VexactServer` Ray actor
  per replica, pinned to the node and GPU of the replica's first worker, and hands its handle to verl's agent loop; a
  replica over several GPUs (pipeline stages, or expert-parallel ranks) adds one
  :class:`~vexact_verl.server.VexactStage` actor per further worker, on that worker's GPU.
- :class:`ServerAdapter` (verl's ``BaseRollout``): lives in each trainer (hybrid) or checkpoint-engine (colocated,
  standalone) worker and turns verl's ``resume(tags)`` / ``release()`` / ``update_weights(generator)`` into calls on
  that server actor.

Both follow verl's vLLM backend call for call, so verl drives vexact exactly as it drives vLLM.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from typing import Any

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from verl.workers.config import HFModelConfig, RolloutConfig
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica

from vexact_models import NamedBuckets, weight_dtype

from .server import ServerSettings, VexactServer, VexactStage, engine_kwargs_from_verl
from .versions import publish_version

log = logging.getLogger("vexact_verl")

ROLLOUT_NAME = "vexact"


async def _aiter(weights):
    """verl hands either a generator or an async generator of ``(name, tensor)``."""
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item


def server_actor_name(replica_rank: int, node_rank: int = 0, role: str = "", suffix: str = "") -> str:
    """The Ray actor name of a replica's server; the ServerAdapter finds it by this name (as verl's vLLM one does)."""
    role = f"{role}_" if role else ""
    return f"{ROLLOUT_NAME}_server_{role}{replica_rank}_{node_rank}{suffix}"


# naive: verl's hybrid mode (the trainer's own process hands the weights over); nccl: verl's separate placement on
# GPUs; gloo: the same on CPU (vexact_verl.checkpoint_engine). Each delivers (name, tensor) pairs that the adapter
# casts and loads as a whole; the others are untested with the vexact rollout (delta_sharded sends sparse patches).
CHECKPOINT_BACKENDS = ("naive", "nccl", "gloo")


def _routed_experts(model_config) -> int | None:
    """The routed-expert count of the model's HF config (``num_experts``, ``n_routed_experts`` or
    ``num_local_experts``); 0 for a dense model, None for a config not at hand (the driver's DictConfig names a
    ``path`` that may be remote: the workers check it)."""
    hf = getattr(model_config, "hf_config", None)
    if hf is None:
        path = getattr(model_config, "local_path", None) or getattr(model_config, "path", None)
        if not path or not os.path.isfile(os.path.join(str(path), "config.json")):
            return None
        with open(os.path.join(path, "config.json")) as f:
            hf = json.load(f)
    get = hf.get if isinstance(hf, dict) else lambda key: getattr(hf, key, None)
    for key in ("num_experts", "n_routed_experts", "num_local_experts"):
        if isinstance(get(key), int) and get(key) > 0:
            return get(key)
    return 0


def _check_expert_parallel(config, model_config=None) -> int:
    """``rollout.expert_parallel_size``: 1 (no expert parallelism), or a divisor of the model's routed experts, with
    ``data_parallel_size`` equal to it (as verl lays out expert parallelism: the attention data-parallel over the
    replica's ranks, each rank a shard of the experts). Returns the size.

    A replica of ``expert_parallel_size`` GPUs runs :class:`vexact_engine.ExpertParallelLLM` over them: one process a
    worker's GPU, each with its own requests and KV cache and its share of the experts, rank 0 the driver that verl
    talks to (as verl's vLLM replica with expert parallelism: the data-parallel ranks of one replica)."""
    ep = getattr(config, "expert_parallel_size", 1)
    ep = 1 if ep is None else ep
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"rollout.expert_parallel_size must be a positive integer, got {ep!r}")
    if ep == 1:
        return 1
    if config.data_parallel_size != ep:
        raise ValueError(
            f"rollout.expert_parallel_size={ep} needs rollout.data_parallel_size={ep} (the attention data-parallel "
            f"over the replica's ranks); got {config.data_parallel_size}"
        )
    pp = config.pipeline_model_parallel_size
    if pp > 1:
        raise ValueError(
            f"rollout.expert_parallel_size={ep} with pipeline_model_parallel_size={pp}: the vexact rollout runs one of "
            "the two in a replica, not both"
        )
    experts = _routed_experts(model_config)
    if experts == 0:
        raise ValueError(f"rollout.expert_parallel_size={ep}: the model has no routed experts (it is not an MoE model)")
    if experts and experts % ep:
        raise ValueError(
            f"rollout.expert_parallel_size={ep} does not divide the model's {experts} routed experts: use a divisor "
            f"of {experts}"
        )
    return ep


def _check_layout(config, model_config=None) -> None:
    backend = config.checkpoint_engine.backend
    if backend not in CHECKPOINT_BACKENDS:
        raise ValueError(
            f"rollout.checkpoint_engine.backend={backend!r}: the vexact rollout takes {list(CHECKPOINT_BACKENDS)} "
            "(naive for the hybrid placement, nccl to sync a separate rollout on GPUs, gloo on CPU)"
        )
    ep = _check_expert_parallel(config, model_config)
    tp, dp, pp = config.tensor_model_parallel_size, config.data_parallel_size, config.pipeline_model_parallel_size
    if tp != 1:
        raise ValueError(
            f"rollout.tensor_model_parallel_size={tp}: the vexact rollout runs without tensor parallelism (it would "
            "change the reduction order of every row); use 1, and data-parallel replicas for throughput"
        )
    if dp != 1 and dp != ep:
        raise ValueError(f"rollout.data_parallel_size={dp}: use 1; verl makes one vexact replica per rollout world")
    if pp > 1:
        engine = engine_kwargs_from_verl(config)
        if engine.get("num_kv_blocks") is None and engine.get("kv_cache_bytes") is None:
            raise ValueError(
                f"rollout.pipeline_model_parallel_size={pp}: every stage must hold the same KV pages; set "
                "+rollout.engine_kwargs.vexact.num_kv_blocks (or kv_cache_bytes)"
            )


def server_settings(config: RolloutConfig, model_config, replica_rank: int, rollout_mode: str) -> ServerSettings:
    """ServerSettings from verl's configs (RolloutConfig dataclass; HFModelConfig or its DictConfig)."""
    path = getattr(model_config, "local_path", None)
    if not path:  # the driver passes the DictConfig, which has only `path` (possibly remote): verl's own local copy
        from verl.utils.fs import copy_to_local

        path = copy_to_local(model_config.path)
    engine = engine_kwargs_from_verl(config, replica_rank)
    return ServerSettings(
        model_path=str(path),
        max_model_len=engine["max_model_len"],
        prompt_length=int(config.prompt_length),
        response_length=int(config.response_length),
        engine=engine,
        free_cache_engine=bool(config.free_cache_engine),
        ignore_eos=bool(config.ignore_eos),
        sleep_level=2 if rollout_mode == "hybrid" else 1,
        pipeline_parallel_size=int(config.pipeline_model_parallel_size),
        expert_parallel_size=int(getattr(config, "expert_parallel_size", 1) or 1),
    )


class VexactReplica(RolloutReplica):
    """One vexact engine per replica, served by a Ray actor: on one GPU, or over the replica's GPUs as pipeline
    stages (``pipeline_model_parallel_size``) or expert-parallel ranks (``expert_parallel_size``); never tensor
    parallelism."""

    def __init__(self, replica_rank: int, config: RolloutConfig, model_config: HFModelConfig, *args, **kwargs):
        super().__init__(replica_rank, config, model_config, *args, **kwargs)
        _check_layout(self.config, self.model_config)
        self.server_class = ray.remote(VexactServer)
        self.stage_class = ray.remote(VexactStage)
        self.stages = []

    def _name(self, node_rank: int) -> str:
        role = "reward" if self.is_reward_model else "teacher" if self.is_teacher_model else ""
        return server_actor_name(self.replica_rank, node_rank, role, self.name_suffix)

    async def launch_servers(self):
        """Start the server actor on the node of the replica's first worker, seeing that worker's GPU; with
        ``pipeline_model_parallel_size`` or ``expert_parallel_size`` > 1 also one rank actor per further worker, on
        that worker's node and GPU (rank r on worker r, as verl places a vLLM replica's ranks)."""
        if len(self.workers) != self.world_size:
            raise RuntimeError(f"vexact replica {self.replica_rank}: {len(self.workers)} workers for world size "
                               f"{self.world_size}")  # fmt: skip

        def where(_self):
            from vexact_models import device_uuid

            ctx = ray.get_runtime_context()
            gpus = ctx.get_accelerator_ids().get("GPU", [])
            # the GPU the worker computes on, by UUID: what its server or stage must use (see server._worker_device)
            on_gpu = bool(gpus) and torch.cuda.is_available()  # the CPU tests give Ray fake "GPU"s
            uuid = device_uuid() if on_gpu else None
            # what the worker's process sees: the actor on its GPU starts seeing the same (Ray's GPU ids are not
            # CUDA_VISIBLE_DEVICES when verl has Ray leave that variable alone)
            visible = os.environ.get("CUDA_VISIBLE_DEVICES") if on_gpu else ",".join(str(g) for g in gpus)
            return ctx.get_node_id(), visible, uuid

        infos = await asyncio.gather(*[w.__ray_call__.remote(where) for w in self.workers])
        visible = infos[0][1]
        mode = self.rollout_mode.value if self.rollout_mode is not None else "hybrid"
        settings = server_settings(self.config, self.model_config, self.replica_rank, mode)
        server = self._place(self.server_class, infos[0], name=self._name(0), max_concurrency=self.max_concurrency)
        server = server.remote(settings, mode, self.replica_rank, 0, visible or None, infos[0][2])
        self.servers = [server]
        if settings.ranks > 1:
            # rank r on the GPU of the replica's worker r; all ranks join one process group, rank 0 drives
            address = await server.pick_dist_address.remote()
            self.stages = [
                self._place(self.stage_class, info, name=f"{self._name(0)}_stage{r}").remote(
                    settings, r, info[1] or None, info[2]
                )
                for r, info in enumerate(infos[1:], start=1)
            ]
            await asyncio.gather(server.launch_server.remote(address), *[s.launch.remote(address) for s in self.stages])
        else:
            await server.launch_server.remote()
        ip, port = await server.get_server_address.remote()
        self._server_handle = server
        self._server_address = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"

    def _place(self, actor_class, info: tuple, **options):
        """The actor on the node of a worker, seeing that worker's GPU(s) from the start of its process."""
        node_id, visible, uuid = (*info, None)[:3]
        # Ray empties CUDA_VISIBLE_DEVICES in an actor that asked for no GPU unless told not to: the actor asks for
        # none (the GPU belongs to the worker it shares it with) and sees what the worker sees. The variable is set
        # when the process starts, and the GPU's UUID makes the runtime env one of its own: Ray then starts a fresh
        # process instead of handing over a pooled one whose CUDA may have started seeing another GPU (2x H200: a
        # stage saw only GPU 0 although its variable said 1).
        env = {}
        if visible or uuid:
            env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
        if visible:
            env["CUDA_VISIBLE_DEVICES"] = visible
        if uuid:
            env["VEXACT_GPU_UUID"] = uuid
        return actor_class.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
            runtime_env={"env_vars": env},
            **options,
        )

    async def sleep(self):
        await asyncio.gather(*[s.wait_for_requests_to_drain.remote() for s in self.servers])
        await asyncio.gather(*[s.sleep.remote() for s in self.servers])

    async def abort_all_requests(self, reject_request: bool = False) -> dict[str, Any]:
        results = await asyncio.gather(
            *[s.abort_all_requests.remote(reject_request=reject_request) for s in self.servers]
        )
        ids = [rid for r in results for rid in r.get("request_ids", [])]
        return {"aborted_count": len(ids), "request_ids": ids, "server_results": results}

    async def abort_request(self, request_id: str) -> dict[str, Any]:
        results = await asyncio.gather(*[s.abort_request.remote(request_id) for s in self.servers])
        for r in results:
            if r.get("aborted"):
                return r
        return {"aborted": False, "request_id": request_id, "error": "Request not found on any server"}

    async def resume_generation(self):
        await asyncio.gather(*[s.resume_generation.remote() for s in self.servers])


class ServerAdapter(BaseRollout):
    """The rollout object in verl's workers: forwards resume/release/update_weights to the replica's server.

    Rank 0 of each replica talks to the server; every rank drains the weight generator, because producing it is a
    collective (FSDP all-gathers each parameter) that every trainer rank must take part in.
    """

    def __init__(self, config: RolloutConfig, model_config: HFModelConfig, device_mesh=None, replica_rank: int = -1):
        super().__init__(config, model_config, device_mesh)
        _check_layout(self.config, self.model_config)
        rank = int(os.environ.get("RANK", "0"))
        local_world_size = int(os.environ.get("RAY_LOCAL_WORLD_SIZE", "1"))
        world = self.config.tensor_model_parallel_size * self.config.data_parallel_size
        world *= self.config.pipeline_model_parallel_size
        self.replica_rank = rank // world if replica_rank == -1 else replica_rank
        self.rollout_rank = rank % world
        self.node_rank = self.rollout_rank // local_world_size
        self._has_server = self.rollout_rank == 0
        self.server_handle = None
        self.bucket_bytes = int(self.config.checkpoint_engine.update_weights_bucket_megabytes) << 20
        dtype = getattr(torch, str(self.config.dtype))
        self._wire_dtype = dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None
        self._ipc: bool | None = None  # decided at the first update_weights (same GPU as the server: CUDA IPC)
        self._direct = None  # the engine's weight buffers, opened (vexact_models.DirectWriter; the single-copy path)
        self.weight_sync_path: str | None = None  # how the last update_weights went: direct, buckets or host
        self._attention_checked = False  # the engine's attention implementation equals ours (first update_weights)

    @property
    def is_leader_rank(self) -> bool:
        return self._has_server

    def _server(self):
        if self._has_server and self.server_handle is None:
            self.server_handle = ray.get_actor(server_actor_name(self.replica_rank, self.node_rank))
        return self.server_handle

    async def resume(self, tags: list[str]):
        """Wake the engine (weights and KV come back together; the tags only say which part verl needs now)."""
        if self.config.free_cache_engine and self._server() is not None:
            await self.server_handle.wake_up.remote(tags=tags)

    async def release(self):
        """Put the engine to sleep: weights and KV cache leave the device."""
        self._close_direct()  # the engine's memory is only freed once no other process holds it
        if self.config.free_cache_engine and self._server() is not None:
            await self.server_handle.sleep.remote()

    @torch.no_grad()
    async def update_weights(self, weights, global_steps: int | None = None, wire_format: str = "named_tensors",
                             **kwargs):  # fmt: skip
        """Send verl's ``(name, tensor)`` generator to the engine.

        Floating tensors are cast to the rollout dtype on the way (round to nearest even, the cast FSDP's mixed
        precision applies before the actor's forward), so the engine holds exactly the values the actor computed with.
        The path is chosen per sync: on the engine's GPU (same ``device_uuid``) the tensors are copied straight into
        the engine's packed weight buffers (single copy, :meth:`_update_weights_direct`); where the engine has no
        packed buffers, into bucket buffers it opens (:meth:`_update_weights_ipc`); on another GPU or host (pipeline
        and expert-parallel replicas, separate placement) in host buckets of
        ``checkpoint_engine.update_weights_bucket_megabytes``, which the replica's driver routes to the ranks that hold
        each tensor (an expert-parallel rank receives the shared weights and its own experts only).
        """
        if wire_format != "named_tensors":
            raise NotImplementedError(f"the vexact rollout takes wire_format='named_tensors', got {wire_format!r}")
        publish_version(global_steps)  # this process's trainer weights are now this version (versions.py)
        if kwargs.get("peft_config") is not None:
            raise NotImplementedError("LoRA adapters are not supported by the vexact rollout; merge them (lora.merge)")
        server = self._server()
        await self._check_attention_impl(server)
        if await self._colocated(server):
            sent = await self._update_weights_direct(server, weights)
            self.weight_sync_path = "direct"
            if sent is None:  # the engine's weights are not packed: bucket buffers it copies from
                sent = await self._update_weights_ipc(server, weights)
                self.weight_sync_path = "buckets"
            if global_steps is not None:
                await server.set_global_steps.remote(global_steps)
            log.info("vexact replica %d: %d tensors updated through CUDA IPC (%s)", self.replica_rank, sent,
                     self.weight_sync_path)  # fmt: skip
            return
        self.weight_sync_path = "host"
        buckets = NamedBuckets(max(self.bucket_bytes, 1))
        sent = 0
        async for name, tensor in _aiter(weights):
            if server is None:
                continue  # not this rank's to send, but the generator must still be drained
            t = tensor.detach()
            if self._wire_dtype is not None and t.is_floating_point():
                t = t.to(weight_dtype(name, self._wire_dtype))  # DeepSeek's bias buffer travels in fp32
            # a copy: producers reuse their buffers for the next bucket
            full = buckets.add(name, t.to("cpu", copy=True))
            if full is not None:
                sent += await server.update_weights.remote(full)
        if server is None:
            return
        last = buckets.finish()
        if last is not None:
            sent += await server.update_weights.remote(last)
        if global_steps is not None:
            await server.set_global_steps.remote(global_steps)
        log.info("vexact replica %d: %d tensors updated", self.replica_rank, sent)

    async def _check_attention_impl(self, server) -> None:
        """Once: the engine and this worker (the trainer's process in verl's hybrid mode) run the same attention
        implementation on CUDA. ``triton`` and ``fa4`` are each invariant but differ from each other in the last bits,
        so a ``$VEXACT_ATTENTION`` set on one side only would make every logprob differ, silently."""
        if self._attention_checked or server is None or not torch.cuda.is_available():
            return
        import vexact_kernels as vk

        theirs, ours = await server.attention_impl.remote(), vk.get_attention_impl()
        if theirs != ours:
            raise RuntimeError(
                f"the vexact rollout engine runs attention with {theirs!r} and this trainer worker with {ours!r}: "
                "their logprobs cannot match bitwise; set VEXACT_ATTENTION the same for both (export it before "
                "starting verl, or +ray_kwargs.ray_init.runtime_env.env_vars.VEXACT_ATTENTION=...)"
            )
        self._attention_checked = True

    async def _colocated(self, server) -> bool:
        """True when this worker and the server share a CUDA device: weights then go through CUDA IPC handles."""
        if self._ipc is None:
            self._ipc = False
            one_gpu = self.config.pipeline_model_parallel_size == 1 and self.config.expert_parallel_size in (None, 1)
            if server is not None and torch.cuda.is_available() and one_gpu:
                from vexact_models import device_uuid

                theirs = await server.weight_sync_device.remote()
                self._ipc = theirs is not None and theirs == device_uuid()
        return self._ipc

    async def _update_weights_direct(self, server, weights) -> int | None:
        """Single-copy colocated path: copy each tensor straight into the engine's parameter, through CUDA IPC views
        of its packed weight buffers (``vexact_models.DirectWriter``); returns the number of checkpoint names loaded,
        or None (the generator untouched) when the engine's weights are not packed.

        Two calls to the server per sync: one to begin (the engine idle, its prefix cache dropped; its buffers'
        handles when this worker has not opened them for the current allocation) and one once the copies have
        landed. The views are closed after the sync unless the server never frees its weights: verl puts the engine
        to sleep through the replica, not through this adapter, and a view held here would keep the engine's memory
        on the device. In hybrid mode every sync follows a wake, so the buffers are opened once per wake either way.
        Copies go in groups of a bucket (``torch._foreach_copy_``) when the tensors are the trainer's own export, one
        at a time when a checkpoint-engine receiver yields views of buffers it refills.
        """
        from vexact_models import DirectWriter

        if self._direct is None:
            self._direct = DirectWriter()
        writer = self._direct
        begun = await server.begin_direct_weight_sync.remote(writer.key)
        if begun is None:
            self._close_direct()
            return None
        written = None
        try:
            if begun["table"] is not None:
                writer.open_handles(begun["table"], begun["handles"], torch.cuda.current_device())
            writer.start(self._wire_dtype or torch.bfloat16, 0 if begun["reused_memory"] else self.bucket_bytes)
            async for name, tensor in _aiter(weights):
                writer.add(name, tensor)
            writer.finish()  # synchronises: the copies have landed
            written = writer.written_mask
        finally:
            if written is None:
                writer.synchronize()  # copies of earlier groups may be in flight; the engine reads nothing meanwhile
            key = begun["key"]
            if written is None or not begun["keep_open"]:
                self._close_direct()
            sent = await server.finish_direct_weight_sync.remote(key, written)
        return sent

    def _close_direct(self) -> None:
        if self._direct is not None:
            self._direct.close()  # the last views of the engine's buffers go: the engine may free them

    async def _update_weights_ipc(self, server, weights) -> int:
        """Colocated path: pack the weights (cast to the rollout dtype, round to nearest even) into two device
        buffers of half a bucket each, hand the server their CUDA IPC handles once, then per bucket only its specs;
        bucket i+1 is packed while the engine copies bucket i into its parameters. No byte touches host memory."""
        from vexact_models import BucketPacker, ipc_handle

        dtype = self._wire_dtype or torch.bfloat16
        packer = BucketPacker(max(self.bucket_bytes // 2, 1 << 20), torch.device("cuda", torch.cuda.current_device()),
                              dtype)  # fmt: skip
        await server.open_weight_buffers.remote([ipc_handle(b) for b in packer.buffers])
        pending, sent = None, 0

        async def submit(bucket):
            nonlocal pending, sent
            packer.synchronize()  # the bucket's bytes are in place before the engine reads them
            if pending is not None:
                sent += await pending  # the engine is done with the other buffer, which is packed next
            pending = server.load_weight_bucket.remote(bucket.index, bucket.specs, bucket.nbytes)

        try:
            async for name, tensor in _aiter(weights):
                for bucket in packer.add(name, tensor):
                    await submit(bucket)
            last = packer.finish()
            if last is not None:
                await submit(last)
            if pending is not None:
                sent += await pending
                pending = None
        finally:
            if pending is not None:  # an error: let the engine finish with the buffer before it is freed
                try:
                    await pending
                except Exception:
                    pass
            await server.close_weight_buffers.remote()
            packer.buffers.clear()
            torch.cuda.empty_cache()
        return sent

    def generate_sequences(self, prompts):
        raise NotImplementedError("the vexact rollout is server-based: verl's agent loop calls its server")
