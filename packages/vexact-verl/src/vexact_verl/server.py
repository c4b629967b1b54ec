"""The rollout server: one vexact engine behind the async, token-in/token-out interface verl's agent loop calls.

verl drives a rollout server through a Ray actor handle (``server.generate.remote(...)``, ``server.sleep.remote()``,
...). :class:`VexactServer` is that actor's class. It owns one :class:`vexact_engine.LLMEngine` and one asyncio task
that steps it: ``generate`` calls only queue a request and wait for its future, so every request that arrives while a
step runs joins the next step (continuous batching across concurrent agent-loop calls). The engine is not
thread-safe; it is touched only by the stepping task (the step itself runs in a worker thread so the actor keeps
answering calls) or under the same lock by the control calls (sleep, wake_up, weight updates, aborts).

The server holds no numerics: logprobs are the engine's, which are the trainer's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from vexact_engine import (
    EngineConfig,
    ExpertParallelLLM,
    LLMEngine,
    MismatchInjection,
    PipelineLLM,
    RequestOutput,
    SamplingParams,
)

log = logging.getLogger("vexact_verl")
GEN_PHASE_LOG_ENV = "VEXACT_GEN_PHASE_LOG"  # a file each replica appends its GenPhase summaries to, one JSON line each

# verl passes these sampling keys (agent loop: temperature/top_p/top_k/repetition_penalty/logprobs; tool agent:
# stop_token_ids; the server itself: max_tokens or sglang's max_new_tokens). Anything else would change what is
# sampled in a way the trainer does not reproduce, so it is refused by name rather than silently dropped.
SUPPORTED_SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "repetition_penalty",
    "logprobs",
    "max_tokens",
    "max_new_tokens",
    "stop_token_ids",
    "ignore_eos",
    "seed",
)


@dataclass
class GenPhase:
    """Where one generation phase of a replica goes (from the server being ready to its next sleep): time to the
    first request, time inside ``engine.step`` (the engine's own work, host and device), time after the last answer,
    and the requests, steps and tokens. The rest of the phase's wall time is the server waiting on its callers (verl's
    agent loop, transport) between steps. Occupancy, where the engine tells it (:func:`engine_occupancy`): the most
    sequences running at once, the KV cache's capacity in tokens and the preemptions in the phase (fewer sequences in
    flight than the batch limit with preemptions means the cache bounds the batch)."""

    start: float = field(default_factory=time.monotonic)
    first: float | None = None
    last: float | None = None
    requests: int = 0
    steps: int = 0
    tokens: int = 0
    engine_s: float = 0.0
    peak_running: int = 0
    kv_tokens: int | None = None
    preemptions_at_start: int | None = None
    preemptions: int = 0

    def summary(self, end: float) -> dict[str, float]:
        first = self.first if self.first is not None else end
        last = self.last if self.last is not None else end
        active = max(last - first, 1e-9)
        return {
            "wall_s": end - self.start,
            "to_first_request_s": first - self.start,
            "first_to_last_answer_s": last - first,
            "after_last_answer_s": end - last,
            "engine_s": self.engine_s,
            "engine_share": self.engine_s / active if self.last is not None else 0.0,
            "requests": self.requests,
            "steps": self.steps,
            "tokens": self.tokens,
            "peak_running": self.peak_running,
            "kv_tokens": self.kv_tokens,
            "preemptions": self.preemptions,
        }

    def observe(self, engine) -> None:
        """After a step: the running count, the KV capacity and the preemptions since the phase's first step."""
        running, kv_tokens, preemptions = engine_occupancy(engine)
        if running is not None:
            self.peak_running = max(self.peak_running, running)
        if kv_tokens is not None:
            self.kv_tokens = kv_tokens
        if preemptions is not None:
            if self.preemptions_at_start is None:
                self.preemptions_at_start = preemptions
            self.preemptions = preemptions - self.preemptions_at_start


def engine_occupancy(engine) -> tuple[int | None, int | None, int | None]:
    """``(sequences running, KV cache tokens, preemptions since construction)`` of a one-GPU engine
    (:class:`vexact_engine.LLMEngine`); None for what an engine does not expose (the multi-rank replicas)."""
    sched, blocks = getattr(engine, "scheduler", None), getattr(engine, "blocks", None)
    running = len(sched.running) if sched is not None and hasattr(sched, "running") else None
    kv = blocks.num_blocks * blocks.block_size if blocks is not None and hasattr(blocks, "num_blocks") else None
    preempt = getattr(sched, "num_preemptions", None) if sched is not None else None
    return running, kv, preempt


