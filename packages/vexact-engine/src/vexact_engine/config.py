from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import vexact_kernels as vk

DEFAULT_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Above the last default size, decode graphs every this many rows up to max_num_seqs. A decode step larger than every
# captured size runs eagerly, and eager launches dominate a step there: on an H200 at batch 512 (1.7B shape, ~1.1k
# context) the GPU waited on the host 9.8 of a 37.4 ms step, against 1.4 of 16.1 ms at batch 256 in a graph
# (benchmarks/results/throughput-rl-h200.md).
GRAPH_BATCH_STEP_LARGE = 64
# Token buckets of the steps with prompt tokens, by default: every 256 tokens up to 4096, then every 1024 (and the
# step budget itself).
GRAPH_TOKEN_STEP, GRAPH_TOKEN_STEP_LARGE, GRAPH_TOKEN_STEP_UNTIL = 256, 1024, 4096
# when the CUDA graphs come back after a wake_up (EngineConfig.graph_recapture)
GRAPH_RECAPTURE = ("lazy", "eager")
CPU_KV_CACHE_BYTES = 256 << 20
# EngineConfig.draw_in_graph's default when left None: "1" or "0" (unset or empty: off)
DRAW_IN_GRAPH_ENV = "VEXACT_DRAW_IN_GRAPH"


