"""The engine loop: validate and queue requests (``add_request``), schedule and run a step (``step``), collect the
requests that finished. ``LLM.generate`` (``llm.py``) drives this loop until every request is done.

A request's path: ``add_request`` -> ``Sequence`` (``sequence.py``) -> ``Scheduler`` picks this step's work
(``scheduler.py``, KV pages from ``block_manager.py``) -> ``ModelRunner`` turns it into tensors, runs the model and
samples (``model_runner.py``; ``sampler.py``, padded steps and CUDA graphs in ``cuda_graphs.py``) -> ``step``
appends the token and its logprob, and returns the finished requests as ``RequestOutput``. Supporting machinery
lives in modules of its own: KV-cache sizing (``kv_cache.py``), model loading (``loading.py``), sleep/wake
(``sleep.py``) and the weight-update paths (``weight_update.py``).

A step is launched, then read back (``_read_back``: append, stopping rules). With ``EngineConfig.async_decode`` the
loop reads step N back after it has launched step N+1 (``in_flight.py``), so the host schedules and prepares a step
while the device runs the one before it; without it each step is read back as soon as it is launched.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from vexact_models import pack_parameters

from .ablation import MismatchInjection, take_mismatch
from .block_manager import BlockManager
from .config import EngineConfig
from .in_flight import LaunchedStep
from .kv_cache import num_kv_blocks, resolve_max_model_len
from .loading import load_engine_model, load_tokenizer
from .model_runner import ModelRunner
from .outputs import RequestOutput
from .sampler import token_seed
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence, SequenceStatus
from .sleep import EngineSleep
from .weight_update import EngineWeights

log = logging.getLogger("vexact_engine")


class LLMEngine(EngineSleep, EngineWeights):
    """One engine replica: a model, its KV cache, a scheduler. Not thread-safe; drive it from one thread."""

    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        model: torch.nn.Module | None = None,
        tokenizer=None,
        config: EngineConfig | None = None,
        mismatch: MismatchInjection | None = None,
        **config_kw,
    ):
        # a study tool, apart from the serving settings: MismatchInjection's fields are also taken as keywords
        self.mismatch = take_mismatch(mismatch, config_kw)
        if config is not None and config_kw:
            raise TypeError("pass either config=EngineConfig(...) or keyword settings, not both")
        self.config = config or EngineConfig(**config_kw)
        if model is None:
            if model_path is None:
                raise ValueError("LLMEngine needs a model_path or a model")
            model = load_engine_model(model_path, self.config)
        self.config = self.config.resolved(next(model.parameters()).is_cuda)  # async_decode's default
        if tokenizer is None and model_path is not None:
            tokenizer = load_tokenizer(model_path)
        if self.config.pack_weights:
            pack_parameters(model)  # before the KV cache is sized and graphs capture the weights' addresses
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.vocab_size = model.config.vocab_size
        self.max_model_len = resolve_max_model_len(model.config, self.config)
        # how the KV cache was sized (kv_cache.num_kv_blocks: the setting that decided it and, sized from GPU memory,
        # the budget, weights and activation peak it left room for)
        self.kv_report: dict = {}
        num_blocks = num_kv_blocks(self.model, self.config, self.max_model_len, self.kv_report)
        self.blocks = BlockManager(num_blocks, self.config.block_size, self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.config, self.blocks, self.max_model_len)
        self.runner = self._make_runner(model, num_blocks)
        self.runner.mismatch = self.mismatch
        self.eos_token_ids = set(model.config.eos_token_ids)
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            self.eos_token_ids.add(tokenizer.eos_token_id)
        self._seqs: dict[str, Sequence] = {}
        self._num_arrivals = 0  # accepted requests so far; a rejected request takes no arrival slot (see add_request)
        self._in_flight: LaunchedStep | None = None  # async_decode: the launched step not read back yet
        self.num_dropped_rows = 0  # async_decode: rows of requests that had finished (or were aborted) when read back
        self._finished_early: list[RequestOutput] = []  # read back while a launch failed: the next step returns them
        self._init_sleep()
        self._init_weights()

    # ---- the loop
    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Validate and queue a request (text or token ids). Raises ValueError/TypeError naming the problem."""
        seq = self._new_sequence(prompt, params, request_id)
        self._seqs[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq.request_id

    def _new_sequence(self, prompt, params: SamplingParams | None, request_id: str | None) -> Sequence:
        """A validated request with its id, seed and arrival number, not queued yet (an expert-parallel driver
        queues it on another rank)."""
        params = params or SamplingParams()
        if isinstance(params, dict):
            raise TypeError(f"sampling params must be a SamplingParams, got a dict {params!r}: SamplingParams(**it)")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        # The arrival number seeds requests without a seed, so it is only taken once the request is accepted:
        # a rejected request must not shift the seeds (and so the outputs) of the requests after it.
        arrival = self._num_arrivals
        if request_id is None:
            request_id = f"req-{arrival}"
            while self._id_in_use(request_id):  # a caller may have used the same name explicitly
                request_id += "+"
        request_id = str(request_id)
        if self._id_in_use(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self._tokenize(prompt)
        if not ids:
            raise ValueError(f"request {request_id}: prompt is empty")
        bad = [(i, t) for i, t in enumerate(ids) if not 0 <= t < self.vocab_size]
        if bad:
            i, t = bad[0]
            raise ValueError(
                f"request {request_id}: token id {t} at position {i} is outside the vocabulary [0, {self.vocab_size})"
            )
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"request {request_id}: prompt has {len(ids)} tokens; max_model_len is {self.max_model_len} "
                "(room for at least one generated token is needed)"
            )
        peak = min(len(ids) + params.max_tokens, self.max_model_len)
        if self.blocks.blocks_for(peak) > self.blocks.num_blocks:
            raise ValueError(
                f"request {request_id}: needs {self.blocks.blocks_for(peak)} KV pages for {peak} tokens; the cache "
                f"has {self.blocks.num_blocks} pages of {self.blocks.block_size} tokens (lower max_tokens or grow "
                "the cache)"
            )
        self._num_arrivals += 1
        seed = params.seed if params.seed is not None else token_seed(self.config.seed, -1 - arrival)
        return Sequence(request_id, ids, params, seed, arrival)

    def step(self) -> list[RequestOutput]:
        """Schedule and run one step; return the requests that finished in it (with ``async_decode``: the requests
        found finished when the step before it is read back, once this one is launched)."""
        if self.sleep_level:
            raise RuntimeError(f"the engine is asleep (level {self.sleep_level}): call wake_up() before step()")
        if self._weights_pending:
            raise RuntimeError(
                f"{len(self._weights_pending)} weight tensor(s) discarded by sleep(level=2) are not reloaded yet, "
                f"e.g. {sorted(self._weights_pending)[:3]}: call update_weights with them first"
            )
        batch = self.scheduler.schedule()
        launched = self._launch(batch) if batch else None
        finished, self._finished_early = self._finished_early, []
        if self.config.async_decode:
            launched, self._in_flight = self._in_flight, launched
        if launched is not None:
            finished += self._read_back(launched)
        elif not batch and not finished and self.scheduler.has_unfinished():
            raise RuntimeError(f"scheduler made no progress with {len(self.scheduler.waiting)} waiting requests")
        if not self.scheduler.has_unfinished():
            self._in_flight = None  # every row still in flight belongs to a finished request: nothing to read
        return finished

    def _launch(self, batch) -> LaunchedStep:
        try:
            launched = self.runner.launch(batch, self.blocks)
        except BaseException:
            # pages registered for this step may not hold their K/V: never let a later request reuse them
            self.blocks.reset_prefix_cache()
            if self._in_flight is not None:  # its requests' tokens stay theirs
                self._finished_early += self._read_back(self._in_flight)
                self._in_flight = None
            raise
        for item in batch:
            item.seq.num_computed_tokens += item.num_new_tokens
        if self.config.async_decode:  # (else the step is read back before anything else looks at its sequences)
            for row, item in enumerate(launched.items):
                item.seq.num_pending += 1  # its token is on the device until the step is read back
                item.seq.pending_row = row
        return launched

    def _read_back(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Append a launched step's tokens and apply the stopping rules; returns the requests that finished. A row
        of a request that finished (or was aborted) after its step was launched is dropped."""
        finished = []
        eos, max_len, done = self.eos_token_ids, self.max_model_len, SequenceStatus.FINISHED
        one_late = self.config.async_decode
        for item, token, logprob in launched.results():
            seq = item.seq
            if one_late:
                seq.num_pending -= 1
                if seq.status is done:
                    self.num_dropped_rows += 1
                    continue
            out = seq.output_token_ids
            out.append(token)
            seq.output_logprobs.append(logprob)
            # the stopping rules (a stop token; EOS unless ignored; max_tokens; max_model_len), inline: one row a
            # request, 256 a step at a large batch
            p = seq.params
            if (p.stop_token_ids and token in p.stop_token_ids) or (not p.ignore_eos and token in eos):
                reason = "stop"
            elif len(out) >= p.max_tokens or len(seq.prompt_token_ids) + len(out) >= max_len:
                reason = "length"
            else:
                continue
            self.scheduler.finish(seq, reason)
            self._seqs.pop(seq.request_id, None)
            finished.append(self._output(seq))
        return finished

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a queued or running request; returns its partial output (finish_reason 'abort')."""
        seq = self._seqs.pop(str(request_id), None)
        if seq is None:
            return None
        self.scheduler.finish(seq, "abort")
        if not self.scheduler.has_unfinished():
            self._in_flight = None  # only finished requests' rows were in flight
        return self._output(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def _id_in_use(self, request_id: str) -> bool:
        return request_id in self._seqs

    def _tokenize(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompt given but the model has no tokenizer; pass token ids")
            return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple)):
            raise TypeError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        ids = list(prompt)
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int):
                raise TypeError(f"prompt token at position {i} is {t!r}; token ids must be integers")
        return ids

    def _output(self, seq: Sequence) -> RequestOutput:
        text = self.tokenizer.decode(seq.output_token_ids) if self.tokenizer is not None else None
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids),
            logprobs=torch.tensor(seq.output_logprobs, dtype=torch.float32),
            finish_reason=seq.finish_reason or seq.status.value,
            text=text,
            num_preemptions=seq.num_preemptions,
            num_cached_tokens=seq.num_cached_tokens or 0,
        )

    # ---- state
    @property
    def stats(self) -> dict[str, int]:
        """Counters since construction: ``prompt_tokens`` of admitted requests and ``cached_prompt_tokens`` of those
        reused from the prefix cache (hit rate = their ratio), ``recompute_tokens_cached`` (tokens of preempted
        requests found cached when re-admitted), ``num_preemptions``, and ``cached_blocks`` now."""
        return dict(self.scheduler.stats, num_preemptions=self.num_preemptions, cached_blocks=self.blocks.num_cached)

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def running_sequences(self) -> list[Sequence]:
        return [s for s in self._seqs.values() if s.status is SequenceStatus.RUNNING]

    def reset_prefix_cache(self) -> None:
        """Forget every cached KV page (pages of running requests stay theirs). :meth:`update_weights` and
        :meth:`sleep` do it themselves; verl's ``clear_kv_cache`` calls it."""
        self.blocks.reset_prefix_cache()

    def _make_runner(self, model: torch.nn.Module, num_blocks: int):
        """The step executor (a pipeline-parallel engine substitutes its own; see ``pipeline.py``)."""
        return ModelRunner(model, self.config, num_blocks, self.max_model_len)
