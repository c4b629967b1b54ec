"""vk.tensor_range: a tensor's range is read from the device once per version, and the checks built on it still
reject bad input (rotary positions, fused_moe expert ids)."""

from __future__ import annotations

import pytest
import torch

import vexact_kernels as vk
from vexact_kernels import _ranges


@pytest.fixture
def reads(monkeypatch):
    seen = []
    real = _ranges._read

    def counting(t):
        seen.append(t)
        return real(t)

    monkeypatch.setattr(_ranges, "_read", counting)
    return seen


def test_range_is_read_once_per_version(reads):
    t = torch.tensor([3, 9, 1])
    assert vk.tensor_range(t) == (1, 9)
    assert vk.tensor_range(t) == (1, 9)
    assert len(reads) == 1
    t[0] = 42  # an in-place write bumps the version: read again
    assert vk.tensor_range(t) == (1, 42)
    assert len(reads) == 2
    assert vk.tensor_range(torch.tensor([3, 9, 1])) == (1, 9)  # an equal tensor is another tensor
    assert len(reads) == 3
    assert vk.tensor_range(torch.empty(0, dtype=torch.int64)) is None


def test_recorded_range_is_used_without_a_read(reads):
    t = torch.tensor([0, 5])
    vk.record_range(t, 0, 5)
    assert vk.tensor_range(t) == (0, 5)
    assert not reads
    t.add_(1)  # the recorded fact is forgotten with the write
    assert vk.tensor_range(t) == (1, 6)
    assert len(reads) == 1


def test_inference_mode_tensors_are_read_every_time(reads):
    with torch.inference_mode():
        t = torch.tensor([2, 4])
    vk.record_range(t, 0, 0)  # no version counter: nothing can be remembered, not even a recorded range
    assert vk.tensor_range(t) == (2, 4)
    assert vk.tensor_range(t) == (2, 4)
    assert len(reads) == 2


def test_rotary_check_reads_the_positions_once_for_every_layer(reads):
    cos, sin = vk.rope_cos_sin(8, 16, 10_000.0)
    x = torch.randn(4, 2, 8)
    pos = torch.tensor([0, 1, 2, 3])
    for _ in range(5):  # five layers, one positions tensor
        vk.apply_rotary(x, pos, cos, sin)
    assert len(reads) == 1
    with pytest.raises(ValueError, match="position 16 >= table size 16"):
        vk.apply_rotary(x, torch.tensor([0, 1, 2, 16]), cos, sin)
    bad = torch.tensor([0, 1, 2, 3])
    bad[3] = 99  # written in place after a read: the check sees the new value
    with pytest.raises(ValueError, match="position 99"):
        vk.apply_rotary(x, bad, cos, sin)


def test_fused_moe_trusts_the_routers_ids_and_still_rejects_bad_ones(reads):
    torch.manual_seed(0)
    t, h, e, inter, k = 5, 8, 4, 6, 2
    x = torch.randn(t, h)
    w_gate_up, w_down = torch.randn(e, 2 * inter, h), torch.randn(e, h, inter)
    weights, ids = vk.moe_route(torch.randn(t, e), k)
    vk.fused_moe(x, w_gate_up, w_down, weights, ids)
    assert not reads  # the router's ids are in [0, E) by construction
    bad = ids.clone()
    bad[2, 1] = e
    with pytest.raises(ValueError, match=r"expert ids must be in \[0, 4\); got 0..4"):
        vk.fused_moe(x, w_gate_up, w_down, weights, bad)