@dataclass
class EngineConfig:
    """Engine settings (serving only; mismatch injection for studies is ``MismatchInjection``); validated at
    construction.

    KV cache size, first setting that applies: ``num_kv_blocks`` pages of ``block_size`` tokens; else
    ``kv_cache_bytes``; else, on CUDA, ``gpu_memory_utilization`` (the fraction of the device's total memory this
    engine may use: the KV cache gets that budget minus the model's weights and a measured activation peak, capped at
    what ``max_num_seqs`` sequences of ``max_model_len`` tokens can use); else (CPU) 256 MiB.
    ``max_num_batched_tokens`` is the token budget of one step (decode tokens plus prefill chunks).

    ``enable_prefix_caching`` (default on): full KV pages are cached by their token prefix and reused by later
    requests that start with the same tokens (the n samples of a GRPO group share their prompt's pages); the
    chunk-invariant kernels make a reused page bitwise the page the request would compute. Off: every request
    computes its whole prompt (the same tokens and logprobs, more work).

    Decode steps on CUDA run as CUDA graphs captured for each of ``cuda_graph_batch_sizes`` (default
    1, 2, 4, ..., 256, then every 64 up to ``max_num_seqs``, plus ``max_num_seqs`` itself when it falls between two
    sizes): a decode step of B sequences is padded to the next captured size (pad rows write no KV and are dropped).
    With an explicit list, larger decode steps run eagerly, as do prefill steps and ``enforce_eager=True``. On CPU
    there are no graphs; an explicit ``cuda_graph_batch_sizes`` there runs the same padded static-buffer decode
    eagerly (to test the padding).

    Steps with prompt tokens (prefill chunks, alone or with decode rows) run as CUDA graphs too, one per token count
    of ``cuda_graph_token_sizes`` (default on CUDA: every 256 tokens up to 4096, then every 1024, below
    ``max_num_batched_tokens``, and that budget itself; ``()`` turns them off): a step of N tokens is padded to the
    next size with one pad sequence that writes no KV, in ``max_num_seqs + 1`` sequence slots (the unused ones
    empty). Eagerly, such a step's many small launches left the GPU idle most of the step. Only with the invariant
    attention kernels (the ``fast`` ones read the step's layout on the host); on CPU an explicit list runs the padded
    path eagerly.

    ``graph_recapture`` says when the graphs come back after a ``wake_up`` (the KV cache and the packed weights return
    at new addresses, so every graph is captured again): ``"lazy"`` (default) captures the largest decode size and the
    largest token count at the wake_up (so the graphs' memory pool reaches the size it has after an eager capture),
    and every other size at the first step that needs it; ``"eager"`` captures them all at the wake_up. A verl step
    decodes at one or two batch sizes, so lazily it pays for a few captures instead of every one (25 by default at a
    4096-token budget). The graphs are the same either way, and so are the tokens and logprobs.

    ``pack_weights`` (default on): the parameters live in one flat buffer per dtype (``vexact_models.pack_parameters``,
    at construction and again when waking from sleep), so each layer's q/k/v and gate/up projections lie end to end
    and the models run them as one matmul each (``vexact_models.layers.grouped_linear``: the same bits as three and
    two). Off: one allocation per parameter, one matmul per projection. The same tokens and logprobs either way.

    ``draw_in_graph`` (default off; ``None`` reads ``$VEXACT_DRAW_IN_GRAPH``, ``1`` or ``0``): a padded decode step
    whose rows all draw from the whole distribution (temperature > 0, no top-k / top-p; no mismatch injection) runs
    its draw (``model.sample``) from the static buffers too, as a second CUDA graph replayed right after the decode
    graph, and brings tokens and logprobs back in one copy; other steps sample eagerly as without it. The same tokens
    and logprobs either way (the fused draw is row-invariant, so pad rows change no real row). On CUDA only with the
    ``invariant`` logprobs kernels (the ``fast`` ones read the device on the host).

    ``async_decode`` (default ``None``: on for a CUDA device where it can run, i.e. with CUDA graphs and the invariant
    attention and logprobs kernels; off on CPU): the loop schedules and launches step N+1 while step N runs and reads
    step N's
    tokens back one step late. A decoding row of step N+1 takes its input token from the device memory step N's draw
    wrote (``in_flight.feed_drawn``), not from the host; the host prepares positions, KV slots and block tables as
    without it. The stopping rules (stop tokens, EOS, ``max_tokens``, ``max_model_len``), aborts and preemption are
    applied when a step is read back: a request that stops on a token of step N has one more row in step N+1, whose
    token is dropped (its KV write lands in its own page; its pages are freed when step N is read). The same tokens
    and logprobs as without it, for every request. It needs the invariant attention and logprobs kernels (``fast``
    ones read a step's layout on the host, a wait for the step before it), and the padded steps CUDA graphs replay
    (``enforce_eager=False``): an eager step keeps the host launching kernels for as long as the device runs them.
    With it ``draw_in_graph`` defaults to on (an explicit value or ``$VEXACT_DRAW_IN_GRAPH`` still wins). Not in a
    ``PipelineLLM`` (which turns the default off). On an H200 at the RL workload it gave +7% tok/s at batch limit 256
    and +33% at 512, where a synchronous step leaves the GPU waiting 8.5 of 32.7 ms on the host
    (benchmarks/results/throughput-rl-h200.md).

    ``split_mixed_steps`` (default on): a step that holds both decode rows and prompt tokens runs as two launches,
    the decode rows as a padded decode step (its CUDA graph, its in-graph draw) and the prompt chunks as a step of
    their own (a graph padded to their token count), decode rows first. Every kernel is row-invariant, so the split
    changes no token and no logprob; it keeps a step that admits one prompt from running its hundreds of decode rows
    through the prompt path (64-row attention tiles, the eager draw). Only where decode steps run padded (CUDA graphs,
    or an explicit ``cuda_graph_batch_sizes`` on CPU); off: one launch for the whole step.

    ``tune_linears`` (default on): before the first capture of each decode graph of at least ``LINEAR_TUNE_MIN_M`` (128)
    rows, the engine times the invariant linear's forms at that graph's projection shapes on this GPU, with the
    model's own weights, and the graph runs the fastest (``vexact_kernels.tune_linears``; 4-16 s at start-up on an
    H200 for the Qwen3-1.7B / 8B shapes; their decode-only step 3.8% / 5.2% shorter,
    ``benchmarks/results/throughput-rl-h200.md``). Every form gives the same bits (a form whose output differs from
    the default's on this GPU is never picked), so the same tokens and logprobs either way; off: the default pick by
    shape. ``tune_linears_min_rows`` (default None: ``LINEAR_TUNE_MIN_M``): the smallest decode graph so timed
    (1: every one, the few-row graphs of a rollout's tail too).

    ``decode_streams`` (1 or 2, default 1): with 2, each decode graph of at least ``DECODE_STREAMS_MIN_ROWS`` (128) rows
    runs its forward as two forwards of half the rows on two CUDA streams, forked and joined inside the graph, so
    that one half's paged attention (bound by memory) can overlap the other half's projections (bound by the tensor
    cores at these sizes). Every kernel is row-invariant, so the same tokens and logprobs either way
    (``benchmarks/nano_overlap.py`` times the forms). Each half runs its projections at half the rows: on an H200
    +0.7-2.6% tok/s for the Qwen3-1.7B shape, -9% for 8B (``benchmarks/results/decode-streams-h200.md``). Eager
    padded steps (CPU, or graphs off) run the two halves one after the other. Not in an ``ExpertParallelLLM`` or a
    ``PipelineLLM`` (one stream: their collectives run in lockstep).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    backend: str = "invariant"
    dtype: str | None = None
    device: str = "cpu"
    seed: int = 0
    enforce_eager: bool = False
    cuda_graph_batch_sizes: tuple[int, ...] | list[int] | None = None
    cuda_graph_token_sizes: tuple[int, ...] | list[int] | None = None
    pack_weights: bool = True
    graph_recapture: str = "lazy"
    draw_in_graph: bool | None = None
    async_decode: bool | None = None
    split_mixed_steps: bool = True
    tune_linears: bool = True
    tune_linears_min_rows: int | None = None
    decode_streams: int = 1

    def __post_init__(self) -> None:
        vk.check_backend(self.backend, "backend")  # a name, or "fast:<op>,..." for per-op-family fast kernels
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be a positive integer, got {value!r}")
        for name in ("num_kv_blocks", "kv_cache_bytes", "tune_linears_min_rows"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"EngineConfig.{name} must be a positive integer, got {value!r}")
        if self.graph_recapture not in GRAPH_RECAPTURE:
            raise ValueError(
                f"EngineConfig.graph_recapture must be one of {GRAPH_RECAPTURE}, got {self.graph_recapture!r}"
            )
        if self.decode_streams not in (1, 2) or isinstance(self.decode_streams, bool):
            raise ValueError(f"EngineConfig.decode_streams must be 1 or 2, got {self.decode_streams!r}")
        for name in ("pack_weights", "split_mixed_steps", "tune_linears"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"EngineConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if self.async_decode is None:
            pass  # the engine resolves it once it knows where the model runs (resolved())
        elif not isinstance(self.async_decode, bool):
            raise TypeError(f"EngineConfig.async_decode must be True, False or None, got {self.async_decode!r}")
        elif self.async_decode:
            self._check_async_decode()
        if self.draw_in_graph is None:
            value = os.environ.get(DRAW_IN_GRAPH_ENV, "")
            if value not in ("", "0", "1"):
                raise ValueError(f"${DRAW_IN_GRAPH_ENV} must be 1 or 0 (or unset), got {value!r}")
            if value or self.async_decode is not None:  # else resolved with async_decode
                self.draw_in_graph = value == "1" or (value == "" and self.async_decode)
        if self.draw_in_graph is not None and not isinstance(self.draw_in_graph, bool):
            raise TypeError(f"EngineConfig.draw_in_graph must be True, False or None, got {self.draw_in_graph!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            value = self.enable_prefix_caching
            raise TypeError(f"EngineConfig.enable_prefix_caching must be True or False, got {value!r}")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0.0 < u <= 1.0:
            raise ValueError(f"EngineConfig.gpu_memory_utilization must be in (0, 1], got {u!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"EngineConfig.max_model_len must be >= 2, got {self.max_model_len!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs})"
                " so every running sequence can decode each step"
            )
        if self.cuda_graph_batch_sizes is not None:
            sizes = list(self.cuda_graph_batch_sizes)
            bad = [s for s in sizes if isinstance(s, bool) or not isinstance(s, int) or s < 1]
            if not sizes or bad:
                raise ValueError(
                    f"EngineConfig.cuda_graph_batch_sizes must be a non-empty list of positive integers, got {sizes!r}"
                )
            self.cuda_graph_batch_sizes = tuple(sorted(set(sizes)))
        if self.cuda_graph_token_sizes is not None:
            sizes = list(self.cuda_graph_token_sizes)
            bad = [s for s in sizes if isinstance(s, bool) or not isinstance(s, int) or s < 1]
            if bad:
                raise ValueError(
                    "EngineConfig.cuda_graph_token_sizes must be a list of positive integers (empty: none), "
                    f"got {sizes!r}"
                )
            self.cuda_graph_token_sizes = tuple(sorted(set(sizes)))

    def resolved(self, on_cuda: bool) -> EngineConfig:
        """This config with ``async_decode`` (and ``draw_in_graph`` after it) decided for a model on CUDA or not:
        the default (``None``) is on where it can run and has something to overlap (a CUDA device, CUDA graphs, the
        invariant attention and logprobs kernels). A config whose ``async_decode`` is set comes back as it is."""
        if self.async_decode is not None:
            return self
        runs = on_cuda
        if runs:
            try:
                self._check_async_decode()
            except ValueError:
                runs = False
        return dataclasses.replace(self, async_decode=runs)

    def _check_async_decode(self) -> None:
        if self.enforce_eager:
            raise ValueError(
                "EngineConfig.async_decode=True needs the padded steps CUDA graphs replay, got enforce_eager=True "
                "(an eager step keeps the host launching kernels while the device runs them: nothing to overlap)"
            )
        with vk.use_backend(self.backend):
            fast = [op for op in ("attention", "logprobs") if vk.get_backend(op) != "invariant"]
        if fast:
            raise ValueError(
                f"EngineConfig.async_decode=True needs the invariant attention and logprobs kernels, got "
                f"backend={self.backend!r} ({', '.join(fast)} fast: those read a step's layout on the host, which "
                "waits for the step before it)"
            )

    def graph_batch_sizes(self, on_cuda: bool) -> list[int]:
        """The padded decode sizes in force: none when eager (or on CPU without an explicit list)."""
        if self.enforce_eager or (self.cuda_graph_batch_sizes is None and not on_cuda):
            return []
        listed = list(self.cuda_graph_batch_sizes or DEFAULT_GRAPH_BATCH_SIZES)
        if not self.cuda_graph_batch_sizes:  # the defaults reach max_num_seqs: no decode step runs eagerly
            listed += list(range(listed[-1] + GRAPH_BATCH_STEP_LARGE, self.max_num_seqs, GRAPH_BATCH_STEP_LARGE))
            if self.max_num_seqs > listed[-1]:
                listed.append(self.max_num_seqs)
        sizes = [s for s in listed if s <= self.max_num_seqs]
        if self.max_num_seqs < max(listed) and self.max_num_seqs not in sizes:
            sizes.append(self.max_num_seqs)
        return sizes

    def graph_token_sizes(self, on_cuda: bool) -> list[int]:
        """The padded token counts of steps with prompt tokens in force: none when eager (or on CPU without an
        explicit list); the default buckets end at ``max_num_batched_tokens``."""
        if self.enforce_eager or (self.cuda_graph_token_sizes is None and not on_cuda):
            return []
        if self.cuda_graph_token_sizes is not None:
            return list(self.cuda_graph_token_sizes)
        # the last size is the budget itself: no step has more tokens, and the KV cache is sized for a step of that
        # many (LLMEngine: twice the activation peak of such a step, once for the graphs' pool)
        sizes, t = [], GRAPH_TOKEN_STEP
        while t < self.max_num_batched_tokens:
            sizes.append(t)
            t += GRAPH_TOKEN_STEP if t < GRAPH_TOKEN_STEP_UNTIL else GRAPH_TOKEN_STEP_LARGE
        return sizes + [self.max_num_batched_tokens]
