"""gpt-oss specifics: config fields, layer types and their errors; the window and the sinks wired per layer; parity
with transformers' GptOssForCausalLM in fp32; checkpoints: bf16 with stacked experts (HF names, both ways) and MXFP4
(dequantised bit for bit as transformers' own ``convert_moe_packed_tensors``); positions past the window accepted by
the model and the engine; engine-side forward invariances (packed == alone, paged chunked == packed)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import vexact_kernels as vk
from vexact_models import (
    GPT_OSS_SHAPES,
    AttentionMetadata,
    CheckpointError,
    GptOssConfig,
    GptOssForCausalLM,
    config_from_dict,
    dequantize_mxfp4,
    load_model,
    named_weights,
    random_model,
    save_checkpoint,
    tiny_gpt_oss_config,
)

transformers = pytest.importorskip("transformers", reason="transformers is the reference")


def _packed(model, seqs):
    ids = torch.cat(seqs)
    pos = torch.cat([torch.arange(len(s), device=s.device) for s in seqs])
    return model(ids, pos, AttentionMetadata.packed([len(s) for s in seqs]))


def _hf_config(cfg: GptOssConfig):
    d = cfg.to_hf_dict()
    hf = transformers.GptOssConfig(**{k: v for k, v in d.items() if k not in ("architectures", "torch_dtype")})
    hf._attn_implementation = "eager"
    return hf


def test_layers_follow_the_config():
    cfg = tiny_gpt_oss_config(num_hidden_layers=4, layer_types=["full_attention", *["sliding_attention"] * 3])
    m = GptOssForCausalLM(cfg)
    assert [layer.self_attn.attn.window for layer in m.model.layers] == [None, 24, 24, 24]
    assert tiny_gpt_oss_config().layer_types == ("sliding_attention", "full_attention")
    block = m.model.layers[0].mlp
    assert tuple(block.experts.gate_up_proj.shape) == (8, 64, 64)  # [E, H, 2I], as transformers holds it
    assert tuple(block.experts.down_proj.shape) == (8, 32, 64)  # [E, I, H]
    assert tuple(block.router.bias.shape) == (8,) and tuple(m.model.layers[0].self_attn.sinks.shape) == (4,)


def test_hf_config_round_trip_and_real_shapes():
    cfg = tiny_gpt_oss_config()
    d = json.loads(json.dumps(cfg.to_hf_dict()))
    assert config_from_dict(d) == cfg
    hf = _hf_config(cfg)
    assert hf.layer_types == list(cfg.layer_types) and hf.rope_parameters["rope_type"] == "yarn"
    # transformers' defaults are gpt-oss-120b's shape (but 36 layers); its to_dict reads back as our config
    ours = config_from_dict({**transformers.GptOssConfig().to_dict(), "model_type": "gpt_oss"})
    want = GptOssConfig(**{**GPT_OSS_SHAPES["gpt-oss-120b"], "torch_dtype": ours.torch_dtype})
    assert dataclasses.replace(ours, router_aux_loss_coef=want.router_aux_loss_coef) == want
    assert ours.rope_scaling.attention_factor == pytest.approx(0.1 * torch.log(torch.tensor(32.0)).item() + 1.0)
    assert ours.layer_types[:2] == ("sliding_attention", "full_attention")


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(layer_types=["sliding_attention"]), "layer_types must list 2"),
        (dict(layer_types=["sliding_attention", "chunked_attention"]), "layer_types must list 2"),
        (dict(swiglu_limit=8.0), "swiglu_limit must be 7.0"),
        (dict(num_experts_per_tok=9), "num_experts_per_tok"),
        (dict(sliding_window=0), "sliding_window must be a positive integer"),
        (dict(hidden_act="gelu"), "hidden_act"),
    ],
)
def test_bad_config_is_an_error(bad, match):
    with pytest.raises(ValueError, match=match):
        tiny_gpt_oss_config(**bad)


def test_quantization_other_than_mxfp4_is_refused():
    d = tiny_gpt_oss_config().to_hf_dict()
    with pytest.raises(ValueError, match="only mxfp4 experts"):
        config_from_dict({**d, "quantization_config": {"quant_method": "fp8"}})
    assert config_from_dict({**d, "quantization_config": {"quant_method": "mxfp4"}}) == tiny_gpt_oss_config()


def _fp32_pair(seed=0):
    cfg = tiny_gpt_oss_config(torch_dtype="float32")
    ours = random_model(cfg, seed)
    with torch.no_grad():
        for name, w in named_weights(ours):
            if name.endswith("experts.gate_up_proj"):
                w.mul_(4.0)  # some gate and up values past the clamp at 7, as in the committed checkpoint
    hf = transformers.GptOssForCausalLM(_hf_config(cfg)).float().eval()
    hf.load_state_dict({n: t for n, t in named_weights(ours)}, strict=True)
    return ours, hf


def test_fp32_logprobs_match_transformers():
    """Sliding (window 24) and full layers, sinks, YaRN, biased router, clamped SwiGLU: fp32 logprobs within 1e-5 of
    transformers' eager GptOssForCausalLM on sequences longer than the window."""
    ours, hf = _fp32_pair()
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 256, (n,), generator=g) for n in (70, 9, 41)]
    with torch.no_grad():
        h = _packed(ours, seqs)
        got, _ = ours.logprobs(h, torch.cat([torch.roll(s, -1) for s in seqs]))
        s = 0
        for seq in seqs:
            want = hf(seq[None]).logits[0].float().log_softmax(-1).gather(1, torch.roll(seq, -1)[:, None])[:, 0]
            assert (got[s : s + len(seq)] - want).abs().max() < 1e-5
            s += len(seq)


