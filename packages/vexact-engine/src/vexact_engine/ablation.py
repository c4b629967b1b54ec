"""Mismatch injection: a study tool that makes the engine disagree with the trainer on purpose, by a known amount.

Serving never needs it; an engine takes one only when asked (``LLM(..., mismatch=MismatchInjection(...))``, or the
same fields as keywords). With it on, every row samples from perturbed fp32 logits, and the reported logprob is the
engine's own log_softmax of those logits, so a trainer sees a mismatch that grows from exactly 0 with the setting.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from .seeds import token_seed

LM_HEAD_DTYPES = ("float32", "bfloat16", "float16")
NOISE_SALT = 0x7E5A  # the logit noise of a token is drawn from a stream apart from its sampling draw


@dataclass(frozen=True)
class MismatchInjection:
    """``logit_noise_std``: Gaussian noise of this standard deviation on the fp32 sampling logits, seeded per request
    and token (a row's noise depends on nothing else in the batch). ``lm_head_dtype``: the lm_head's output rounded
    to this dtype before sampling. Both off by default; validated at construction."""

    logit_noise_std: float = 0.0
    lm_head_dtype: str = "float32"

    def __post_init__(self) -> None:
        noise = self.logit_noise_std
        if isinstance(noise, bool) or not isinstance(noise, (int, float)) or not 0.0 <= noise < math.inf:
            raise ValueError(f"MismatchInjection.logit_noise_std must be a finite number >= 0, got {noise!r}")
        if self.lm_head_dtype not in LM_HEAD_DTYPES:
            raise ValueError(
                f"MismatchInjection.lm_head_dtype must be one of {LM_HEAD_DTYPES}, got {self.lm_head_dtype!r}"
            )

    @property
    def active(self) -> bool:
        return self.logit_noise_std > 0 or self.lm_head_dtype != "float32"

    def apply(self, logits: torch.Tensor, seeds: list[int], indices: list[int]) -> torch.Tensor:
        """fp32 ``logits [S, V]`` rounded to ``lm_head_dtype``, plus ``N(0, logit_noise_std^2)`` noise drawn per row
        from a generator seeded by (request seed, token index)."""
        logits = logits.to(getattr(torch, self.lm_head_dtype)).float()
        if self.logit_noise_std > 0:
            noise = torch.empty_like(logits)
            gen = torch.Generator(device=logits.device)
            for i, (seed, index) in enumerate(zip(seeds, indices, strict=True)):
                noise[i].normal_(generator=gen.manual_seed(token_seed(seed ^ NOISE_SALT, index)))
            logits = logits + self.logit_noise_std * noise
        return logits


FIELDS = tuple(f.name for f in dataclasses.fields(MismatchInjection))


def take_mismatch(mismatch: MismatchInjection | None, settings: dict) -> MismatchInjection | None:
    """The engine's injection: ``mismatch``, or one built from :data:`FIELDS` given among the engine's keyword
    ``settings`` (removed from them); None when neither asks for one."""
    given = {name: settings.pop(name) for name in FIELDS if name in settings}
    if given and mismatch is not None:
        raise TypeError(f"pass either mismatch=MismatchInjection(...) or its fields {sorted(given)}, not both")
    if given:
        mismatch = MismatchInjection(**given)
    if mismatch is not None and not isinstance(mismatch, MismatchInjection):
        raise TypeError(f"mismatch must be a MismatchInjection, got {type(mismatch).__name__}")
    return mismatch if mismatch is not None and mismatch.active else None
