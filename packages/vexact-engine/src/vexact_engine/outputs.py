from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RequestOutput:
    """A finished (or rejected/aborted) request.

    ``logprobs`` is fp32, one per generated token: exactly ``log_softmax(logits / T)`` as the trainer computes it.
    ``finish_reason``: ``stop`` (EOS or a stop token), ``length`` (max_tokens or max_model_len), ``abort``, or
    ``rejected`` (bad input; ``error`` says why and no tokens were generated). ``num_cached_tokens``: prompt tokens
    whose K/V came from the prefix cache when the request was first scheduled.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: torch.Tensor
    finish_reason: str
    text: str | None = None
    error: str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None
