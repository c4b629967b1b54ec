import math

import pytest
import torch

from vexact_trainer import (
    check_finite_loss,
    grpo_advantages,
    mismatch_metrics,
    ppo_clip_loss,
    reinforce_loss,
    rollout_correction,
)


def test_grpo_advantages_are_zero_mean_unit_std_per_group():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0, 5.0, 5.0, 5.0])
    adv = grpo_advantages(r, group_size=4)
    g = adv.view(2, 4)
    assert torch.allclose(g.mean(1), torch.zeros(2), atol=1e-6)
    assert torch.allclose(g[0].std(), torch.tensor(1.0), atol=1e-4)
    assert torch.equal(g[1], torch.zeros(4))  # identical rewards carry no signal
    assert torch.allclose(
        grpo_advantages(r, 4, normalize_std=False).view(2, 4)[0], torch.tensor([0.5, -0.5, -0.5, 0.5])
    )
    with pytest.raises(ValueError, match="groups of 3"):
        grpo_advantages(r, group_size=3)


def test_ppo_equals_policy_gradient_inside_the_clip_range_and_stops_outside():
    lp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    old = torch.tensor([-1.0, -2.0, -0.5])
    adv = torch.tensor([1.0, -1.0, 2.0])
    mask = torch.ones(3)
    out = ppo_clip_loss(lp, old, adv, mask)
    assert math.isclose(out.loss.item(), -(1.0 - 1.0 + 2.0) / 3, rel_tol=1e-6)  # ratio 1: -mean(A)
    out.loss.backward()
    assert torch.allclose(lp.grad, -adv / 3)
    assert out.clip_fraction.item() == 0.0 and out.approx_kl.item() == 0.0
    # ratio e^1 with positive advantage is clipped at 1.2: no gradient, counted as clipped
    lp2 = torch.tensor([0.0], requires_grad=True)
    out2 = ppo_clip_loss(lp2, torch.tensor([-1.0]), torch.tensor([1.0]), torch.ones(1))
    out2.loss.backward()
    assert math.isclose(out2.loss.item(), -1.2, rel_tol=1e-6) and lp2.grad.item() == 0.0
    assert out2.clip_fraction.item() == 1.0


def test_mask_excludes_prompt_tokens_and_shapes_must_match():
    lp = torch.tensor([-1.0, -3.0], requires_grad=True)
    loss = reinforce_loss(lp, torch.tensor([2.0, 100.0]), torch.tensor([1.0, 0.0]))
    assert loss.item() == 2.0
    with pytest.raises(ValueError, match="share one shape"):
        reinforce_loss(lp, torch.ones(3), torch.ones(2))


def test_rollout_correction_is_a_no_op_when_rollout_equals_trainer():
    lp = torch.tensor([-1.0, -0.3, -2.0])
    mask = torch.ones(3)
    for mode in ("none", "tis", "mis"):
        w, m = rollout_correction(lp, lp.clone(), mask, mode)
        assert torch.equal(w, torch.ones(3)) and torch.equal(m, mask)
    m = mismatch_metrics(lp, lp.clone(), mask)
    assert m["k3_kl"] == 0.0 and m["mismatched"] == 0 and m["max_abs_delta"] == 0.0


def test_tis_truncates_and_mis_masks_large_ratios():
    old = torch.tensor([0.0, 0.0, 0.0])
    rollout = torch.tensor([0.0, -2.0, 2.0])  # ratios 1, e^2, e^-2
    mask = torch.ones(3)
    w, m = rollout_correction(old, rollout, mask, "tis", threshold=2.0)
    assert torch.allclose(w, torch.tensor([1.0, 2.0, math.exp(-2.0)]))
    w, m = rollout_correction(old, rollout, mask, "mis", threshold=2.0)
    assert torch.equal(m, torch.tensor([1.0, 0.0, 0.0]))
    with pytest.raises(ValueError, match="unknown rollout-correction mode"):
        rollout_correction(old, rollout, mask, "clip")
    stats = mismatch_metrics(rollout, old, mask)
    assert stats["mismatched"] == 2 and stats["k3_kl"] > 0


def test_nan_loss_is_flagged():
    assert check_finite_loss(torch.tensor(1.0))
    assert not check_finite_loss(torch.tensor(float("nan")))
    assert not check_finite_loss(torch.tensor(float("inf")))
