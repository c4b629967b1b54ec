"""``moe_expert_outputs`` + ``moe_combine`` (the halves expert parallelism runs on different ranks) give
``fused_moe``'s bits, with the experts split into shards by id and the shards' rows put back together."""

from __future__ import annotations

import pytest
import torch

import vexact_kernels as vk
from vexact_kernels.triton_ops import interpreting


def _case(t=13, e=8, k=4, h=32, inter=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).bfloat16()
    w13 = (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).bfloat16()
    w2 = (torch.randn(e, h, inter, generator=g) / inter**0.5).bfloat16()
    w, ids = vk.moe_route(torch.randn(t, e, generator=g), k)
    return x, w13, w2, w, ids


@pytest.mark.parametrize("shards", [1, 2, 4])
def test_sharded_expert_outputs_and_combine_equal_fused_moe(shards):
    x, w13, w2, w, ids = _case()
    e = w13.shape[0]
    per = e // shards
    y = torch.zeros(*ids.shape, x.shape[1])
    for s in range(shards):
        part = vk.moe_expert_outputs(x, w13[s * per : (s + 1) * per], w2[s * per : (s + 1) * per], ids - s * per)
        mine = (ids // per == s).unsqueeze(-1)
        assert torch.equal(part[~mine.expand_as(part)], torch.zeros_like(part[~mine.expand_as(part)]))
        y = torch.where(mine, part, y)
    assert torch.equal(vk.moe_combine(y, w, x.dtype), vk.fused_moe(x, w13, w2, w, ids))


def test_combine_order_matters_at_top_k_4():
    """A combine in another order (here the ranks reversed) changes the fp32 sum's bits: the order is the contract."""
    x, w13, w2, w, ids = _case(k=4)
    y = vk.moe_expert_outputs(x, w13, w2, ids)
    assert not torch.equal(vk.moe_combine(y.flip(1), w.flip(1), torch.float32), vk.moe_combine(y, w, torch.float32))


def test_no_rows_and_bad_input():
    x, w13, w2, w, ids = _case()
    assert vk.moe_expert_outputs(x[:0], w13, w2, ids[:0]).shape == (0, ids.shape[1], x.shape[1])
    assert vk.moe_combine(torch.zeros(0, 2, 32), w[:0, :2], torch.bfloat16).shape == (0, 32)
    with pytest.raises(TypeError, match="float32"):
        vk.moe_combine(torch.zeros(2, 2, 32, dtype=torch.bfloat16), w[:2, :2], torch.bfloat16)
    with pytest.raises(ValueError, match="invariant"), vk.use_backend("fast"):
        vk.moe_expert_outputs(x, w13, w2, ids)


@pytest.mark.skipif(not interpreting(), reason="interpreter tests run where TRITON_INTERPRET=1 (no GPU)")
@pytest.mark.parametrize("shards", [1, 2])
def test_triton_halves_equal_triton_fused_moe(shards):
    """The Triton halves (the GPU path of expert parallelism), through the interpreter: ``triton_fused_moe``'s bits."""
    from vexact_kernels.triton_ops import moe

    x, w13, w2, w, ids = _case(t=5, k=2)
    per = w13.shape[0] // shards
    y = torch.zeros(*ids.shape, x.shape[1])
    for s in range(shards):
        part = moe.triton_moe_expert_outputs(
            x, w13[s * per : (s + 1) * per], w2[s * per : (s + 1) * per], ids - s * per
        )
        y = torch.where((ids // per == s).unsqueeze(-1), part, y)
    assert torch.equal(moe.triton_moe_combine(y, w, x.dtype), moe.triton_fused_moe(x, w13, w2, w, ids))
