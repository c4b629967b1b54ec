from __future__ import annotations

import torch
from torch import nn

import vexact_kernels as vk


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # one host read for min and max; a CUDA graph capture (which cannot read the device) skips the check
        ids = vk.tensor_range(input_ids)
        if ids is not None and (ids[0] < 0 or ids[1] >= self.vocab_size):
            bad = input_ids[(input_ids < 0) | (input_ids >= self.vocab_size)][0].item()
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        return self.weight[input_ids]


class LMHead(nn.Module):
    """Final norm + lm_head as one unit: the only place logits and logprobs come from (engine and trainer alike)."""

    def __init__(self, vocab_size: int, hidden_size: int, eps: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype))

    def logits(self, hidden: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[T, V]`` from pre-norm hidden states."""
        return vk.compute_logits(hidden, norm_weight, self.eps, self.weight)

    def logprobs(
        self,
        hidden: torch.Tensor,
        norm_weight: torch.Tensor,
        targets: torch.Tensor,
        temperature: float | torch.Tensor = 1.0,
        chunk_size: int = 1024,
        with_entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return vk.logprobs_from_hidden(
            hidden, norm_weight, self.eps, self.weight, targets, temperature, chunk_size, with_entropy
        )

    def sample(
        self, hidden: torch.Tensor, norm_weight: torch.Tensor, temperature: float | torch.Tensor, seeds: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens [T], logprobs [T])`` drawn from pre-norm hidden rows with per-row int64 ``seeds`` (no top-k /
        top-p); the logprob is :meth:`logprobs`' for the drawn token, bit for bit."""
        return vk.sample_from_hidden(hidden, norm_weight, self.eps, self.weight, temperature, seeds)
