"""Pipeline parallelism: stages of consecutive decoder layers, one per device of a host (never tensor parallelism).

Every rank of an initialised ``torch.distributed`` group builds a :class:`PipelineLLM` from the same model (SPMD,
e.g. under ``torchrun``). Rank ``r`` keeps the decoder layers of stage ``r`` (:func:`stage_layers`) and a KV cache
for those layers only; the embedding, final norm and head stay on every rank (the first stage embeds, the last
samples). Rank 0 is the driver: it owns the scheduler and the requests, like a one-device engine. Each step:

1. rank 0 broadcasts the step (token ids, positions, paged metadata and, for the rows that sample, their sampling
   params, seeds and token indices: a few hundred bytes of Python objects);
2. stage ``r`` takes the activations from stage ``r - 1`` (the first stage embeds the tokens), runs its layers on
   its own KV cache and sends the result on; activations travel as raw bytes (viewed as uint8), so nothing is
   rounded on the way;
3. the last stage samples with the same :func:`~vexact_engine.sampler.sample_rows_on_device` as a one-device engine and
   sends ``(tokens, logprobs)`` back to rank 0.

Why this is bitwise equal to one device: a row's arithmetic never crosses a stage boundary. Each layer runs the same
kernels on the same inputs as it would on one device; a stage boundary only moves exact bits from one device to the
next. The contract test compares tokens and logprobs with ``torch.equal`` against a one-device engine.

Scope: generation (continuous batching, chunked prefill, preemption, abort) runs eagerly (CUDA-graph decode is a
one-device feature for now). ``sleep``/``wake_up``/``update_weights`` are called on rank 0, which sends them to every
stage as a control message between steps; each stage applies the one-device logic to what it holds, and the driver
gathers the answers (an error on any stage is raised on rank 0). The KV cache size must
be given (``num_kv_blocks`` or ``kv_cache_bytes``): every stage must hold the same number of pages.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import vexact_kernels as vk
from vexact_models import WeightSyncGroup, expected_tensors, load_model, receive_weights

from .ablation import MismatchInjection, take_mismatch
from .block_manager import BlockManager
from .config import EngineConfig
from .in_flight import LaunchedStep
from .llm import LLM
from .loading import load_tokenizer
from .model_runner import kv_cache_shapes
from .sampler import rows_to_host, sample_rows_on_device
from .scheduler import ScheduledSeq
from .step_inputs import step_lists, step_tensors

log = logging.getLogger("vexact_engine")


def stage_layers(num_layers: int, num_stages: int) -> list[range]:
    """Consecutive layer ranges, one per stage; the first ``num_layers % num_stages`` stages get one more."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"{num_stages} pipeline stages for {num_layers} layers: need 1 <= stages <= layers")
    base, extra = divmod(num_layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


class _StageRunner:
    """Runs one stage's layers on its own KV cache; on the driver, also drives the whole pipeline for a step."""

    mismatch: MismatchInjection | None = None  # a study tool, set by the engine that asks for one

    def __init__(self, model: nn.Module, config: EngineConfig, num_blocks: int, layers: range, rank: int, world: int):
        self.model = model
        self.config = config
        self.layers = layers
        self.rank, self.world = rank, world
        self.first, self.last = rank == 0, rank == world - 1
        cfg = model.config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.hidden_size = cfg.hidden_size
        self.kv_shapes = kv_cache_shapes(cfg, num_blocks, config.block_size)
        self.allocate()

    def allocate(self) -> None:
        """This stage's KV cache (its layers only); ``LLMEngine.wake_up`` calls it."""
        self.kv_caches = {
            i: tuple(torch.zeros(shape, dtype=self.dtype, device=self.device) for shape in self.kv_shapes)
            for i in self.layers
        }

    def release(self) -> None:
        """Drop the KV cache (``LLMEngine.sleep``)."""
        self.kv_caches = None

    def _comm_device(self) -> torch.device:
        # NCCL moves device tensors; gloo moves host tensors
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def _send(self, t: torch.Tensor, dst: int) -> None:
        dist.send(t.contiguous().to(self._comm_device()), dst)

    def _recv(self, shape, dtype, src: int) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=self._comm_device())
        dist.recv(buf, src)
        return buf.to(self.device)

    @torch.no_grad()
    def _run_stage(self, step: dict) -> tuple[list[int], list[float]] | None:
        ids, pos, meta = step_tensors(step, self.device)
        dev = self.device
        t = len(step["ids"])
        with vk.use_backend(self.config.backend):
            if self.first:
                x = self.model.model.embed_tokens(ids)
            else:
                # the activations' raw bytes: exact, and both NCCL and gloo move uint8
                nbytes = self.hidden_size * torch.empty(0, dtype=self.dtype).element_size()
                x = self._recv((t, nbytes), torch.uint8, self.rank - 1).view(self.dtype)
            x = self.model.model.run_layers(x, pos, meta, self.kv_caches, self.layers)
            if not self.last:
                self._send(x.contiguous().view(torch.uint8), self.rank + 1)
                return None
            if not step["rows"]:
                return [], []
            rows = torch.tensor(step["rows"], dtype=torch.int64, device=dev)
            return rows_to_host(
                sample_rows_on_device(
                    self.model, self.config.backend, x[rows], step["params"], step["seeds"], step["indices"],
                    self.mismatch,
                )
            )  # fmt: skip

    # ---- driver side
    def run(self, batch: list[ScheduledSeq], blocks: BlockManager) -> list[tuple[ScheduledSeq, int, float]]:
        return self.launch(batch, blocks).results()

    def launch(self, batch: list[ScheduledSeq], blocks: BlockManager) -> LaunchedStep:
        """One step through every stage; its results are on the host when this returns (no ``async_decode``)."""
        step = step_lists(batch, blocks)
        sampling = [b for b, item in enumerate(batch) if item.is_last_chunk]
        items = [batch[b] for b in sampling]
        step.update(
            rows=[step["cu"][b + 1] - 1 for b in sampling],
            params=[it.seq.params for it in items],
            seeds=[it.seq.seed for it in items],
            indices=[len(it.seq.output_token_ids) for it in items],
        )
        dist.broadcast_object_list([step], src=0, device=self._comm_device())
        out = self._run_stage(step)
        if self.world > 1:
            both = self._recv((2, len(items)), torch.float64, self.world - 1).cpu()
        else:
            both = torch.tensor(out, dtype=torch.float64).reshape(2, len(items))  # token ids < 2**53: exact
        return LaunchedStep(items, both, read_later=False)

    def stop_workers(self) -> None:
        dist.broadcast_object_list([None], src=0, device=self._comm_device())

    def control(self, message: dict, local) -> list:
        """Driver: send a control message (sleep, wake, weights) to every stage, apply it here with ``local``, and
        gather every rank's answer (rank order). A stage's error comes back as its answer and is raised here, so a
        bad update cannot leave the driver waiting."""
        dist.broadcast_object_list([message], src=0, device=self._comm_device())
        mine = _answer(local, message)
        answers = [None] * self.world
        dist.gather_object(mine, answers, dst=0)
        for rank, ans in enumerate(answers):
            if isinstance(ans, _StageError):
                raise RuntimeError(f"pipeline stage {rank}: {ans.message}")
        return answers

    # ---- worker side
    def serve(self, local) -> int:
        """Run steps (and control messages, through ``local``) as the driver sends them, until it stops the
        pipeline; returns the number of steps run."""
        steps = 0
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, device=self._comm_device())
            if box[0] is None:
                return steps
            if "op" in box[0]:
                dist.gather_object(_answer(local, box[0]), None, dst=0)
                continue
            out = self._run_stage(box[0])
            if self.last and out is not None:
                tokens, logprobs = out
                both = torch.tensor([[float(t) for t in tokens], logprobs], dtype=torch.float64)
                self._send(both.reshape(2, len(tokens)), 0)
            steps += 1


