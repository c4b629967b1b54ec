"""The residual add fused into the norm after it (``layers.add_rms_norm``): a decoder layer hands the next one its MLP
output and the residual stream apart, so when inferring every norm but layer 0's input norm does the add too (one
kernel on CUDA). The hidden states and logprobs are bit for bit those of the plain pre-norm blocks
(``x = x + attn(norm(x)); x = x + mlp(norm(x))``): on the CPU reference, with the norms run by the Triton kernels
under the interpreter, and on CUDA. Under grad (the trainer), with hooks on a norm, the two ops run as before."""

from __future__ import annotations

import importlib

import pytest
import torch

import vexact_kernels as vk
from vexact_kernels.triton_ops import interpreting, triton_available
from vexact_models import AttentionMetadata, pack_parameters, random_model, tiny_config
from vexact_models import tiny_deepseek_v3_config as tiny_deepseek_v3
from vexact_models import tiny_qwen3_moe_config as tiny_qwen3_moe
from vexact_models.layers import RMSNorm, add_rms_norm

interp = pytest.mark.skipif(
    not (triton_available() and interpreting()), reason="interpreter tests run where TRITON_INTERPRET=1 (no GPU)"
)
FAMILIES = ["qwen3", "qwen2", "llama", "mistral", "qwen3_moe", "deepseek_v3"]


def _model(family: str, device="cpu"):
    cfg = {"qwen3_moe": tiny_qwen3_moe, "deepseek_v3": tiny_deepseek_v3}.get(family, lambda: tiny_config(family))()
    model = random_model(cfg, seed=7, device=device)
    pack_parameters(model)  # as the engine runs it
    return model


def _inputs(device="cpu"):
    ids = torch.tensor([5, 9, 200, 3, 17, 42, 7, 1, 99, 250], device=device)
    pos = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 0, 1], device=device)
    meta = AttentionMetadata.packed([5, 3, 2])
    if device != "cpu":
        meta = AttentionMetadata(cu_seqlens=meta.cu_seqlens.to(device))
    return ids, pos, meta


def _plain_blocks(model, ids, pos, meta) -> torch.Tensor:
    """The pre-norm blocks as written before the fusion: every residual add its own op."""
    x = model.model.embed_tokens(ids)
    for layer in model.model.layers:
        x = x + layer.self_attn(layer.input_layernorm(x), pos, meta, None)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return x


def _count_fused(monkeypatch) -> list[int]:
    calls = []
    real = vk.add_rms_norm

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(vk, "add_rms_norm", counting)
    return calls


def _check_model(model, ids, pos, meta, monkeypatch):
    with torch.no_grad():
        plain = _plain_blocks(model, ids, pos, meta)
        calls = _count_fused(monkeypatch)
        hidden = model(ids, pos, meta)
        assert len(calls) == 2 * model.config.num_hidden_layers - 1  # every norm but layer 0's input norm
        assert torch.equal(hidden, plain)
        assert torch.equal(model.logprobs(hidden, ids)[0], model.logprobs(plain, ids)[0])
    return hidden


@pytest.mark.parametrize("family", FAMILIES)
def test_inference_forward_is_bitwise_the_plain_blocks(family, monkeypatch):
    model = _model(family)
    ids, pos, meta = _inputs()
    hidden = _check_model(model, ids, pos, meta, monkeypatch)
    # under grad the trainer's path: each layer gets the stream as one tensor and fuses only its own add (attention
    # output + stream) into the post-attention norm, differentiable; the same bits
    calls = _count_fused(monkeypatch)
    assert torch.equal(model(ids, pos, meta), hidden) and len(calls) == model.config.num_hidden_layers
    trainable = random_model(model.config, seed=7).requires_grad_(True)  # the trainer's: not packed, needs grad
    out = trainable(ids, pos, meta)
    assert torch.equal(out, hidden) and out.grad_fn is not None
    out.float().square().sum().backward()
    assert all(p.grad is not None for n, p in trainable.named_parameters() if "post_attention_layernorm" in n)


@interp
@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3"])
def test_interpreted_triton_norms_in_the_model_are_bitwise_the_plain_blocks(family, monkeypatch):
    """The norms on the Triton kernels (the CUDA path, here through the interpreter): the fused kernel's sum and
    norm are the plain add's and the single norm kernel's."""
    from vexact_kernels.triton_ops import rms_norm as triton_rms_norm

    ops_module = importlib.import_module("vexact_kernels.rms_norm")  # the module, not the function of that name
    monkeypatch.setattr(ops_module, "use_triton", lambda *tensors: True)
    launches = []
    real = triton_rms_norm.add_rms_norm_fwd
    monkeypatch.setattr(triton_rms_norm, "add_rms_norm_fwd", lambda *a: launches.append(1) or real(*a))
    model = _model(family)
    _check_model(model, *_inputs(), monkeypatch)
    assert len(launches) == 2 * model.config.num_hidden_layers - 1


def test_a_hooked_norm_runs_as_its_module(monkeypatch):
    model = _model("qwen3")
    ids, pos, meta = _inputs()
    seen = []
    model.model.layers[1].input_layernorm.register_forward_hook(lambda mod, args, out: seen.append(args[0]))
    with torch.no_grad():
        plain = _plain_blocks(model, ids, pos, meta)
        seen.clear()
        calls = _count_fused(monkeypatch)
        assert torch.equal(model(ids, pos, meta), plain)
    assert len(calls) == 2 * model.config.num_hidden_layers - 2  # that norm's add and norm ran apart
    assert len(seen) == 1 and seen[0].shape == plain.shape  # the hook saw the stream (the add's result)


@pytest.mark.parametrize("grad", [False, True])
def test_add_rms_norm_helper_is_the_add_then_the_module(grad):
    norm = RMSNorm(48, 1e-6, torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.1 * torch.randn(48))
    x, r = torch.randn(6, 48).bfloat16(), torch.randn(6, 48).bfloat16()
    with torch.set_grad_enabled(grad):
        s, y = add_rms_norm(norm, x, r)
        assert torch.equal(s, x + r) and torch.equal(y, norm(x + r))
        s0, y0 = add_rms_norm(norm, x, None)  # no pending residual: x is the stream
        assert s0 is x and torch.equal(y0, norm(x))
    assert (y.grad_fn is not None) == grad  # under grad through the module: differentiable in the weight


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_inference_forward_is_bitwise_the_plain_blocks(family, monkeypatch):
    """On CUDA: the fused Triton kernel (one launch per add + norm) inside the model, against the plain blocks."""
    model = _model(family, device="cuda")
    _check_model(model, *_inputs("cuda"), monkeypatch)
