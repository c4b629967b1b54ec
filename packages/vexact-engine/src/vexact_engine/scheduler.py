"""Who runs this step: continuous batching with chunked prefill under a token budget, preemption by recompute.

Each step, running sequences are served first, in arrival order: a decoding sequence gets one token, a sequence
still in prefill gets its next chunk. When the KV cache cannot hold a sequence's next tokens, the most recently
admitted running sequence is preempted: its pages are freed and it goes back to the front of the queue, keeping the
tokens it has generated; it will be recomputed from scratch (same numerics, so the same KV and the same logprobs).
Waiting sequences are then admitted while the budget, ``max_num_seqs`` and free pages allow.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .block_manager import BlockManager
from .config import EngineConfig
from .sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the sequence, so the step samples its next token."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.config = config
        self.blocks = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

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
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed, budget)
            while not self.blocks.can_allocate(seq, seq.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            self.blocks.allocate(seq, seq.num_computed_tokens + n)
            out.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1
        if preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_uncomputed, budget)
            if n < seq.num_uncomputed and not self.config.enable_chunked_prefill:
                break
            if not self.blocks.can_allocate(seq, seq.num_computed_tokens + n):
                break
            self.waiting.popleft()
            self.blocks.allocate(seq, seq.num_computed_tokens + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.append(ScheduledSeq(seq, n))
            budget -= n
        return out

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.blocks.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
