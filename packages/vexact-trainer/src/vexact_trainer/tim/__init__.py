"""Training-inference mismatch (TIM) diagnostics: rescore any engine's rollouts with the invariant trainer.

A study tool beside the trainer, not part of training: ``rollouts`` (the input layouts and their checks),
``rescore`` (the trainer's logprobs of the same tokens), ``metrics`` (the comparison) and ``report`` (files).

Three steps, each usable alone:

1. :func:`load_rollouts` reads rollouts in one of :data:`LAYOUTS` into :class:`Rollout` rows (prompt ids, response
   ids, the engine's per-token logprobs and the temperature they were computed at), checking every row (lengths,
   token ids inside the vocabulary, finite logprobs, a temperature) with an error naming the row.
2. :func:`rescore` computes the trainer's logprobs of the same tokens (:meth:`Actor.compute_log_probs`, batched by
   token count, with a progress bar) and, optionally, the trainer's top-1 token at each position.
3. :func:`tim_metrics` compares the two: per-token |delta logprob|, fraction of tokens that differ, KL estimates (k1 and
   K3), chi-square, log-perplexity difference, by position and engine-probability bucket, worst sequences first, and
   greedy flips. :func:`write_report` writes ``summary.json``, PNG plots and one self-contained ``report.html``.

Conventions: ``a`` is the engine's (rollout) logprob of a sampled token, ``b`` the trainer's, ``d = b - a``;
the tokens were drawn from the engine, so ``mean(a - b)`` (k1) and ``mean(exp(d) - 1 - d)`` (K3) estimate
KL(engine || trainer) and ``mean((exp(d) - 1)^2)`` estimates the chi-square divergence chi^2(trainer || engine).
Two logprobs "differ" when their fp32 values are not bitwise equal.
"""

from .metrics import POSITION_BUCKETS, POSITION_EDGES, PROB_BUCKETS, PROB_EDGES, compare, tim_metrics, tim_token_metrics
from .report import Report, write_report
from .rescore import Rescored, rescore
from .rollouts import (
    LAYOUTS,
    VERL_TEXT_DUMP,
    VLLM_LOGPROBS_MODES,
    BadRolloutError,
    Rollout,
    check_rollout,
    from_verl,
    from_vexact,
    from_vllm,
    load_rollouts,
    rollouts_from_outputs,
    rollouts_to_jsonl,
)

__all__ = [
    "LAYOUTS",
    "POSITION_BUCKETS",
    "POSITION_EDGES",
    "PROB_BUCKETS",
    "PROB_EDGES",
    "VERL_TEXT_DUMP",
    "VLLM_LOGPROBS_MODES",
    "BadRolloutError",
    "Report",
    "Rescored",
    "Rollout",
    "check_rollout",
    "compare",
    "from_verl",
    "from_vexact",
    "from_vllm",
    "load_rollouts",
    "rescore",
    "rollouts_from_outputs",
    "rollouts_to_jsonl",
    "tim_metrics",
    "tim_token_metrics",
    "write_report",
]