class _StageError:
    def __init__(self, message: str):
        self.message = message


def _answer(local, message: dict):
    try:
        return local(message)
    except Exception as e:  # sent to the driver, which raises it
        return _StageError(f"{type(e).__name__}: {e}")


def _engine_settings(
    config: EngineConfig | None, mismatch: MismatchInjection | None, config_kw: dict
) -> tuple[EngineConfig, MismatchInjection | None]:
    """The engine's config and mismatch injection from a multi-rank engine's arguments, as ``LLM`` takes them."""
    mismatch = take_mismatch(mismatch, config_kw)
    if config is not None and config_kw:
        raise TypeError("pass either config=EngineConfig(...) or keyword settings, not both")
    return config or EngineConfig(**config_kw), mismatch


def _require_group(engine: str) -> None:
    if not dist.is_initialized():
        raise RuntimeError(f"{engine} needs an initialised torch.distributed process group (e.g. torchrun)")


def _apply_sleep_wake(llm: LLM, message: dict, engine: str) -> tuple[list, list[str]]:
    """The control messages both multi-rank engines' ``_apply`` take alike: ``sleep`` or ``wake_up``, applied to this
    rank's own part with the one-device logic; any other op is unknown to ``engine``. Answers ``_apply``'s answer for
    an op that loads nothing: no names loaded, the names still pending."""
    op = message["op"]
    if op == "sleep":
        LLM.sleep(llm, message["level"])
    elif op == "wake_up":
        LLM.wake_up(llm)
    else:
        raise ValueError(f"unknown {engine} control message {op!r}")
    return [], sorted(llm._weights_pending)


