"""Per-step attention layout: one small object instead of many arguments.

Two layouts, the only thing that differs between the trainer and the engine:
- packed (training, scoring): sequences laid end to end, ``cu_seqlens [B+1]`` marks their boundaries;
- paged (inference): each sequence brings ``n_q`` new tokens (a prefill chunk or one decode token) whose K/V are
  written at ``slot_mapping`` and which attend over ``context_lens`` cached positions through ``block_tables``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    cu_seqlens: torch.Tensor  # [B+1] query boundaries (packed: whole sequences; paged: new tokens per sequence)
    slot_mapping: torch.Tensor | None = None  # [T] flat KV slot of each new token (paged only)
    block_tables: torch.Tensor | None = None  # [B, max_pages] page ids (paged only)
    context_lens: torch.Tensor | None = None  # [B] KV length including the new tokens (paged only)

    @property
    def paged(self) -> bool:
        return self.block_tables is not None

    @classmethod
    def packed(cls, seq_lens: list[int]) -> AttentionMetadata:
        cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(torch.tensor(seq_lens, dtype=torch.int64), 0)
        return cls(cu_seqlens=cu)

    def __post_init__(self) -> None:
        parts = (self.slot_mapping, self.block_tables, self.context_lens)
        if any(p is None for p in parts) and not all(p is None for p in parts):
            raise ValueError("paged AttentionMetadata needs slot_mapping, block_tables and context_lens together")
