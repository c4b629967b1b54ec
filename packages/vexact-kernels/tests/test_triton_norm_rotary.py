"""A Qwen3 attention's q/k norms and rotary in one launch (``rms_norm_rotary_qk``): bitwise the two launches it
replaces (the q/k norm pair, then the q/k rotation), on CPU through the interpreter at small shapes and on the GPU
at the 1.7B / 8B head layouts, on q and k as the dense model gives them (views into the grouped q/k/v output)."""

from __future__ import annotations

import pytest
import torch

import vexact_kernels as vk
from vexact_kernels import rotary
from vexact_kernels.triton_ops import interpreting, triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")
interp = pytest.mark.skipif(not interpreting(), reason="interpreter tests run where TRITON_INTERPRET=1 (no GPU)")
EPS = 1e-6


def _inputs(t, hq, hk, d, device, seed=0, max_position=512):
    """q ``[t, hq, d]`` and k ``[t, hk, d]`` split from one grouped q/k/v output (token stride ``(hq + 2 hk) d``), the
    norms' weights, positions and the rope tables."""
    g = torch.Generator().manual_seed(seed)
    qkv = (3.0 * torch.randn(t, (hq + 2 * hk) * d, generator=g)).bfloat16().to(device)
    q, k, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    wq = (1.0 + 0.1 * torch.randn(d, generator=g)).bfloat16().to(device)
    wk = (1.0 + 0.1 * torch.randn(d, generator=g)).bfloat16().to(device)
    positions = torch.randint(0, max_position, (t,), generator=g).to(device)
    cos, sin = (x.to(device) for x in vk.rope_cos_sin(d, max_position, 1e6))
    return q.view(t, hq, d), wq, k.view(t, hk, d), wk, positions, cos, sin


def _two_launches(q, wq, k, wk, positions, cos, sin):
    from vexact_kernels.triton_ops.rms_norm import triton_rms_norm_pair
    from vexact_kernels.triton_ops.rotary import triton_apply_rotary_pair

    qn, kn = triton_rms_norm_pair(q, wq, k, wk, EPS)
    return triton_apply_rotary_pair(qn, kn, positions, cos, sin)


def _fused(q, wq, k, wk, positions, cos, sin):
    from vexact_kernels.triton_ops.rms_norm import qk_norm_rotary_fwd

    return qk_norm_rotary_fwd(q, wq, k, wk, EPS, positions, cos, sin)


@interp
@pytest.mark.parametrize("t, hq, hk, d", [(1, 2, 1, 16), (3, 4, 2, 16), (2, 2, 2, 128), (5, 3, 1, 32)])
def test_interpreted_fused_launch_is_the_two_launches_bitwise(t, hq, hk, d):
    args = _inputs(t, hq, hk, d, "cpu", seed=t * d + hq)
    q1, k1 = _fused(*args)
    q2, k2 = _two_launches(*args)
    assert q1.shape == (t, hq, d) and k1.shape == (t, hk, d) and q1.is_contiguous() and k1.is_contiguous()
    assert torch.equal(q1, q2) and torch.equal(k1, k2)
    # and the contiguous copies give the views' bits
    q, wq, k, wk, *rest = args
    q3, k3 = _fused(q.contiguous(), wq, k.contiguous(), wk, *rest)
    assert torch.equal(q1, q3) and torch.equal(k1, k3)


def test_public_op_is_the_two_ops_where_it_does_not_fuse():
    """On CPU tensors (the reference), with the switch off, and where autograd records: the two ops, as they are."""
    q, wq, k, wk, positions, cos, sin = _inputs(3, 4, 2, 16, "cpu", seed=1)
    want = vk.apply_rotary_qk(*vk.rms_norm_pair(q, wq, k, wk, EPS), positions, cos, sin)
    got = vk.rms_norm_rotary_qk(q, wq, k, wk, EPS, positions, cos, sin)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    wq = wq.clone().requires_grad_()
    out = vk.rms_norm_rotary_qk(q, wq, k, wk, EPS, positions, cos, sin)
    assert out[0].requires_grad and not out[1].requires_grad
    (out[0].float().sum()).backward()
    assert wq.grad is not None


