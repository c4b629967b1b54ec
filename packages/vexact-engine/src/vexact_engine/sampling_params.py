from __future__ import annotations

import math
from dataclasses import dataclass, field

MIN_TEMPERATURE = 1e-5  # the smallest positive temperature (vLLM treats those below it as greedy)


@dataclass
class SamplingParams:
    """How to sample one request.

    ``temperature == 0`` is greedy (argmax); its reported logprobs are at temperature 1, so a trainer scores greedy
    rollouts at temperature 1 (``vexact_trainer.Actor`` refuses 0, which has no logprobs). Otherwise the reported
    logprob of a token is ``log_softmax(logits / temperature)`` over the full vocabulary, exactly what the trainer
    computes; top-k / top-p only restrict which tokens can be drawn. ``seed`` makes the draw reproducible whatever
    else is in the batch (``None``: the engine derives one from its own seed and the request's arrival order).
    """

    temperature: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k
    top_p: float = 1.0
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        # NaN fails every comparison (so passes `< 0`), and the sampler would then draw it at temperature 1
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if 0 < t < MIN_TEMPERATURE:  # logits / t would overflow fp32 (inf - inf: NaN logprobs)
            raise ValueError(f"temperature {t!r} is below {MIN_TEMPERATURE}: logits / temperature overflows; use 0 "
                             "for greedy decoding")  # fmt: skip
        p = self.top_p
        if not isinstance(p, (int, float)) or not math.isfinite(p) or not (0.0 < p <= 1.0):
            raise ValueError(f"top_p must be a finite number in (0, 1], got {p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off), 0 (off) or >= 1, got {self.top_k!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
