"""AttentionMetadata.per_step: a value derived from the layout is made once per step and shared by every layer, and
made again whenever it could be stale (a layout tensor replaced or written in place, a CUDA graph capture)."""

from __future__ import annotations

import pytest
import torch

from vexact_models import AttentionMetadata


def _paged(device="cpu"):
    return AttentionMetadata(
        cu_seqlens=torch.tensor([0, 1, 2], device=device),
        slot_mapping=torch.tensor([5, -1], device=device),
        block_tables=torch.tensor([[1], [0]], device=device),
        context_lens=torch.tensor([6, 1], device=device),
    )


def _counting():
    made = []

    def make():
        made.append(object())
        return made[-1]

    return made, make


def test_per_step_is_made_once_per_key():
    meta, (made, make) = _paged(), _counting()
    first = meta.per_step("a", make)
    assert meta.per_step("a", make) is first and len(made) == 1
    assert meta.per_step("b", make) is not first and len(made) == 2


@pytest.mark.parametrize("field", ["cu_seqlens", "slot_mapping", "block_tables", "context_lens"])
def test_per_step_is_made_again_after_an_in_place_write_or_a_new_tensor(field):
    meta, (made, make) = _paged(), _counting()
    first = meta.per_step("a", make)
    getattr(meta, field).add_(0)  # same values, but written: a derived value may be stale
    second = meta.per_step("a", make)
    assert second is not first and meta.per_step("a", make) is second
    setattr(meta, field, getattr(meta, field).clone())
    assert meta.per_step("a", make) is not second and len(made) == 3


def test_per_step_keeps_nothing_in_repr_or_init():
    meta = _paged()
    meta.per_step("a", lambda: 1)
    assert "_derived" not in repr(meta)
    with pytest.raises(TypeError):
        AttentionMetadata(cu_seqlens=meta.cu_seqlens, _derived={})


@pytest.mark.gpu
def test_per_step_is_made_again_inside_a_cuda_graph_capture():
    """The warm-up before a capture must not hand the capture a tensor made outside it: the graph records the work."""
    meta = _paged("cuda")
    eager = meta.per_step("ctx", lambda: meta.context_lens.to(torch.int32))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = meta.per_step("ctx", lambda: meta.context_lens.to(torch.int32))
        again = meta.per_step("ctx", lambda: meta.context_lens.to(torch.int32))
    assert captured is not eager and again is captured
    meta.context_lens.copy_(torch.tensor([9, 3]))
    graph.replay()
    assert captured.tolist() == [9, 3]
