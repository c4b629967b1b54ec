"""The invariant actor's forward on verl's packed layout == the vexact trainer, bitwise."""

from __future__ import annotations

import pytest
import torch

from vexact_models import default_checkpoint, load_model
from vexact_trainer import Actor
from vexact_verl.actor import packed_log_probs

PROMPTS = [[257, 72, 101], [257, 49, 43, 49, 61, 50], [257, 10]]
RESPONSES = [[50, 51, 52, 256], [33], [97, 98, 99, 100, 101]]


def nested(rows):
    return torch.nested.nested_tensor([torch.tensor(r) for r in rows], layout=torch.jagged)


@pytest.mark.parametrize("temperature", [1.0, 0.7, torch.tensor([0.5, 1.0, 1.3])])
def test_verl_layout_logprobs_equal_trainer(temperature):
    model = load_model(default_checkpoint())
    seqs = [p + r for p, r in zip(PROMPTS, RESPONSES, strict=True)]
    ids, pos = nested(seqs), nested([list(range(len(s))) for s in seqs])
    with torch.no_grad():
        lp, ent = packed_log_probs(model, ids, pos, temperature, with_entropy=True)
        temps = temperature.tolist() if isinstance(temperature, torch.Tensor) else temperature
        want = Actor(model).compute_log_probs(PROMPTS, RESPONSES, temps, with_entropy=True)
    for i, (p, s) in enumerate(zip(PROMPTS, seqs, strict=True)):
        # verl reads a response token's logprob at the position before it
        got = lp[i][len(p) - 1 : len(s) - 1]
        assert torch.equal(got, want.logprobs[i]), f"sequence {i}"
        assert torch.equal(ent[i][len(p) - 1 : len(s) - 1], want.entropy[i]), f"sequence {i}"


def test_bad_layouts_are_refused():
    model = load_model(default_checkpoint())
    with pytest.raises(TypeError, match="jagged nested"):
        packed_log_probs(model, torch.tensor([1, 2]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="2 temperatures for 1 sequences"):
        packed_log_probs(model, nested([[1, 2]]), nested([[0, 1]]), torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize(
    "temperature, message",
    [
        (float("nan"), r"temperature must be a finite number > 0, got nan"),
        (torch.tensor(float("inf")), r"temperature must be a finite number > 0, got inf"),
        (torch.tensor([0.5, float("nan"), 1.0]), r"temperature\[1\] must be a finite number > 0, got nan"),
    ],
)
def test_non_finite_temperatures_are_refused_by_value(temperature, message):
    """A NaN passed the kernel's `t <= 0` check and gave NaN logprobs: refused with the trainer's check."""
    model = load_model(default_checkpoint())
    seqs = [p + r for p, r in zip(PROMPTS, RESPONSES, strict=True)]
    with pytest.raises(ValueError, match=message):
        packed_log_probs(model, nested(seqs), nested([list(range(len(s))) for s in seqs]), temperature)