@dataclass
class ServerSettings:
    """What one server needs from verl's RolloutConfig and HFModelConfig (plain values, so tests can build it)."""

    model_path: str
    max_model_len: int
    prompt_length: int
    response_length: int
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields
    free_cache_engine: bool = True
    ignore_eos: bool = False
    sleep_level: int = 2  # hybrid: weights are re-sent after every sleep, so they need not be kept
    pipeline_parallel_size: int = 1  # > 1: stages of layers on that many GPUs (vexact_engine.PipelineLLM)
    expert_parallel_size: int = 1  # > 1: routed experts sharded over that many GPUs (vexact_engine.ExpertParallelLLM)

    def __post_init__(self):
        if self.pipeline_parallel_size > 1 and self.expert_parallel_size > 1:
            raise ValueError(
                f"pipeline_parallel_size={self.pipeline_parallel_size} with expert_parallel_size="
                f"{self.expert_parallel_size}: a vexact replica runs one of the two, not both"
            )

    @property
    def ranks(self) -> int:
        """The replica's processes (one a GPU): its pipeline stages or its expert-parallel ranks, else 1."""
        return max(self.pipeline_parallel_size, self.expert_parallel_size)


def engine_kwargs_from_verl(config, replica_rank: int = 0) -> dict[str, Any]:
    """EngineConfig fields from a verl RolloutConfig.

    ``rollout.engine_kwargs.vexact`` may set any EngineConfig field (``backend``, ``block_size``, ``num_kv_blocks``,
    ``kv_cache_bytes``, ...) and, for mismatch studies, a ``MismatchInjection`` field (``logit_noise_std``,
    ``lm_head_dtype``); an unknown key raises ``ValueError`` naming it and the allowed ones.
    """
    kw: dict[str, Any] = {
        "max_num_seqs": int(config.max_num_seqs),
        "max_num_batched_tokens": int(config.max_num_batched_tokens),
        "max_model_len": int(config.max_model_len or (config.prompt_length + config.response_length)),
        "enable_chunked_prefill": bool(config.enable_chunked_prefill),
        "enable_prefix_caching": bool(config.enable_prefix_caching),
        "gpu_memory_utilization": float(config.gpu_memory_utilization),
        "enforce_eager": bool(config.enforce_eager),
        "dtype": str(config.dtype),
        "seed": int(config.seed) + int(replica_rank),
    }
    if config.cudagraph_capture_sizes:
        kw["cuda_graph_batch_sizes"] = tuple(int(s) for s in config.cudagraph_capture_sizes)
    # the engine needs room for every running sequence to decode in one step
    kw["max_num_batched_tokens"] = max(kw["max_num_batched_tokens"], kw["max_num_seqs"])
    extra = dict((config.engine_kwargs or {}).get("vexact", None) or {})
    allowed = {f.name for cls in (EngineConfig, MismatchInjection) for f in dataclasses.fields(cls)}
    bad = sorted(set(extra) - allowed)
    if bad:
        raise ValueError(f"rollout.engine_kwargs.vexact has unknown key(s) {bad}; allowed: {sorted(allowed)}")
    kw.update(extra)
    return kw


def to_engine_params(
    sampling_params: dict[str, Any], prompt_len: int, settings: ServerSettings
) -> tuple[SamplingParams, bool]:
    """verl's sampling dict -> (SamplingParams, whether logprobs were asked for). ``max_tokens`` as vLLM's server."""
    sp = dict(sampling_params)
    unknown = sorted(set(sp) - set(SUPPORTED_SAMPLING_KEYS))
    if unknown:
        raise ValueError(f"sampling params {unknown} are not supported by the vexact rollout; supported: "
                         f"{list(SUPPORTED_SAMPLING_KEYS)}")  # fmt: skip
    rep = sp.pop("repetition_penalty", 1.0)
    if rep is not None and float(rep) != 1.0:
        raise ValueError(f"repetition_penalty must be 1.0 with the vexact rollout (the trainer has none), got {rep!r}")
    room = settings.max_model_len - prompt_len
    if room < 1:
        raise ValueError(f"prompt has {prompt_len} tokens; max_model_len is {settings.max_model_len} (need >= 1 more)")
    if "max_tokens" in sp:
        max_tokens = sp.pop("max_tokens")
    elif "max_new_tokens" in sp:
        max_tokens = sp.pop("max_new_tokens")
    else:
        max_tokens = min(settings.response_length, settings.prompt_length + settings.response_length - prompt_len)
    sp.pop("max_new_tokens", None)
    max_tokens = max(1, min(_number(int, "max_tokens", max_tokens), room))
    want_logprobs = bool(sp.pop("logprobs", False))
    top_k = sp.pop("top_k", -1)
    # SamplingParams refuses a NaN or infinite temperature / top_p by value
    params = SamplingParams(
        temperature=_number(float, "temperature", sp.pop("temperature", 1.0)),
        top_p=_number(float, "top_p", sp.pop("top_p", 1.0)),
        top_k=-1 if top_k is None else _number(int, "top_k", top_k),
        max_tokens=max_tokens,
        seed=sp.pop("seed", None),
        stop_token_ids=list(sp.pop("stop_token_ids", None) or []),
        ignore_eos=bool(sp.pop("ignore_eos", settings.ignore_eos)),
    )
    return params, want_logprobs


