"""tim/* metrics for verl's logger: the function against hand-computed values, and the wrap of verl's own
calculate_debug_metrics (installed by the plugin)."""

from __future__ import annotations

import math

import pytest
import torch

from vexact_verl import tim_step_metrics


def test_tim_step_metrics_hand_computed():
    rollout = torch.tensor([[-1.0, -0.5, -9.0], [-0.25, -7.0, -7.0]])
    actor = torch.tensor([[-1.0, -0.75, 0.0], [-0.25, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])  # padding differs wildly and must not count
    m = tim_step_metrics(rollout, actor, mask)
    d = [0.0, -0.25, 0.0]
    assert m["tim/tokens_differ"] == 1 and m["tim/fraction_differ"] == pytest.approx(1 / 3)
    assert m["tim/abs_delta_max"] == 0.25 and m["tim/kl_k1"] == pytest.approx(0.25 / 3)
    assert m["tim/kl_k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 3)
    assert m["tim/chi2"] == pytest.approx(sum(math.expm1(x) ** 2 for x in d) / 3)
    exact = tim_step_metrics(rollout, rollout.clone(), mask)
    assert exact["tim/kl_k3"] == 0.0 and exact["tim/tokens_differ"] == 0
    assert tim_step_metrics(rollout, actor, torch.zeros_like(mask)) == {}
    with pytest.raises(ValueError, match="must have one shape"):
        tim_step_metrics(rollout, actor[:, :2], mask)


def test_verl_debug_metrics_carry_tim_metrics():
    protocol = pytest.importorskip("verl.protocol")
    from verl.utils.debug import metrics as verl_metrics

    from vexact_verl.tim import install

    assert install() and install()  # idempotent
    batch = protocol.DataProto.from_dict(
        {
            "rollout_log_probs": torch.tensor([[-1.0, -0.5]]),
            "old_log_probs": torch.tensor([[-1.0, -0.75]]),
            "responses": torch.tensor([[3, 4]]),
            "response_mask": torch.tensor([[1, 1]]),
        }
    )
    out = verl_metrics.calculate_debug_metrics(batch)
    assert "training/rollout_probs_diff_max" in out and out["tim/tokens_differ"] == 1
