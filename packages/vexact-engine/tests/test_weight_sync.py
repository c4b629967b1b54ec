"""Packed weight buckets into the engine (``load_bucket``), in place: parameters keep their storage; a bad bucket is
refused by name, changes nothing and leaves the engine usable; refused while asleep or with requests in flight. And
the single-copy path (``begin_weight_write`` / ``finish_weight_write``): a trainer writing straight into the packed
weights, in one process here (the CUDA IPC handles: contracts/test_weight_sync.py on a GPU)."""

from __future__ import annotations

import pytest
import torch

from vexact_engine import LLM, SamplingParams
from vexact_models import (
    BucketPacker,
    CheckpointError,
    DirectWriter,
    expected_tensors,
    random_model,
    tiny_qwen3_config,
)

KW = dict(max_num_seqs=4, max_num_batched_tokens=16, block_size=4, num_kv_blocks=64)
PROMPTS = [[5, 6, 7, 8, 9], [10, 11]]
PARAMS = SamplingParams(temperature=0.9, max_tokens=6, seed=4, ignore_eos=True)


def _buckets(model, bucket_bytes=16 << 10):
    packer = BucketPacker(bucket_bytes, "cpu", num_buffers=1)
    named = [(n, t.detach()) for n, t in expected_tensors(model).items()]
    return [(packer.buffers[0][: b.nbytes].clone(), b.specs) for b in packer.buckets(named)]


def _gen(llm):
    return llm.generate(PROMPTS, PARAMS, use_tqdm=False)


def _same(a, b):
    return all(x.token_ids == y.token_ids and torch.equal(x.logprobs, y.logprobs) for x, y in zip(a, b, strict=True))


def test_load_bucket_in_place_equals_a_fresh_engine():
    new = random_model(tiny_qwen3_config(), seed=2)
    llm = LLM(model=random_model(tiny_qwen3_config(), seed=1), **KW)
    ptrs = [p.data_ptr() for p in llm.model.parameters()]
    loaded = [n for buf, specs in _buckets(new) for n in llm.load_bucket(buf, specs)]
    assert sorted(loaded) == sorted(llm.weight_names())
    assert ptrs == [p.data_ptr() for p in llm.model.parameters()]  # same storage: captured graphs stay valid
    assert _same(_gen(llm), _gen(LLM(model=new, **KW)))


@pytest.mark.parametrize("field", ["name", "shape", "dtype"])
def test_a_bad_bucket_changes_nothing_and_the_engine_stays_usable(field):
    llm = LLM(model=random_model(tiny_qwen3_config(), seed=1), **KW)
    before = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    new = random_model(tiny_qwen3_config(), seed=2)
    (buf, specs), *rest = _buckets(new)
    s = specs[-1]
    bad = {"name": s._replace(name="model.layers.7.mlp.up_proj.weight"),
           "shape": s._replace(shape=(*s.shape[:-1], s.shape[-1] * 2)),
           "dtype": s._replace(dtype=torch.float32)}[field]  # fmt: skip
    with pytest.raises(
        CheckpointError, match={"name": "no tensor of that name", "shape": "shape", "dtype": "dtype"}[field]
    ):
        llm.load_bucket(buf, [*specs[:-1], bad])
    assert _same(_gen(llm), before)  # unchanged, still serving
    for b, sp in [(buf, specs), *rest]:  # and a good sync afterwards works
        llm.load_bucket(b, sp)
    assert _same(_gen(llm), _gen(LLM(model=new, **KW)))


def test_refused_while_asleep_or_busy_and_level_2_needs_every_weight():
    new = random_model(tiny_qwen3_config(), seed=2)
    buckets = _buckets(new)
    llm = LLM(model=random_model(tiny_qwen3_config(), seed=1), **KW)
    llm.sleep(level=2)
    with pytest.raises(RuntimeError, match="asleep"):
        llm.load_bucket(*buckets[0])
    llm.wake_up()
    llm.load_bucket(*buckets[0])
    llm.add_request([1, 2, 3], PARAMS)
    with pytest.raises(RuntimeError, match="not reloaded yet"):
        llm.step()
    with pytest.raises(RuntimeError, match="unfinished"):
        llm.load_bucket(*buckets[1])
    llm.abort_request("req-0")
    for b in buckets[1:]:
        llm.load_bucket(*b)
    assert _same(_gen(llm), _gen(LLM(model=new, **KW)))


def test_a_bucket_sync_drops_the_prefix_cache():
    """Cached K/V was computed with the old weights: after a packed sync the same prompts must not hit it (they would
    give the old model's next tokens), and the engine must equal a fresh one with the new weights."""
    new = random_model(tiny_qwen3_config(), seed=2)
    llm = LLM(model=random_model(tiny_qwen3_config(), seed=1), **KW)
    _gen(llm)
    assert llm.blocks.num_cached > 0
    for buf, specs in _buckets(new):
        llm.load_bucket(buf, specs)
    assert llm.blocks.num_cached == 0
    after = _gen(llm)
    assert all(o.num_cached_tokens == 0 for o in after)
    assert _same(after, _gen(LLM(model=new, **KW)))


def _direct(llm, model, **write_kw) -> list[str]:
    """The single-copy path in one process: the engine's packed buffers stand for the trainer's opened IPC views."""
    table, buffers = llm.begin_weight_write()
    writer = DirectWriter()
    writer.open(table, buffers)
    written = writer.write(expected_tensors(model).items(), **write_kw)
    return llm.finish_weight_write(table.key, table.mask(written))


def test_a_direct_write_lands_in_place_and_equals_a_fresh_engine():
    new = random_model(tiny_qwen3_config(), seed=2)
    llm = LLM(model=random_model(tiny_qwen3_config(), seed=1), **KW)
    _gen(llm)
    assert llm.blocks.num_cached > 0
    ptrs = [p.data_ptr() for p in llm.model.parameters()]
    assert sorted(_direct(llm, new)) == sorted(llm.weight_names())
    assert ptrs == [p.data_ptr() for p in llm.model.parameters()]  # same storage: captured graphs stay valid
    assert llm.blocks.num_cached == 0  # cached K/V of the old weights is gone
    assert _same(_gen(llm), _gen(LLM(model=new, **KW)))


def test_a_direct_write_after_a_level_2_sleep_and_the_refusals():
    new = random_model(tiny_qwen3_config(), seed=2)
    llm = LLM(model=random_model(tiny_qwen3_config(), seed=1), **KW)
    table, _ = llm.weight_table()
    llm.sleep(level=2)
    assert llm.weight_table() is None
    with pytest.raises(RuntimeError, match="asleep"):
        llm.begin_weight_write()
    llm.wake_up()
    assert llm.weight_table()[0].key != table.key  # new buffers: views opened for the old key are stale
    with pytest.raises(RuntimeError, match="re-allocated"):
        llm.finish_weight_write(table.key, table.mask([]))
    llm.add_request([1, 2, 3], PARAMS)
    with pytest.raises(RuntimeError, match="unfinished"):
        llm.begin_weight_write()
    llm.abort_request("req-0")
    with pytest.raises(RuntimeError, match="not reloaded yet"):
        llm.step()
    _direct(llm, new)
    assert _same(_gen(llm), _gen(LLM(model=new, **KW)))


def test_an_unpacked_engine_offers_no_direct_write():
    llm = LLM(model=random_model(tiny_qwen3_config(), seed=1), pack_weights=False, **KW)
    assert llm.weight_table() is None
    with pytest.raises(RuntimeError, match="not packed"):
        llm.begin_weight_write()