def _number(kind: type, key: str, value: Any):
    """``kind(value)``, or a ValueError naming the sampling key (``int(nan)`` alone would not say which one)."""
    try:
        return kind(value)
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"sampling param {key} must be a finite {kind.__name__}, got {value!r}") from e


def _free_port() -> tuple[int, socket.socket]:
    """A port held open for the server's lifetime, so that each server has a distinct address."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("", 0))
    return sock.getsockname()[1], sock


class VexactServer:
    """One vexact engine serving verl's token-in/token-out calls. Wrapped with ``ray.remote`` by the replica.

    The constructor only records settings; :meth:`launch_server` builds the engine (so a replica can create every
    server first and then start them together, as verl's replicas do). A request reaches the engine only while it is
    ready (awake, with every weight loaded); one that arrives before waits in the server, so a weight sync never
    finds a request of the old weights inside the engine and a request never runs on half-loaded weights.
    """

    def __init__(
        self,
        settings: ServerSettings,
        rollout_mode: str = "hybrid",
        replica_rank: int = 0,
        node_rank: int = 0,
        cuda_visible_devices: str | None = None,
        gpu_uuid: str | None = None,
    ):
        _place(self, settings, cuda_visible_devices, gpu_uuid)
        self.rollout_mode = rollout_mode
        self.replica_rank = replica_rank
        self.node_rank = node_rank
        self.engine: LLMEngine | None = None
        self.global_steps: int | None = None
        self.stats = {"steps": 0, "max_in_flight": 0, "weight_buckets": 0}
        self._lock = asyncio.Lock()  # held while the engine is touched
        self._work = asyncio.Event()  # set when the stepping task may have work
        self._ready = asyncio.Event()  # engine awake and every weight loaded
        self._missing: set[str] = set()  # weights discarded by a level-2 sleep and not reloaded yet
        self._futures: dict[str, asyncio.Future] = {}  # every request not answered yet
        self._in_engine: set[str] = set()  # those of them the engine holds
        self._prompts: dict[str, list[int]] = {}
        self._loop_task: asyncio.Task | None = None
        self._paused = False  # abort_all_requests closes the gate until resume_generation
        self._resume = asyncio.Event()
        self._resume.set()
        self._reject = False
        self._ip = "127.0.0.1"
        self._port, self._port_sock = _free_port()
        self._weight_buffers: list[torch.Tensor] = []  # a colocated trainer's bucket buffers (CUDA IPC), one sync
        self._writing = False  # a colocated trainer is writing into the engine's weights (the single-copy path)
        self._warned_unseeded = False
        self._phase = GenPhase()
        self.last_phase: dict[str, float] = {}  # GenPhase.summary of the phase the last sleep ended

    # ---- lifecycle
    async def launch_server(self, dist_address: tuple[str, int] | None = None) -> None:
        """Build the engine (load the checkpoint) and start the stepping task.

        Multi-GPU replica (``settings.ranks > 1``: pipeline stages or expert-parallel ranks): this server is rank 0
        and the replica's driver; ``dist_address`` (from :meth:`pick_dist_address`) is where the ranks meet, and the
        replica launches the other ranks (:class:`VexactStage`) at the same time, since joining the process group
        waits for all.
        """
        if self.engine is not None:
            return
        try:
            import ray

            self._ip = ray.util.get_node_ip_address().strip("[]")
        except Exception:  # not inside Ray (direct use in a test): keep the loopback address
            pass
        engine_kw = _engine_kwargs(self.settings, self.gpu_uuid)
        if self.settings.ranks > 1:
            if dist_address is None:
                raise ValueError("a multi-GPU replica's server needs its ranks' dist_address to launch")
            self.engine = await asyncio.to_thread(_parallel_engine, self.settings, engine_kw, 0, dist_address)
        else:
            self.engine = await asyncio.to_thread(LLMEngine, self.settings.model_path, **engine_kw)
        if self.engine.max_model_len < self.settings.max_model_len:
            log.warning("max_model_len %d capped at the model's %d", self.settings.max_model_len,
                        self.engine.max_model_len)  # fmt: skip
            self.settings.max_model_len = self.engine.max_model_len
        self._ready.set()
        self._loop_task = asyncio.get_running_loop().create_task(self._step_loop())

    def pick_dist_address(self) -> tuple[str, int]:
        """A free TCP port on this server's node, where a multi-GPU replica's ranks form their process group."""
        port, sock = _free_port()
        sock.close()
        try:
            import ray

            ip = ray.util.get_node_ip_address().strip("[]")
        except Exception:
            ip = "127.0.0.1"
        return ip, port

    def get_server_address(self) -> tuple[str, int]:
        """A distinct (ip, port) per server: verl keys its load balancer by it. No HTTP server is started."""
        return self._ip, self._port

    def get_rollout_config(self) -> ServerSettings:
        return self.settings

    async def set_global_steps(self, global_steps: int) -> None:
        """The trainer step whose weights the engine holds (reported with each output, as vLLM's server does)."""
        self.global_steps = global_steps

    # ---- generation
    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: Any = None,
        video_data: Any = None,
        audio_data: Any = None,
        mm_processor_kwargs: Any = None,
        priority: int = 0,
        **kwargs: Any,
    ):
        """Generate for one request; returns verl's ``TokenOutput`` (``log_probs`` when ``logprobs`` was asked)."""
        from verl.workers.rollout.replica import TokenOutput

        if image_data is not None or video_data is not None or audio_data is not None:
            raise ValueError("the vexact rollout serves text models only; got image/video/audio data")
        if kwargs:
            raise ValueError(f"generate() got arguments the vexact rollout does not support: {sorted(kwargs)}")
        prompt_ids = [int(t) for t in (prompt_ids.tolist() if hasattr(prompt_ids, "tolist") else prompt_ids)]
        try:
            params, want_logprobs = to_engine_params(sampling_params, len(prompt_ids), self.settings)
        except ValueError as e:  # raised to the caller (verl's agent loop), never dropped
            raise ValueError(f"request {request_id}: {e}") from e
        if params.seed is None and not self._warned_unseeded:
            self._warned_unseeded = True
            log.warning("vexact replica %d: requests carry no seed, so their samples follow arrival order and differ "
                        "between runs; for reproducible runs set actor_rollout_ref.rollout.agent.default_agent_loop="
                        "vexact_single_turn_agent (vexact_verl.agent_loop)", self.replica_rank)  # fmt: skip
        while self._paused:  # a weight sync is under way: wait for it (or be told to re-route)
            if self._reject:
                steps = {"global_steps": self.global_steps}
                return TokenOutput(token_ids=[], stop_reason="aborted", extra_fields=steps)
            await self._resume.wait()
        request_id = str(request_id)
        version = self.global_steps  # an abort before the request reaches the engine: no token, this version
        if request_id in self._futures:
            raise ValueError(f"request id {request_id!r} is already in use")
        fut = asyncio.get_running_loop().create_future()
        self._futures[request_id] = fut
        self._prompts[request_id] = prompt_ids
        try:
            while not fut.done():
                while not self._ready.is_set() and not fut.done():  # asleep or weights missing: wait (or abort)
                    ready = asyncio.ensure_future(self._ready.wait())
                    await asyncio.wait([ready, fut], return_when=asyncio.FIRST_COMPLETED)
                    ready.cancel()
                if fut.done():
                    break
                async with self._lock:
                    if fut.done():  # aborted while it waited for the lock: it must not enter the engine
                        break
                    if not self._ready.is_set():  # put to sleep while we waited for the lock: wait again
                        continue
                    self.engine.add_request(prompt_ids, params, request_id)  # validates; raises on bad input
                    self._in_engine.add(request_id)
                    self._phase.requests += 1
                    if self._phase.first is None:
                        self._phase.first = time.monotonic()
                        self._phase.observe(self.engine)  # the counts before the phase's first step
                    version = self.global_steps
                self._work.set()
                break
            out = await fut
        finally:
            self._futures.pop(request_id, None)
            self._prompts.pop(request_id, None)
            self._in_engine.discard(request_id)
        return self._token_output(out, want_logprobs, version)

    def _token_output(self, out, want: bool, version: int | None):
        """verl's ``TokenOutput``; ``extra_fields["global_steps"]`` is the policy version of every token in it: the
        weights the engine held when the request entered it, which stay until it leaves (a weight update is refused
        while requests are in the engine: verl aborts them first, and resumes them as new requests)."""
        from verl.workers.rollout.replica import TokenOutput

        reasons = {"stop": "completed", "length": "completed", "abort": "aborted"}
        stop = reasons.get(out.finish_reason, out.finish_reason)
        return TokenOutput(
            token_ids=list(out.token_ids),
            log_probs=out.logprobs.tolist() if want else None,
            stop_reason=stop,
            num_preempted=out.num_preemptions,
            extra_fields={"global_steps": version},
        )

    async def _step_loop(self) -> None:
        """Step the engine while it has work; wait on an event otherwise. Never dies on one bad step."""
        while True:
            await self._work.wait()
            async with self._lock:
                engine = self.engine
                if not self._ready.is_set() or not engine.has_unfinished_requests():
                    self._work.clear()  # generate / wake_up / a finished weight load set it again
                    continue
                try:
                    self.stats["max_in_flight"] = max(self.stats["max_in_flight"], len(self._in_engine))
                    t0 = time.monotonic()
                    finished = await asyncio.to_thread(engine.step)
                    self._phase.engine_s += time.monotonic() - t0
                    self._phase.steps += 1
                    self._phase.observe(engine)
                    self.stats["steps"] += 1
                except Exception as e:  # fail the requests in flight rather than hang their callers
                    log.exception("engine step failed")
                    for rid in list(self._in_engine):
                        engine.abort_request(rid)
                        fut = self._futures.get(rid)
                        if fut is not None and not fut.done():
                            fut.set_exception(RuntimeError(f"vexact engine step failed: {e!r}"))
                    continue
            for out in finished:
                self._finish(out)
            await asyncio.sleep(0)  # let queued generate() calls join the next step

    def _finish(self, out) -> None:
        if out.request_id in self._in_engine:
            self._phase.tokens += len(out.token_ids)
            self._phase.last = time.monotonic()
        self._in_engine.discard(out.request_id)
        fut = self._futures.get(out.request_id)
        if fut is not None and not fut.done():
            fut.set_result(out)

    # ---- aborts
    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict[str, Any]:
        """Stop one request; its caller gets the tokens so far with ``stop_reason='aborted'``."""
        request_id = str(request_id)
        if request_id not in self._futures:
            return {"aborted": False, "request_id": request_id, "error": f"Request {request_id} not found"}
        async with self._lock:
            out = self.engine.abort_request(request_id) if request_id in self._in_engine else None
        if out is None:  # still waiting in the server: it has generated nothing
            prompt = self._prompts.get(request_id, [])
            out = RequestOutput(request_id, prompt, [], torch.empty(0, dtype=torch.float32), "abort")
        self._finish(out)
        return {"aborted": True, "request_id": request_id}

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False):
        """Abort everything in flight and hold new requests until :meth:`resume_generation` (verl's weight sync)."""
        self._paused, self._reject = True, reject_request
        self._resume.clear()
        ids = list(self._futures)
        for rid in ids:
            await self.abort_request(rid)
        return {"aborted_count": len(ids), "request_ids": ids}

    async def resume_generation(self) -> None:
        self._paused = self._reject = False
        self._resume.set()

    async def resume_engine_generation(self) -> None:
        """vLLM's replica resumes in two steps; the vexact engine has nothing to resume besides the gate."""

    async def open_submission_gate(self) -> None:
        await self.resume_generation()

    async def wait_for_requests_to_drain(self) -> None:
        while self._in_engine:
            await asyncio.sleep(0.01)

    # ---- memory: verl's resume(tags)/release() and the replica's wake_up()/sleep()
    async def sleep(self) -> None:
        """Free weights and KV cache (``engine.sleep``); standalone servers keep theirs, as vLLM's do.

        Hybrid mode sleeps at ``settings.sleep_level`` (2: weights discarded, verl re-sends them all after); the
        server then admits no request until every discarded weight is loaded again.
        """
        if self.rollout_mode == "standalone" or not self.settings.free_cache_engine:
            return
        self._ready.clear()  # new requests wait in the server from now on
        await self.wait_for_requests_to_drain()
        self._end_phase()
        level = self.settings.sleep_level if self.rollout_mode == "hybrid" else 1
        async with self._lock:
            if not self.engine.sleep_level:
                # named while the weights still have their shapes: a discarded MoE expert stack cannot be split
                # into its per-expert names
                names = self.engine.weight_names()
                _engine_call(self.engine, "sleep", level=level)
                if level == 2:
                    self._missing = names

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what :meth:`sleep` freed. The engine restores weights and KV together, so any tag wakes it."""
        if self.rollout_mode == "standalone":
            return
        async with self._lock:
            if self.engine.sleep_level:
                _engine_call(self.engine, "wake_up")
        self._set_ready()

    def _set_ready(self) -> None:
        # a multi-GPU replica's driver also knows what its other ranks still miss: a request must not reach them first
        elsewhere = getattr(self.engine, "weights_pending_elsewhere", None)
        if not self.engine.sleep_level and not self._missing and not self._writing and not elsewhere:
            if not self._ready.is_set():
                self._phase = GenPhase()
            self._ready.set()
            self._work.set()

    def _end_phase(self) -> None:
        """Log where the generation phase that ends here went (:class:`GenPhase`), and keep it for get_stats."""
        if self._phase.requests:
            self.last_phase = self._phase.summary(time.monotonic())
            p = self.last_phase
            log.info(
                "vexact replica %d, generation phase: %.2f s from ready to sleep; first request after %.2f s, "
                "last answer %.2f s later, then %.2f s to sleep; engine steps %.2f s (%.0f%% of first request to last "
                "answer); %d requests, %d steps, %d tokens; at most %d running, KV cache %s tokens, %d preemptions",
                self.replica_rank, p["wall_s"], p["to_first_request_s"], p["first_to_last_answer_s"],
                p["after_last_answer_s"], p["engine_s"], 100 * p["engine_share"], p["requests"], p["steps"],
                p["tokens"], p["peak_running"], p["kv_tokens"], p["preemptions"],
            )  # fmt: skip
            path = os.environ.get(GEN_PHASE_LOG_ENV)
            if path:  # one JSON line a phase, for a run's own record (examples/verify/run_pair.sh sets it)
                with open(path, "a") as f:
                    f.write(json.dumps({"replica": self.replica_rank, "global_steps": self.global_steps, **p}) + "\n")
        self._phase = GenPhase()

    async def release_kv_cache(self) -> None:
        """Before a weight sync: the engine frees KV with its weights only, so this is a no-op."""

    async def resume_kv_cache(self) -> None:
        await self.wake_up(["kv_cache"])

    async def clear_kv_cache(self) -> None:
        """Drop the engine's prefix cache. The engine drops it by itself on every weight update and sleep (its K/V
        would be stale), so nothing computed with old weights is ever reused; this is for callers that ask."""
        if self.engine is None:
            return
        async with self._lock:
            self.engine.reset_prefix_cache()

    # ---- weights
    async def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Load one bucket of ``(hf_name, tensor)``; floating tensors are cast to the engine's dtype (RNE, as FSDP's
        mixed-precision cast). Returns how many tensors were loaded. Refused while requests are in flight."""
        async with self._lock:
            loaded = await asyncio.to_thread(self.engine.update_weights, named_tensors)
            self.stats["weight_buckets"] += 1
            self._missing.difference_update(loaded)
        self._set_ready()
        return len(loaded)

    def attention_impl(self) -> str:
        """The attention implementation this server's process runs on CUDA tensors (``triton`` or ``fa4``,
        ``$VEXACT_ATTENTION``): the two give different bits, so the trainer must run the same one."""
        import vexact_kernels as vk

        return vk.get_attention_impl()

    # ---- weights without host copies: a colocated trainer's device buffers, opened through CUDA IPC handles
    def weight_sync_device(self) -> str | None:
        """The UUID of this server's GPU when a trainer on the same GPU may hand it CUDA IPC handles (a one-device
        engine on CUDA), else None (the host path: a multi-GPU replica's weights lie on several GPUs)."""
        if self.engine is None or self.settings.ranks > 1:
            return None
        device = next(self.engine.model.parameters(), torch.empty(0)).device
        if device.type != "cuda":
            return None
        from vexact_models import device_uuid

        return device_uuid(device)

    async def open_weight_buffers(self, handles: list) -> None:
        """Open the trainer's bucket buffers (``vexact_models.ipc_handle``) for one sync; no bytes are copied."""
        from vexact_models import open_ipc_handle

        device = torch.cuda.current_device()
        self._weight_buffers = [open_ipc_handle(h, device) for h in handles]

    async def load_weight_bucket(self, index: int, specs: list, nbytes: int) -> int:
        """Copy one packed bucket (buffer ``index``, its ``TensorSpec`` list) into the engine's parameters in place;
        returns the number of tensors completed. Returns once the copies are done: the trainer then refills the
        buffer. Refused while requests are in flight (as :meth:`update_weights`)."""
        if not 0 <= index < len(self._weight_buffers):
            raise ValueError(f"weight buffer {index} is not open ({len(self._weight_buffers)} open)")
        buffer = self._weight_buffers[index]
        if not 0 <= nbytes <= buffer.numel():
            raise ValueError(f"bucket of {nbytes} bytes in a buffer of {buffer.numel()}")

        def load():
            loaded = self.engine.load_bucket(buffer[:nbytes], specs)
            if buffer.is_cuda:
                torch.cuda.current_stream(buffer.device).synchronize()
            return loaded

        async with self._lock:
            loaded = await asyncio.to_thread(load)
            self.stats["weight_buckets"] += 1
            self._missing.difference_update(loaded)
        self._set_ready()
        return len(loaded)

    async def close_weight_buffers(self) -> None:
        """Let go of the trainer's buffers at the end of a sync (so the trainer's allocator can free them)."""
        self._weight_buffers = []
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()

    # ---- weights with one copy: a colocated trainer writes straight into the engine's packed weight buffers
    async def begin_direct_weight_sync(self, open_key: str | None = None) -> dict[str, Any] | None:
        """Open a single-copy sync for a trainer on this GPU, or None when the engine's weights are not packed (the
        trainer then sends buckets). Refused while requests are in flight or asleep (as :meth:`update_weights`); drops
        the prefix cache; admits no request until :meth:`finish_direct_weight_sync`.

        Returns ``key`` (of the engine's current allocation), ``table`` and ``handles`` (``vexact_models.WeightTable``
        and one CUDA IPC handle per buffer; both None when the caller has ``open_key == key`` open already: each
        handle must be opened exactly once, torch counts its holder), ``keep_open`` (True when this server never
        frees its weights, so the caller may keep its views for the next sync; otherwise it closes them before the
        engine sleeps, or the engine's memory stays held) and ``reused_memory`` (False in hybrid mode, where the
        tensors come from the trainer's own export and stay valid, so the caller may copy them in groups; a
        checkpoint-engine receiver refills its buffers). On CPU the buffers themselves stand for the handles (a
        caller in this process, the tests).
        """
        from vexact_models import ipc_handle

        def begin():
            if self.engine.sleep_level or self.engine.weight_table() is None:
                return None  # asleep: the bucket path names the problem
            return self.engine.begin_weight_write()  # refuses (requests in flight), naming why

        async with self._lock:
            begun = await asyncio.to_thread(begin)
            if begun is None:
                return None
            table, buffers = begun
            fresh = open_key != table.key
            handles = [ipc_handle(b) if b.is_cuda else b for b in buffers] if fresh else None
            self._writing = True
            self._ready.clear()
            self.stats["direct_syncs"] = self.stats.get("direct_syncs", 0) + 1
        keep = self.rollout_mode == "standalone" or not self.settings.free_cache_engine
        return {"key": table.key, "table": table if fresh else None, "handles": handles, "keep_open": keep,
                "reused_memory": self.rollout_mode != "hybrid"}  # fmt: skip

    async def finish_direct_weight_sync(self, key: str, written: bytes | None) -> int:
        """End a single-copy sync: the trainer's copies have landed (it synchronised its stream). ``written`` (a
        ``WeightTable.mask``) names the weights now loaded; None when the trainer's sync failed (nothing counts as
        loaded). The server admits requests again once every weight is loaded. Returns how many names were loaded."""
        try:
            async with self._lock:
                self._writing = False
                loaded = [] if written is None else self.engine.finish_weight_write(key, written)
                self._missing.difference_update(loaded)
        finally:
            self._set_ready()
        return len(loaded)

    async def collective_rpc(self, method: str, timeout=None, args: tuple = (), kwargs: dict | None = None):
        raise NotImplementedError(f"the vexact rollout has no collective_rpc ({method!r})")

    async def start_profile(self, **kwargs) -> None:
        """Profiling hooks verl calls on every backend; the engine has no profiler of its own."""

    async def stop_profile(self) -> None:
        pass

    async def get_stats(self) -> dict[str, float]:
        """Counters for tests and logs: engine steps, most requests in the engine when a step started, weight
        buckets loaded, requests not answered yet, CUDA memory allocated by this process, the engine's prompt
        tokens and those reused from its prefix cache, and ``phase_*``: the last generation phase that a sleep
        ended (:class:`GenPhase`)."""
        device_bytes = torch.cuda.memory_allocated() if torch.cuda.is_initialized() else 0
        engine = {k: v for k, v in getattr(self.engine, "stats", {}).items() if k.endswith("prompt_tokens")}
        phase = {f"phase_{k}": v for k, v in self.last_phase.items()}
        return dict(self.stats, **engine, **phase, in_flight=len(self._futures), device_bytes=device_bytes)


