"""TIM metrics in verl's logger: the token-level summary of :func:`vexact_trainer.tim_metrics`
(:func:`vexact_trainer.tim_token_metrics`) on each step's batch.

verl's trainer logs ``training/rollout_probs_diff_*`` from ``verl.utils.debug.metrics.calculate_debug_metrics(batch)``
when the batch holds ``rollout_log_probs`` (the rollout's) beside ``old_log_probs`` (the actor's recomputation); it
imports that function at the call. :func:`install` wraps it (no copy of verl code) so the same dict also carries
``tim/*``: fraction of tokens whose logprobs differ (fp32 bitwise), |delta| mean and max, KL k1 and K3, chi-square,
log-perplexity difference. The vexact plugin installs it in every process that loads it (so with
``rollout.name=vexact``, and with any rollout while the plugin is loaded).

Attribution by op family inside verl (off by default): with the actor engine config's ``vexact.tim_attribute_every=N``
(N >= 1; the config class :class:`vexact_verl.actor_engine.VexactFSDPEngineConfig`, or the VeOmni one), the ``vexact``
actor engine rescores, on every N-th training step, ``vexact.tim_attribute_samples`` (default 4) of the step's sequences
once per op family with that family on the ``fast`` kernel and the rest invariant, once all-``fast`` and once
all-invariant, before the step's first update (the weights that scored ``old_log_prob``), under ``torch.no_grad``;
:func:`attribution_metrics` turns the rescores into ``tim_attr/<family>/*`` (``all``: the whole fast backend), which the
engine adds to the step's metrics, so they reach verl's logger with the ``actor/`` prefix. ``vexact.tim_attribute_ops``
(a list, or a comma-separated string) narrows the families.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

KEYS = ("fraction_differ", "k1_kl", "k3_kl", "chi2", "log_ppl_diff")


def tim_step_metrics(rollout_log_probs: torch.Tensor, old_log_probs: torch.Tensor, response_mask: torch.Tensor) -> dict:
    """``tim/*`` metrics of one batch: ``[B, R]`` rollout and actor logprobs, ``[B, R]`` mask of response tokens."""
    from vexact_trainer import tim_token_metrics

    if rollout_log_probs.shape != old_log_probs.shape or response_mask.shape != old_log_probs.shape:
        raise ValueError(
            f"rollout_log_probs {tuple(rollout_log_probs.shape)}, old_log_probs {tuple(old_log_probs.shape)} and "
            f"response_mask {tuple(response_mask.shape)} must have one shape"
        )
    mask = response_mask.bool().cpu()
    if not mask.any():
        return {}
    # verl calls this on the driver inside its old_log_prob timer. One masked select of the whole batch lists each
    # row's response tokens in row order (the concatenation of the rows), and only the token-level statistics are
    # computed: 0.016 s for 512 x 1024 tokens on one CPU thread; a tensor per row and the whole of tim_metrics
    # (quantiles, buckets, per-sequence rows) take 0.16 s (0.80 s for 512 x 4096), with the same values
    eng = rollout_log_probs.detach().float().cpu()[mask]
    tr = old_log_probs.detach().float().cpu()[mask]
    s = tim_token_metrics(eng, tr)
    out = {f"tim/{k}": s[k] for k in KEYS}
    out["tim/abs_delta_mean"] = s["abs_delta"]["mean"]
    out["tim/abs_delta_max"] = s["abs_delta"]["max"]
    out["tim/tokens_differ"] = s["tokens_differ"]
    return out


def install() -> bool:
    """Wrap verl's ``calculate_debug_metrics`` to add :func:`tim_step_metrics`; idempotent. False without verl."""
    try:
        from verl.utils.debug import metrics as verl_metrics
    except ImportError:
        return False
    original = verl_metrics.calculate_debug_metrics
    if getattr(original, "_vexact_tim", False):
        return True

    @functools.wraps(original)
    def calculate_debug_metrics(data):
        out = original(data)
        batch = data.batch
        if "rollout_log_probs" in batch.keys() and "old_log_probs" in batch.keys():
            resp = batch["responses"].shape[-1]
            mask = batch["response_mask"] if "response_mask" in batch.keys() else batch["attention_mask"][:, -resp:]
            out.update(tim_step_metrics(batch["rollout_log_probs"], batch["old_log_probs"], mask))
        return out

    calculate_debug_metrics._vexact_tim = True
    verl_metrics.calculate_debug_metrics = calculate_debug_metrics
    return True


ATTR_KEYS = ("abs_delta_mean", "abs_delta_max", "fraction_differ", "k3_kl")
# the keys of the actor engine config's ``vexact`` section (vexact_verl.actor_engine.VexactFSDPEngineConfig)
KEY_EVERY, KEY_SAMPLES, KEY_OPS = "tim_attribute_every", "tim_attribute_samples", "tim_attribute_ops"


@dataclass(frozen=True)
class AttributionConfig:
    """``every``: attribute on every ``every``-th training step (0: never, the default); ``samples``: sequences
    rescored per step (per data-parallel rank); ``ops``: op families (None: every family the model has)."""

    every: int = 0
    samples: int = 4
    ops: tuple[str, ...] | None = None

    def __post_init__(self):
        import vexact_kernels as vk

        if not isinstance(self.every, int) or self.every < 0:
            raise ValueError(f"vexact.{KEY_EVERY} must be an integer >= 0 (0: off), got {self.every!r}")
        if not isinstance(self.samples, int) or self.samples < 1:
            raise ValueError(f"vexact.{KEY_SAMPLES} must be an integer >= 1, got {self.samples!r}")
        for op in self.ops or ():
            if op not in vk.OPS:
                raise ValueError(f"vexact.{KEY_OPS}: unknown op family {op!r}; allowed: {', '.join(vk.OPS)}")

    @classmethod
    def from_settings(cls, settings, other_keys: tuple[str, ...] = ()) -> AttributionConfig:
        """From the actor engine config's ``vexact`` section (a mapping; None or empty: off), its keys other than
        ``other_keys`` (the section's keys another part reads). An unknown key, or a value of the wrong kind, raises
        ``ValueError`` naming it."""
        settings = {k: v for k, v in dict(settings or {}).items() if k not in other_keys}
        unknown = sorted(set(settings) - {KEY_EVERY, KEY_SAMPLES, KEY_OPS})
        if unknown:
            allowed = [KEY_EVERY, KEY_SAMPLES, KEY_OPS, *other_keys]
            raise ValueError(f"vexact has unknown key(s) {unknown}; allowed: {allowed}")

        def integer(key: str, default: int) -> int:
            value = settings.get(key, default)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"vexact.{key} must be an integer, got {value!r}")
            return value

        ops = settings.get(KEY_OPS)
        if isinstance(ops, str):
            ops = [o for o in ops.split(",") if o.strip()]
        ops = tuple(str(o).strip() for o in ops) if ops else None
        return cls(integer(KEY_EVERY, 0), integer(KEY_SAMPLES, 4), ops)

    def specs(self, model_config) -> list[str]:
        """Backend specs to rescore with: ``fast:<family>`` each, then ``fast`` (MoE only for a model with experts)."""
        import vexact_kernels as vk

        moe = bool(getattr(model_config, "num_experts", 0) or getattr(model_config, "n_routed_experts", 0))
        ops = self.ops or tuple(op for op in vk.OPS if op != "moe" or moe)
        return [f"fast:{op}" for op in ops] + ["fast"]


def attribution_metrics(
    score: Callable[[str], torch.Tensor], specs: list[str], response_mask: torch.Tensor, reference: str = "invariant"
) -> dict:
    """``tim_attr/<family>/*`` of one sample: ``score(spec)`` gives the sample's ``[M, R]`` response logprobs on
    backend ``spec``; each spec's are compared with ``reference``'s (the engine's, ``spec`` playing the engine) by
    :func:`tim_step_metrics` over ``response_mask``. ``<family>`` is the spec's family, ``all`` for ``fast``,
    ``invariant`` for ``invariant`` (a control: exactly 0)."""
    base = score(reference)
    out = {}
    for spec in specs:
        name = spec.partition(":")[2] or ("all" if spec == "fast" else spec)
        s = tim_step_metrics(score(spec), base, response_mask)
        out.update({f"tim_attr/{name}/{k}": s[f"tim/{k}"] for k in ATTR_KEYS if f"tim/{k}" in s})
    return out
