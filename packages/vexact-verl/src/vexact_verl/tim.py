"""TIM metrics in verl's logger: the summary of :func:`vexact_trainer.tim_metrics` on each step's batch.

verl's trainer logs ``training/rollout_probs_diff_*`` from ``verl.utils.debug.metrics.calculate_debug_metrics(batch)``
when the batch holds ``rollout_log_probs`` (the rollout's) beside ``old_log_probs`` (the actor's recomputation); it
imports that function at the call. :func:`install` wraps it (no copy of verl code) so the same dict also carries
``tim/*``: fraction of tokens whose logprobs differ (fp32 bitwise), |delta| mean and max, KL k1 and K3, chi-square,
log-perplexity difference. The vexact plugin installs it in every process that loads it (so with
``rollout.name=vexact``, and with any rollout while the plugin is loaded); the attribution by op family is not run
inside verl (``vexact tim attribute`` runs it on a checkpoint).
"""

from __future__ import annotations

import functools

import torch

KEYS = ("fraction_differ", "kl_k1", "kl_k3", "chi2", "log_ppl_diff")


def tim_step_metrics(rollout_log_probs: torch.Tensor, old_log_probs: torch.Tensor, response_mask: torch.Tensor) -> dict:
    """``tim/*`` metrics of one batch: ``[B, R]`` rollout and actor logprobs, ``[B, R]`` mask of response tokens."""
    from vexact_trainer import tim_metrics

    if rollout_log_probs.shape != old_log_probs.shape or response_mask.shape != old_log_probs.shape:
        raise ValueError(
            f"rollout_log_probs {tuple(rollout_log_probs.shape)}, old_log_probs {tuple(old_log_probs.shape)} and "
            f"response_mask {tuple(response_mask.shape)} must have one shape"
        )
    mask = response_mask.bool().cpu()
    keep = [i for i in range(mask.shape[0]) if mask[i].any()]
    if not keep:
        return {}
    eng = [rollout_log_probs[i].detach().float().cpu()[mask[i]] for i in keep]
    tr = [old_log_probs[i].detach().float().cpu()[mask[i]] for i in keep]
    s = tim_metrics(eng, tr, worst=0)
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
