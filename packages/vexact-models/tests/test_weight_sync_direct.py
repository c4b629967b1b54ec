"""The single-copy colocated path's two ends on CPU (the CUDA IPC handles between two processes are GPU tests:
contracts/test_weight_sync.py): the engine's table of where each checkpoint-named tensor lies in its packed buffers,
and the trainer's writer, which copies straight into them bit for bit and refuses a bad tensor by name before writing
its group."""

from __future__ import annotations

import pytest
import torch

from vexact_models import (
    CheckpointError,
    DirectWriter,
    WeightTable,
    copy_tensors,
    expected_tensors,
    named_weights,
    pack_parameters,
    random_model,
    tiny_config,
    tiny_deepseek_v3_config,
    tiny_qwen3_config,
    tiny_qwen3_moe_config,
    weight_dtype,
    weight_table,
)


def _config(family: str, dtype: str = "bfloat16"):
    if family == "qwen3_moe":
        return tiny_qwen3_moe_config(torch_dtype=dtype)
    if family == "deepseek_v3":
        return tiny_deepseek_v3_config(torch_dtype=dtype)
    return tiny_config(family, torch_dtype=dtype)


def _engine(family: str, seed: int = 5):
    model = random_model(_config(family), seed=seed)
    return model, pack_parameters(model)


def _writer(model, buffers) -> tuple[DirectWriter, WeightTable]:
    table, views = weight_table(model, buffers)
    writer = DirectWriter()
    writer.open(table, views)  # one process: the engine's own buffers stand for the opened IPC handles
    return writer, table


def _export(master, stacked: bool = False):
    """The trainer's export: fp32 master tensors by checkpoint name (per expert, or stacked tensors whole)."""
    return list(named_weights(master)) if stacked else list(expected_tensors(master).items())


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_moe", "deepseek_v3"])
def test_the_table_covers_every_checkpoint_name_in_the_packed_buffers(family):
    model, buffers = _engine(family)
    table, views = weight_table(model, buffers)
    assert set(expected_tensors(model)) <= set(table.slots)  # per expert and projection ...
    assert {n for n, _ in named_weights(model)} <= set(table.slots)  # ... and stacked tensors whole
    for name, t in expected_tensors(model).items():
        slot = table.slots[name]
        view = views[slot.buffer][slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)
        assert view.data_ptr() == t.data_ptr() and torch.equal(view, t), name
    params = {id(p) for p in model.parameters()}
    inside = {table.slots[n].buffer for n, t in named_weights(model) if id(t) in params}
    assert inside == set(range(len(buffers)))  # every parameter in a packed buffer ...
    loose = [n for n, t in named_weights(model) if id(t) not in params]
    assert all(table.slots[n].buffer >= len(buffers) for n in loose)  # ... buffers (DeepSeek's fp32 bias) apart
    assert bool(loose) == (family == "deepseek_v3")
    assert table.skip == (frozenset({"lm_head.weight"}) if model.config.tie_word_embeddings else frozenset())
    assert table.buffer_bytes == tuple(v.numel() for v in views)
    again, _ = weight_table(model, buffers)
    assert again.slots == table.slots and again.key != table.key  # a new key per table: views opened for one are stale


@pytest.mark.parametrize("stacked", [False, True], ids=["per-expert", "stacked"])
@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_moe", "deepseek_v3"])
def test_the_writer_copies_the_bf16_cast_in_place(family, stacked):
    model, buffers = _engine(family)
    ptrs = [p.data_ptr() for p in model.parameters()]
    master = random_model(_config(family, "float32"), seed=11)
    writer, table = _writer(model, buffers)
    named = _export(master, stacked)
    written = writer.write(named)
    assert written == [n for n, _ in named if n not in table.skip]
    assert writer.written_mask == table.mask(written)
    assert sorted(table.completed(writer.written_mask)) == sorted(expected_tensors(model))
    for name, t in expected_tensors(model).items():
        want = expected_tensors(master)[name].to(weight_dtype(name, torch.bfloat16))  # RNE, DeepSeek's bias fp32
        assert t.dtype == want.dtype and torch.equal(t, want), name
    assert ptrs == [p.data_ptr() for p in model.parameters()]  # same storage: captured graphs stay valid
    assert all(writer.view(n).data_ptr() == t.data_ptr() for n, t in expected_tensors(model).items())


@pytest.mark.parametrize("field", ["name", "shape", "dtype", "twice", "integer"])
def test_a_bad_tensor_is_refused_by_name_and_nothing_is_written(field):
    model, buffers = _engine("qwen3")
    before = {n: t.clone() for n, t in expected_tensors(model).items()}
    named = _export(random_model(_config("qwen3", "float32"), seed=11))
    name, t = named[-1]
    bad = {"name": [("model.layers.9.mlp.up_proj.weight", t)], "shape": [(name, t[:-1])], "dtype": [],
           "twice": [named[0]], "integer": [(name, t.to(torch.int32))]}[field]  # fmt: skip
    dtype = torch.float16 if field == "dtype" else torch.bfloat16  # a rollout dtype other than the engine's
    match = {"name": "no tensor of that name", "shape": "shape", "dtype": "dtype torch.float16 != the engine's "
             "torch.bfloat16", "twice": "sent twice", "integer": "floating-point"}[field]  # fmt: skip
    writer, _ = _writer(model, buffers)
    with pytest.raises(CheckpointError, match=f"nothing written: .*{match}"):
        writer.write([*named, *bad], dtype=dtype)
    assert all(torch.equal(t, before[n]) for n, t in expected_tensors(model).items())  # not even the good ones


