"""Checkpoints: save/load round trips (single file and sharded) and every way a checkpoint can be wrong."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from vexact_models import (
    AttentionMetadata,
    CheckpointError,
    Qwen3ForCausalLM,
    iter_checkpoint,
    load_config,
    load_model,
    load_weights,
    make_tiny_checkpoint,
    random_model,
    save_checkpoint,
    tiny_qwen3_config,
)

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def _params(model) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


def _assert_same_params(a, b):
    pa, pb = _params(a), _params(b)
    assert sorted(pa) == sorted(pb)
    for name in pa:
        assert pa[name].dtype == pb[name].dtype, name
        assert torch.equal(pa[name], pb[name]), name


def _forward(model, n: int = 9) -> torch.Tensor:
    ids = torch.arange(n) * 7 % model.config.vocab_size
    hidden = model(ids, torch.arange(n), AttentionMetadata.packed([n]))
    return model.logits(hidden)


def _rewrite_single(path, edit):
    tensors = load_file(str(path / SINGLE))
    edit(tensors)
    save_file(tensors, str(path / SINGLE), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def reference():
    return random_model(tiny_qwen3_config(), seed=3)


def test_single_file_round_trip(tmp_path, reference):
    save_checkpoint(reference, tmp_path)
    assert (tmp_path / SINGLE).is_file() and not (tmp_path / INDEX).exists()
    loaded = load_model(tmp_path)
    assert isinstance(loaded, Qwen3ForCausalLM) and loaded.config == reference.config
    _assert_same_params(loaded, reference)
    # rotary tables are rebuilt after meta init, so the forward pass is the same bit for bit
    assert torch.equal(loaded.model.rotary_emb.cos, reference.model.rotary_emb.cos)
    assert torch.equal(_forward(loaded), _forward(reference))
    assert not any(p.requires_grad for p in loaded.parameters())


def test_sharded_round_trip(tmp_path, reference):
    save_checkpoint(reference, tmp_path, max_shard_bytes=40_000)
    index = json.loads((tmp_path / INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (tmp_path / SINGLE).exists()
    assert set(index["weight_map"]) == set(_params(reference))
    assert index["metadata"]["total_size"] == sum(p.numel() * p.element_size() for p in reference.parameters())
    loaded = load_model(tmp_path)
    _assert_same_params(loaded, reference)
    assert torch.equal(_forward(loaded), _forward(reference))
    names = [n for n, _ in iter_checkpoint(tmp_path)]
    assert sorted(names) == sorted(_params(reference)) and len(names) == len(set(names))


def test_make_tiny_checkpoint_is_deterministic(tmp_path):
    a = load_model(make_tiny_checkpoint(tmp_path / "a", seed=5, tokenizer=False))
    b = load_model(make_tiny_checkpoint(tmp_path / "b", seed=5, tokenizer=False, max_shard_bytes=50_000))
    c = random_model(tiny_qwen3_config(), seed=6)
    _assert_same_params(a, b)
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


def test_dtype_override(tmp_path, reference):
    save_checkpoint(reference, tmp_path)
    loaded = load_model(tmp_path, dtype="float32")
    assert loaded.config.torch_dtype == "float32"
    for name, p in _params(loaded).items():
        assert p.dtype == torch.float32
        assert torch.equal(p, _params(reference)[name].float())


def test_missing_shard_file_names_it(tmp_path, reference):
    save_checkpoint(reference, tmp_path, max_shard_bytes=40_000)
    victim = sorted(set(json.loads((tmp_path / INDEX).read_text())["weight_map"].values()))[1]
    (tmp_path / victim).unlink()
    with pytest.raises(FileNotFoundError, match=victim):
        load_model(tmp_path)


def test_shard_lacking_a_tensor_its_index_lists(tmp_path, reference):
    save_checkpoint(reference, tmp_path, max_shard_bytes=40_000)
    index = json.loads((tmp_path / INDEX).read_text())
    name, shard = next(iter(index["weight_map"].items()))
    tensors = load_file(str(tmp_path / shard))
    del tensors[name]
    save_file(tensors, str(tmp_path / shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"shard {shard} lacks tensors its index lists: .*{name}"):
        load_model(tmp_path)


def test_no_weights_at_all(tmp_path, reference):
    save_checkpoint(reference, tmp_path)
    (tmp_path / SINGLE).unlink()
    with pytest.raises(FileNotFoundError, match="no safetensors weights"):
        load_model(tmp_path)


@pytest.fixture
def tiny_dir(tmp_path):
    return make_tiny_checkpoint(tmp_path / "tiny", tokenizer=False)


def _raises_naming(path, file_name: str, cause: type[Exception], match: str = ""):
    """load_model raises CheckpointError naming the file, chained to the reader's own error."""
    with pytest.raises(CheckpointError, match=re.escape(file_name) + match) as info:
        load_model(path)
    assert isinstance(info.value.__cause__, cause), repr(info.value.__cause__)
    return info.value


@pytest.mark.parametrize("damage", ["half", "garbage", "empty"])
def test_unreadable_safetensors_names_the_file(tiny_dir, damage):
    f = tiny_dir / SINGLE
    data = f.read_bytes()
    f.write_bytes({"half": data[: len(data) // 2], "garbage": bytes(range(256)) * 8, "empty": b""}[damage])
    err = _raises_naming(tiny_dir, SINGLE, SafetensorError, r" is not a readable safetensors file")
    assert str(tiny_dir / SINGLE) in str(err)
    with pytest.raises(CheckpointError, match=re.escape(SINGLE)):
        list(iter_checkpoint(tiny_dir))


def test_truncated_shard_of_a_sharded_checkpoint_names_it(tmp_path, reference):
    save_checkpoint(reference, tmp_path, max_shard_bytes=40_000)
    victim = sorted(set(json.loads((tmp_path / INDEX).read_text())["weight_map"].values()))[1]
    data = (tmp_path / victim).read_bytes()
    (tmp_path / victim).write_bytes(data[: len(data) // 2])
    _raises_naming(tmp_path, victim, SafetensorError, r" is not a readable safetensors file")


@pytest.mark.parametrize(
    "content,cause,match",
    [
        (b'{"model_type": "qwen3",', json.JSONDecodeError, r" is not valid JSON: Expecting"),
        (b"\x80\x81 not utf-8", UnicodeDecodeError, r" is not valid JSON"),
        (b"", json.JSONDecodeError, r" is not valid JSON"),
    ],
)
def test_config_json_that_is_not_json_names_the_file(tiny_dir, content, cause, match):
    (tiny_dir / "config.json").write_bytes(content)
    _raises_naming(tiny_dir, "config.json", cause, match)
    with pytest.raises(CheckpointError, match=re.escape(str(tiny_dir / "config.json")) + match):
        load_config(tiny_dir)


def test_config_json_that_is_not_an_object_names_the_file(tiny_dir):
    (tiny_dir / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=r"config.json must hold a JSON object, got a list"):
        load_model(tiny_dir)


def test_index_that_is_not_json_names_the_file(tmp_path, reference):
    save_checkpoint(reference, tmp_path, max_shard_bytes=40_000)
    text = (tmp_path / INDEX).read_text()
    (tmp_path / INDEX).write_text(text[: len(text) // 2])
    _raises_naming(tmp_path, INDEX, json.JSONDecodeError, r" is not valid JSON")
    with pytest.raises(CheckpointError, match=re.escape(INDEX)):
        list(iter_checkpoint(tmp_path))


@pytest.mark.parametrize("index", [{}, {"weight_map": ["model.norm.weight"]}, [1]])
def test_index_without_a_weight_map_names_the_file(tmp_path, reference, index):
    save_checkpoint(reference, tmp_path, max_shard_bytes=40_000)
    (tmp_path / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=re.escape(INDEX) + r" (has no weight_map|must hold a JSON object)"):
        load_model(tmp_path)


def test_checkpoint_error_is_one_class_wherever_imported():
    from vexact_models import errors, loader

    assert loader.CheckpointError is errors.CheckpointError is CheckpointError


def test_config_shape_mismatch(tmp_path, reference):
    """config.json says hidden 32, the weights were written for hidden 64."""
    save_checkpoint(reference, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["hidden_size"] = 32
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        CheckpointError,
        match=r"checkpoint shape \([^)]*64[^)]*\) != model shape \([^)]*32[^)]*\) \(does config.json match",
    ):
        load_model(tmp_path)


def test_unexpected_tensor(tmp_path, reference):
    save_checkpoint(reference, tmp_path)
    _rewrite_single(tmp_path, lambda t: t.__setitem__("model.layers.9.mlp.gate_proj.weight", torch.zeros(2, 2)))
    with pytest.raises(CheckpointError, match=r"1 tensor\(s\) the model does not have.*model.layers.9.mlp.gate_proj"):
        load_model(tmp_path)


def test_missing_tensor(tmp_path, reference):
    save_checkpoint(reference, tmp_path)
    _rewrite_single(tmp_path, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(CheckpointError, match=r"missing 1 tensor\(s\).*model.layers.1.self_attn.k_norm.weight"):
        load_model(tmp_path)


def test_integer_tensor(tmp_path, reference):
    save_checkpoint(reference, tmp_path)
    name = "model.norm.weight"
    _rewrite_single(tmp_path, lambda t: t.__setitem__(name, torch.ones(64, dtype=torch.int32)))
    with pytest.raises(CheckpointError, match=f"{name}: checkpoint dtype torch.int32 is not a floating-point type"):
        load_model(tmp_path)


def test_other_float_dtype_is_cast(tmp_path, reference):
    save_checkpoint(reference, tmp_path)
    _rewrite_single(tmp_path, lambda t: t.update({k: v.float() for k, v in t.items()}))
    loaded = load_model(tmp_path)
    _assert_same_params(loaded, reference)


def test_checkpoint_error_is_a_value_error():
    assert issubclass(CheckpointError, ValueError)


def test_partial_update_with_strict_false(reference):
    model = random_model(tiny_qwen3_config(), seed=4)
    name = "model.layers.0.mlp.up_proj.weight"
    src = _params(reference)[name]
    assert load_weights(model, [(name, src)], strict=False) == [name]
    assert torch.equal(_params(model)[name], src)
    with pytest.raises(CheckpointError, match="missing"):
        load_weights(model, [(name, src)], strict=True)
    with pytest.raises(CheckpointError, match=r"checkpoint shape \(3,\)"):
        load_weights(model, [(name, torch.zeros(3))], strict=False)


def test_tied_embeddings(tmp_path):
    cfg = tiny_qwen3_config(tie_word_embeddings=True)
    model = random_model(cfg, seed=7)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    save_checkpoint(model, tmp_path)
    stored = load_file(str(tmp_path / SINGLE))
    assert "lm_head.weight" not in stored and "model.embed_tokens.weight" in stored
    loaded = load_model(tmp_path)
    assert loaded.config.tie_word_embeddings
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    _assert_same_params(loaded, model)
    logits = _forward(loaded)
    assert torch.isfinite(logits).all()
    assert torch.equal(logits, _forward(model))
    # some tied checkpoints still store the head; it is ignored, not an "unexpected tensor"
    _rewrite_single(tmp_path, lambda t: t.__setitem__("lm_head.weight", torch.zeros(272, 64, dtype=torch.bfloat16)))
    again = load_model(tmp_path)
    assert torch.equal(_forward(again), logits)
