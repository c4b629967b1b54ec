"""Per-step attention layout: one small object instead of many arguments.

Two layouts, the only thing that differs between the trainer and the engine:
- packed (training, scoring): sequences laid end to end, ``cu_seqlens [B+1]`` marks their boundaries;
- paged (inference): each sequence brings ``n_q`` new tokens (a prefill chunk or one decode token) whose K/V are
  written at ``slot_mapping`` and which attend over ``context_lens`` cached positions through ``block_tables``.

What the kernels derive from a layout (int32 copies, tile tables) is made once per step and shared by every layer
through :meth:`AttentionMetadata.per_step`, not rebuilt in each layer.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    cu_seqlens: torch.Tensor  # [B+1] query boundaries (packed: whole sequences; paged: new tokens per sequence)
    slot_mapping: torch.Tensor | None = None  # [T] flat KV slot of each new token (paged only)
    block_tables: torch.Tensor | None = None  # [B, max_pages] page ids (paged only)
    context_lens: torch.Tensor | None = None  # [B] KV length including the new tokens (paged only)
    _derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)

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

    def per_step(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """``make()``, made at the first call for ``key`` and returned again to every later one (every layer of the
        step): for values derived from this layout only. Made anew when a layout tensor has been replaced or written
        in place since, and when a CUDA graph capture starts or ends in between: a capture must record the work, not
        read a tensor made outside it (by the warm-up run before it, say). So a metadata object serves one capture at
        most: a second capture must get its own (as the engine's captures do, one per batch size)."""
        stamp = self._stamp()
        hit = self._derived.get(key)
        if hit is not None and _same_stamp(hit[0], stamp):
            return hit[1]
        value = make()
        self._derived[key] = (stamp, value)
        return value

    def _stamp(self) -> tuple:
        tensors = (self.cu_seqlens, self.slot_mapping, self.block_tables, self.context_lens)
        capturing = any(t is not None and t.is_cuda for t in tensors) and torch.cuda.is_current_stream_capturing()
        return tensors, tuple(_version(t) for t in tensors), capturing


def _version(t: torch.Tensor | None) -> object:
    if t is None:
        return None
    try:
        return t._version  # bumped by every in-place write
    except RuntimeError:  # an inference-mode tensor keeps no version: never reuse what was derived from it
        return object()


def _same_stamp(a: tuple, b: tuple) -> bool:
    return all(x is y for x, y in zip(a[0], b[0], strict=True)) and a[1] == b[1] and a[2] == b[2]
