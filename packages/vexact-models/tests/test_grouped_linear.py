"""grouped_linear: sibling projections whose weights lie end to end (q/k/v, gate/up under pack_parameters) run as one
matmul when inferring, bit for bit the separate matmuls (CPU reference; Triton interpreter; CUDA at Qwen3-1.7B shapes);
anything else (not adjacent, autograd on, fast backend, ...) falls back to the separate linears, so the trainer's
forward and backward are unchanged."""

from __future__ import annotations

import pytest
import torch

import vexact_kernels as vk
from vexact_kernels.triton_ops import interpreting, triton_available
from vexact_models import (
    QWEN3_SHAPES,
    AttentionMetadata,
    pack_parameters,
    random_model,
    tiny_config,
    tiny_deepseek_v3_config,
    tiny_qwen3_moe_config,
)
from vexact_models.layers import Linear, grouped_linear

interp = pytest.mark.skipif(
    not (triton_available() and interpreting()), reason="interpreter tests run where TRITON_INTERPRET=1 (no GPU)"
)


def _adjacent(widths, k, bias, dtype, device="cpu", seed=0, gap=0):
    """Linears whose weights (and biases) are consecutive views of one flat buffer (``gap`` elements between)."""
    g = torch.Generator(device).manual_seed(seed)
    n = sum(widths)
    flat_w = torch.empty(n * k + gap * len(widths), dtype=dtype, device=device)
    flat_b = torch.empty(n + gap * len(widths), dtype=dtype, device=device)
    linears, start, bstart = [], 0, 0
    for w in widths:
        lin = Linear(k, w, bias, dtype).to(device)
        lin.weight.data = flat_w[start : start + w * k].view(w, k)
        lin.weight.data.copy_(torch.randn(w, k, generator=g, device=device) / k**0.5)
        start += w * k + gap
        if bias:
            lin.bias.data = flat_b[bstart : bstart + w]
            lin.bias.data.copy_(torch.randn(w, generator=g, device=device))
            bstart += w + gap
        linears.append(lin.requires_grad_(False))
    return linears


