"""Dense configs (Qwen3, Qwen2, Llama, Mistral): validation at construction, HF config.json mapping, clear errors."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from vexact_models import (
    MODEL_CLASSES,
    LlamaConfig,
    Qwen3Config,
    config_from_dict,
    load_config,
    parse_dtype,
    tiny_config,
    tiny_qwen3_config,
)


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
    "rope,field",
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({"rope_scaling": {"type": "longrope", "factor": 2.0}}, "rope_scaling"),
        ({"rope_parameters": {"rope_type": "su", "rope_theta": 1e6}}, "rope_parameters"),
    ],
)
def test_unknown_rope_type_raises_naming_the_field(rope, field):
    name = next(iter(rope.values())).get("rope_type", next(iter(rope.values())).get("type"))
    with pytest.raises(ValueError, match=rf"{field}.rope_type '{name}' is not supported; supported: \['default', "):
        config_from_dict(_hf_dict(**rope))


def test_rope_scaling_types_read_from_either_field():
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}  # fmt: skip
    cfg = config_from_dict(_hf_dict(model_type="llama", rope_scaling=llama3))
    assert cfg.rope_scaling == llama3 and isinstance(cfg, LlamaConfig)
    d = _hf_dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e3})
    del d["rope_theta"]  # transformers 5.x keeps theta inside rope_parameters
    cfg = config_from_dict(d)
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0} and cfg.rope_theta == 5e3
    assert config_from_dict(_hf_dict(rope_scaling={"type": "dynamic", "factor": 2.0})).rope_scaling["rope_type"] == (
        "dynamic"
    )
    assert config_from_dict(_hf_dict(rope_parameters={"rope_type": "default", "rope_theta": 5.0})).rope_scaling is None
    with pytest.raises(ValueError, match=r"rope_scaling \(llama3\) lacks \['low_freq_factor', 'high_freq_factor'"):
        config_from_dict(_hf_dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}))
    with pytest.raises(ValueError, match=r"rope_scaling \(linear\): \['factor'\] must be > 0"):
        tiny_config("llama", rope_scaling={"rope_type": "linear", "factor": 0})


def test_hidden_act_other_than_silu_raises_naming_it():
    for family in ("qwen3", "llama", "qwen2", "mistral"):
        with pytest.raises(ValueError, match=r"hidden_act 'gelu' is not supported; supported: \['silu'\]"):
            config_from_dict(_hf_dict(model_type=family, hidden_act="gelu"))


def test_sliding_window_per_family():
    """Qwen: the window counts only with use_sliding_window and on layers >= max_window_layers (or layer_types);
    Mistral: whenever set; Llama: never."""
    assert (
        config_from_dict(_hf_dict(model_type="qwen2", sliding_window=32, use_sliding_window=False)).sliding_window
        is None
    )
    assert config_from_dict(_hf_dict(model_type="qwen2", sliding_window=32, use_sliding_window=True,
                                     max_window_layers=1)).sliding_window == 32  # fmt: skip
    assert (
        config_from_dict(_hf_dict(sliding_window=32, use_sliding_window=True, max_window_layers=2)).sliding_window
        is None
    )
    assert config_from_dict(_hf_dict(sliding_window=32, use_sliding_window=True,
                                     layer_types=["full_attention"] * 2)).sliding_window is None  # fmt: skip
    assert config_from_dict(_hf_dict(model_type="mistral", sliding_window=32)).sliding_window == 32
    assert config_from_dict(_hf_dict(model_type="mistral", sliding_window=None)).sliding_window is None
    with pytest.raises(ValueError, match="MistralConfig.sliding_window must be a positive integer or None, got 0"):
        config_from_dict(_hf_dict(model_type="mistral", sliding_window=0))


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2", "mistral"])
def test_every_family_round_trips_and_names_its_architecture(family):
    cfg = tiny_config(family)
    d = json.loads(json.dumps(cfg.to_hf_dict()))
    assert d["model_type"] == family and d["architectures"] == [MODEL_CLASSES[family].__name__]
    assert config_from_dict(d) == cfg


@pytest.mark.parametrize("model_type", ["qwen2_moe", "gemma", None])
def test_unknown_model_type_raises_naming_it(model_type):
    d = _hf_dict(model_type=model_type)
    with pytest.raises(
        ValueError, match=rf"unknown model_type {model_type!r}; supported: \['deepseek_v3', 'gpt_oss', 'llama', "
    ):
        config_from_dict(d)


def test_load_config_from_dir_and_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_hf_dict()))
    assert load_config(tmp_path) == tiny_qwen3_config()
    assert load_config(tmp_path / "config.json") == tiny_qwen3_config()
    (tmp_path / "config.json").write_text(json.dumps(_hf_dict(model_type="gemma")))
    with pytest.raises(ValueError, match="unknown model_type 'gemma'"):
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


def test_qwen3_8b_shape_is_the_published_config():
    """QWEN3_SHAPES["qwen3-8b"] holds Qwen/Qwen3-8B's config.json sizes; on the meta device (no 8B allocation) the
    model has the published 8.19B parameters (untied: the input embedding and lm_head are separate)."""
    from vexact_models import QWEN3_SHAPES

    cfg = tiny_qwen3_config(**QWEN3_SHAPES["qwen3-8b"])
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (4096, 12288, 36)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (32, 8, 128)
    assert cfg.vocab_size == 151936 and cfg.max_position_embeddings == 40960 and cfg.rope_theta == 1e6
    assert not cfg.tie_word_embeddings and cfg.kv_cache_dims == (8, 128, 128)
    assert cfg.to_hf_dict()["tie_word_embeddings"] is False
    with torch.device("meta"):
        model = MODEL_CLASSES["qwen3"](cfg)
    params = sum(p.numel() for p in model.parameters())
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert params == 8_190_735_360, params
