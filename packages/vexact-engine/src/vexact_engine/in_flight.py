"""A launched step the host has not read back yet: what ``EngineConfig.async_decode`` keeps in flight.

With ``async_decode`` the engine launches step N+1 before it reads step N's tokens, so the host prepares a step while
the device runs the one before it. Two pieces make that work, both used by ``model_runner`` and ``cuda_graphs``:

- :class:`LaunchedStep`: a step's drawn tokens and logprobs on their way to the host. Their copy is queued behind
  the step (into pinned memory on CUDA, so queueing it does not wait for the step) with an event that the engine
  waits on when it reconciles the step, one step later. Without ``async_decode`` the copy is read at once, as a
  plain blocking copy.
- :func:`feed_drawn`: a row whose input token the host does not have yet (drawn by the step still in flight) goes in
  with a placeholder id, and the device writes the drawn token over it before the step runs. The host learns the
  token one step later, the device has it in time: the same input ids as a step prepared after the read.
"""

from __future__ import annotations

import torch

from .scheduler import ScheduledSeq


class LaunchedStep:
    """The sequences that sample in a launched step and their ``[2, >= S]`` float64 tokens-and-logprobs rows (fp32
    logprobs and token ids below 2**53 are exact in float64: one copy for both), on their way to the host."""

    __slots__ = ("items", "_host", "_event")

    def __init__(self, items: list[ScheduledSeq], both: torch.Tensor | None, read_later: bool):
        self.items = items
        self._event = None
        if both is None or not items:
            self._host = None
        elif read_later and both.is_cuda:
            self._host = both.to("cpu", non_blocking=True)  # a pinned host tensor: queueing the copy does not wait
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = both.cpu()

    def results(self) -> list[tuple[ScheduledSeq, int, float]]:
        """``(item, token, logprob)`` for each sequence that samples; waits for the step on CUDA."""
        if self._host is None:
            return []
        if self._event is not None:
            self._event.synchronize()
        n = len(self.items)
        tokens = [int(t) for t in self._host[0, :n].tolist()]
        return list(zip(self.items, tokens, self._host[1, :n].tolist(), strict=True))


def feed_drawn(ids: torch.Tensor, dst: torch.Tensor, src: torch.Tensor, drawn: torch.Tensor) -> None:
    """``ids[dst[i]] = drawn[src[i]]`` on the device: the tokens the last launched step drew (``drawn [S]`` int64),
    as the input ids of the rows that read them (``dst``, ``src``: int64 index tensors of one length)."""
    ids.index_copy_(0, dst, drawn.index_select(0, src))
