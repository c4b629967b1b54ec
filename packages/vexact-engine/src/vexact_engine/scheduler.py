"""Who runs this step: continuous batching with chunked prefill under a token budget, preemption by recompute.

Each step, running sequences are served first, in arrival order: a decoding sequence gets one token, a sequence
still in prefill gets its next chunk. When the KV cache cannot hold a sequence's next tokens, the most recently
admitted running sequence is preempted: its pages are freed and it goes back to the front of the queue, keeping the
tokens it has generated; it will be recomputed (same numerics, so the same KV and the same logprobs).
Waiting sequences are then admitted while the budget, ``max_num_seqs`` and free pages allow.

With prefix caching (``EngineConfig.enable_prefix_caching``), a sequence being admitted first takes the cached pages
of its longest cached prefix of full pages (``BlockManager.match_prefix``) and is prefilled from there: a chunked
prefill from a cached context. A preempted sequence's full pages stay cached while nothing evicts them, so its
recompute often starts near where it stopped. Every page a step fills is registered as it is scheduled.

With ``EngineConfig.async_decode`` the engine schedules a step while the one before it still runs, so a decoding
sequence may hold a token the host has not read yet (``Sequence.num_pending``): it counts as one of the sequence's
tokens (the step reads it on the device, ``model_runner``), its page is registered one step later (its key needs the
token), and a sequence whose pending token reaches ``max_tokens`` or ``max_model_len`` is not scheduled again (it
finishes when that token is read). One that stops on a stop token is found a step late: its extra row is dropped.
"""

from __future__ import annotations

from collections import deque

from .block_manager import BlockManager
from .config import EngineConfig
from .sequence import Sequence, SequenceStatus


class ScheduledSeq:
    """One sequence's work in a step: ``num_new_tokens`` tokens from ``seq.num_computed_tokens`` on.
    ``is_last_chunk``: the chunk reaches the end of the sequence, so the step samples its next token; fixed when the
    step is scheduled (the scheduler passes it; left out, it is worked out from ``seq``). ``admitted``: the sequence
    is admitted in this step, so the prefix pages it took from the cache may be ones this step's other prompt chunks
    fill (the runner keeps such a row in the launch that writes them). A plain class with slots: a step of 256 decode
    rows makes 256 of them, and a dataclass's ``__post_init__`` would be one more call each."""

    __slots__ = ("seq", "num_new_tokens", "is_last_chunk", "admitted")

    def __init__(self, seq: Sequence, num_new_tokens: int, is_last_chunk: bool | None = None, admitted: bool = False):
        self.seq = seq
        self.num_new_tokens = num_new_tokens
        if is_last_chunk is None:
            is_last_chunk = seq.num_computed_tokens + num_new_tokens == seq.num_tokens
        self.is_last_chunk = is_last_chunk
        self.admitted = admitted

    def __repr__(self) -> str:
        return f"ScheduledSeq({self.seq!r}, num_new_tokens={self.num_new_tokens}, is_last_chunk={self.is_last_chunk})"


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int | None = None):
        self.config = config
        self.blocks = block_manager
        self.max_model_len = max_model_len  # a sequence this long is done (None: no limit here)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # prompt tokens of admitted requests and how many of those came from the prefix cache (first admission);
        # tokens a preempted request got back from the cache when re-admitted
        self.stats = {"prompt_tokens": 0, "cached_prompt_tokens": 0, "recompute_tokens_cached": 0}

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.config.max_num_batched_tokens
        out: list[ScheduledSeq] = []
        preempted = False
        i = 0
        # A decode row needs a page only when it crosses a page boundary and fills a page only when it reaches one:
        # both tests inline (the calls they skip would do nothing), as are the sequence's length and the pages an
        # end needs (``Sequence.num_tokens``, ``BlockManager.blocks_for``): a step of 256 decode rows runs this loop
        # 256 times and the GPU waits for it.
        blocks, running, add = self.blocks, self.running, out.append
        page, caching = blocks.block_size, blocks.enable_prefix_caching
        max_len = self.max_model_len
        while i < len(running) and budget > 0:
            seq = running[i]
            pending = seq.num_pending
            total = len(seq.prompt_token_ids) + len(seq.output_token_ids) + pending
            if pending and (
                len(seq.output_token_ids) + pending >= seq.params.max_tokens or (max_len and total >= max_len)
            ):
                i += 1  # its pending token is its last: it finishes when the engine reads it
                continue
            computed = seq.num_computed_tokens
            n = total - computed
            if n > budget:
                n = budget
            end = computed + n
            if -(-end // page) > len(seq.block_table):
                while not blocks.can_allocate(seq, end):
                    victim = running.pop()
                    self._preempt(victim)
                    preempted = True
                    if victim is seq:
                        break
                if seq.status is not SequenceStatus.RUNNING:
                    break
                blocks.allocate(seq, end)
            if caching and end // page > len(seq.block_content_ids):
                blocks.cache_full_blocks(seq, end - pending)  # a page's key needs its tokens on the host
            if n == 1 and end == total:  # a decode row: the same (immutable) item every step, made once
                item = seq.decode_item
                if item is None:
                    item = seq.decode_item = ScheduledSeq(seq, 1, True)
                add(item)
            else:
                add(ScheduledSeq(seq, n, end == total))
            budget -= n
            i += 1
        if preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending:  # preempted with a token in flight: admitted once the engine has read it
                break
            prefix = self.blocks.match_prefix(seq)  # a waiting sequence holds no pages
            computed = len(prefix) * self.blocks.block_size
            n = min(seq.num_tokens - computed, budget)
            if n < seq.num_tokens - computed and not self.config.enable_chunked_prefill:
                break
            if not self.blocks.can_allocate_with_prefix(seq, prefix, computed + n):
                break
            self.waiting.popleft()
            self.blocks.take_prefix(seq, prefix)
            self.blocks.allocate(seq, computed + n)
            self.blocks.cache_full_blocks(seq, computed + n)
            self._count_admission(seq, computed)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.append(ScheduledSeq(seq, n, computed + n == seq.num_tokens, admitted=True))
            budget -= n
        return out

    def _count_admission(self, seq: Sequence, cached: int) -> None:
        if seq.num_cached_tokens is None:  # first admission
            seq.num_cached_tokens = cached
            self.stats["prompt_tokens"] += len(seq.prompt_token_ids)
            self.stats["cached_prompt_tokens"] += cached
        else:
            self.stats["recompute_tokens_cached"] += cached

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.blocks.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
