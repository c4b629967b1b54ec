"""The engine loop: validate and queue requests, schedule a step, run it, collect finished requests."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from vexact_models import load_model, load_weights

from .block_manager import BlockManager
from .config import EngineConfig
from .model_runner import ModelRunner
from .outputs import RequestOutput
from .sampler import token_seed
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence, SequenceStatus

log = logging.getLogger("vexact_engine")


def load_tokenizer(path: str | Path):
    """The checkpoint's tokenizer through transformers, or None when it has none (token-id prompts only)."""
    path = Path(path)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        log.warning("transformers is not installed: %s's tokenizer is not loaded; pass token ids", path)
        return None
    return AutoTokenizer.from_pretrained(str(path))


class LLMEngine:
    """One engine replica: a model, its KV cache, a scheduler. Not thread-safe; drive it from one thread."""

    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        model: torch.nn.Module | None = None,
        tokenizer=None,
        config: EngineConfig | None = None,
        **config_kw,
    ):
        if config is not None and config_kw:
            raise TypeError("pass either config=EngineConfig(...) or keyword settings, not both")
        self.config = config or EngineConfig(**config_kw)
        if model is None:
            if model_path is None:
                raise ValueError("LLMEngine needs a model_path or a model")
            model = load_model(model_path, dtype=self.config.dtype, device=self.config.device)
        if tokenizer is None and model_path is not None:
            tokenizer = load_tokenizer(model_path)
        self.model = model.eval()
        self.tokenizer = tokenizer
        mcfg = model.config
        self.vocab_size = mcfg.vocab_size
        self.max_model_len = min(
            self.config.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings
        )
        if not self.config.enable_chunked_prefill and self.config.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"with chunked prefill off, max_num_batched_tokens ({self.config.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}): a whole prompt (or a preempted request's recompute) must fit "
                "one step"
            )
        dtype = next(model.parameters()).dtype
        num_blocks = self.config.num_kv_blocks or max(
            1, self.config.kv_cache_bytes // ModelRunner.kv_bytes_per_block(mcfg, self.config.block_size, dtype)
        )
        self.blocks = BlockManager(num_blocks, self.config.block_size)
        self.scheduler = Scheduler(self.config, self.blocks)
        self.runner = ModelRunner(model, self.config, num_blocks)
        self.eos_token_ids = set(mcfg.eos_token_ids)
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            self.eos_token_ids.add(tokenizer.eos_token_id)
        self._seqs: dict[str, Sequence] = {}
        self._num_arrivals = 0  # accepted requests so far; a rejected request takes no arrival slot (see add_request)

    # ---- requests
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

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Validate and queue a request (text or token ids). Raises ValueError/TypeError naming the problem."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        # The arrival number seeds requests without a seed, so it is only taken once the request is accepted:
        # a rejected request must not shift the seeds (and so the outputs) of the requests after it.
        arrival = self._num_arrivals
        if request_id is None:
            request_id = f"req-{arrival}"
            while request_id in self._seqs:  # a caller may have used the same name explicitly
                request_id += "+"
        request_id = str(request_id)
        if request_id in self._seqs:
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
        seq = Sequence(request_id, ids, params, seed, arrival)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a queued or running request; returns its partial output (finish_reason 'abort')."""
        seq = self._seqs.pop(str(request_id), None)
        if seq is None:
            return None
        self.scheduler.finish(seq, "abort")
        return self._output(seq)

    # ---- weights
    def update_weights(self, named_tensors) -> list[str]:
        """Load new weights by HF name, without a restart; returns the names loaded.

        ``named_tensors`` is any iterable of ``(hf_name, tensor)`` (a generator of buckets is fine: tensors are
        copied one at a time). Names, shapes and dtypes are checked; a partial update is allowed. The KV cache of
        running requests was computed with the old weights, so updating while requests are in flight is refused.
        """
        if self.has_unfinished_requests():
            raise RuntimeError(
                f"update_weights with {len(self._seqs)} unfinished request(s): finish or abort them first"
            )
        return load_weights(self.model, named_tensors, strict=False)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    # ---- the loop
    def step(self) -> list[RequestOutput]:
        """Schedule and run one step; return the requests that finished in it."""
        batch = self.scheduler.schedule()
        if not batch:
            if self.scheduler.has_unfinished():
                raise RuntimeError(f"scheduler made no progress with {len(self.scheduler.waiting)} waiting requests")
            return []
        results = self.runner.run(batch, self.blocks)
        for item in batch:
            item.seq.num_computed_tokens += item.num_new_tokens
        finished = []
        for item, token, logprob in results:
            seq = item.seq
            seq.output_token_ids.append(token)
            seq.output_logprobs.append(logprob)
            reason = self._stop_reason(seq, token)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                self._seqs.pop(seq.request_id, None)
                finished.append(self._output(seq))
        return finished

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

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
        )

    def running_sequences(self) -> list[Sequence]:
        return [s for s in self._seqs.values() if s.status is SequenceStatus.RUNNING]
