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
    assert m["tim/abs_delta_max"] == 0.25 and m["tim/k1_kl"] == pytest.approx(0.25 / 3)
    assert m["tim/k3_kl"] == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 3)
    assert m["tim/chi2"] == pytest.approx(sum(math.expm1(x) ** 2 for x in d) / 3)
    exact = tim_step_metrics(rollout, rollout.clone(), mask)
    assert exact["tim/k3_kl"] == 0.0 and exact["tim/tokens_differ"] == 0
    assert tim_step_metrics(rollout, actor, torch.zeros_like(mask)) == {}
    with pytest.raises(ValueError, match="must have one shape"):
        tim_step_metrics(rollout, actor[:, :2], mask)


def test_tim_step_metrics_equal_tim_metrics_of_each_row_bitwise():
    # one masked select over the batch against the tokens of each row as a tensor of its own, through the whole of
    # vexact_trainer.tim_metrics: every value equal to the bit; rows of uneven length, an empty row, holes in the mask
    # (a tool-interleaved response), bf16 rollout logprobs
    from vexact_trainer import tim_metrics

    g = torch.Generator().manual_seed(0)
    rollout = -5 * torch.rand(64, 300, generator=g)
    actor = rollout + 1e-3 * torch.randn(64, 300, generator=g) * (torch.rand(64, 300, generator=g) < 0.3)
    mask = (torch.arange(300) < torch.randint(0, 301, (64, 1), generator=g)).long()
    mask[0] = 0
    mask[::7] *= (torch.rand(mask[::7].shape, generator=g) < 0.5).long()
    for r, a in ((rollout, actor), (rollout, rollout.clone()), (rollout.bfloat16(), actor)):
        rows = [i for i in range(64) if mask[i].any()]
        s = tim_metrics([r[i].float()[mask[i].bool()] for i in rows], [a[i][mask[i].bool()] for i in rows], worst=0)
        want = {f"tim/{k}": s[k] for k in ("fraction_differ", "k1_kl", "k3_kl", "chi2", "log_ppl_diff")}
        want.update({"tim/abs_delta_mean": s["abs_delta"]["mean"], "tim/abs_delta_max": s["abs_delta"]["max"]})
        want["tim/tokens_differ"] = s["tokens_differ"]
        got = tim_step_metrics(r, a, mask)
        assert got == want and all(type(got[k]) is type(want[k]) for k in want)


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


def test_attribution_config_from_settings_and_bad_values_name_the_key():
    from vexact_verl.tim import AttributionConfig

    assert AttributionConfig.from_settings(None) == AttributionConfig(every=0, samples=4, ops=None)  # off by default
    assert AttributionConfig.from_settings({}) == AttributionConfig()
    cfg = AttributionConfig.from_settings(
        {"tim_attribute_every": 5, "tim_attribute_samples": 2, "tim_attribute_ops": "linear, moe"}
    )
    assert (cfg.every, cfg.samples, cfg.ops) == (5, 2, ("linear", "moe"))
    assert AttributionConfig.from_settings({"tim_attribute_ops": ["linear", "moe"]}).ops == ("linear", "moe")
    assert cfg.specs(object()) == ["fast:linear", "fast:moe", "fast"]
    dense = AttributionConfig(every=1).specs(object())
    assert "fast:moe" not in dense and dense[-1] == "fast"
    assert "fast:moe" in AttributionConfig(every=1).specs(type("C", (), {"num_experts": 4})())
    for settings, match in (
        ({"tim_attribute_every": "often"}, "vexact.tim_attribute_every must be an integer"),
        ({"tim_attribute_every": -1}, "vexact.tim_attribute_every must be an integer >= 0"),
        ({"tim_attribute_samples": 0}, "vexact.tim_attribute_samples must be an integer >= 1"),
        ({"tim_attribute_ops": "linear,matmul"}, "unknown op family 'matmul'; allowed: linear"),
        ({"tim_attribution_every": 1}, r"unknown key\(s\) \['tim_attribution_every'\]"),
    ):
        with pytest.raises(ValueError, match=match):
            AttributionConfig.from_settings(settings)


def test_attribution_metrics_compare_each_spec_with_the_reference():
    from vexact_verl.tim import attribution_metrics

    lp = {"invariant": torch.tensor([[-1.0, -2.0, -5.0]]), "fast:linear": torch.tensor([[-1.0, -2.5, 0.0]])}
    lp["fast"] = lp["fast:linear"]
    m = attribution_metrics(lp.__getitem__, ["invariant", "fast:linear", "fast"], torch.tensor([[1, 1, 0]]))
    assert m["tim_attr/invariant/abs_delta_mean"] == 0.0 and m["tim_attr/invariant/fraction_differ"] == 0.0
    assert m["tim_attr/linear/abs_delta_mean"] == 0.25 and m["tim_attr/linear/fraction_differ"] == 0.5
    assert m["tim_attr/linear/abs_delta_max"] == 0.5 and m["tim_attr/all/k3_kl"] == m["tim_attr/linear/k3_kl"] > 0
    assert sorted({k.split("/")[2] for k in m}) == ["abs_delta_max", "abs_delta_mean", "fraction_differ", "k3_kl"]
