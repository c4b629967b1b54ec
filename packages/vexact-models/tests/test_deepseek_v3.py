"""DeepSeek-V3 / Moonlight specifics: config fields and their errors, dense and MoE layers, YaRN, both checkpoint
layouts (transformers' save_pretrained = published per-expert; stacked in memory), FP8 refused, and the MLA
contract (paged decode == packed training) shown failing once on a perturbed driver.

The forward invariances (packed == alone, paged chunked == packed, decode == packed) run for this family in
test_qwen3.py."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

import vexact_kernels as vk
from vexact_models import (
    DEEPSEEK_V3_SHAPES,
    AttentionMetadata,
    CheckpointError,
    DeepseekV3ForCausalLM,
    config_from_dict,
    default_checkpoint,
    load_model,
    load_weights,
    random_model,
    save_checkpoint,
    tiny_deepseek_v3_config,
)
from vexact_models.layers import DeepseekMoeBlock, MLAttention

transformers = pytest.importorskip("transformers", reason="transformers writes the reference checkpoints")


def _packed(model, seqs):
    ids = torch.cat(seqs)
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    return model(ids, pos, AttentionMetadata.packed([len(s) for s in seqs]))


def test_dense_and_moe_layers_follow_the_config():
    cfg = tiny_deepseek_v3_config(num_hidden_layers=6, first_k_dense_replace=2, moe_layer_freq=2)
    m = DeepseekV3ForCausalLM(cfg)
    assert [isinstance(layer.mlp, DeepseekMoeBlock) for layer in m.model.layers] == [0, 0, 1, 0, 1, 0]
    block = m.model.layers[2].mlp
    assert tuple(block.experts.gate_up_proj.shape) == (8, 64, 64)
    assert tuple(block.gate.e_score_correction_bias.shape) == (8,)
    assert tuple(block.shared_experts.gate_proj.weight.shape) == (32, 64)  # n_shared * moe_intermediate
    attn = m.model.layers[0].self_attn
    assert isinstance(attn, MLAttention) and tuple(attn.kv_b_proj.weight.shape) == (4 * (16 + 16), 32)
    assert not hasattr(DeepseekV3ForCausalLM(tiny_deepseek_v3_config(q_lora_rank=None)).model.layers[0].self_attn,
                       "q_a_proj")  # fmt: skip


def test_hf_config_round_trip_yarn_and_real_shapes():
    cfg = tiny_deepseek_v3_config()
    d = json.loads(json.dumps(cfg.to_hf_dict()))
    assert config_from_dict(d) == cfg
    hf = transformers.DeepseekV3Config(**{k: v for k, v in d.items() if k != "torch_dtype"})
    ours = config_from_dict(hf.to_dict())
    assert ours.rope_scaling == cfg.rope_scaling and ours.n_routed_experts == 8
    # the softmax scale carries YaRN's mscale(factor, mscale_all_dim)^2, as transformers' attention does
    assert cfg.softmax_scale == pytest.approx(24**-0.5 * (0.1 * 0.5 * torch.tensor(4.0).log().item() + 1) ** 2)
    hf_attn = transformers.DeepseekV3ForCausalLM(hf).model.layers[0].self_attn
    assert cfg.softmax_scale == pytest.approx(hf_attn.scaling, rel=1e-12)
    assert tiny_deepseek_v3_config(rope_scaling=None).softmax_scale == 24**-0.5
    for name, shape in DEEPSEEK_V3_SHAPES.items():
        c = tiny_deepseek_v3_config(**shape)
        assert c.kv_cache_dims == (c.num_attention_heads, 192, 128), name
    v3 = tiny_deepseek_v3_config(**DEEPSEEK_V3_SHAPES["deepseek-v3"])
    assert v3.is_moe_layer(3) and not v3.is_moe_layer(2)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(topk_group=3), r"topk_group \(3\) must be <= n_group \(2\)"),
        (dict(num_key_value_heads=2), r"num_key_value_heads \(2\) must equal num_attention_heads \(4\)"),
        (dict(qk_rope_head_dim=7), "qk_rope_head_dim must be even"),
        (dict(n_routed_experts=9), r"n_routed_experts \(9\) must be a multiple of n_group \(2\)"),
        (dict(num_experts_per_tok=5), r"num_experts_per_tok \(5\) > the experts of topk_group groups"),
        (dict(scoring_func="relu"), "scoring_func must be 'sigmoid' or 'softmax'"),
        (dict(topk_method="greedy"), "topk_method must be 'noaux_tc'"),
        (dict(v_head_dim=0), "v_head_dim must be a positive integer"),
        (dict(q_lora_rank=0), "q_lora_rank must be a positive integer"),
    ],
)
def test_bad_config_is_a_clear_error(change, match):
    with pytest.raises(ValueError, match=match):
        tiny_deepseek_v3_config(**change)


def test_bad_hf_config_json_is_a_clear_error():
    d = tiny_deepseek_v3_config().to_hf_dict()
    with pytest.raises(ValueError, match=r"rope_scaling.type 'dynamic' is not supported"):
        config_from_dict({**d, "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    with pytest.raises(ValueError, match="quantization_config .*'fp8'.* not supported"):
        config_from_dict({**d, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}})
    with pytest.raises(ValueError, match="rope_scaling.factor must be >= 1"):
        config_from_dict({**d, "rope_scaling": {**d["rope_scaling"], "factor": 0.5}})
    with pytest.raises(ValueError, match=r"lacks \['kv_lora_rank'\]"):
        config_from_dict({k: v for k, v in d.items() if k != "kv_lora_rank"})
    assert config_from_dict({**d, "q_lora_rank": None}).q_lora_rank is None


def test_fp8_checkpoint_tensors_are_refused(tmp_path):
    model = random_model(tiny_deepseek_v3_config(), seed=0)
    w = model.model.layers[0].self_attn.o_proj.weight
    name = "model.layers.0.self_attn.o_proj.weight"
    with pytest.raises(CheckpointError, match=f"{name} .*float8_e4m3fn.*not supported"):
        load_weights(model, [(name, w.to(torch.float8_e4m3fn))], strict=False)
    with pytest.raises(CheckpointError, match="weight_scale_inv .*FP8"):
        load_weights(model, [(name + "_scale_inv", torch.ones(1, 1))], strict=False)


def test_transformers_save_pretrained_and_stacked_layouts_load(tmp_path):
    """transformers 5.9 writes this model type per expert (``experts.{e}.gate_proj.weight``, as the published
    Moonlight checkpoint) with the bias in fp32; its in-memory layout is stacked. Both load to the same weights."""
    ref = load_model(default_checkpoint("deepseek_v3"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(default_checkpoint("deepseek_v3")), dtype=torch.bfloat16)
    hf.save_pretrained(tmp_path / "hf")
    saved = load_file(tmp_path / "hf" / "model.safetensors")
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in saved
    assert saved["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    loaded = load_model(tmp_path / "hf")
    for i in (1, 2):  # the fp32 bias comes back bit-exact in the bf16 model (its values are not bf16-representable)
        bias = saved[f"model.layers.{i}.mlp.gate.e_score_correction_bias"]
        assert not torch.equal(bias, bias.bfloat16().float())
        got = loaded.model.layers[i].mlp.gate.e_score_correction_bias
        assert got.dtype == torch.float32 and torch.equal(got, bias)
    for (n, a), b in zip(ref.named_parameters(), loaded.parameters(), strict=True):
        assert torch.equal(a, b), n
    stacked = hf.state_dict()
    assert "model.layers.2.mlp.experts.gate_up_proj" in stacked
    model = random_model(tiny_deepseek_v3_config(), seed=5)
    load_weights(model, stacked.items())
    for (n, a), b in zip(ref.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b), n


def test_bias_is_an_fp32_buffer_in_every_path(tmp_path):
    """The bias is a persistent fp32 buffer: a checkpoint tensor (saved, exported, packed in fp32), not a parameter
    (no gradient, no FSDP cast); a bf16 checkpoint bias loads (exactly, widened), a wrong shape is refused, and a
    packed bucket carries it in fp32 while the receiver refuses it in bf16."""
    from vexact_models import BucketPacker, TensorSpec, expected_tensors, load_bucket, named_weights, weight_dtype

    model = random_model(tiny_deepseek_v3_config(), seed=3)
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.dtype == torch.float32 and name not in dict(model.named_parameters())
    assert name in expected_tensors(model) and name in dict(named_weights(model))
    assert weight_dtype(name, torch.bfloat16) == torch.float32
    assert weight_dtype("model.layers.1.mlp.gate.weight", torch.bfloat16) == torch.bfloat16
    save_checkpoint(model, tmp_path / "ck")
    assert load_file(tmp_path / "ck" / "model.safetensors")[name].dtype == torch.float32
    half = torch.randn(8).bfloat16()
    load_weights(model, [(name, half)], strict=False)
    assert torch.equal(bias, half.float())
    with pytest.raises(CheckpointError, match=f"{name}: checkpoint shape \\(9,\\) != model shape \\(8,\\)"):
        load_weights(model, [(name, torch.zeros(9))], strict=False)

    src = random_model(tiny_deepseek_v3_config(), seed=4)
    packer = BucketPacker(1 << 16, "cpu", torch.bfloat16, num_buffers=1)
    for bucket in packer.buckets(named_weights(src)):
        specs = {spec.name: spec for spec in bucket.specs}
        if name in specs:
            assert specs[name].dtype == torch.float32
        load_bucket(model, packer.buffers[bucket.index], bucket.specs)
    for (n, a), (_, b) in zip(named_weights(model), named_weights(src), strict=True):
        assert a.dtype == weight_dtype(n, torch.bfloat16) and torch.equal(a, b.to(a.dtype)), n
    assert torch.equal(bias, src.model.layers[1].mlp.gate.e_score_correction_bias)
    bad = TensorSpec(name, (8,), torch.bfloat16, 0)
    with pytest.raises(CheckpointError, match="dtype torch.bfloat16 != the engine's torch.float32"):
        load_bucket(model, torch.zeros(256, dtype=torch.uint8), [bad])


def test_near_tie_routes_like_transformers_and_a_bf16_bias_would_not():
    """Three experts whose biased scores differ by 5e-4, below bf16's resolution at 0.5 (2^-8): with the fp32 bias
    our choice is transformers' ({1, 2}); the bias rounded to bf16 (the old parameter) ties them all, and the lower
    index wins ({0, 1}), so the comparison fails on it."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(default_checkpoint("deepseek_v3")), dtype=torch.bfloat16)
    ours = load_model(default_checkpoint("deepseek_v3")).model.layers[1].mlp
    theirs = hf.model.layers[1].mlp
    bias = torch.tensor([0.5005, 0.5010, 0.5015, -1.0, -1.0, -1.0, -1.0, -1.0])
    assert len(set(bias[:3].bfloat16().tolist())) == 1  # one bf16 value for the three
    assert theirs.gate.e_score_correction_bias.dtype == torch.float32  # transformers keeps it fp32 (and loads it so)
    theirs.gate.e_score_correction_bias.copy_(bias)
    ours.gate.e_score_correction_bias.copy_(bias)
    logits = torch.zeros(3, 8)  # equal unbiased scores: the bias alone decides
    want_ids, want_w = theirs.route_tokens_to_experts(logits)

    def agrees(block) -> bool:
        weights, ids = block.route(logits)
        order = ids.argsort(dim=-1)
        got = ids.gather(1, order), weights.gather(1, order)
        ref_order = want_ids.argsort(dim=-1)
        ref = want_ids.gather(1, ref_order), want_w.gather(1, ref_order)
        return torch.equal(got[0], ref[0]) and torch.allclose(got[1], ref[1])

    assert sorted(want_ids[0].tolist()) == [1, 2]
    assert agrees(ours)
    ours.gate.e_score_correction_bias.copy_(bias.bfloat16().float())  # the old bf16 parameter's value
    assert not agrees(ours)