def test_the_clamp_and_the_window_are_exercised():
    """The parity above means something only if the checkpoint reaches the clamp and the sequences the window."""
    ours, _ = _fp32_pair()
    seen = []
    layer = ours.model.layers[0]
    handle = layer.mlp.register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
    with torch.no_grad():
        _packed(ours, [torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(2))])
    handle.remove()
    h = vk.linear(seen[0], layer.mlp.experts.gate_up_proj[0].t(), layer.mlp.experts.gate_up_proj_bias[0])
    assert (h[:, 0::2] > 7).any() and (h[:, 1::2].abs() > 7).any()
    assert layer.self_attn.attn.window < 40


def test_positions_past_the_window_are_accepted():
    m = random_model(tiny_gpt_oss_config())
    with torch.no_grad():
        assert torch.isfinite(_packed(m, [torch.arange(100) % 256])).all()


def test_bf16_checkpoint_round_trip_with_stacked_experts_loads_in_transformers(tmp_path):
    """save_checkpoint writes transformers' names with the experts stacked (not one tensor per expert); both
    load_model and transformers' from_pretrained read it back bit for bit."""
    m = random_model(tiny_gpt_oss_config())
    save_checkpoint(m, tmp_path)
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert "model.layers.0.mlp.experts.gate_up_proj" in names and "model.layers.1.self_attn.sinks" in names
    assert not any(".experts.0." in n for n in names)
    back = load_model(tmp_path)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(named_weights(m), named_weights(back), strict=True))
    hf = transformers.GptOssForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    hf_sd = hf.state_dict()
    assert all(torch.equal(hf_sd[n], t) for n, t in named_weights(m))


def _mxfp4_pair(e, rows, cols, g):
    """Random MXFP4 blocks [e, rows, cols / 32, 16] and scales [e, rows, cols / 32] (exponents 2**-6 .. 2**2)."""
    blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(121, 130, (e, rows, cols // 32), generator=g, dtype=torch.uint8)
    return blocks, scales


def test_mxfp4_dequantisation_is_transformers_bit_for_bit():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(3)
    for shape in ((3, 10, 4, 16), (2, 64, 2, 16)):
        blocks = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
        scales = torch.randint(0, 256, shape[:-1], generator=g, dtype=torch.uint8)  # every exponent, inf and nan
        ours, theirs = dequantize_mxfp4(blocks, scales), convert_moe_packed_tensors(blocks, scales)
        assert ours.dtype == theirs.dtype == torch.bfloat16 and ours.shape == theirs.shape
        assert torch.equal(ours.view(torch.int16), theirs.view(torch.int16))  # bits, nan and -0.0 included


def test_mxfp4_checkpoint_loads_dequantised(tmp_path):
    """A checkpoint in the released layout (experts as MXFP4 blocks + scales, the rest bf16) loads with the experts
    equal to transformers' dequantisation; a lone half of a pair is an error naming the other."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    cfg = tiny_gpt_oss_config()
    m = random_model(cfg)
    g = torch.Generator().manual_seed(4)
    tensors, want = {}, {}
    for name, t in named_weights(m):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            e, cols, rows = t.shape  # the model's [E, in, out]: the checkpoint's rows are the outputs
            blocks, scales = _mxfp4_pair(e, rows, cols, g)
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            want[name] = convert_moe_packed_tensors(blocks, scales)
        else:
            tensors[name] = t.contiguous()
    d = {**cfg.to_hf_dict(), "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": []}}
    (tmp_path / "config.json").write_text(json.dumps(d))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    loaded = dict(named_weights(load_model(tmp_path)))
    assert all(torch.equal(loaded[n], w) for n, w in want.items())
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"layers\.1\.mlp\.experts\.down_proj_scales is missing"):
        load_model(tmp_path)


def test_engine_does_not_cap_max_model_len_at_the_window():
    from vexact_engine import EngineConfig
    from vexact_engine.kv_cache import resolve_max_model_len

    cfg = tiny_gpt_oss_config()
    assert resolve_max_model_len(cfg, EngineConfig(max_model_len=200)) == 200


@pytest.mark.gpu
def test_invariant_backend_runs_the_model_on_cuda_batch_invariant():
    """On CUDA the Triton kernels run the window, the sinks and the MoE options: a sequence past the window gives the
    same hidden states alone and packed with others, torch.equal, and a backward reaches the sinks and expert biases."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (on CPU the reference runs the window and the sinks)")
    m = random_model(tiny_gpt_oss_config(), device="cuda")
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 256, (n,), generator=g).cuda() for n in (60, 7, 33)]
    with torch.no_grad():
        batch = _packed(m, seqs)
        alone = _packed(m, seqs[:1])
    assert torch.equal(batch[:60], alone)
    for p in m.parameters():
        p.requires_grad_(True)
    _packed(m, seqs).float().square().mean().backward()
    layer = m.model.layers[0]
    assert layer.self_attn.sinks.grad is not None and layer.self_attn.sinks.grad.abs().sum() > 0
    assert layer.mlp.experts.gate_up_proj_bias.grad is not None and layer.mlp.experts.down_proj_bias.grad is not None
