"""The engine loop: validate and queue requests, schedule a step, run it, collect finished requests."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from vexact_models import (
    WeightTable,
    allocate_packed,
    expected_tensors,
    load_bucket,
    load_model,
    load_weights,
    pack_parameters,
    packed_buffers,
    receive_weights,
    weight_table,
    weight_targets,
)

from .block_manager import BlockManager
from .config import CPU_KV_CACHE_BYTES, EngineConfig
from .model_runner import ModelRunner, profile_activation_bytes
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


_GIB = 1 << 30


def _tensor_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def check_model_fits(model: torch.nn.Module, config: EngineConfig, device: torch.device) -> None:
    """Raise ValueError with the figures when the model's weights alone exceed the engine's share of the device."""
    total = torch.cuda.get_device_properties(device).total_memory
    budget = config.gpu_memory_utilization * total
    weights = _tensor_bytes(model)
    if weights >= budget:
        raise ValueError(
            f"the model's weights take {weights / _GIB:.2f} GiB but gpu_memory_utilization="
            f"{config.gpu_memory_utilization} allows {budget / _GIB:.2f} GiB of the device's {total / _GIB:.2f} GiB; "
            "raise gpu_memory_utilization (at most 1.0) or use a device with more memory"
        )


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
            # load on the host first, so a model too large for the device's budget fails with the figures
            model = load_model(model_path, dtype=self.config.dtype, device="cpu")
            device = torch.device(self.config.device)
            if device.type == "cuda":
                check_model_fits(model, self.config, device)
            if self.config.pack_weights:
                pack_parameters(model, device)  # from the host straight into the flat buffers: one device copy
            model = model.to(device)  # the buffers (and the parameters, unpacked)
        if tokenizer is None and model_path is not None:
            tokenizer = load_tokenizer(model_path)
        if self.config.pack_weights:
            pack_parameters(model)  # before the KV cache is sized and graphs capture the weights' addresses
        self.model = model.eval()
        self.tokenizer = tokenizer
        mcfg = model.config
        self.vocab_size = mcfg.vocab_size
        limit = mcfg.max_position_embeddings
        window = getattr(mcfg, "sliding_window", None)
        if window is not None:
            # the kernels attend to every earlier key: equal to the model's window only while a sequence fits in it
            if self.config.max_model_len is not None and self.config.max_model_len > window:
                raise ValueError(
                    f"max_model_len {self.config.max_model_len} > the model's sliding_window {window}: "
                    f"sliding-window attention is not implemented; set max_model_len <= {window}"
                )
            limit = min(limit, window)
        self.max_model_len = min(self.config.max_model_len or limit, limit)
        if not self.config.enable_chunked_prefill and self.config.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"with chunked prefill off, max_num_batched_tokens ({self.config.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}): a whole prompt (or a preempted request's recompute) must fit "
                "one step"
            )
        num_blocks = self._num_kv_blocks()
        self.blocks = BlockManager(num_blocks, self.config.block_size, self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.config, self.blocks)
        self.runner = self._make_runner(model, num_blocks)
        self.eos_token_ids = set(mcfg.eos_token_ids)
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            self.eos_token_ids.add(tokenizer.eos_token_id)
        self._seqs: dict[str, Sequence] = {}
        self._num_arrivals = 0  # accepted requests so far; a rejected request takes no arrival slot (see add_request)
        self.sleep_level = 0  # 0: awake; 1 or 2: see sleep()
        self._host_copies: dict[str, torch.Tensor] = {}  # weights offloaded by sleep(level=1), reused across cycles
        self._shapes: dict[str, tuple[torch.Size, torch.dtype]] = {}
        self._weights_pending: set[str] = set()  # names to reload after sleep(level=2)
        self._targets: dict | None = None  # name -> parameter (view) for packed buckets; rebuilt after sleep/wake
        self._weight_table = None  # (WeightTable, buffers) for a colocated trainer's writes; rebuilt per allocation

    def _make_runner(self, model: torch.nn.Module, num_blocks: int):
        """The step executor (a pipeline-parallel engine substitutes its own; see ``pipeline.py``)."""
        return ModelRunner(model, self.config, num_blocks, self.max_model_len)

    def _num_kv_blocks(self) -> int:
        cfg, mcfg = self.config, self.model.config
        dtype = next(self.model.parameters()).dtype
        per_block = ModelRunner.kv_bytes_per_block(mcfg, cfg.block_size, dtype)
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        device = next(self.model.parameters()).device
        if cfg.kv_cache_bytes is not None or device.type != "cuda":
            return max(1, (cfg.kv_cache_bytes or CPU_KV_CACHE_BYTES) // per_block)
        return self._kv_blocks_from_gpu_memory(device, per_block)

    def _kv_blocks_from_gpu_memory(self, device: torch.device, per_block: int) -> int:
        """KV pages = (gpu_memory_utilization * total - weights - 2 * activation peak) / page bytes, no more than
        this process can still allocate, and no more than ``max_num_seqs`` sequences of ``max_model_len`` tokens can
        use. The second activation peak covers the CUDA graphs' memory pool (a graph's step has at most
        ``max_num_batched_tokens`` tokens, the profiled step's count)."""
        cfg = self.config
        torch.cuda.empty_cache()
        weights = _tensor_bytes(self.model)
        activations = profile_activation_bytes(self.model, cfg)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        budget = cfg.gpu_memory_utilization * total
        want = budget - weights - 2 * activations
        can = free - 2 * activations
        figures = (
            f"gpu_memory_utilization={cfg.gpu_memory_utilization} of {total / _GIB:.2f} GiB = {budget / _GIB:.2f} GiB; "
            f"weights {weights / _GIB:.2f} GiB, activation peak {activations / _GIB:.2f} GiB (x2 with the CUDA "
            f"graphs), {free / _GIB:.2f} GiB free on the device"
        )
        kv = min(want, can)
        min_blocks = -(-self.max_model_len // cfg.block_size)
        if kv < min_blocks * per_block:
            raise ValueError(
                f"no room for a KV cache that holds one sequence of max_model_len {self.max_model_len} "
                f"({min_blocks * per_block / _GIB:.3f} GiB): {figures}. Raise gpu_memory_utilization, lower "
                "max_num_batched_tokens / max_num_seqs / max_model_len, or free device memory"
            )
        if can < want:
            log.warning("KV cache limited by free device memory (other allocations hold some): %s", figures)
        # More pages than max_num_seqs sequences of max_model_len tokens can use would only take memory from others
        useful = cfg.max_num_seqs * min_blocks
        num_blocks = min(int(kv // per_block), useful)
        log.info(
            "KV cache: %d pages of %d tokens (%.2f GiB%s); %s", num_blocks, cfg.block_size,
            num_blocks * per_block / _GIB, ", all that max_num_seqs x max_model_len can use" if num_blocks == useful
            else "", figures,
        )  # fmt: skip
        return num_blocks

    # ---- sleep / wake (a colocated trainer can use the device meanwhile)
    def sleep(self, level: int = 1) -> None:
        """Free the KV cache, the CUDA graphs and the weights' device memory.

        ``level=1`` keeps the weights in (pinned) host memory and restores them on :meth:`wake_up`; ``level=2``
        discards the parameters: after :meth:`wake_up` the caller must load every one with :meth:`update_weights`
        before the next step. Buffers (DeepSeek's fp32 ``e_score_correction_bias`` too) are kept in host memory at
        either level and come back bit for bit. Refused while requests are unfinished (their KV would be lost):
        finish or abort them first. Requests may be added while asleep; they run after waking. On CPU the same
        happens with host storages.
        """
        self._refuse_sleep(level)
        self.runner.release()
        self._targets = None
        self._weight_table = None
        self.blocks.reset_prefix_cache()  # the cached pages' K/V goes with the KV cache
        on_cuda = self.runner.device.type == "cuda"
        for name, t, is_param in self._named_tensors():
            self._shapes[name] = (t.shape, t.dtype)
            # Buffers are kept at either level, bit for bit: rotary tables are no weights, and DeepSeek's fp32 bias
            # buffer (a checkpoint tensor, which an update may also send) stays valid when a sender omits it.
            if level == 1 or not is_param:
                if on_cuda:
                    host = self._host_copies.get(name)
                    if host is None or host.shape != t.shape or host.dtype != t.dtype:
                        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                        self._host_copies[name] = host
                    host.copy_(t.data, non_blocking=True)
                else:
                    self._host_copies[name] = t.data  # the host storage is the copy; the model lets go of it
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        if level == 2:
            for name, _, is_param in self._named_tensors():
                if is_param:
                    self._host_copies.pop(name, None)
        if on_cuda:
            torch.cuda.synchronize(self.runner.device)  # the copies must land before the storages are freed
            torch.cuda.empty_cache()
        self.sleep_level = level

    def _refuse_sleep(self, level: int) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (offload weights) or 2 (discard weights), got {level!r}")
        if self.sleep_level:
            raise RuntimeError(f"the engine is already asleep (level {self.sleep_level}); call wake_up() first")
        if self.has_unfinished_requests():
            raise RuntimeError(f"sleep with {len(self._seqs)} unfinished request(s): finish or abort them first")

    def _refuse_update(self) -> None:
        if self.sleep_level:
            raise RuntimeError(f"update_weights while asleep (level {self.sleep_level}): call wake_up() first")
        if self.has_unfinished_requests():
            raise RuntimeError(
                f"update_weights with {len(self._seqs)} unfinished request(s): finish or abort them first"
            )

    def wake_up(self) -> None:
        """Restore what :meth:`sleep` freed: weights (level 1; level 2 leaves them to :meth:`update_weights`),
        the KV cache and the CUDA graphs. A no-op when awake."""
        if not self.sleep_level:
            return
        dev = self.runner.device
        pack = self.config.pack_weights
        for name, t, is_param in self._named_tensors():
            shape, dtype = self._shapes[name]
            if self.sleep_level == 2 and is_param:
                if not pack:  # packed: allocated below, all at once
                    t.data = torch.empty(shape, dtype=dtype, device=dev)
            else:
                host = self._host_copies[name]
                # packed parameters point at their host copy for now; pack_parameters copies them into the buffers
                t.data = host.to(dev, non_blocking=True) if dev.type == "cuda" and not (pack and is_param) else host
                if dev.type != "cuda":
                    del self._host_copies[name]
        if pack and self.sleep_level == 2:
            params = {name for name, _, is_param in self._named_tensors() if is_param}
            allocate_packed(self.model, {name: self._shapes[name] for name in params}, dev)
        elif pack:
            pack_parameters(self.model, dev)  # on CPU the host copies are the packed views: nothing to do
        if self.sleep_level == 2:
            kept = {name for name, _ in self.model.named_buffers()}
            self._weights_pending = self.weight_names() - kept
        self.runner.allocate()
        self.sleep_level = 0

    def _named_tensors(self):
        """(name, tensor, is_parameter) for every distinct parameter and buffer of the model (tied ones once)."""
        seen = set()
        for name, p in self.model.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                yield name, p, True
        for name, b in self.model.named_buffers():
            if id(b) not in seen:
                seen.add(id(b))
                yield name, b, False

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
        self._refuse_update()
        # cached K/V was computed with the old weights; dropped first, so a load that fails half way drops it too
        self.blocks.reset_prefix_cache()
        loaded = load_weights(self.model, named_tensors, strict=False)
        self._weights_pending.difference_update(loaded)
        if self.model.config.tie_word_embeddings and "lm_head.weight" in self._weights_pending:
            self._weights_pending.discard("lm_head.weight")
        return loaded

    def load_bucket(self, buffer: torch.Tensor, specs: list, skip=None) -> list[str]:
        """Load one packed bucket (``vexact_models.BucketPacker``'s layout: a uint8 buffer on the model's device and
        its ``TensorSpec`` list) into the parameters in place; returns the checkpoint names completed.

        Every spec is checked (name, the parameter's exact dtype and shape, byte range) before any byte is copied,
        so a bad bucket raises ``CheckpointError`` and changes nothing. Parameters keep their storage, so captured
        CUDA graphs stay valid. The copies are queued on the current stream (the caller synchronises before the
        buffer is reused). Refused while requests are unfinished or while asleep, as :meth:`update_weights`.
        """
        self._refuse_update()
        self.blocks.reset_prefix_cache()  # as update_weights: cached K/V was computed with the old weights
        if self._targets is None:
            self._targets = weight_targets(self.model)
        loaded = load_bucket(self.model, buffer, specs, targets=self._targets, skip=skip)
        self._weights_pending.difference_update(loaded)
        return loaded

    def receive_weights(self, group) -> list[str]:
        """Receive a whole weight sync broadcast by rank 0 of ``group`` (a ``vexact_models.WeightSyncGroup`` whose
        device is this engine's) and load it bucket by bucket; returns the names loaded."""
        self._refuse_update()
        return receive_weights(group, self.load_bucket)

    # ---- weights written in place by a trainer on the same GPU (the single-copy colocated path)
    def weight_table(self) -> tuple[WeightTable, list[torch.Tensor]] | None:
        """Where each checkpoint-named weight lies in the packed parameter buffers, and those buffers as bytes
        (``vexact_models.weight_table``): what a colocated trainer opens (CUDA IPC handles of the buffers) and writes
        into. None when the weights are not packed (``pack_weights=False``) or are asleep. Built once per allocation
        (waking gives the parameters new buffers), each time with a new ``key``."""
        if self.sleep_level:
            return None
        if self._weight_table is None:
            packed = packed_buffers(self.model)
            if packed is None:
                return None
            self._weight_table = weight_table(self.model, packed[0])
        return self._weight_table

    def begin_weight_write(self) -> tuple[WeightTable, list[torch.Tensor]]:
        """Before a colocated trainer writes weights straight into the parameters (``vexact_models.DirectWriter``
        over the buffers of :meth:`weight_table`): refused while asleep or with requests unfinished, as
        :meth:`update_weights`; drops the prefix cache. Returns ``(table, buffers)``. Run no step until
        :meth:`finish_weight_write` (the trainer synchronises its copies first). Parameters keep their storage, so
        captured CUDA graphs stay valid."""
        self._refuse_update()
        found = self.weight_table()
        if found is None:
            raise RuntimeError(
                "this engine's weights are not packed in flat buffers (EngineConfig.pack_weights=False, or pipeline "
                "stages): send them with load_bucket or update_weights"
            )
        self.blocks.reset_prefix_cache()  # cached K/V was computed with the old weights
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)  # no kernel of ours still reads the weights being overwritten
            torch.cuda.ipc_collect()  # allocations a trainer has let go of since it held them are freed now
        return found

    def finish_weight_write(self, key: str, written: bytes) -> list[str]:
        """After the trainer's copies have landed: the table slots set in ``written`` (``WeightTable.mask`` of what it
        wrote) count as loaded; returns their checkpoint names. Refused when ``key`` is not the current table's (the
        weights were re-allocated since: the bytes went to memory the engine no longer uses)."""
        table = self._weight_table[0] if self._weight_table is not None else None
        if table is None or table.key != key:
            now = table.key if table is not None else None
            raise RuntimeError(
                f"weights were written for weight table {key!r}, but the engine's weights were re-allocated since "
                f"(table now {now!r}, asleep: {bool(self.sleep_level)}): sync again"
            )
        loaded = table.completed(written)
        self._weights_pending.difference_update(loaded)
        return loaded

    def weight_names(self) -> set[str]:
        """The checkpoint names of the weights this engine holds (stacked experts one by one, as published
        checkpoints and the trainer's export name them): what a full :meth:`update_weights` sends."""
        return set(expected_tensors(self.model))

    def reset_prefix_cache(self) -> None:
        """Forget every cached KV page (pages of running requests stay theirs). :meth:`update_weights` and
        :meth:`sleep` do it themselves; verl's ``clear_kv_cache`` calls it."""
        self.blocks.reset_prefix_cache()

    @property
    def stats(self) -> dict[str, int]:
        """Counters since construction: ``prompt_tokens`` of admitted requests and ``cached_prompt_tokens`` of those
        reused from the prefix cache (hit rate = their ratio), ``recompute_tokens_cached`` (tokens of preempted
        requests found cached when re-admitted), ``num_preemptions``, and ``cached_blocks`` now."""
        return dict(self.scheduler.stats, num_preemptions=self.num_preemptions, cached_blocks=self.blocks.num_cached)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    # ---- the loop
    def step(self) -> list[RequestOutput]:
        """Schedule and run one step; return the requests that finished in it."""
        if self.sleep_level:
            raise RuntimeError(f"the engine is asleep (level {self.sleep_level}): call wake_up() before step()")
        if self._weights_pending:
            raise RuntimeError(
                f"{len(self._weights_pending)} weight tensor(s) discarded by sleep(level=2) are not reloaded yet, "
                f"e.g. {sorted(self._weights_pending)[:3]}: call update_weights with them first"
            )
        batch = self.scheduler.schedule()
        if not batch:
            if self.scheduler.has_unfinished():
                raise RuntimeError(f"scheduler made no progress with {len(self.scheduler.waiting)} waiting requests")
            return []
        try:
            results = self.runner.run(batch, self.blocks)
        except BaseException:
            # pages registered for this step may not hold their K/V: never let a later request reuse them
            self.blocks.reset_prefix_cache()
            raise
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
            num_cached_tokens=seq.num_cached_tokens or 0,
        )

    def running_sequences(self) -> list[Sequence]:
        return [s for s in self._seqs.values() if s.status is SequenceStatus.RUNNING]