def test_checkpoint_round_trip(tmp_path):
    model = random_model(tiny_deepseek_v3_config(q_lora_rank=None, rope_scaling=None), seed=2)
    save_checkpoint(model, tmp_path / "ck", max_shard_bytes=100_000)
    loaded = load_model(tmp_path / "ck")
    assert dataclasses.asdict(loaded.config) == dataclasses.asdict(model.config)
    seqs = [torch.randint(0, 272, (9,), generator=torch.Generator().manual_seed(0))]
    assert torch.equal(_packed(loaded, seqs), _packed(model, seqs))


def _paged_decode(model, seq: torch.Tensor, page: int = 4) -> torch.Tensor:
    """Prefill the first half of ``seq`` as one chunk, then decode the rest token by token, through a paged cache."""
    heads, dk, dv = model.config.kv_cache_dims
    n, pages = len(seq), -(-len(seq) // page)
    bf16 = torch.bfloat16
    caches = [
        (torch.zeros(pages, page, heads, dk, dtype=bf16), torch.zeros(pages, page, heads, dv, dtype=bf16))
        for _ in model.model.layers
    ]
    table = torch.arange(pages)[None]
    out, done = [], 0
    for chunk in [n // 2] + [1] * (n - n // 2):
        p = torch.arange(done, done + chunk)
        meta = AttentionMetadata(torch.tensor([0, chunk]), p, table, torch.tensor([done + chunk]))
        out.append(model(seq[done : done + chunk], p, meta, caches))
        done += chunk
    return torch.cat(out)


def test_mla_contract_fails_when_one_driver_applies_the_scale_elsewhere(monkeypatch):
    """The engine == trainer contract for MLA is not vacuous: fold the softmax scale into q (a bf16 rounding) in the
    paged driver only, the kernel then scaling by 1, and paged decode no longer equals the packed forward."""
    model = random_model(tiny_deepseek_v3_config(), seed=1)
    seq = torch.randint(0, 272, (24,), generator=torch.Generator().manual_seed(3))
    packed = _packed(model, [seq])
    assert torch.equal(_paged_decode(model, seq), packed)  # the real drivers agree
    real = vk.attention_paged

    def scale_folded_into_q(q, k_cache, v_cache, tables, ctx, cu, scale=None):
        return real(q * scale, k_cache, v_cache, tables, ctx, cu, 1.0)

    monkeypatch.setattr(vk, "attention_paged", scale_folded_into_q)
    assert not torch.equal(_paged_decode(model, seq), packed)
