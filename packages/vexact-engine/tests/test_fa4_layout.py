"""The engine's steps under FA4 attention (``VEXACT_ATTENTION=fa4``), on CPU against a stand-in for FA4: the int32
layout FA4 reads (page table, context lengths, query offsets) is made once per step and shared by every layer, its
values are the step's own, and the tokens and logprobs are bitwise those of the same stand-in fed per layer."""

from __future__ import annotations

import pytest
import torch

import vexact_kernels as vk
from vexact_engine import LLM, SamplingParams
from vexact_kernels import attention as attn
from vexact_kernels import fa4_attention
from vexact_models import random_model, tiny_qwen3_config


class _ReferenceFA4:
    """``flash_attn_varlen_func`` of the paged path as the CPU reference attention (so the bits are the reference's);
    it records what each call was handed and checks FA4's int32 dtypes."""

    def __init__(self):
        self.calls: list[dict] = []
        self.inside = False

    def flash_attn_varlen_func(self, q, k_cache, v_cache, **kw):
        for name in ("cu_seqlens_q", "seqused_k", "page_table"):
            assert kw[name].dtype == torch.int32, (name, kw[name].dtype)
        self.calls.append(kw)
        self.inside = True  # the reference below must not come back here
        try:
            out = vk.attention_paged(
                q, k_cache, v_cache, kw["page_table"], kw["seqused_k"], kw["cu_seqlens_q"], kw["softmax_scale"]
            )
        finally:
            self.inside = False
        return out, None


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_qwen3_config(head_dim=64), seed=4)  # heads FA4 takes (attention.FA4_MIN_HEAD_DIM)


@pytest.fixture
def fa4(monkeypatch):
    fake = _ReferenceFA4()
    monkeypatch.setattr(attn, "_on_cuda", lambda *t: None if fake.inside else "fa4")  # as CUDA tensors under fa4
    monkeypatch.setattr(fa4_attention, "_interface", lambda: fake)
    monkeypatch.setattr(fa4_attention, "check_device", lambda op, device, capability=None: 9)
    fake.built = []
    make = fa4_attention.paged_layout

    def paged_layout(*args):
        layout = make(*args)
        # the step's values when it is built (a padded step's static buffers take the next step's values after)
        steps = (layout.page_table, layout.block_tables), (layout.seqused_k, layout.context_lens)
        fake.built.append((layout, [torch.equal(a.long(), b[: a.shape[0]]) for a, b in (*steps, (layout.cu, args[2]))]))
        return layout

    monkeypatch.setattr(fa4_attention, "paged_layout", paged_layout)
    return fake


def _workload():
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 30, 12, 2, 19)]
    params = [
        SamplingParams(temperature=[1.0, 0.0][i % 2], max_tokens=6 + i, seed=i, ignore_eos=True) for i in range(5)
    ]
    return prompts, params


PADDED = dict(cuda_graph_batch_sizes=[2, 4, 8], cuda_graph_token_sizes=[16, 32, 64])


@pytest.mark.parametrize("kw", [{}, PADDED], ids=["eager", "padded"])
def test_fa4_layout_once_per_step_equals_the_per_layer_conversion(model, fa4, monkeypatch, kw):
    engine = dict(max_num_seqs=4, max_num_batched_tokens=16, block_size=4, num_kv_blocks=64, **kw)
    prompts, params = _workload()
    once = LLM(model=model, **engine).generate(prompts, params, use_tqdm=False)
    layers = model.config.num_hidden_layers
    calls, built = list(fa4.calls), list(fa4.built)
    assert len(built) > 5 and len(calls) == layers * len(built)  # one layout per step, every layer uses it
    for step, (layout, equal) in enumerate(built):
        assert layout.page_table.dtype == layout.seqused_k.dtype == layout.cu.dtype == torch.int32
        assert equal == [True, True, True], step  # page table, context lengths, query offsets: the step's own
        for call in calls[step * layers : (step + 1) * layers]:
            assert call["page_table"] is layout.page_table and call["seqused_k"] is layout.seqused_k
            assert call["cu_seqlens_q"] is layout.cu
    # the fallback: no layout, each layer converts for itself (what every call did before the layout)
    monkeypatch.setattr(attn, "paged_attention_layout", lambda *a: None)
    monkeypatch.setattr(vk, "paged_attention_layout", lambda *a: None)
    fa4.calls.clear()
    per_layer = LLM(model=model, **engine).generate(prompts, params, use_tqdm=False)
    assert len(fa4.calls) == len(calls) and len(fa4.built) == len(built) + len(calls)
    for a, b in zip(once, per_layer, strict=True):
        assert a.token_ids == b.token_ids and torch.equal(a.logprobs, b.logprobs)
    # and the stand-in's bits are the CPU reference's: the layout's values are the step's own
    monkeypatch.undo()
    plain = LLM(model=model, **engine).generate(prompts, params, use_tqdm=False)
    for a, b in zip(once, plain, strict=True):
        assert a.token_ids == b.token_ids and torch.equal(a.logprobs, b.logprobs)
