"""Who owns which KV pages. A sequence's block table maps its position p to slot table[p // B] * B + p % B."""

from __future__ import annotations

from collections import deque

from .sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether ``seq`` can hold ``num_tokens`` tokens of KV after allocating the pages it lacks."""
        return self.blocks_for(num_tokens) - len(seq.block_table) <= self.num_free

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        if need > self.num_free:
            raise RuntimeError(f"KV cache exhausted: {seq.request_id} needs {need} pages, {self.num_free} free")
        for _ in range(max(0, need)):
            seq.block_table.append(self.free_blocks.popleft())

    def free(self, seq: Sequence) -> None:
        self.free_blocks.extend(seq.block_table)
        seq.block_table = []

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