def _count_linear(monkeypatch):
    calls = []
    real = vk.linear

    def counting(*args, **kwargs):
        calls.append(args[1].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(vk, "linear", counting)
    return calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m", [1, 3, 37])
def test_fused_equals_separate_on_the_reference(m, bias, dtype, monkeypatch):
    widths, k = (48, 16, 80), 100  # widths not multiples of the 32 / 64 tiles; K not of the 32-wide block
    linears = _adjacent(widths, k, bias, dtype)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    separate = [lin(x) for lin in linears]
    calls = _count_linear(monkeypatch)
    with torch.no_grad():
        fused = grouped_linear(x, linears)
    assert calls == [(sum(widths), k)]  # one matmul over the span
    for a, b in zip(fused, separate, strict=True):
        assert a.shape == b.shape and torch.equal(a, b)
    x3 = x.reshape(1, m, k)  # leading dims are kept
    with torch.no_grad():
        assert all(torch.equal(a[0], b) for a, b in zip(grouped_linear(x3, linears), separate, strict=True))


@interp
@pytest.mark.parametrize("m", [1, 3, 37])
@pytest.mark.parametrize("k", [70, 1100])  # 1100: two fixed splits of 1024
@pytest.mark.parametrize("bias", [False, True])
def test_interpreted_kernel_span_equals_separate_for_odd_widths(m, k, bias):
    """The property grouped_linear relies on, in the Triton kernel itself, at widths no tile divides."""
    from vexact_kernels.triton_ops import matmul

    widths = (13, 7, 50)
    linears = _adjacent(widths, k, bias, torch.bfloat16, seed=k)
    span_w = linears[0].weight.as_strided((sum(widths), k), (k, 1))
    span_b = linears[0].bias.as_strided((sum(widths),), (1,)) if bias else None
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
    fused = matmul.linear(x, span_w, span_b, torch.bfloat16).split(widths, dim=-1)
    for lin, part in zip(linears, fused, strict=True):
        assert torch.equal(part, matmul.linear(x, lin.weight, lin.bias, torch.bfloat16))


@interp
def test_interpreted_split_programs_and_single_program_agree_on_the_span():
    from vexact_kernels.triton_ops import matmul

    widths, k = (48, 16, 32), 1100
    linears = _adjacent(widths, k, True, torch.bfloat16, seed=5)
    span_w = linears[0].weight.as_strided((sum(widths), k), (k, 1))
    span_b = linears[0].bias.as_strided((sum(widths),), (1,))
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    parts = [matmul.matmul(x, lin.weight, lin.bias, torch.bfloat16, split_programs=True) for lin in linears]
    for split in (False, True):
        fused = matmul.matmul(x, span_w, span_b, torch.bfloat16, split_programs=split).split(widths, dim=-1)
        assert all(torch.equal(a, b) for a, b in zip(fused, parts, strict=True))


def _fallback_cases():
    separate = [Linear(64, w, False, torch.bfloat16).requires_grad_(False) for w in (32, 16)]
    for lin in separate:
        lin.weight.copy_(torch.randn(lin.weight.shape))
    yield "separate allocations", separate, {}
    yield "a gap between", _adjacent((32, 16), 64, False, torch.bfloat16, gap=8), {}
    yield "width not a multiple of 16", _adjacent((40, 16), 64, False, torch.bfloat16), {}
    mixed = _adjacent((32, 16), 64, True, torch.bfloat16)
    mixed[1].bias = None
    yield "one bias missing", mixed, {}
    apart = _adjacent((32, 16), 64, True, torch.bfloat16)
    apart[1].bias = torch.nn.Parameter(apart[1].bias.detach().clone(), requires_grad=False)  # its own allocation
    yield "biases not adjacent", apart, {}
    yield "autograd on", _adjacent((32, 16), 64, False, torch.bfloat16), {"grad": True}
    yield "fast backend", _adjacent((32, 16), 64, False, torch.bfloat16), {"backend": "fast"}


@pytest.mark.parametrize("case", list(_fallback_cases()), ids=lambda c: c[0])
def test_falls_back_to_separate_linears(case, monkeypatch):
    _, linears, opts = case
    x = torch.randn(5, 64).bfloat16()
    with vk.use_backend(opts.get("backend", "invariant")):
        separate = [lin(x) for lin in linears]
        calls = _count_linear(monkeypatch)
        with torch.set_grad_enabled(opts.get("grad", False)):
            out = grouped_linear(x, linears)
    assert len(calls) == len(linears)
    assert all(torch.equal(a, b) for a, b in zip(out, separate, strict=True))


FAMILIES = ["qwen3", "qwen2", "qwen2_wide", "llama", "mistral", "qwen3_moe", "deepseek_v3"]


def _cfg(family):
    if family == "qwen3_moe":
        return tiny_qwen3_moe_config()
    if family == "deepseek_v3":
        return tiny_deepseek_v3_config()
    if family == "qwen2_wide":  # q/k/v biases of 128 bf16 = 256 bytes: packed end to end, so they group too
        return tiny_config("qwen2", num_attention_heads=8, num_key_value_heads=8)
    return tiny_config(family, attention_bias=True) if family == "llama" else tiny_config(family)


def _run(model, grad: bool):
    ids = torch.tensor([5, 9, 200, 3, 17, 42, 7, 1])
    pos = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])
    meta = AttentionMetadata.packed([5, 3])
    with torch.set_grad_enabled(grad):
        hidden = model(ids, pos, meta)
        lp = model.logprobs(hidden, ids)
        lp = lp[0] if isinstance(lp, tuple) else lp
    return hidden, lp


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_model_inference_is_grouped_and_bitwise_unchanged(family, monkeypatch):
    plain = random_model(_cfg(family), seed=3)
    packed = random_model(_cfg(family), seed=3)
    pack_parameters(packed)
    calls_plain = _count_linear(monkeypatch)
    ref = _run(plain, grad=False)
    n_plain = len(calls_plain)
    calls_plain.clear()
    out = _run(packed, grad=False)
    for a, b in zip(out, ref, strict=True):
        assert torch.equal(a, b)
    cfg = plain.config
    biased_qkv = family in ("qwen2", "llama")  # tiny biases (64 and 32 wide) are padded apart: q/k/v stay separate
    if family == "deepseek_v3":  # dense MLPs and shared experts: one matmul fewer each
        assert len(calls_plain) < n_plain
    else:
        saved = cfg.num_hidden_layers * (0 if biased_qkv else 2)  # q/k/v: 3 -> 1
        saved += sum(1 for layer in packed.model.layers if hasattr(layer.mlp, "gate_proj"))  # gate/up: 2 -> 1
        assert n_plain - len(calls_plain) == saved


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_training_forward_and_grads_unchanged_by_packing(family):
    """Under grad the grouped path never runs: outputs and every parameter's grad equal the unpacked model's."""
    models = [random_model(_cfg(family), seed=4).requires_grad_(True) for _ in range(2)]
    pack_parameters(models[1])
    results = []
    for model in models:
        hidden, lp = _run(model, grad=True)
        (lp.sum() + hidden.float().square().mean()).backward()
        results.append((hidden.detach(), lp.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (h0, lp0, g0), (h1, lp1, g1) = results
    assert torch.equal(h0, h1) and torch.equal(lp0, lp1)
    assert g0.keys() == g1.keys()
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 64, 300])
@pytest.mark.parametrize("group", ["qkv", "gate_up", "qkv_bias"])
def test_gpu_fused_equals_separate_at_qwen3_1_7b_shapes(group, m, monkeypatch):
    """On CUDA (the invariant Triton matmul, split programs at small M, the TMA kernel above 256 rows): the grouped
    projections of Qwen3-1.7B are bit for bit the separate ones."""
    s = QWEN3_SHAPES["qwen3-1.7b"]
    k, d = s["hidden_size"], s["head_dim"]
    if group == "gate_up":
        widths = (s["intermediate_size"],) * 2
    else:
        widths = (s["num_attention_heads"] * d, s["num_key_value_heads"] * d, s["num_key_value_heads"] * d)
    linears = _adjacent(widths, k, group == "qkv_bias", torch.bfloat16, device="cuda", seed=m)
    x = torch.randn(m, k, device="cuda", generator=torch.Generator("cuda").manual_seed(m)).bfloat16()
    with torch.no_grad():
        separate = [lin(x) for lin in linears]
        calls = _count_linear(monkeypatch)
        fused = grouped_linear(x, linears)
    assert len(calls) == 1
    for a, b in zip(fused, separate, strict=True):
        assert torch.equal(a, b)
