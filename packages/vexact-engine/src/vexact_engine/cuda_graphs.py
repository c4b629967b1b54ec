"""Padded steps from static buffers, and their CUDA graphs: the part of :class:`~vexact_engine.ModelRunner` that
makes a step a fixed shape so that it can replay a captured graph.

Steps can run padded to a fixed shape from static buffers (:class:`StaticStep`): as CUDA graphs on CUDA, eagerly
(same buffers, same padding, no capture) on CPU. A decode step pads to the next captured batch size: a pad row writes
no KV (slot -1), reads one valid page (context 1) and is dropped. A step with prompt tokens pads to the next captured
token count, in a fixed number of sequence slots: the pad tokens form one sequence that writes no KV, the slots after
it are empty sequences (no query, no key). Every kernel is row-invariant and a sequence's attention reads only its
own keys, so padding never changes a real row's numerics. Steps with prompt tokens run padded only over the
invariant attention kernels (the ``fast`` ones read the step's layout on the host).

With ``EngineConfig.draw_in_graph``, a padded decode step whose rows all take the fused draw also draws from the
static buffers (each row's seed and temperature sit beside its token): a second graph on CUDA, replayed right after
the decode graph, and one copy back for tokens and logprobs. The draw is row-invariant too, so a pad row (seed 0,
temperature 1) changes no real row's token or logprob.

The graphs are captured at start-up and after every ``wake_up`` (the KV cache comes back at new addresses), all at
once or lazily (``EngineConfig.graph_recapture``), largest first into one shared memory pool.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
from tqdm.auto import tqdm

import vexact_kernels as vk
from vexact_models import AttentionMetadata

from .block_manager import BlockManager
from .config import EngineConfig
from .in_flight import feed_drawn
from .sampler import token_seeds
from .scheduler import ScheduledSeq
from .step_inputs import step_lists

log = logging.getLogger("vexact_engine")

# Eager warm-up runs of each shape before its capture (speed only): the first capture of a runner compiles the Triton
# kernels of every shape and makes the lazily allocated buffers (two runs: the second is the steady state); a
# re-capture (every wake_up, the KV cache at new addresses) finds both done, and one run primes the new side stream.
WARMUPS_FIRST_CAPTURE = 2
WARMUPS_RECAPTURE = 1
# EngineConfig.decode_streams = 2: decode steps of at least this many rows run as two half-batch forwards
DECODE_STREAMS_MIN_ROWS = 128


class CudaGraphs:
    """The padded steps of a :class:`~vexact_engine.ModelRunner` (which sets the attributes these methods read:
    ``graph_sizes``, ``token_sizes``, ``prompt_seqs``, the static buffers, the graphs and their counters)."""

    # A pad row of a padded decode step: token 0 at position 0, KV slot -1 (write_kv_cache skips it), context 1.
    PAD_ROW = (0, 0, -1, 1)

    def _init_graphs(self, config: EngineConfig) -> None:
        """The padded sizes in force and the (empty) graphs; ``allocate`` then fills the static buffers and
        captures."""
        on_cuda = self.device.type == "cuda"
        self.graph_sizes = config.graph_batch_sizes(on_cuda)
        # steps with prompt tokens run padded only over the invariant attention kernels (module doc)
        with vk.use_backend(config.backend):
            self.token_sizes = config.graph_token_sizes(on_cuda) if vk.get_backend("attention") == "invariant" else []
        # Sequence slots of a padded step with prompt tokens: the batch, one pad sequence, never equal to a token
        # count (FA4 takes a step with as many queries as sequences for a decode step).
        self.prompt_seqs = config.max_num_seqs + 1
        while self.prompt_seqs in self.token_sizes:
            self.prompt_seqs += 1
        # a size no step can fill has no valid warm-up layout either (_warm_layout): more tokens than slots of
        # max_model_len each
        self.max_context = self.max_pages * config.block_size  # the longest sequence a block-table row can hold
        self.token_sizes = [t for t in self.token_sizes if -(-t // self.prompt_seqs) <= self.max_context]
        self.draw_in_graph = self._draws_from_static(config)
        self._graphs: dict[tuple[str, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._uncaptured: set[tuple[str, int]] = set()  # graphs a lazy re-capture leaves to their first step
        self._graph_pool = None
        self._decode: StaticStep | None = None
        self._prompt: StaticStep | None = None
        self._prompt_out: torch.Tensor | None = None
        self._draws: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # decode size -> its draw graph
        self.num_graph_draws = 0  # padded decode steps that drew from the static buffers (a graph on CUDA)
        self.num_padded_steps = 0  # decode steps run padded (replayed as a graph on CUDA)
        self.num_padded_prompt_steps = 0  # steps with prompt tokens run padded (replayed as a graph on CUDA)
        self.graph_error: str | None = None  # why capture failed, when it did (steps then run eagerly)
        self.capture_seconds = 0.0  # time spent capturing graphs since the last allocate (start-up or wake_up)
        # device memory the captures reserved since the last allocate (the graphs' pool and what their warm-up runs
        # left in the caching allocator): memory the KV cache had to leave free (kv_cache.py reserves one activation
        # peak for it)
        self.capture_reserved_bytes = 0
        self.captures = 0  # captures of the graphs so far (start-up, then one per wake_up)
        self.captured_at_steps = 0  # graphs captured at their first step (lazy re-capture), since the last allocate
        # the linear's form per projection shape, timed before the first capture of each decode size it covers
        # (EngineConfig.tune_linears; speed only), the timings behind them, and the sizes timed
        self.linear_picks: dict = {}
        self.linear_tuning: dict = {}
        self._linears_tuned: set[int] = set()
        self._half_stream: torch.cuda.Stream | None = None  # the second half's stream (EngineConfig.decode_streams)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def _guarded(self, capture, *args) -> None:
        try:
            capture(*args)
        except Exception as e:  # an op that cannot be captured: run eagerly, loudly
            self._drop_graphs(f"{type(e).__name__}: {e}")
            log.warning("CUDA graph capture failed, steps run eagerly (padded): %s", self.graph_error)

    def _drop_graphs(self, why: str) -> None:
        """Forget every graph (steps then run padded and eagerly) and say ``why`` in ``graph_error``."""
        self._graphs.clear()
        self._draws.clear()
        self._uncaptured.clear()
        self._graph_pool = None
        self.graph_error = why

    def _allocate_static(self) -> None:
        if self.graph_sizes:
            size = max(self.graph_sizes)
            draw_rows = size if self.draw_in_graph else 0
            self._decode = StaticStep(size, size, self.max_pages, self.device, draw_rows)
        if self.token_sizes:
            self._prompt = StaticStep(max(self.token_sizes), self.prompt_seqs, self.max_pages, self.device)
        for static in (self._decode, self._prompt):
            if static is not None:  # the host prepares a step while the one before it runs: copies must not wait
                static.pinned = self.async_decode and self.device.type == "cuda"

    def padded_size(self, batch: list[ScheduledSeq]) -> int | None:
        """The static size a step runs at, or None when it runs eagerly (not all one-token steps, or too large)."""
        if not self.graph_sizes or self.kv_caches is None or any(it.num_new_tokens != 1 for it in batch):
            return None
        return next((s for s in self.graph_sizes if s >= len(batch)), None)

    def padded_tokens(self, batch: list[ScheduledSeq]) -> int | None:
        """The static token count a step with prompt tokens runs at (one pad sequence takes the rest), or None when
        it runs eagerly (no size large enough, or a pad longer than a sequence may be)."""
        if not self.token_sizes or self.kv_caches is None or len(batch) >= self.prompt_seqs:
            return None
        n = sum(it.num_new_tokens for it in batch)
        size = next((t for t in self.token_sizes if t >= n), None)
        if size is None or size - n > self.max_context:
            return None
        return size

    def _draws_from_static(self, config: EngineConfig) -> bool:
        """Whether padded decode steps may draw from the static buffers (``EngineConfig.draw_in_graph``): the model
        has the fused draw, and on CUDA the logprobs kernels are the invariant ones (the ``fast`` draw reads the
        device on the host, which a capture cannot)."""
        if not config.draw_in_graph or not self.graph_sizes or not hasattr(self.model, "sample"):
            return False
        if getattr(self.model.config, "vocab_size", None) is None:
            return False
        with vk.use_backend(config.backend):
            return self.device.type != "cuda" or vk.get_backend("logprobs") == "invariant"

    def graph_draw_size(self, batch: list[ScheduledSeq]) -> int | None:
        """The padded size a decode step runs at with its draw from the static buffers, or None when it samples
        eagerly (the switch is off, the step runs unpadded, a row does not sample or does not take the fused draw,
        or a mismatch injection is on)."""
        if not self.draw_in_graph or (self.mismatch is not None and self.mismatch.active):
            return None
        size = self.padded_size(batch)
        if size is None:
            return None
        vocab = self.model.config.vocab_size
        for item in batch:
            # draws_whole inline: a call per row was 4x the time of this loop at 256 rows
            p = item.seq.params
            if not item.is_last_chunk or p.temperature == 0 or p.top_p < 1.0 or 0 < p.top_k < vocab:
                return None
        return size

    def _fill_decode(self, batch: list[ScheduledSeq], blocks: BlockManager, size: int, draw: bool = False) -> None:
        # Every item is a one-token step, so the step's lists hold one entry per row; a pad row is a sequence of one
        # token at position 0 that writes no KV (slot -1) and reads one page. ``draw``: each row's draw seed and
        # temperature too (a pad row's: seed 0, temperature 1).
        pad = size - len(batch)
        step = step_lists(batch, blocks, with_tables=False)
        t_id, t_pos, t_slot, t_ctx = self.PAD_ROW
        self._decode.write(
            step["ids"] + [t_id] * pad,
            step["positions"] + [t_pos] * pad,
            step["slots"] + [t_slot] * pad,
            list(range(size + 1)),
            step["ctx"] + [t_ctx] * pad,
            batch,
            size,
            draw_rows(batch, size) if draw else None,
            (step["feed_dst"], step["feed_src"]),
        )
        if step["feed_dst"]:
            self.num_fed_rows += len(step["feed_dst"])
            self._decode.feed_drawn(len(step["feed_dst"]), self._drawn)

    def _fill_prompt(self, batch: list[ScheduledSeq], blocks: BlockManager, size: int) -> list[int]:
        # The pad tokens form one sequence after the real ones (positions 0..P-1, context P, slot -1: no KV written,
        # its keys read from pages its table row names, valid pages whatever they hold); the slots after it are
        # empty sequences (no query, no key). Returns the step's real ``cu``.
        step = step_lists(batch, blocks, with_tables=False)
        cu, n = step["cu"], step["cu"][-1]
        pad, empty = size - n, self.prompt_seqs - len(batch) - 1
        t_id, _, t_slot, _ = self.PAD_ROW
        self._prompt.write(
            step["ids"] + [t_id] * pad,
            step["positions"] + list(range(pad)),
            step["slots"] + [t_slot] * pad,
            cu + [size] * (empty + 1),
            step["ctx"] + [pad] + [0] * empty,
            batch,
            self.prompt_seqs,
            feed=(step["feed_dst"], step["feed_src"]),
        )
        if step["feed_dst"]:
            self.num_fed_rows += len(step["feed_dst"])
            self._prompt.feed_drawn(len(step["feed_dst"]), self._drawn)
        return cu

    def _replay(self, key: tuple[str, int], static: StaticStep, tokens: int, seqs: int) -> torch.Tensor:
        graph = self._graphs.get(key)
        if graph is not None:
            graph[0].replay()
            return graph[1]
        return self._step_forward(key, *static.args(tokens, seqs))

    def _step_forward(self, key: tuple[str, int], ids, pos, meta: AttentionMetadata) -> torch.Tensor:
        """A padded step's forward (its hidden rows): a decode step of at least ``DECODE_STREAMS_MIN_ROWS`` rows
        with ``EngineConfig.decode_streams = 2`` as two forwards of half the rows (on two streams while a CUDA graph
        is captured, else one after the other), every other step as one forward."""
        rows = ids.shape[0]
        if key[0] != "decode" or self.config.decode_streams == 1 or rows < DECODE_STREAMS_MIN_ROWS:
            return self.model(ids, pos, meta, self.kv_caches)
        half = rows // 2
        cu = meta.cu_seqlens  # a decode step's: 0, 1, ..., rows (one token a sequence), so its head serves both halves
        parts = [
            (ids[s], pos[s], AttentionMetadata(cu_seqlens=c, slot_mapping=meta.slot_mapping[s],
                                               block_tables=meta.block_tables[s], context_lens=meta.context_lens[s]))
            for s, c in ((slice(0, half), cu[: half + 1]), (slice(half, rows), cu[: rows - half + 1]))
        ]  # fmt: skip
        if self.device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            return torch.cat([self.model(*part, self.kv_caches) for part in parts])
        if self._half_stream is None:
            self._half_stream = torch.cuda.Stream(self.device)
        main, side = torch.cuda.current_stream(self.device), self._half_stream
        side.wait_stream(main)
        first = self.model(*parts[0], self.kv_caches)
        with torch.cuda.stream(side):
            second = self.model(*parts[1], self.kv_caches)
        main.wait_stream(side)
        return torch.cat([first, second])

    def _warm_layout(self, static: StaticStep, tokens: int, seqs: int) -> None:
        """A valid step of pad tokens only (no KV written) for a warm-up and capture: the tokens split evenly over
        the sequences, each at positions 0.. of its own."""
        lens = [tokens // seqs + (1 if i < tokens % seqs else 0) for i in range(seqs)]
        t_id, _, t_slot, _ = self.PAD_ROW
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        positions = [p for n in lens for p in range(n)]
        draw = draw_rows([], seqs) if static.draw_rows else None
        static.write([t_id] * tokens, positions, [t_slot] * tokens, cu, lens, [], seqs, draw)

    def _shapes(self) -> list[tuple[tuple[str, int], StaticStep, int, int]]:
        """Every graph's (key, static buffers, tokens, sequences): the token counts of the steps with prompt tokens,
        then the decode sizes, each largest first (the order of an eager capture)."""
        shapes = [(("prompt", t), self._prompt, t, self.prompt_seqs) for t in sorted(self.token_sizes, reverse=True)]
        return shapes + [(("decode", s), self._decode, s, s) for s in sorted(self.graph_sizes, reverse=True)]

    def _capture_all(self, lazy: bool = False) -> None:
        """Capture one graph per token count of the steps with prompt tokens and one per decode size, largest
        first, sharing one memory pool (they never run together). A graph of prompt tokens copies its hidden rows
        to one static buffer, so no graph's output holds pool memory another graph reuses. ``lazy``: only the
        largest of each kind; the others wait in ``_uncaptured`` for their first step (:meth:`_ensure_graph`)."""
        self._graph_pool = torch.cuda.graph_pool_handle()
        shapes = self._shapes()
        self._uncaptured = set()
        if lazy:
            largest = {("prompt", max(self.token_sizes, default=0)), ("decode", max(self.graph_sizes, default=0))}
            self._uncaptured = {key for key, *_ in shapes if key not in largest}
            shapes = [shape for shape in shapes if shape[0] in largest]
        start, reserved = time.perf_counter(), torch.cuda.memory_reserved(self.device)
        warmups = WARMUPS_RECAPTURE if self.captures else WARMUPS_FIRST_CAPTURE
        bar = tqdm(shapes, desc="capturing CUDA graphs", unit="graph", leave=False)
        for shape in bar:
            self._capture(*shape, warmups)
        torch.cuda.synchronize(self.device)
        # at start-up and at every wake_up (the KV cache comes back at new addresses)
        self.capture_seconds = time.perf_counter() - start
        self.capture_reserved_bytes = torch.cuda.memory_reserved(self.device) - reserved
        self.captures += 1
        log.info(
            "captured %d CUDA graphs in %.1f s, %d warm-up run(s) each (decode batch sizes %s, token counts %s)%s",
            len(self._graphs), self.capture_seconds, warmups, sorted(self.graph_sizes), sorted(self.token_sizes),
            f"; {len(self._uncaptured)} more at their first step" if self._uncaptured else "",
        )  # fmt: skip

    def _capture(self, key: tuple[str, int], static: StaticStep, tokens: int, seqs: int, warmups: int) -> None:
        """One graph: ``warmups`` eager runs of a pad-only step (they compile the Triton kernels for the shape and
        write no KV), then the capture into the shared pool. Writes the static buffers: a step fills them after."""
        with vk.use_backend(self.config.backend), torch.no_grad():
            self._warm_layout(static, tokens, seqs)
            ids, pos, meta = static.args(tokens, seqs)
            if key[0] == "decode":
                self._tune_linears(tokens, ids, pos, meta)
            with vk.linear_picks(self.linear_picks):
                self._capture_graph(key, ids, pos, meta, static, tokens, warmups)

    def _tune_linears(self, tokens: int, ids, pos, meta) -> None:
        """Before a decode size's first capture (``EngineConfig.tune_linears``, at least
        ``EngineConfig.tune_linears_min_rows`` rows, by default ``LINEAR_TUNE_MIN_M``): one eager pad-only step notes
        its matmuls, whose forms are then timed on this GPU (``vk.tune_linears``); the picks join ``linear_picks``,
        which the captures run under."""
        least = self.config.tune_linears_min_rows or vk.LINEAR_TUNE_MIN_M
        if not self.config.tune_linears or tokens < least or tokens in self._linears_tuned:
            return
        start = time.perf_counter()
        self._linears_tuned.add(tokens)
        try:
            with vk.record_linears(least) as calls:
                self._step_forward(("decode", tokens), ids, pos, meta)
            picks, report = vk.tune_linears(calls)
        except Exception as e:  # speed only: the default pick serves every shape
            log.warning("decode size %d: timing the linear's forms failed (%s: %s); the default pick stays", tokens,
                        type(e).__name__, e)  # fmt: skip
            return
        self.linear_picks.update(picks)
        self.linear_tuning.update(report)
        log.info(
            "decode size %d: the linear's forms timed at %d shapes in %.1f s; picked %s",
            tokens, len(report), time.perf_counter() - start,
            {key[1:3]: report[key]["pick"] for key in picks} or "the default everywhere",
        )  # fmt: skip

    def _capture_graph(self, key, ids, pos, meta, static: StaticStep, tokens: int, warmups: int) -> None:
        """The warm-ups and the capture of one graph (in ``_capture``'s backend, without autograd)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmups):
                warm = self._step_forward(key, ids, pos, meta)
        torch.cuda.current_stream().wait_stream(side)
        if key[0] == "prompt" and self._prompt_out is None:  # as many rows as the largest token count
            rows = max(self.token_sizes)
            self._prompt_out = torch.empty((rows, *warm.shape[1:]), dtype=warm.dtype, device=self.device)
        del warm
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            out = self._step_forward(key, ids, pos, meta)
            if key[0] == "prompt":
                self._prompt_out[:tokens].copy_(out)
                out = self._prompt_out[:tokens]
        self._graphs[key] = (graph, out)
        if key[0] == "decode" and self.draw_in_graph:
            self._capture_draw(tokens, static, graph, out, warmups, side)

    def _capture_draw(self, size: int, static: StaticStep, decode, hidden: torch.Tensor, warmups: int, side) -> None:
        """The draw graph of decode size ``size``: the fused draw of the decode graph's ``hidden`` rows with the
        static seeds and temperatures (pad rows' after a warm layout), into one ``[2, size]`` float64 output."""
        temps, seeds = static.draw_args(size)
        decode.replay()  # real hidden rows for the warm-ups (a pad-only step: no KV written)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmups):
                self._draw(hidden, temps, seeds)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            out = self._draw(hidden, temps, seeds)
        self._draws[size] = (graph, out)

    def _draw(self, hidden: torch.Tensor, temps: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
        # fp32 logprobs and token ids (< 2**53) are exact in float64: one transfer for both, as in sample_rows_on_device
        tokens, logprobs = self.model.sample(hidden, temps, seeds)
        return torch.stack([tokens.to(torch.float64), logprobs.to(torch.float64)])

    def _replay_draw(self, size: int, hidden: torch.Tensor) -> torch.Tensor:
        draw = self._draws.get(size)
        if draw is not None:
            draw[0].replay()
            return draw[1]
        return self._draw(hidden, *self._decode.draw_args(size))

    def _ensure_graph(self, key: tuple[str, int], static: StaticStep, tokens: int, seqs: int) -> None:
        """Capture ``key``'s graph now if a lazy re-capture left it for its first step; before the step fills the
        static buffers, which the capture's warm-up overwrites."""
        if key not in self._uncaptured:
            return
        self._uncaptured.discard(key)
        start, reserved = time.perf_counter(), torch.cuda.memory_reserved(self.device)
        self._guarded(self._capture, key, static, tokens, seqs, WARMUPS_RECAPTURE)
        torch.cuda.synchronize(self.device)
        self.capture_seconds += time.perf_counter() - start
        self.capture_reserved_bytes += torch.cuda.memory_reserved(self.device) - reserved
        self.captured_at_steps += 1

    def _forward_with_draw(self, batch: list[ScheduledSeq], blocks: BlockManager, size: int) -> torch.Tensor:
        """A padded decode step and its draw from the static buffers (:meth:`graph_draw_size`): the same tokens and
        logprobs as :meth:`forward` then :meth:`sample`, as ``[2, size]`` float64 rows on the device."""
        with vk.use_backend(self.config.backend):
            self._ensure_graph(("decode", size), self._decode, size, size)
            self._fill_decode(batch, blocks, size, draw=True)
            self.num_padded_steps += 1
            self.num_graph_draws += 1
            hidden = self._replay(("decode", size), self._decode, size, size)
            return self._replay_draw(size, hidden)


class StaticStep:
    """The device buffers a padded step reads, at fixed addresses (what its CUDA graphs captured): steps of up to
    ``max_tokens`` query tokens in up to ``max_seqs`` sequences.

    One flat int64 buffer holds the token rows (ids, positions, KV slots) and the sequence rows (``cu`` query
    offsets, context lengths), each starting 128-byte aligned as fresh tensors do (Triton specialises kernels on
    pointer alignment, so the graphs see the pointers eager steps see); a step's values go over in one copy. The
    block tables have a host mirror rewritten only where a row changed: row r holds the pages of the table list last
    written there (kept, with how many of its pages were written). A sequence's table list only grows at its end and
    is replaced, never edited, when its pages change otherwise (preemption, prefix cache), so an unchanged list object
    means its first pages are still right. Converting every table of a 256-row step to a tensor took about 0.5 ms of
    host time per decode step, with the GPU idle meanwhile. Columns past a row's own pages, and the rows of pad and
    empty sequences, hold page ids of earlier steps: always valid pages, never read for a real row.

    With ``async_decode`` the buffer also carries the step's fed rows (which token rows read which drawn token,
    :meth:`feed_drawn`), and on CUDA (``pinned``) every copy goes through pinned memory without blocking the host:
    a copy from pageable memory may wait for the step queued before it.
    """

    def __init__(self, max_tokens: int, max_seqs: int, max_pages: int, device: torch.device, draw_rows: int = 0):
        t, s = -(-max_tokens // 16) * 16, -(-(max_seqs + 1) // 16) * 16
        self.offsets = (0, t, 2 * t, 3 * t, 3 * t + s)  # ids, positions, slots, cu, ctx
        # ``draw_rows`` rows of draw inputs after them: int64 seeds, then fp32 temperatures two to an int64 slot
        self.draw_rows = draw_rows
        d, f = -(-draw_rows // 16) * 16, -(-draw_rows // 32) * 16
        self.draw_offsets = (3 * t + 2 * s, 3 * t + 2 * s + d)
        # the fed rows (async_decode; at most one a sequence): token rows, then the drawn rows they read
        self.feed_offsets = (3 * t + 2 * s + d + f, 3 * t + 3 * s + d + f)
        self.host = torch.zeros(3 * t + 4 * s + d + f, dtype=torch.int64)
        self.host_np = self.host.numpy()
        self.host_np[self.draw_offsets[1] :].view(np.float32)[:] = 1.0  # valid temperatures before any step
        self.buf = torch.empty_like(self.host, device=device).copy_(self.host)  # never the host tensor itself
        self.tables = torch.zeros(max_seqs, max_pages, dtype=torch.int64, device=device)
        self.tables_host = torch.zeros(max_seqs, max_pages, dtype=torch.int64)
        self.tables_np = self.tables_host.numpy()
        self.table_rows: list[tuple[list[int] | None, int]] = [(None, 0)] * max_seqs
        self.pinned = False

    def args(self, tokens: int, seqs: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """``(input_ids, positions, paged AttentionMetadata)``: views of the buffers for ``tokens`` / ``seqs``."""
        o_id, o_pos, o_slot, o_cu, o_ctx = self.offsets
        b = self.buf
        meta = AttentionMetadata(
            cu_seqlens=b[o_cu : o_cu + seqs + 1],
            slot_mapping=b[o_slot : o_slot + tokens],
            block_tables=self.tables[:seqs],
            context_lens=b[o_ctx : o_ctx + seqs],
        )
        return b[o_id : o_id + tokens], b[o_pos : o_pos + tokens], meta

    def draw_args(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(temperatures fp32 [rows], seeds int64 [rows])``: views of the draw rows of the device buffer."""
        o_seed, o_temp = self.draw_offsets
        temps = self.buf[o_temp : o_temp + -(-rows // 2)].view(torch.float32)[:rows]
        return temps, self.buf[o_seed : o_seed + rows]

    def feed_drawn(self, rows: int, drawn: torch.Tensor) -> None:
        """Write the drawn tokens the step's first ``rows`` fed rows read into its input ids (after :meth:`write`)."""
        o_dst, o_src = self.feed_offsets
        b = self.buf
        feed_drawn(b[self.offsets[0] : self.offsets[1]], b[o_dst : o_dst + rows], b[o_src : o_src + rows], drawn)

    def write(self, ids, positions, slots, cu, ctx, batch: list[ScheduledSeq], seqs: int, draw=None, feed=None) -> None:
        """A step's values (plain lists; token rows of one length, ``cu`` one longer than ``ctx``), its draw rows
        (``draw``: seeds and temperatures, or None to leave them), its fed rows (``feed``: token rows and the drawn
        rows they read, or None) and the block tables of ``batch`` (rows ``0..len(batch)-1``), copied to the device
        buffers in one copy (and the tables' changed columns)."""
        h = self.host_np
        for off, values in zip(self.offsets, (ids, positions, slots, cu, ctx), strict=True):
            h[off : off + len(values)] = values
        if draw is not None:
            seeds, temps = draw
            o_seed, o_temp = self.draw_offsets
            h[o_seed : o_seed + len(seeds)] = seeds
            h[o_temp : o_temp + -(-len(temps) // 2)].view(np.float32)[: len(temps)] = temps
        if feed is not None and feed[0]:
            for off, values in zip(self.feed_offsets, feed, strict=True):
                h[off : off + len(values)] = values
        self._to_device(self.buf, self.host)
        rows, tab, width = self.table_rows, self.tables_np, 1
        for r, item in enumerate(batch):
            table = item.seq.block_table
            n = len(table)
            if n > width:
                width = n
            known, done = rows[r]
            if known is table and done == n:  # a decode row inside its last page: nothing new
                continue
            if known is not table or done > n:
                done = 0
            if done < n:
                tab[r, done:n] = table[done:n]
                rows[r] = (table, n)
        self._to_device(self.tables[:seqs, :width], self.tables_host[:seqs, :width])

    def _to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.pinned:  # a pinned copy of the host values: the host may rewrite its own right after
            dst.copy_(src.contiguous().pin_memory(), non_blocking=True)
        else:
            dst.copy_(src)


def draw_rows(batch: list[ScheduledSeq], size: int) -> tuple[np.ndarray, np.ndarray]:
    """The draw rows of a padded decode step of ``size`` rows: each sequence's seed for its next token
    (:func:`~vexact_engine.sampler.token_seeds`) and its temperature as fp32 (what ``sample_rows_on_device`` takes),
    then pad rows (seed 0, temperature 1)."""
    seeds = np.zeros(size, dtype=np.int64)
    temps = np.ones(size, dtype=np.float32)
    if batch:
        seqs = [item.seq for item in batch]
        seeds[: len(seqs)] = token_seeds(
            [q.seed for q in seqs], [len(q.output_token_ids) + q.num_pending for q in seqs]
        )
        temps[: len(seqs)] = [q.params.temperature for q in seqs]
    return seeds, temps