def test_groups_are_written_until_a_bad_one_and_the_rest_is_still_consumed():
    model, buffers = _engine("qwen3")
    named = _export(random_model(_config("qwen3", "float32"), seed=11))
    writer, _ = _writer(model, buffers)
    consumed = []

    def produce():
        for i, item in enumerate(named):
            consumed.append(i)
            yield ("nope.weight", item[1]) if i == 5 else item

    with pytest.raises(CheckpointError, match=r"\(1 of \d+ tensors\), 5 tensors of earlier groups were written"):
        writer.write(produce(), group_bytes=1)  # a group per tensor, the sixth is bad
    assert consumed == list(range(len(named)))  # a collective producer is drained to its end
    got = expected_tensors(model)
    assert all(torch.equal(got[n], t.to(torch.bfloat16)) for n, t in named[:5])
    assert not any(torch.equal(got[n], t.to(torch.bfloat16)) for n, t in named[6:])


def test_per_tensor_copies_for_a_producer_that_reuses_its_memory():
    """A receiver yields views of one bucket buffer it refills (verl's checkpoint engines): with group_bytes=0 each
    tensor is copied before the next is produced."""
    model, buffers = _engine("qwen3")
    named = _export(random_model(_config("qwen3", "bfloat16"), seed=11))
    scratch = torch.empty(max(t.numel() for _, t in named), dtype=torch.bfloat16)

    def produce():
        for name, t in named:
            view = scratch[: t.numel()].view(t.shape)
            view.copy_(t)
            yield name, view

    writer, _ = _writer(model, buffers)
    writer.write(produce(), group_bytes=0)
    got = expected_tensors(model)
    assert all(torch.equal(got[n], t) for n, t in named)


def test_bad_arguments_and_masks():
    model, buffers = _engine("qwen3")
    table, views = weight_table(model, buffers)
    writer = DirectWriter()
    with pytest.raises(RuntimeError, match="before open"):
        writer.write([])
    with pytest.raises(ValueError, match="bytes"):
        writer.open(table, views[:-1] + [views[-1][:-1]])
    writer.open(table, views)
    with pytest.raises(ValueError, match="group_bytes"):
        writer.write([], group_bytes=-1)
    names = list(table.slots)[::3]
    assert sorted(table.completed(table.mask(names))) == sorted(n for name in names for n in table.slots[name].names)
    with pytest.raises(ValueError, match="slot mask"):
        table.completed(b"")
    writer.close()
    assert writer.key is None and writer.buffers == []
    t = torch.zeros(4, 4)
    model.model.norm.weight.data = t.t()[0]  # a strided view: no single slot to write
    with pytest.raises(ValueError, match="not contiguous"):
        weight_table(model)


def test_an_unpacked_model_gets_a_buffer_per_storage():
    model = random_model(tiny_qwen3_config(), seed=5)
    table, views = weight_table(model)
    assert len(views) == len({p.untyped_storage().data_ptr() for p in model.parameters()})
    writer = DirectWriter()
    writer.open(table, views)
    named = _export(random_model(_config("qwen3", "float32"), seed=11))
    writer.write(named)
    assert all(torch.equal(expected_tensors(model)[n], t.to(torch.bfloat16)) for n, t in named)


@pytest.mark.parametrize("memcpy_min_bytes", [0, 1 << 10, None], ids=["all-memcpy", "mixed", "all-foreach"])
@pytest.mark.parametrize("source", ["float32", "bfloat16"])
def test_the_copy_launches_do_not_change_the_values(source, memcpy_min_bytes):
    """copy_tensors can send large same-dtype tensors one memcpy each and the rest in one foreach launch: every split
    gives exactly copy_'s values (a bf16 source: the bytes; an fp32 one: the RNE cast, always in the foreach)."""
    model, buffers = _engine("qwen3")
    master = random_model(_config("qwen3", source), seed=11)
    table, views = weight_table(model, buffers)
    writer = DirectWriter(memcpy_min_bytes=memcpy_min_bytes)
    writer.open(table, views)
    writer.write(_export(master), group_bytes=1 << 12)
    for name, t in expected_tensors(model).items():
        assert torch.equal(t, expected_tensors(master)[name].to(torch.bfloat16)), name
    dsts = [torch.zeros(n, dtype=torch.bfloat16) for n in (3, 600, 1 << 20)]
    srcs = [torch.randn(n, dtype=torch.float32) for n in (3, 600, 1 << 20)]
    bf = [s.to(torch.bfloat16) for s in srcs]
    bf[2][7] = -0.0  # a byte copy keeps the sign of zero
    copy_tensors(dsts[::2], bf[::2], memcpy_min_bytes)  # the 2 MB one: a memcpy unless memcpy_min_bytes is None
    copy_tensors(dsts[1:2], srcs[1:2], memcpy_min_bytes)  # a cast: always the foreach launch
    assert all(torch.equal(d, s.to(torch.bfloat16)) for d, s in zip(dsts[1:2], srcs[1:2], strict=True))
    assert all(torch.equal(d.view(torch.int16), b.view(torch.int16)) for d, b in zip(dsts[::2], bf[::2], strict=True))
