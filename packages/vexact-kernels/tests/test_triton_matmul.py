"""The invariant Triton matmul: on CPU through the interpreter (small shapes), on the GPU at real shapes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import vexact_kernels as vk
from vexact_kernels.triton_ops import interpreting, triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")
interp = pytest.mark.skipif(not interpreting(), reason="interpreter tests run where TRITON_INTERPRET=1 (no GPU)")


def _mm():
    from vexact_kernels.triton_ops import matmul

    return matmul


@interp
@settings(max_examples=15, deadline=None)
@given(m=st.integers(1, 40), k=st.integers(1, 150), n=st.integers(1, 40), bias=st.booleans())
def test_interpreted_matmul_correct_and_row_invariant(m, k, n, bias):
    mm = _mm()
    g = torch.Generator().manual_seed(m * 10007 + k * 101 + n)
    a = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    c = mm.matmul(a, w, b, torch.float32)
    ref = a.double() @ w.double().T + (b.double() if bias else 0)
    assert torch.allclose(c.double(), ref, atol=1e-3 * k**0.5, rtol=1e-3)
    for i in {0, m // 2, m - 1}:
        assert torch.equal(mm.matmul(a[i : i + 1], w, b, torch.float32)[0], c[i])


@interp
def test_interpreted_strided_operands_and_backward():
    mm = _mm()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 70, generator=g, dtype=torch.float32, requires_grad=True)
    w = torch.randn(33, 70, generator=g, dtype=torch.float32, requires_grad=True)
    y = mm.linear(x, w, None, torch.float32)
    gy = torch.randn(9, 33, generator=g)
    y.backward(gy)
    assert torch.allclose(x.grad, gy @ w.detach(), atol=1e-4)
    assert torch.allclose(w.grad, gy.T @ x.detach(), atol=1e-4)
    # a transposed (non-contiguous) operand gives the same values as its contiguous copy
    wt = w.detach().t().contiguous().t()
    assert torch.equal(mm.matmul(x.detach(), wt), mm.matmul(x.detach(), w.detach().contiguous()))


@interp
@pytest.mark.parametrize("bias", [False, True])
def test_interpreted_split_programs_give_the_same_bits(bias):
    """K = 2100 spans three fixed splits of 1024: one program walking them == a program per split + combine."""
    mm = _mm()
    g = torch.Generator().manual_seed(3)
    a = torch.randn(5, 2100, generator=g).bfloat16()
    w = torch.randn(20, 2100, generator=g).bfloat16()
    b = torch.randn(20, generator=g).bfloat16() if bias else None
    one = mm.matmul(a, w, b, torch.float32, split_programs=False)
    split = mm.matmul(a, w, b, torch.float32, split_programs=True)
    assert torch.equal(one, split)
    assert torch.equal(mm.matmul(a[2:3], w, b, torch.float32, split_programs=True)[0], one[2])
    ref = a.double() @ w.double().T + (b.double() if bias else 0)
    assert torch.allclose(one.double(), ref, atol=1e-3 * 2100**0.5, rtol=1e-3)


def test_dtype_mismatch_is_an_error():
    mm = _mm()
    with pytest.raises(TypeError, match="cast the weight"):
        mm.matmul(torch.zeros(2, 4), torch.zeros(3, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="expected a"):
        mm.matmul(torch.zeros(2, 4), torch.zeros(3, 5))


@pytest.mark.gpu
@pytest.mark.parametrize("kn", [(4096, 4096), (2048, 6144), (6144, 2048)])
@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_gpu_rows_equal_m1_for_random_m(kn, dtype):
    k, n = kn
    g = torch.Generator(device="cuda").manual_seed(k + n)
    w = torch.randn(n, k, device="cuda", generator=g).to(dtype)
    ms = [1, 2, 3, 8, 17, 64, 65, 255, 256, 257, 1000, 4096, 16384] + torch.randint(1, 16384, (6,)).tolist()
    x = torch.randn(max(ms), k, device="cuda", generator=g).to(dtype)
    ref = torch.cat([vk.linear(x[i : i + 1], w) for i in range(64)])  # each row alone (M = 1)
    for m in ms:
        y = vk.linear(x[:m], w)
        r = min(m, 64)
        assert torch.equal(y[:r], ref[:r]), f"M={m}: rows differ from M=1"
    # random row subsets
    idx = torch.randperm(max(ms), device="cuda")[:300]
    assert torch.equal(vk.linear(x[idx], w), vk.linear(x, w)[idx])
    # correctness vs cuBLAS within bf16 tolerance
    y = vk.linear(x[:4096], w, out_dtype=torch.float32)
    ref32 = x[:4096].float() @ w.float().T
    assert (y - ref32).abs().max().item() < 1e-2 * (k**0.5)


@pytest.mark.gpu
def test_gpu_every_config_gives_the_same_bits():
    """The invariance argument: tile M/N shape, warps/stages and where a K split runs never change an element."""
    mm = _mm()
    g = torch.Generator(device="cuda").manual_seed(0)
    for m, k, n in [(1, 4096, 4096), (300, 2048, 6144), (4096, 1024, 3000)]:
        a = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        w = torch.randn(n, k, device="cuda", generator=g).bfloat16()
        outs = [mm.matmul(a, w, out_dtype=torch.float32, config=cfg) for cfg in mm.CONFIGS]
        outs.append(mm.matmul(a, w, out_dtype=torch.float32, config=(16, 16, 4, 2)))
        outs.append(mm.matmul(a, w, out_dtype=torch.float32, config=(128, 256, 8, 3)))
        outs.append(mm.matmul(a, w, out_dtype=torch.float32, config=mm.TMA_CONFIG_FP32_OUT))  # persistent TMA
        outs.append(mm.matmul(a, w, out_dtype=torch.float32, config=(128, 128, 8, 4, True)))  # warp-specialized
        for cfg in ((16, 32, 4, 6), (16, 64, 4, 4), (64, 64, 4, 6)):  # a program per K split, then the combine
            outs.append(mm.matmul(a, w, out_dtype=torch.float32, config=cfg, split_programs=True))
        for o in outs[1:]:
            assert torch.equal(o, outs[0]), f"config changed bits at {(m, k, n)}"


@pytest.mark.gpu
def test_gpu_backward_deterministic_and_correct():
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(3000, 2048, device="cuda", generator=g).bfloat16().requires_grad_()
    w = torch.randn(1024, 2048, device="cuda", generator=g).bfloat16().requires_grad_()
    gy = torch.randn(3000, 1024, device="cuda", generator=g).bfloat16()
    grads = []
    for _ in range(2):
        x.grad = w.grad = None
        vk.linear(x, w).backward(gy)
        grads.append((x.grad.clone(), w.grad.clone()))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    assert (grads[0][0].float() - gy.float() @ w.float()).abs().max() < 0.5
    assert (grads[0][1].float() - gy.float().T @ x.float()).abs().max() < 2.0
