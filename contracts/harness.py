"""Reusable checks, so each contract can also be shown failing on a deliberately perturbed op."""

from __future__ import annotations

from collections.abc import Callable

import torch


def row_invariance_violations(
    op: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, subsets: list[list[int]]
) -> list[int]:
    """Rows whose result differs (bitwise) between the full batch and each sub-batch (incl. each row alone)."""
    full = op(x)
    bad = set()
    for rows in [[i] for i in range(min(len(x), 8))] + subsets:
        part = op(x[rows])
        for j, r in enumerate(rows):
            if not torch.equal(part[j], full[r]):
                bad.add(r)
    return sorted(bad)


def logprob_mismatches(engine_outputs, trainer_logprobs) -> list[tuple[str, int]]:
    """(request_id, n_mismatched_tokens) for every request whose logprobs are not torch.equal."""
    out = []
    for o, lp in zip(engine_outputs, trainer_logprobs, strict=True):
        lp = lp.cpu()
        if not torch.equal(o.logprobs, lp):
            n = o.logprobs.numel() if o.logprobs.shape != lp.shape else int((o.logprobs != lp).sum())
            out.append((o.request_id, n))
    return out


# Qwen3-0.6B's HF config shapes, for the GPU-target contracts that run a real-sized model with random weights.
QWEN3_06B = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1_000_000.0,
    tie_word_embeddings=True,
)  # fmt: skip

# Qwen3-1.7B's HF config shapes (same use as QWEN3_06B).
QWEN3_17B = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1_000_000.0,
    tie_word_embeddings=True,
)  # fmt: skip
