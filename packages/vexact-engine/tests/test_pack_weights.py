"""EngineConfig.pack_weights: the engine keeps its parameters in flat buffers (``vexact_models.pack_parameters``) at
construction and after every wake-up; updates copy into them in place. Packing never changes a token or a logprob
bit: the engine with it on equals the engine with it off, through prefix-cache hits, padded decode, sleep/wake and
weight updates."""

from __future__ import annotations

import pytest
import torch

from vexact_engine import LLM, EngineConfig, SamplingParams
from vexact_models import (
    BucketPacker,
    default_checkpoint,
    expected_tensors,
    packed_buffers,
    random_model,
    tiny_config,
    tiny_qwen3_moe_config,
)

KW = dict(max_num_seqs=4, max_num_batched_tokens=16, block_size=4, num_kv_blocks=64, cuda_graph_batch_sizes=[2, 4])
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [10, 11], list(range(30, 45)), [5, 6, 7, 8, 9, 10, 11, 12, 14]]
PARAMS = SamplingParams(temperature=0.9, max_tokens=8, seed=4, ignore_eos=True)


def _cfg(family: str):
    return tiny_qwen3_moe_config() if family == "qwen3_moe" else tiny_config(family)


def _gen(llm):
    return llm.generate(PROMPTS, PARAMS, use_tqdm=False)


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids and torch.equal(x.logprobs, y.logprobs)


def _buckets(model, bucket_bytes=16 << 10):
    packer = BucketPacker(bucket_bytes, "cpu", num_buffers=1)
    named = [(n, t.detach()) for n, t in expected_tensors(model).items()]
    return [(packer.buffers[0][: b.nbytes].clone(), b.specs) for b in packer.buckets(named)]


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama", "qwen3_moe"])
def test_packed_engine_equals_unpacked_engine(family):
    packed = LLM(model=random_model(_cfg(family), seed=1), **KW)
    plain = LLM(model=random_model(_cfg(family), seed=1), pack_weights=False, **KW)
    assert packed_buffers(packed.model) is not None and packed_buffers(plain.model) is None
    first = _gen(packed)
    _same(first, _gen(plain))
    assert packed.stats["cached_prompt_tokens"] > 0  # the shared prompt prefix was a cache hit
    _same(_gen(packed), first)  # again, reading pages cached by the first round


def test_loaded_checkpoint_is_packed():
    llm = LLM(default_checkpoint(), num_kv_blocks=64)
    assert packed_buffers(llm.model) is not None
    plain = LLM(default_checkpoint(), num_kv_blocks=64, pack_weights=False)
    _same(llm.generate(PROMPTS, PARAMS, use_tqdm=False), plain.generate(PROMPTS, PARAMS, use_tqdm=False))


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_wake_and_updates_keep_the_weights_packed(level):
    llm = LLM(model=random_model(tiny_config("qwen3"), seed=1), **KW)
    new = random_model(tiny_config("qwen3"), seed=2)
    fresh = _gen(LLM(model=random_model(tiny_config("qwen3"), seed=2), pack_weights=False, **KW))
    _gen(llm)
    llm.sleep(level=level)
    assert all(p.numel() == 0 for p in llm.model.parameters())
    llm.wake_up()
    assert packed_buffers(llm.model) is not None
    llm.update_weights([(n, p.detach().clone()) for n, p in new.named_parameters()])
    buffers, _ = packed_buffers(llm.model)
    _same(_gen(llm), fresh)
    llm.load_bucket(*_buckets(random_model(tiny_config("qwen3"), seed=2))[0])  # in place as well
    after, _ = packed_buffers(llm.model)
    assert [b.data_ptr() for b in after] == [b.data_ptr() for b in buffers]


def test_pack_weights_must_be_a_bool():
    with pytest.raises(TypeError, match="pack_weights must be True or False, got 'yes'"):
        EngineConfig(pack_weights="yes")


def test_packed_engine_runs_grouped_projections(monkeypatch):
    """Each layer's q/k/v and gate/up run as one matmul each in the packed engine (7 -> 4 linears per layer)."""
    import vexact_kernels as vk

    counts = {}
    real = vk.linear
    for pack in (True, False):
        llm = LLM(model=random_model(tiny_config("qwen3"), seed=1), pack_weights=pack, **KW)
        calls = []
        monkeypatch.setattr(vk, "linear", lambda *a, _calls=calls, **k: _calls.append(a[1].shape) or real(*a, **k))
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1), use_tqdm=False)  # one prefill step
        monkeypatch.setattr(vk, "linear", real)
        counts[pack] = len(calls)
    layers = tiny_config("qwen3").num_hidden_layers
    assert counts[False] - counts[True] == 3 * layers


@pytest.mark.gpu
@pytest.mark.parametrize("recapture", ["eager", "lazy"])
def test_gpu_packed_engine_equals_unpacked_through_graphs_sleep_and_updates(recapture):
    """On CUDA: decode graphs and a graph of the steps with prompt tokens captured over the grouped projections, a
    level-1 wake restoring from pinned host copies into new flat buffers, a level-2 wake allocating them: tokens and
    logprobs those of the unpacked engine. ``graph_recapture="lazy"``: a wake_up captures the largest decode size
    and token count (4 and 16), and decode size 2 comes at its first step."""
    kw = dict(KW, device="cuda", graph_recapture=recapture)
    packed = LLM(default_checkpoint(), **kw)
    plain = LLM(default_checkpoint(), pack_weights=False, **kw)
    buffers, _ = packed_buffers(packed.model)
    assert all(b.is_cuda for b in buffers) and packed_buffers(plain.model) is None
    # decode batch sizes 2 and 4, and one token count (16, the step budget) for the steps with prompt tokens
    assert packed.runner.num_graphs == 3 and packed.runner.graph_error is None
    ref = _gen(plain)
    _same(_gen(packed), ref)
    for level in (1, 2):
        packed.sleep(level=level)
        packed.wake_up()
        if level == 2:
            packed.update_weights([(n, t.detach().clone()) for n, t in expected_tensors(plain.model).items()])
        assert packed_buffers(packed.model) is not None
        assert packed.runner.num_graphs == (3 if recapture == "eager" else 2) and packed.runner.graph_error is None
        _same(_gen(packed), ref)
        # the workload decodes at 4 and then 2 sequences: lazily, decode size 2 is captured at its first step
        assert packed.runner.num_graphs == 3 and packed.runner.captured_at_steps == (recapture == "lazy")
