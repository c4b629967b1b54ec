"""pack_parameters: every distinct parameter becomes a view of one flat buffer per (device, dtype), at 256-byte aligned
offsets, sibling weights (q/k/v, gate/up) end to end, values and forward outputs unchanged bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vexact_models import (
    PACK_ALIGN,
    AttentionMetadata,
    allocate_packed,
    pack_parameters,
    packed_buffers,
    random_model,
    tiny_config,
    tiny_qwen3_moe_config,
)

FAMILIES = ["qwen3", "qwen2", "llama", "qwen3_moe"]


def _model(family: str, seed: int = 1):
    cfg = tiny_qwen3_moe_config() if family == "qwen3_moe" else tiny_config(family)
    return random_model(cfg, seed=seed)


def _forward(model):
    ids = torch.tensor([5, 9, 200, 3, 17, 42, 7])
    pos = torch.tensor([0, 1, 2, 3, 0, 1, 2])
    meta = AttentionMetadata.packed([4, 3])
    with torch.no_grad():
        hidden = model(ids, pos, meta)
        lp = model.logprobs(hidden, ids)
        return [hidden, *(t for t in (lp if isinstance(lp, tuple) else (lp,)) if t is not None)]


def _slot_start(buffer: torch.Tensor, p: torch.Tensor) -> int:
    return p.data_ptr() - buffer.data_ptr()


@pytest.mark.parametrize("family", FAMILIES)
def test_values_and_outputs_unchanged_and_every_parameter_is_a_view(family):
    model = _model(family)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = _forward(model)
    old_ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    buffers = pack_parameters(model)
    assert len(buffers) == 1 and buffers[0].dtype == torch.bfloat16 and buffers[0].dim() == 1
    found, table = packed_buffers(model)
    assert [b.data_ptr() for b in found] == [b.data_ptr() for b in buffers]
    assert [b.numel() for b in found] == [b.numel() for b in buffers]
    assert set(table) == set(before)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
        assert p.untyped_storage().data_ptr() == buffers[0].data_ptr(), name  # a view of the buffer
        assert p.data_ptr() != old_ptrs[name]
        slot = table[name]
        assert slot.offset % PACK_ALIGN == 0 and _slot_start(buffers[0], p) == slot.offset
        assert slot.shape == tuple(p.shape) and slot.dtype == p.dtype
    for a, b in zip(_forward(model), out, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_sibling_weights_lie_end_to_end(family):
    model = _model(family)
    pack_parameters(model)
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    for group in ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)):
        for a, b in zip(group, group[1:], strict=False):
            assert b.weight.data_ptr() == a.weight.data_ptr() + a.weight.numel() * a.weight.element_size()
    if family == "qwen2":  # biases come after the siblings' weights (each at an aligned offset of its own)
        _, table = packed_buffers(model)
        names = list(table)
        prefix = "model.layers.0.self_attn."
        order = [names.index(prefix + s) for s in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_proj.bias")]
        assert order == sorted(order) and order[1] == order[0] + 1 and order[2] == order[1] + 1


def test_tied_parameter_packed_once():
    model = _model("llama")  # tied embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    pack_parameters(model)
    _, table = packed_buffers(model)
    assert "model.embed_tokens.weight" in table and "lm_head.weight" not in table
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_idempotent_and_stale_after_a_move():
    model = _model("qwen3")
    first = pack_parameters(model)
    again = pack_parameters(model)
    assert [b.data_ptr() for b in again] == [b.data_ptr() for b in first]
    assert pack_parameters(model, "cpu")[0].data_ptr() == first[0].data_ptr()  # already on that device
    model.to("cpu")  # nothing to move: still packed
    assert packed_buffers(model) is not None
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.float()  # every parameter re-allocated: no longer packed
    assert packed_buffers(model) is None
    buffers = pack_parameters(model)
    assert buffers[0].dtype == torch.float32 and packed_buffers(model) is not None
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n].float())


def test_one_buffer_per_dtype_in_first_use_order():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.randn(3, 5, dtype=torch.float32))
            self.b = nn.Parameter(torch.randn(7, dtype=torch.bfloat16))
            self.c = nn.Parameter(torch.randn(2, 2, dtype=torch.float32))
            self.register_buffer("kept", torch.randn(4))

    model = Mixed()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    kept = model.kept
    buffers = pack_parameters(model)
    assert [b.dtype for b in buffers] == [torch.float32, torch.bfloat16]
    _, table = packed_buffers(model)
    assert table["a"] == (0, 0, (3, 5), torch.float32)
    assert table["b"] == (1, 0, (7,), torch.bfloat16)
    assert table["c"] == (0, PACK_ALIGN, (2, 2), torch.float32)
    assert model.kept is kept  # buffers are not packed
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])


def test_allocate_packed_lays_out_as_pack_parameters():
    model = _model("qwen2")
    pack_parameters(model)
    _, table = packed_buffers(model)
    shapes = {n: (p.shape, p.dtype) for n, p in model.named_parameters()}
    other = _model("qwen2", seed=2)
    for p in other.parameters():
        p.data = torch.empty(0, dtype=p.dtype)  # as an engine's level-2 sleep leaves them
    buffers = allocate_packed(other, shapes, "cpu")
    found, other_table = packed_buffers(other)
    assert other_table == table and found[0].data_ptr() == buffers[0].data_ptr()
    with pytest.raises(KeyError, match="no shape given for parameter"):
        allocate_packed(other, {}, "cpu")