def _host_model(engine: str, model_path: str | Path | None, tokenizer, config: EngineConfig):
    """The whole model loaded on the host (each rank then cuts out its part before moving it to its device) and its
    tokenizer, unless one was given."""
    if model_path is None:
        raise ValueError(f"{engine} needs a model_path or a model")
    model = load_model(model_path, dtype=config.dtype, device="cpu")
    if tokenizer is None:
        tokenizer = load_tokenizer(model_path)
    return model, tokenizer


class PipelineLLM(LLM):
    """An engine whose decoder layers are split over the ranks of the default process group (one stage per rank).

    Build it on every rank with the same arguments. Rank 0 (:attr:`is_driver`) takes requests (``generate``,
    ``add_request``/``step``, ``abort_request``) and must call :meth:`shutdown` at the end; every other rank calls
    :meth:`serve`, which returns when the driver shuts down.
    """

    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        model: nn.Module | None = None,
        tokenizer=None,
        config: EngineConfig | None = None,
        mismatch: MismatchInjection | None = None,
        **config_kw,
    ):
        config, mismatch = _engine_settings(config, mismatch, config_kw)
        if config.async_decode is None:  # the default: off here (its stages step in lockstep)
            config = dataclasses.replace(config, async_decode=False)
        if config.async_decode:
            raise ValueError("PipelineLLM does not run EngineConfig.async_decode=True (its stages step in lockstep)")
        if config.decode_streams != 1:
            raise ValueError(
                f"PipelineLLM runs one decode stream, got EngineConfig.decode_streams={config.decode_streams}"
            )
        _require_group("PipelineLLM")
        if config.num_kv_blocks is None and config.kv_cache_bytes is None:
            raise ValueError("PipelineLLM needs num_kv_blocks or kv_cache_bytes: every stage must hold the same pages")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if model is None:
            model, tokenizer = _host_model("PipelineLLM", model_path, tokenizer, config)
        self.stage = stage_layers(model.config.num_hidden_layers, self.world)[self.rank]
        self._all_names = _weight_names(model)
        layers = model.model.layers
        for i in range(len(layers)):
            if i not in self.stage:
                layers[i] = nn.Identity()  # not this stage's: drop its weights
        model = model.to(config.device)
        # graphs are one-device only for now: the driver's steps run eagerly (a copy: the caller's config is theirs)
        config = dataclasses.replace(config, enforce_eager=True)
        super().__init__(model=model, tokenizer=tokenizer, config=config, mismatch=mismatch)
        self._own_names = _weight_names(self.model)
        self._remote_pending: set[str] = set()  # driver: weights other stages still miss
        self._sync_group: WeightSyncGroup | None = None  # this stage's member of a trainer's weight sync group
        log.info("pipeline rank %d/%d holds layers %s", self.rank, self.world, list(self.stage))

    def _make_runner(self, model: nn.Module, num_blocks: int) -> _StageRunner:
        return _StageRunner(model, self.config, num_blocks, self.stage, self.rank, self.world)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def serve(self) -> int:
        if self.is_driver:
            raise RuntimeError("rank 0 drives the pipeline: call generate()/step() and shutdown(), not serve()")
        return self.runner.serve(self._apply)

    def shutdown(self) -> None:
        """Driver only: release the other ranks from :meth:`serve`."""
        if not self.is_driver:
            raise RuntimeError("only rank 0 shuts the pipeline down")
        self.runner.stop_workers()

    # ---- sleep / wake / weights: the driver sends each to every stage, which applies the one-device logic to its
    # own layers (and the embedding, norm and head every stage holds)
    def _apply(self, message: dict):
        op = message["op"]
        if op == "update_weights":
            loaded = LLM.update_weights(self, [(n, t) for n, t in message["tensors"] if n in self._own_names])
            return loaded, sorted(self._weights_pending)
        elif op == "join_weight_sync":
            host, port, first, world, timeout_s = message["args"]
            self._sync_group = WeightSyncGroup(host, port, first + self.rank, world, self.runner.device, timeout_s)
        elif op == "receive_weights":
            if self._sync_group is None:
                raise RuntimeError("receive_weights before join_weight_sync")
            others = self._all_names - self._own_names  # known, held by another stage: skipped here

            def load(buffer, specs):
                return LLM.load_bucket(self, buffer, specs, skip=others.__contains__)

            loaded = receive_weights(self._sync_group, load)
            return loaded, sorted(self._weights_pending)
        else:
            return _apply_sleep_wake(self, message, "pipeline")
        return [], sorted(self._weights_pending)

    def _drive(self, message: dict) -> list:
        if not self.is_driver:
            raise RuntimeError(f"{message['op']}() is called on rank 0, which sends it to every stage")
        op = message["op"]
        # refuse on the driver, before any stage acts, what a one-device engine would refuse
        if op == "sleep":
            self._refuse_sleep(message["level"])
        elif op in ("update_weights", "receive_weights"):
            self._refuse_update()
        answers = self.runner.control(message, self._apply)
        # every stage's weights must be back before the next step (the driver's own: LLMEngine.step checks them)
        self._remote_pending = {name for _, pending in answers[1:] for name in pending}
        return answers

    def step(self):
        if self._remote_pending:
            raise RuntimeError(
                f"{len(self._remote_pending)} weight tensor(s) of other pipeline stages, discarded by sleep(level=2), "
                f"are not reloaded yet, e.g. {sorted(self._remote_pending)[:3]}: call update_weights with them first"
            )
        return super().step()

    def sleep(self, level: int = 1) -> None:
        """Every stage frees its KV cache and its weights (``level`` as for a one-device engine)."""
        self._drive({"op": "sleep", "level": level})

    def wake_up(self) -> None:
        self._drive({"op": "wake_up"})

    def update_weights(self, named_tensors) -> list[str]:
        """Load HF-named tensors into the stages that hold them (each decoder layer's on its stage; the embedding,
        norm and head on every stage). Returns the names loaded. A name no stage holds is refused by name."""
        tensors = [(str(n), t.detach().to("cpu")) for n, t in named_tensors]
        unknown = [n for n, _ in tensors if n not in self._all_names]
        if unknown:
            raise ValueError(f"{len(unknown)} tensor(s) the model does not have, e.g. {unknown[:5]}")
        answers = self._drive({"op": "update_weights", "tensors": tensors})
        loaded = {n for names, _ in answers for n in names}
        return [n for n, _ in tensors if n in loaded]

    @property
    def weights_pending_elsewhere(self) -> set[str]:
        """Driver: the weights other stages still miss after a level-2 sleep (no step runs until they are in)."""
        return set(self._remote_pending)

    def weight_table(self):
        """None: a pipeline's weights lie on several GPUs, so no trainer writes them through one stage's buffers;
        they come with :meth:`update_weights` or :meth:`receive_weights`."""
        return None

    def join_weight_sync(self, host: str, port: int, first_rank: int, world_size: int, timeout_s: float = 600.0):
        """Every stage joins a trainer's weight sync group (``vexact_models.WeightSyncGroup``) as rank
        ``first_rank + stage``; the trainer is rank 0 and joins at the same time. Called on rank 0."""
        self._drive({"op": "join_weight_sync", "args": (host, port, first_rank, world_size, timeout_s)})

    def receive_weights(self, group=None) -> list[str]:
        """Every stage receives the trainer's broadcast (``vexact_models.broadcast_weights``) on the group it joined
        and loads the tensors it holds, straight from the wire (no hop through rank 0). Returns the names loaded on
        any stage. Called on rank 0 (``group`` is ignored: each stage uses its own member)."""
        answers = self._drive({"op": "receive_weights"})
        return sorted({n for names, _ in answers for n in names})


def _weight_names(model: nn.Module) -> set[str]:
    """Every name a weight update may use: parameter names (stacked experts whole) and checkpoint names (experts one
    by one), tied weights under each of their names."""
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return params | set(expected_tensors(model, remove_duplicate=False))


__all__ = ["PipelineLLM", "stage_layers"]
