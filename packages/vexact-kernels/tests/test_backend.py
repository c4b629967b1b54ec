"""The backend switch: explicit, scoped, never a silent fallback."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

import vexact_kernels as vk


def test_default_is_invariant():
    assert vk.BACKENDS == ("invariant", "fast")
    assert vk.get_backend() == "invariant"


def test_use_backend_is_scoped_and_nests():
    with vk.use_backend("fast"):
        assert vk.get_backend() == "fast"
        with vk.use_backend("invariant"):
            assert vk.get_backend() == "invariant"
        assert vk.get_backend() == "fast"
    assert vk.get_backend() == "invariant"


def test_use_backend_restores_after_an_exception():
    with pytest.raises(RuntimeError, match="boom"), vk.use_backend("fast"):
        raise RuntimeError("boom")
    assert vk.get_backend() == "invariant"


def test_set_backend():
    try:
        vk.set_backend("fast")
        assert vk.get_backend() == "fast"
    finally:
        vk.set_backend("invariant")
    assert vk.get_backend() == "invariant"


@pytest.mark.parametrize("name", ["foo", "Invariant", "", "triton"])
def test_unknown_backend_raises_value_error_naming_it(name):
    with pytest.raises(ValueError, match=rf"unknown kernel backend {name!r}; expected one of"):
        with vk.use_backend(name):
            pass
    with pytest.raises(ValueError, match=rf"unknown kernel backend {name!r}"):
        vk.set_backend(name)
    assert vk.get_backend() == "invariant"


def test_backend_is_per_context_not_global():
    seen = []
    with vk.use_backend("fast"):
        t = threading.Thread(target=lambda: seen.append(vk.get_backend()))
        t.start()
        t.join()
    assert seen == ["invariant"]


def test_ops_dispatch_on_the_backend_in_force():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(300, 256, generator=g), torch.randn(256, 256, generator=g)
    with vk.use_backend("fast"):
        assert torch.equal(vk.linear(x, w), F.linear(x, w))
        logits = torch.randn(4, 50, generator=g)
        assert torch.equal(vk.log_softmax(logits), torch.log_softmax(logits, -1))
    # the invariant linear is a different reduction order: it must not be torch's GEMM for every row
    assert not torch.equal(vk.linear(x, w), F.linear(x, w))


def _op_calls():
    f = torch.float32
    cache = torch.zeros(2, 4, 1, 8)
    return {
        "linear": lambda dt: vk.linear(torch.ones(2, 8, dtype=dt), torch.ones(3, 8, dtype=f)),
        "rms_norm": lambda dt: vk.rms_norm(torch.ones(2, 8, dtype=dt), torch.ones(8), 1e-6),
        "silu_and_mul": lambda dt: vk.silu_and_mul(torch.ones(2, 8, dtype=dt), torch.ones(2, 8, dtype=dt)),
        "apply_rotary": lambda dt: vk.apply_rotary(
            torch.ones(2, 1, 8, dtype=dt), torch.arange(2), *vk.rope_cos_sin(8, 4, 1e4)
        ),
        "attention_packed": lambda dt: vk.attention_packed(
            torch.ones(2, 1, 8, dtype=dt), torch.ones(2, 1, 8), torch.ones(2, 1, 8), torch.tensor([0, 2])
        ),
        "attention_paged": lambda dt: vk.attention_paged(
            torch.ones(2, 1, 8, dtype=dt), cache, cache, torch.tensor([[0]]), torch.tensor([2]), torch.tensor([0, 2])
        ),
        "compute_logits": lambda dt: vk.compute_logits(
            torch.ones(2, 8, dtype=dt), torch.ones(8), 1e-6, torch.ones(5, 8)
        ),
    }


@pytest.mark.parametrize("op", sorted(_op_calls()))
@pytest.mark.parametrize("backend", vk.BACKENDS)
def test_every_op_rejects_integer_tensors_and_accepts_floats(op, backend):
    call = _op_calls()[op]
    with vk.use_backend(backend):
        call(torch.float32)  # the same call with a float tensor is fine
        with pytest.raises(TypeError, match="dtype torch.int64; expected one of"):
            call(torch.int64)


def _cuda_calls(dev: str):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 16, generator=g).to(dev)
    # the GPU attention kernels take bf16/fp16 (fp32 softmax statistics inside)
    qkv = torch.randn(6, 1, 16, generator=g).bfloat16().to(dev)
    cache = torch.randn(2, 4, 1, 16, generator=g).bfloat16().to(dev)
    logits = torch.randn(6, 50, generator=g).to(dev)
    return {
        "linear": lambda: vk.linear(x, x[:4]),
        "rms_norm": lambda: vk.rms_norm(x, torch.ones(16, device=dev), 1e-6),
        "silu_and_mul": lambda: vk.silu_and_mul(x, x),
        "attention_packed": lambda: vk.attention_packed(qkv, qkv, qkv, torch.tensor([0, 2, 6])),
        "attention_paged": lambda: vk.attention_paged(
            qkv[:2], cache, cache, torch.tensor([[1, 0]]), torch.tensor([7]), torch.tensor([0, 2])
        ),
        "log_softmax": lambda: vk.log_softmax(logits, torch.full((6,), 0.7)),
        "logprobs_from_hidden": lambda: vk.logprobs_from_hidden(
            x, torch.ones(16, device=dev), 1e-6, x[:5], torch.arange(6, device=dev) % 5, 0.9, chunk_size=4
        )[0],
    }


@pytest.mark.gpu
@pytest.mark.parametrize("op", list(_cuda_calls("cpu")))
def test_cuda_tensors_run_on_both_backends(op):
    """On CUDA the invariant backend runs its Triton kernels (no silent fallback to torch) and, like the fast
    backend, agrees with the CPU reference within tolerance."""
    on_cpu = _cuda_calls("cpu")[op]()
    call = _cuda_calls("cuda")[op]
    torch.testing.assert_close(call().cpu(), on_cpu, rtol=3e-2, atol=3e-2)  # different reduction order, bf16 I/O
    with vk.use_backend("fast"):
        out = call()
    tol = 3e-2 if op.startswith("attention") else 2e-3  # bf16 attention I/O; TF32 may be on for CUDA matmuls
    torch.testing.assert_close(out.cpu(), on_cpu, rtol=tol, atol=tol)


def test_per_op_backend_sets_only_the_listed_families():
    assert vk.OPS == ("linear", "attention", "rms_norm", "rotary", "activation", "logprobs", "moe")
    with vk.use_backend("fast", ops={"linear", "moe"}):
        assert vk.get_backend("linear") == "fast" and vk.get_backend("moe") == "fast"
        assert vk.get_backend("attention") == "invariant"
        assert vk.get_backend() == "fast:linear,moe"
        with vk.use_backend("fast", ops=["rotary"]):  # the others keep the enclosing context's backend
            assert vk.get_backend() == "fast:linear,rotary,moe"
        with vk.use_backend({"linear": "invariant"}):
            assert vk.get_backend() == "fast:moe"
        with vk.use_backend("invariant"):  # a name sets every family
            assert vk.get_backend() == "invariant"
    assert vk.get_backend() == "invariant"
    with vk.use_backend("fast:attention,logprobs"):  # a spec string: listed fast, the rest invariant
        assert vk.backend_map() == {op: "fast" if op in ("attention", "logprobs") else "invariant" for op in vk.OPS}
    with vk.use_backend("fast", ops=vk.OPS):
        assert vk.get_backend() == "fast"
    assert vk.check_backend("fast:moe, linear") == "fast:linear,moe"


@pytest.mark.parametrize(
    "spec, ops, match",
    [
        ("fast", {"matmul"}, "op families must be a non-empty subset of"),
        ("fast", set(), "op families must be a non-empty subset of"),
        ("fast:", None, "op families must be a non-empty subset of"),
        ("fast:linear,softmax", None, "op families must be a non-empty subset of"),
        ("quick:linear", None, "unknown kernel backend 'quick'"),
        ({"linear": "slow"}, None, "unknown kernel backend 'slow'"),
    ],
)
def test_bad_per_op_spec_raises_naming_it(spec, ops, match):
    with pytest.raises(ValueError, match=match), vk.use_backend(spec, ops=ops):
        pass
    assert vk.get_backend() == "invariant"


def test_ops_string_is_refused():
    with pytest.raises(TypeError, match="not the string 'linear'"), vk.use_backend("fast", ops="linear"):
        pass
    with pytest.raises(ValueError, match="unknown op family 'matmul'"):
        vk.get_backend("matmul")


def test_lm_head_follows_the_logprobs_family_not_linear():
    g = torch.Generator().manual_seed(1)
    h, nw, w = torch.randn(5, 64, generator=g), torch.ones(64), torch.randn(300, 64, generator=g)
    inv = vk.compute_logits(h, nw, 1e-6, w)
    with vk.use_backend("fast", ops={"linear"}):
        assert torch.equal(vk.compute_logits(h, nw, 1e-6, w), inv)
    with vk.use_backend("fast", ops={"logprobs"}):
        fast = vk.compute_logits(h, nw, 1e-6, w)
    assert not torch.equal(fast, inv)
    assert torch.equal(fast, F.linear(vk.rms_norm(h, nw, 1e-6), w))
