"""Policy-gradient losses, advantages and rollout-correction terms for RL on LLMs.

All per-token tensors share one shape (packed ``[T]`` or padded ``[B, L]``) with a 0/1 ``mask`` of the same shape
selecting response tokens. ``logprobs`` carry gradients; everything else is treated as data.

Rollout correction is for the fast-backend baseline: when the rollout engine's logprobs (``rollout_logprobs``)
differ from the trainer's recomputation at the rollout policy (``old_logprobs``), truncated importance sampling
(TIS) reweights tokens by ``min(pi_old / pi_rollout, C)`` and masked importance sampling (MIS) drops tokens whose
ratio falls outside ``[1/C, C]``. With VeXact's invariant backend the ratio is exactly 1 and both are no-ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items() if t is not None}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"per-token tensors must share one shape; got {shapes}")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over tokens where ``mask`` is 1 (token-mean aggregation); 0 when the mask is empty."""
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1)


def grpo_advantages(rewards: torch.Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6):
    """Group-normalised advantages: each reward minus its group's mean (divided by the group's std if asked).

    ``rewards [n_groups * group_size]``, groups contiguous (all samples of a prompt together).
    """
    if group_size < 1 or rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.float().view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if normalize_std:
        std = r.std(dim=1, keepdim=True, unbiased=group_size > 1) if group_size > 1 else torch.zeros_like(r)
        adv = adv / (std + eps)
    return adv.view(-1)


def reinforce_loss(logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``-mean(A * log pi)`` over response tokens (advantages broadcast per token)."""
    _check_same_shape(logprobs=logprobs, advantages=advantages, mask=mask)
    return -masked_mean(advantages.detach() * logprobs, mask)


@dataclass
class PPOOutput:
    loss: torch.Tensor
    clip_fraction: torch.Tensor
    approx_kl: torch.Tensor


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    weights: torch.Tensor | None = None,
) -> PPOOutput:
    """PPO's clipped surrogate (GRPO uses it with group-normalised advantages); ``weights`` = rollout correction."""
    _check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask, weights=weights)
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip ranges must be >= 0, got low={clip_low}, high={clip_high}")
    log_ratio = logprobs - old_logprobs.detach()
    ratio = torch.exp(log_ratio)
    adv = advantages.detach()
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    if weights is not None:
        per_token = per_token * weights.detach()
    with torch.no_grad():
        clip_fraction = masked_mean((clipped > unclipped).float(), mask)
        approx_kl = masked_mean(0.5 * log_ratio.detach() ** 2, mask)
    return PPOOutput(masked_mean(per_token, mask), clip_fraction, approx_kl)


def rollout_correction(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, mode: str, threshold: float = 2.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token weights and the updated mask for ``mode`` in {"none", "tis", "mis"} (see the module docstring)."""
    _check_same_shape(old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs, mask=mask)
    if threshold <= 1.0:
        raise ValueError(f"rollout-correction threshold must be > 1, got {threshold}")
    ratio = torch.exp(old_logprobs.detach().float() - rollout_logprobs.float())
    if mode == "none":
        return torch.ones_like(ratio), mask
    if mode == "tis":
        return torch.clamp(ratio, max=threshold), mask
    if mode == "mis":
        keep = (ratio <= threshold) & (ratio >= 1.0 / threshold)
        return torch.ones_like(ratio), mask * keep.to(mask.dtype)
    raise ValueError(f"unknown rollout-correction mode {mode!r}; expected 'none', 'tis' or 'mis'")


def k3_kl(log_ratio: torch.Tensor) -> torch.Tensor:
    """Per-token K3 estimate of KL(rollout || trainer): ``(r - 1) - log r`` with ``log_ratio = log r =
    log pi_trainer - log pi_rollout``, elementwise, in ``log_ratio``'s dtype (callers pass float64). Exactly 0.0 where
    the two logprobs are equal; its mean over tokens is the ``k3_kl`` metric everywhere it is reported."""
    return torch.expm1(log_ratio) - log_ratio


def mismatch_metrics(rollout_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, mask: torch.Tensor) -> dict:
    """How far the rollout's logprobs are from the trainer's on the sampled tokens.

    ``k3_kl``: mean of ``(r - 1) - log r`` with ``r = pi_trainer / pi_rollout`` (the K3 estimate of
    KL(rollout || trainer)); exactly 0.0 when the two are bitwise equal.
    """
    _check_same_shape(rollout_logprobs=rollout_logprobs, trainer_logprobs=trainer_logprobs, mask=mask)
    sel = mask.bool()
    a, b = rollout_logprobs[sel].double(), trainer_logprobs[sel].double()
    log_r = b - a
    n = int(sel.sum())
    return {
        "tokens": n,
        "mismatched": int((a != b).sum()),
        "mismatch_fraction": float((a != b).double().mean()) if n else 0.0,
        "max_abs_delta": float(log_r.abs().max()) if n else 0.0,
        "k3_kl": float(k3_kl(log_r).mean()) if n else 0.0,
    }


def check_finite_loss(loss: torch.Tensor) -> bool:
    """False for a NaN/inf loss: the caller must skip the step (and log why) instead of applying it."""
    return bool(torch.isfinite(loss).all())


def sequence_load_balancing_loss(router, seq_lens, num_experts: int, top_k: int) -> torch.Tensor:
    """Per packed sequence, transformers' load-balancing loss over that sequence's tokens alone: ``[S]`` fp32.

    ``router``: the :class:`vexact_models.RouterOutput` list of one packed forward (one per sparse layer, ``[T, E]``
    logits and ``[T, k]`` ids); ``seq_lens``: the packed sequences' lengths (summing to ``T``). Entry ``s`` equals
    ``vexact_models.load_balancing_loss`` on sequence ``s``'s rows of every layer (``E * sum_e f_e * P_e``, ``f_e``
    the share of its (token, rank) slots routed to ``e``, ``P_e`` its mean router probability, over all layers).
    Differentiable in the logits through ``P_e`` (the choice ``f_e`` has no gradient). Memory ``O(T * E)``: the
    layers are summed one at a time, never materialised as ``[layers, T, k, E]``.
    """
    if not router:
        raise ValueError("sequence_load_balancing_loss: no router outputs recorded (is this an MoE model?)")
    dev = router[0].logits.device
    lens = torch.as_tensor(list(seq_lens), dtype=torch.long, device=dev)
    if int(lens.sum()) != router[0].logits.shape[0]:
        raise ValueError(f"sequence lengths sum to {int(lens.sum())} but the router saw {router[0].logits.shape[0]}")
    probs = counts = None
    for r in router:  # [T, E] per layer
        p = torch.softmax(r.logits.float(), dim=-1)
        ids = r.topk_ids[:, :top_k]
        c = torch.zeros(p.shape, device=dev).scatter_add_(1, ids, torch.ones(ids.shape, device=dev))
        probs, counts = (p, c) if probs is None else (probs + p, counts + c)
    seg = torch.repeat_interleave(torch.arange(len(lens), device=dev), lens)  # [T]: each row's sequence
    p_sum = probs.new_zeros(len(lens), num_experts).index_add(0, seg, probs)  # [S, E]
    c_sum = counts.new_zeros(len(lens), num_experts).index_add(0, seg, counts)
    rows = (len(router) * lens).to(torch.float32).unsqueeze(1)  # (layer, token) rows per sequence
    return num_experts * ((c_sum / rows) * (p_sum / rows)).sum(dim=-1)
