"""One request's state as it moves through the engine."""

from __future__ import annotations

import enum

from .sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, seed: int, arrival: int):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.params = params
        self.seed = seed
        self.arrival = arrival
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.block_table: list[int] = []
        self.block_content_ids: list[int] = []  # prefix-cache content ids of the full pages of block_table
        self.num_cached_tokens: int | None = None  # prompt tokens reused from the prefix cache at first admission
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        # the scheduler's item for a decode step of this sequence (one new token, which samples), reused every step:
        # making 256 of them a step cost ~70 us of host time at a batch of 256
        self.decode_item = None
        # EngineConfig.async_decode: tokens drawn by launched steps that the host has not read back yet (0 or 1 when
        # a step is scheduled), and the row of the last launched step's drawn tokens that holds the newest of them
        self.num_pending = 0
        self.pending_row = -1

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens the host holds (not the ``num_pending`` still on the device)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def token(self, index: int) -> int:
        """Token ``index`` of prompt + output (one token of :meth:`token_ids`, without building a list)."""
        k = index - len(self.prompt_token_ids)
        return self.output_token_ids[k] if k >= 0 else self.prompt_token_ids[index]

    def token_ids(self, start: int, end: int) -> list[int]:
        n_prompt = len(self.prompt_token_ids)
        out = self.prompt_token_ids[start:end]
        if end > n_prompt:
            out = out + self.output_token_ids[max(0, start - n_prompt) : end - n_prompt]
        return out

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )
