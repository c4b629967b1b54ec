"""Qwen3Config: validation at construction, HF config.json mapping, clear errors."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from vexact_models import Qwen3Config, config_from_dict, load_config, parse_dtype, tiny_qwen3_config


def _hf_dict(**overrides) -> dict:
    d = tiny_qwen3_config().to_hf_dict()
    d.update(overrides)
    return d


def test_tiny_config_is_valid_gqa():
    cfg = tiny_qwen3_config()
    assert cfg.num_attention_heads % cfg.num_key_value_heads == 0
    assert cfg.num_attention_heads != cfg.num_key_value_heads
    assert cfg.dtype == torch.bfloat16
    assert cfg.eos_token_ids == (256,)


def test_hf_dict_round_trip():
    cfg = tiny_qwen3_config(tie_word_embeddings=True, eos_token_id=[256, 258])
    d = json.loads(json.dumps(cfg.to_hf_dict()))
    assert d["architectures"] == ["Qwen3ForCausalLM"] and d["model_type"] == "qwen3"
    assert config_from_dict(d) == cfg
    assert config_from_dict(d).eos_token_ids == (256, 258)


def test_from_hf_dict_fills_hf_defaults():
    d = _hf_dict()
    for key in ("head_dim", "num_key_value_heads", "torch_dtype", "rope_theta"):
        del d[key]
    d["dtype"] = "float32"
    cfg = config_from_dict(d)
    assert cfg.head_dim == d["hidden_size"] // d["num_attention_heads"]
    assert cfg.num_key_value_heads == cfg.num_attention_heads
    assert cfg.torch_dtype == "float32" and cfg.dtype == torch.float32
    assert cfg.rope_theta == Qwen3Config.rope_theta


def test_rope_theta_from_rope_parameters_and_unknown_keys_ignored():
    d = _hf_dict(rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, some_future_key=1)
    del d["rope_theta"]
    assert config_from_dict(d).rope_theta == 5000.0


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
        {"rope_scaling": {"type": "linear", "factor": 2.0}},
        {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e6}},
    ],
)
def test_non_default_rope_is_not_implemented(rope):
    name = next(iter(rope.values())).get("rope_type", next(iter(rope.values())).get("type"))
    with pytest.raises(NotImplementedError, match=rf"rope_type '{name}' is not supported"):
        config_from_dict(_hf_dict(**rope))


def test_sliding_window_is_not_implemented():
    with pytest.raises(NotImplementedError, match="sliding-window"):
        config_from_dict(_hf_dict(use_sliding_window=True))


@pytest.mark.parametrize("model_type", ["llama", "qwen2_moe", None])
def test_unknown_model_type_raises_naming_it(model_type):
    d = _hf_dict(model_type=model_type)
    with pytest.raises(
        ValueError, match=rf"unknown model_type {model_type!r}; supported: \['deepseek_v3', 'qwen3', 'qwen3_moe'\]"
    ):
        config_from_dict(d)


def test_load_config_from_dir_and_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_hf_dict()))
    assert load_config(tmp_path) == tiny_qwen3_config()
    assert load_config(tmp_path / "config.json") == tiny_qwen3_config()
    (tmp_path / "config.json").write_text(json.dumps(_hf_dict(model_type="mistral")))
    with pytest.raises(ValueError, match="unknown model_type 'mistral'"):
        load_config(tmp_path)


def test_load_config_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json at"):
        load_config(tmp_path)


def test_heads_not_a_multiple_of_kv_heads():
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\) must be a multiple of num_key_value_heads \(4\)"):
        tiny_qwen3_config(num_attention_heads=6, num_key_value_heads=4)
    with pytest.raises(ValueError, match="must be a multiple"):
        config_from_dict(_hf_dict(num_attention_heads=3, num_key_value_heads=2))


@pytest.mark.parametrize(
    "field,value",
    [
        ("hidden_size", 0),
        ("vocab_size", -5),
        ("num_hidden_layers", 2.0),
        ("head_dim", "16"),
        ("num_key_value_heads", 0),
    ],
)
def test_non_positive_or_non_int_sizes(field, value):
    with pytest.raises(ValueError, match=rf"Qwen3Config.{field} must be a positive integer, got {value!r}"):
        tiny_qwen3_config(**{field: value})


def test_other_field_errors():
    with pytest.raises(ValueError, match="head_dim must be even for rotary, got 15"):
        tiny_qwen3_config(head_dim=15)
    with pytest.raises(ValueError, match="rms_norm_eps must be > 0, got 0"):
        tiny_qwen3_config(rms_norm_eps=0)
    with pytest.raises(ValueError, match="unsupported dtype 'int8'"):
        tiny_qwen3_config(torch_dtype="int8")


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        tiny_qwen3_config().hidden_size = 128  # type: ignore[misc]


def test_parse_dtype():
    assert parse_dtype("torch.float16") is torch.float16
    assert parse_dtype(torch.bfloat16) is torch.bfloat16
    with pytest.raises(ValueError, match="unsupported dtype torch.float64"):
        parse_dtype(torch.float64)
    with pytest.raises(ValueError, match="unsupported dtype 'fp8'"):
        parse_dtype("fp8")
