"""Qwen3-MoE specifics: config fields, dense layers mixed in, both checkpoint layouts (per-expert as published and as
transformers' save_pretrained writes it; stacked as transformers holds it in memory), clear errors, router outputs.

The forward invariances (packed == alone, paged chunked == packed, decode == packed) run for this family in
test_qwen3.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from vexact_models import (
    AttentionMetadata,
    CheckpointError,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    config_from_dict,
    default_checkpoint,
    expected_tensors,
    load_balancing_loss,
    load_model,
    load_weights,
    random_model,
    record_router,
    save_checkpoint,
    tiny_qwen3_moe_config,
)
from vexact_models.layers import SparseMoeBlock

transformers = pytest.importorskip("transformers", reason="transformers writes the reference checkpoints")


def _forward(model, seqs):
    ids = torch.tensor([t for s in seqs for t in s])
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    return model(ids, pos, AttentionMetadata.packed([len(s) for s in seqs]))


def test_sparse_and_dense_layers_follow_the_config():
    cfg = tiny_qwen3_moe_config(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=(3,))
    m = Qwen3MoeForCausalLM(cfg)
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in m.model.layers]
    assert sparse == [False, True, False, False, False, True]  # (i+1) % 2 == 0, and layer 3 forced dense
    block = m.model.layers[1].mlp
    assert tuple(block.experts.gate_up_proj.shape) == (8, 64, 64)  # [E, 2I, H]
    assert tuple(block.experts.down_proj.shape) == (8, 64, 32)  # [E, H, I]
    assert tuple(block.gate.weight.shape) == (8, 64)


def test_hf_config_round_trip_and_validation():
    cfg = tiny_qwen3_moe_config()
    d = json.loads(json.dumps(cfg.to_hf_dict()))
    assert d["architectures"] == ["Qwen3MoeForCausalLM"] and d["mlp_only_layers"] == [1]
    assert config_from_dict(d) == cfg
    hf = transformers.Qwen3MoeConfig(**{k: v for k, v in d.items() if k != "torch_dtype"})
    assert config_from_dict(hf.to_dict()).num_experts == cfg.num_experts
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(9\) > num_experts \(8\)"):
        tiny_qwen3_moe_config(num_experts_per_tok=9)
    with pytest.raises(ValueError, match=r"mlp_only_layers has \[5\], outside the layers \[0, 3\)"):
        tiny_qwen3_moe_config(mlp_only_layers=(5,))
    with pytest.raises(ValueError, match="num_experts must be a positive integer"):
        tiny_qwen3_moe_config(num_experts=0)
    assert isinstance(config_from_dict(d), Qwen3MoeConfig)
    # transformers 5.x writes the expert count under its attribute-map name
    alias = {k: v for k, v in d.items() if k != "num_experts"}
    assert config_from_dict({**alias, "num_local_experts": 8}) == cfg
    with pytest.raises(ValueError, match=r"lacks \['num_experts'\]"):
        config_from_dict(alias)


def _hf_save(tmp_path, model):
    """Write our tiny model's weights through transformers' own Qwen3MoeForCausalLM.save_pretrained."""
    path = tmp_path / "ours"
    save_checkpoint(model, path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16)
    hf.save_pretrained(str(tmp_path / "hf"))
    return tmp_path / "hf"


def test_loads_what_transformers_save_pretrained_writes(tmp_path):
    ref = load_model(default_checkpoint("qwen3_moe"))
    hf_dir = _hf_save(tmp_path, ref)
    names = set(load_file(str(hf_dir / "model.safetensors")))
    # transformers 5.x holds experts stacked in memory but writes the published per-expert layout
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in names
    assert not any(n.endswith("experts.gate_up_proj") for n in names)
    back = load_model(hf_dir)
    for (n, a), (_, b) in zip(ref.named_parameters(), back.named_parameters(), strict=True):
        assert torch.equal(a, b), n


def test_loads_the_stacked_layout_too(tmp_path):
    ref = load_model(default_checkpoint("qwen3_moe"))
    stacked = {n: p.detach().contiguous() for n, p in ref.named_parameters()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in stacked
    fresh = random_model(ref.config, seed=5)
    loaded = load_weights(fresh, stacked.items())
    assert set(loaded) == set(expected_tensors(fresh))  # a stacked tensor counts as its per-expert names
    for (n, a), (_, b) in zip(ref.named_parameters(), fresh.named_parameters(), strict=True):
        assert torch.equal(a, b), n


def test_checkpoint_is_per_expert_and_round_trips(tmp_path):
    ref = load_model(default_checkpoint("qwen3_moe"))
    save_checkpoint(ref, tmp_path / "c", max_shard_bytes=100_000)
    index = json.loads((tmp_path / "c" / "model.safetensors.index.json").read_text())
    assert "model.layers.2.mlp.experts.7.down_proj.weight" in index["weight_map"]
    back = load_model(tmp_path / "c")
    seqs = [[1, 2, 3, 4, 5], [9, 8]]
    assert torch.equal(_forward(back, seqs), _forward(ref, seqs))


def _copy_without(src, dst, drop=None, reshape=None):
    dst.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = tensors[reshape][:, :-1].contiguous()
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


def test_missing_or_misshapen_expert_tensor_is_named(tmp_path):
    src = default_checkpoint("qwen3_moe")
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    with pytest.raises(CheckpointError, match=r"missing 1 tensor\(s\), e\.g\. \['model\.layers\.2\.mlp\.experts\.5"):
        load_model(_copy_without(src, tmp_path / "missing", drop=name))
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight: checkpoint shape"):
        load_model(_copy_without(src, tmp_path / "shape", reshape=name))
    ref = load_model(src)
    bad = ref.model.layers[0].mlp.experts.gate_up_proj.detach()[:, :-1]
    with pytest.raises(CheckpointError, match=r"experts\.gate_up_proj: checkpoint shape"):
        load_weights(ref, [("model.layers.0.mlp.experts.gate_up_proj", bad)], strict=False)
    with pytest.raises(CheckpointError, match=r"the model does not have.*experts\.8\.gate_proj"):
        load_weights(ref, [("model.layers.0.mlp.experts.8.gate_proj.weight", torch.zeros(32, 64))], strict=False)


def test_router_outputs_are_recorded_per_sparse_layer():
    model = load_model(default_checkpoint("qwen3_moe"))
    seqs = [[3, 1, 4, 1, 5], [9, 2, 6]]
    plain = _forward(model, seqs)
    with record_router() as router:
        hidden = _forward(model, seqs)
    assert torch.equal(hidden, plain)  # recording changes nothing
    assert len(router) == 2  # layers 0 and 2; layer 1 is dense
    for r in router:
        assert r.logits.shape == (8, 8) and r.logits.dtype == torch.float32
        assert r.topk_ids.shape == (8, 2)
    with record_router() as nothing:
        pass
    assert nothing == []
    loss = load_balancing_loss(router, num_experts=8, top_k=2)
    assert loss.ndim == 0 and loss.item() > 0
    # the formula as transformers writes it (a one-hot mean over tokens), bit for bit
    ids = torch.cat([r.topk_ids for r in router])[:, :2]
    one_hot = torch.nn.functional.one_hot(ids, 8).float().mean(dim=0)
    probs = torch.softmax(torch.cat([r.logits for r in router]).float(), dim=-1).mean(dim=0)
    assert torch.equal(loss, (one_hot * probs.unsqueeze(0)).sum() * 8)
    with pytest.raises(ValueError, match="no router outputs recorded"):
        load_balancing_loss([], 8, 2)
