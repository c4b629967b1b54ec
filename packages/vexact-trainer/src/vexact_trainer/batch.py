"""Packed batches: sequences laid end to end, no padding."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vexact_models import AttentionMetadata


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata  # packed layout (cu_seqlens)
    targets: torch.Tensor  # [T] next token of each position (0 at a sequence's last position)
    prompt_lens: list[int]
    seq_lens: list[int]

    @property
    def cu_seqlens(self) -> torch.Tensor:
        return self.meta.cu_seqlens

    def to(self, device: torch.device | str) -> PackedBatch:
        meta = AttentionMetadata(cu_seqlens=self.meta.cu_seqlens.to(device))
        return PackedBatch(
            self.input_ids.to(device),
            self.positions.to(device),
            meta,
            self.targets.to(device),
            self.prompt_lens,
            self.seq_lens,
        )


def pack(prompts: list[list[int]], responses: list[list[int]], vocab_size: int, max_len: int) -> PackedBatch:
    """Pack ``prompt + response`` sequences; validates lengths and token ids with errors naming the sequence."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    if not prompts:
        raise ValueError("empty batch: no sequences to score")
    seqs, prompt_lens = [], []
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        p = p.tolist() if isinstance(p, torch.Tensor) else list(p)
        r = r.tolist() if isinstance(r, torch.Tensor) else list(r)
        if not p:
            raise ValueError(f"sequence {i}: prompt is empty")
        s = p + r
        if len(s) > max_len:
            raise ValueError(f"sequence {i} has {len(s)} tokens; the model's max length is {max_len}")
        bad = [t for t in s if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"sequence {i}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        seqs.append(s)
        prompt_lens.append(len(p))
    lens = [len(s) for s in seqs]
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.int64)
    pos = torch.cat([torch.arange(n) for n in lens])
    targets = torch.cat([torch.tensor(s[1:] + [0], dtype=torch.int64) for s in seqs])
    return PackedBatch(ids, pos, AttentionMetadata.packed(lens), targets, prompt_lens, lens)