def _place(actor, settings: ServerSettings, cuda_visible_devices: str | None, gpu_uuid: str | None) -> None:
    """A server's or stage's first step: see the GPU(s) of a trainer rank of its replica (set before CUDA
    initialises), then keep its settings and the UUID of the GPU it builds its engine on."""
    if cuda_visible_devices:
        os.environ["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
    actor.gpu_uuid = gpu_uuid
    actor.settings = settings


def _worker_device(gpu_uuid: str | None) -> str:
    """The device this process builds its engine on: the GPU whose UUID is ``gpu_uuid`` (its worker's), else the
    first visible GPU, else the CPU. By UUID, not by index: a process whose CUDA started before
    ``CUDA_VISIBLE_DEVICES`` was set sees every GPU of the node, and index 0 is then another worker's GPU (two
    pipeline stages on one GPU: NCCL refuses the group with "Duplicate GPU detected")."""
    if not torch.cuda.is_available():
        return "cpu"
    index = 0
    if gpu_uuid:
        from vexact_models import device_uuid

        visible = [device_uuid(i) for i in range(torch.cuda.device_count())]
        if gpu_uuid not in visible:
            raise RuntimeError(
                f"the worker's GPU {gpu_uuid} is not among this process's GPUs {visible} "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
            )
        index = visible.index(gpu_uuid)
    torch.cuda.set_device(index)
    return f"cuda:{index}"


def _engine_kwargs(settings: ServerSettings, gpu_uuid: str | None = None) -> dict[str, Any]:
    kw = dict(settings.engine)
    # decided here, in the process that owns the device (verl's driver-side actors see no GPU)
    if "device" not in kw:
        kw["device"] = _worker_device(gpu_uuid)
    return kw


def _parallel_engine(settings: ServerSettings, engine_kw: dict, rank: int, dist_address: tuple[str, int]):
    """Join the replica's process group (rank ``rank`` of ``settings.ranks``) and build this rank's engine: its
    pipeline stage (:class:`PipelineLLM`) or its share of the experts (:class:`ExpertParallelLLM`, driven by rank
    0). Either way rank 0 takes every request and control call, the others serve."""
    import torch.distributed as dist

    on_cuda = str(engine_kw["device"]).startswith("cuda")
    if on_cuda:
        torch.cuda.set_device(torch.device(engine_kw["device"]))  # NCCL's device for this rank
    ip, port = dist_address
    dist.init_process_group(
        "nccl" if on_cuda else "gloo",
        init_method=f"tcp://{ip}:{port}",
        rank=rank,
        world_size=settings.ranks,
    )
    if settings.expert_parallel_size > 1:
        return ExpertParallelLLM(settings.model_path, driven=True, **engine_kw)
    return PipelineLLM(settings.model_path, **engine_kw)


class VexactStage:
    """Rank ``rank`` >= 1 of a multi-GPU replica (Ray actor): a pipeline stage (its layers and KV cache) or an
    expert-parallel rank (its share of the routed experts, its own requests and KV cache), driven by rank 0's
    :class:`VexactServer`. Its engine serves in a thread until the actor ends."""

    def __init__(
        self, settings: ServerSettings, rank: int, cuda_visible_devices: str | None = None, gpu_uuid: str | None = None
    ):
        _place(self, settings, cuda_visible_devices, gpu_uuid)
        self.rank = rank
        self.engine = None
        self._thread = None
        self._error: str | None = None

    def launch(self, dist_address: tuple[str, int]) -> None:
        import threading

        engine_kw = _engine_kwargs(self.settings, self.gpu_uuid)
        self.engine = _parallel_engine(self.settings, engine_kw, self.rank, dist_address)

        def serve():
            try:
                self.engine.serve()
            except Exception as e:  # the driver gone (actor teardown) or a broken group: kept for status()
                self._error = f"{type(e).__name__}: {e}"

        self._thread = threading.Thread(target=serve, name=f"vexact-stage-{self.rank}", daemon=True)
        self._thread.start()

    def status(self) -> dict[str, Any]:
        device = str(next(self.engine.model.parameters()).device) if self.engine is not None else None
        return {
            "rank": self.rank,
            "serving": bool(self._thread and self._thread.is_alive()),
            "error": self._error,
            "device": device,
        }


def _engine_call(engine: LLMEngine, name: str, **kw):
    fn = getattr(engine, name, None)
    if fn is None:
        raise RuntimeError(f"this vexact_engine has no LLMEngine.{name}(): upgrade vexact-engine for sleep/wake")
    return fn(**kw)