def test_head_sizes_outside_the_tile_take_the_two_launches(monkeypatch):
    """The one launch takes head rows of whole 16-byte vectors that one warp holds; another head size is refused by
    name there, and the public op runs the two launches for it (their bits, as everywhere)."""
    from vexact_kernels.triton_ops.rms_norm import qk_norm_rotary_fwd, qk_tile_fits

    assert qk_tile_fits(torch.empty(1, 1, 128, dtype=torch.bfloat16))
    assert qk_tile_fits(torch.empty(1, 1, 256, dtype=torch.bfloat16))
    assert qk_tile_fits(torch.empty(1, 1, 128, dtype=torch.float32))
    assert not qk_tile_fits(torch.empty(1, 1, 24, dtype=torch.bfloat16))  # 48-byte rows: not whole vectors
    assert not qk_tile_fits(torch.empty(1, 1, 512, dtype=torch.bfloat16))  # a row wider than a warp's 512 bytes
    assert not qk_tile_fits(torch.empty(1, 1, 256, dtype=torch.float32))
    args = _inputs(2, 2, 1, 24, "cpu", seed=3)
    with pytest.raises(ValueError, match="head size 24 of torch.bfloat16"):
        qk_norm_rotary_fwd(*args[:4], EPS, *args[4:])
    if triton_available() and interpreting():
        monkeypatch.setattr(rotary, "use_triton", lambda *a: True)  # the kernels' path on CPU tensors, interpreted
        q, k = vk.rms_norm_rotary_qk(*args[:4], EPS, *args[4:])
        want = vk.apply_rotary_qk(*vk.rms_norm_pair(*args[:4], EPS), *args[4:])
        assert torch.equal(q, want[0]) and torch.equal(k, want[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("t", [1, 7, 256])
@pytest.mark.parametrize("hq, hk", [(16, 8), (32, 8), (32, 4)])
def test_gpu_norm_rotary_qk_is_the_two_launches_bitwise(t, hq, hk, monkeypatch):
    """At the Qwen3-1.7B, 8B and 30B-A3B head layouts (head_dim 128), on grouped q/k/v views: the fused launch gives
    the two launches' bits (the norm's contracted sum of squares, the rotation's unfused products), and the public op
    takes it where ``FUSE_NORM_ROTARY`` is on."""
    args = _inputs(t, hq, hk, 128, "cuda", seed=t + hq + hk, max_position=40960)
    q1, k1 = _fused(*args)
    q2, k2 = _two_launches(*args)
    assert torch.equal(q1, q2) and torch.equal(k1, k2)
    q, wq, k, wk, positions, cos, sin = args
    with torch.no_grad():
        on = vk.rms_norm_rotary_qk(q, wq, k, wk, EPS, positions, cos, sin)
        monkeypatch.setattr(rotary, "FUSE_NORM_ROTARY", False)
        off = vk.rms_norm_rotary_qk(q, wq, k, wk, EPS, positions, cos, sin)
    assert torch.equal(on[0], off[0]) and torch.equal(on[1], off[1]) and torch.equal(on[0], q1)


def _kv_write_case(t, hq, hk, d, device, seed):
    """The inputs, the grouped output's v view, empty paged caches of 3 pages of 4 and a slot per token (one of them
    -1: a padding row, skipped)."""
    args = _inputs(t, hq, hk, d, device, seed=seed)
    q = args[0]
    wide = torch.randn(t, hk + 1, d, generator=torch.Generator().manual_seed(seed)).to(q.dtype).to(device)
    v = wide[:, 1:]  # a strided view, as the grouped q/k/v output gives v
    caches = [torch.full((3, 4, hk, d), 7.0, dtype=q.dtype, device=device) for _ in range(2)]
    slots = torch.randperm(12, generator=torch.Generator().manual_seed(seed))[:t]
    slots[t // 2] = -1
    return args, v, caches, slots.to(device)


def _written(args, v, caches, slots, fused: bool, monkeypatch):
    """``rms_norm_rotary_qk(..., kv_write=...)``'s outputs and the caches after it, with ``FUSE_KV_WRITE`` on/off."""
    k_cache, v_cache = (c.clone() for c in caches)
    monkeypatch.setattr(rotary, "FUSE_KV_WRITE", fused)
    with torch.no_grad():
        q, k = vk.rms_norm_rotary_qk(*args[:4], EPS, *args[4:], kv_write=(v, k_cache, v_cache, slots))
    return q, k, k_cache, v_cache


@interp
@pytest.mark.parametrize("t, hq, hk, d", [(1, 2, 1, 16), (5, 4, 2, 32)])
def test_interpreted_cache_write_in_the_launch_is_write_kv_cache(t, hq, hk, d, monkeypatch):
    """``FUSE_KV_WRITE``: the rotated k and the v rows stored in the paged caches by the norm + rotary launch are
    ``write_kv_cache``'s stores after it, bitwise (a padding row's slot -1 untouched), and q / k as before; a launch
    that stores k at the wrong head is caught."""
    from vexact_kernels import attention as att

    monkeypatch.setattr(rotary, "use_triton", lambda *a: True)  # the kernels' path on CPU tensors, interpreted
    monkeypatch.setattr(att, "use_triton", lambda *a: True)
    case = _kv_write_case(t, hq, hk, d, "cpu", seed=t + d)
    fused = _written(*case, True, monkeypatch)
    apart = _written(*case, False, monkeypatch)
    for a, b in zip(fused, apart, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(fused[0], _fused(*case[0])[0])
    if t > 1:  # one row is padding: the others were written
        assert not torch.equal(fused[2], case[2][0]) and not torch.equal(fused[3], case[2][1])
    from vexact_kernels.triton_ops import rms_norm as rn

    real = rn._qk_norm_rotary_kernel

    class OtherHead:  # k rows stored one head stride further: another head's place (or past the row)
        def __getitem__(self, grid):
            def launch(*a, **kw):
                a = list(a)
                a[25] = a[25] + 1 if a[25] != a[24] else a[25]  # stride_kch
                return real[grid](*a, **kw)

            return launch

    monkeypatch.setattr(rn, "_qk_norm_rotary_kernel", OtherHead())
    if hk > 1:
        assert not torch.equal(_written(*case, True, monkeypatch)[2], apart[2])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("t", [1, 7])
@pytest.mark.parametrize("hq, hk", [(16, 8), (32, 4)])
def test_gpu_cache_write_in_the_launch_is_write_kv_cache(t, hq, hk, monkeypatch):
    """On the GPU at head_dim 128 (the 1.7B and 30B-A3B layouts): the caches after the fused launch are the caches
    after the norm + rotary launch and ``write_kv_cache``, bitwise, and q / k the same."""
    case = _kv_write_case(t, hq, hk, 128, "cuda", seed=t + hq)
    fused = _written(*case, True, monkeypatch)
    apart = _written(*case, False, monkeypatch)
    for a, b in zip(fused, apart, strict=True):
        assert torch.equal(a, b)
