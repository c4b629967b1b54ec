"""Triton rms_norm: on CPU through the interpreter (small shapes), on the GPU at real shapes.

Checks: float64-reference accuracy, row invariance (``torch.equal``), backward against float64 autograd, and a
deterministic (run-to-run identical) dweight. The q/k pair kernel: bitwise two single launches, also on q and k as
the dense model gives them (views into the grouped q/k/v output), which it reads in place, without a copy.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import vexact_kernels as vk
from vexact_kernels.triton_ops import interpreting, triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")
interp = pytest.mark.skipif(not interpreting(), reason="interpreter tests run where TRITON_INTERPRET=1 (no GPU)")
EPS = 1e-6


def _ops():
    from vexact_kernels.triton_ops import rms_norm

    return rms_norm


def _rand(*shape, seed=0, dtype=torch.bfloat16, scale=1.0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(dtype).to(device)


def _reference(x, w, eps=EPS):
    xd = x.double()
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _grads(x, w, dy, fn):
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    fn(x, w).backward(dy)
    return x.grad, w.grad


@interp
@pytest.mark.parametrize("hidden", [1, 100, 1500])
@pytest.mark.parametrize("scale", [1e-3, 50.0])
def test_interpreted_forward_matches_float64(hidden, scale):
    ops = _ops()
    x, w = _rand(5, hidden, seed=1, scale=scale), 1.0 + 0.1 * _rand(hidden, seed=2)
    ref = _reference(x, w)
    y32 = ops.triton_rms_norm(x, w, EPS, torch.float32)
    torch.testing.assert_close(y32.double(), ref, rtol=2e-6, atol=1e-6)
    y = ops.triton_rms_norm(x, w, EPS)
    assert y.dtype == torch.bfloat16
    # the interpreter rounds fp32 -> bf16 toward zero (the GPU rounds to nearest): allow one bf16 ulp
    torch.testing.assert_close(y.double(), ref, rtol=2.0**-7, atol=1e-6)


@interp
@settings(max_examples=12, deadline=None)
@given(m=st.integers(1, 12), hidden=st.sampled_from([8, 33, 200]), seed=st.integers(0, 2**16), data=st.data())
def test_interpreted_row_result_independent_of_batch(m, hidden, seed, data):
    ops = _ops()
    x, w = _rand(m, hidden, seed=seed), 1.0 + 0.1 * _rand(hidden, seed=seed + 1)
    full = ops.triton_rms_norm(x, w, EPS, torch.float32)
    rows = torch.tensor(data.draw(st.lists(st.integers(0, m - 1), min_size=1, max_size=m), label="rows"))
    assert torch.equal(ops.triton_rms_norm(x[rows], w, EPS, torch.float32), full[rows])
    step = data.draw(st.integers(1, m), label="chunk")
    assert torch.equal(torch.cat([ops.triton_rms_norm(c, w, EPS, torch.float32) for c in x.split(step)]), full)


@interp
def test_interpreted_backward_matches_float64_and_is_deterministic():
    ops = _ops()
    m, hidden = 70, 100
    x, w = _rand(m, hidden, seed=3, dtype=torch.float32), 1.0 + 0.1 * _rand(hidden, seed=4, dtype=torch.float32)
    dy = _rand(m, hidden, seed=5, dtype=torch.float32)
    dx, dw = _grads(x, w, dy, lambda a, b: ops.triton_rms_norm(a, b, EPS))
    rdx, rdw = _grads(x.double(), w.double(), dy.double(), _reference)
    torch.testing.assert_close(dx.double(), rdx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw.double(), rdw, rtol=1e-5, atol=1e-4)
    dx2, dw2 = _grads(x, w, dy, lambda a, b: ops.triton_rms_norm(a, b, EPS))
    assert torch.equal(dx, dx2) and torch.equal(dw, dw2)
    # forward values do not depend on whether autograd is recording
    assert torch.equal(
        ops.triton_rms_norm(x.requires_grad_(), w, EPS).detach(), ops.triton_rms_norm(x.detach(), w, EPS)
    )


@interp
@pytest.mark.parametrize("hidden", [24, 1500])
def test_interpreted_backward_tiles_many_partials_and_row_subsets(monkeypatch, hidden):
    """The backward's tiles: ``dweight`` over more partials than one tile of the final sum (small partials forced),
    against float64 and run to run; ``dx`` of a row subset at any offset bitwise the full batch's rows."""
    ops = _ops()
    monkeypatch.setattr(ops, "RMS_DW_ELEMS", 0)
    monkeypatch.setattr(ops, "RMS_DW_ROWS", 2 * ops.RMS_DW_TILE if hidden < 100 else ops.RMS_DW_TILE)
    m = 35 * ops.bwd_dw_shape(hidden)[0] + 3 if hidden < 100 else 2 * ops.RMS_DW_TILE + 5
    x, w = _rand(m, hidden, seed=6, dtype=torch.float32), 1.0 + 0.1 * _rand(hidden, seed=7, dtype=torch.float32)
    dy = _rand(m, hidden, seed=8, dtype=torch.float32)
    if hidden < 100:
        assert triton_cdiv(m, ops.bwd_dw_shape(hidden)[0]) > ops.RMS_DW_TILE  # two tiles of partials in the final sum
    dx, dw = _grads(x, w, dy, lambda a, b: ops.triton_rms_norm(a, b, EPS))
    rdx, rdw = _grads(x.double(), w.double(), dy.double(), _reference)
    torch.testing.assert_close(dx.double(), rdx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw.double(), rdw, rtol=1e-5, atol=1e-3)
    assert torch.equal(dw, _grads(x, w, dy, lambda a, b: ops.triton_rms_norm(a, b, EPS))[1])
    for lo, hi in ((0, 1), (5, 6), (3, 20), (m - 7, m)):
        sub, _ = _grads(x[lo:hi], w, dy[lo:hi], lambda a, b: ops.triton_rms_norm(a, b, EPS))
        assert torch.equal(sub, dx[lo:hi]), (lo, hi)


@interp
def test_interpreted_leading_dims_and_bf16_backward():
    ops = _ops()
    x, w = _rand(2, 3, 40, seed=6), 1.0 + 0.1 * _rand(40, seed=7)
    y = ops.triton_rms_norm(x, w, EPS)
    assert y.shape == x.shape and torch.equal(y.reshape(-1, 40), ops.triton_rms_norm(x.reshape(-1, 40), w, EPS))
    dy = _rand(2, 3, 40, seed=8)
    dx, dw = _grads(x, w, dy, lambda a, b: ops.triton_rms_norm(a, b, EPS))
    assert dx.dtype == dw.dtype == torch.bfloat16 and dx.shape == x.shape
    rdx, rdw = _grads(x.double(), w.double(), dy.double(), _reference)
    torch.testing.assert_close(dx.double(), rdx, rtol=2.0**-7, atol=1e-3)
    torch.testing.assert_close(dw.double(), rdw, rtol=2.0**-7, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [2048, 4096, 5120])
def test_gpu_every_row_equals_the_single_row_result(hidden):
    gen = torch.Generator().manual_seed(hidden)
    sizes = [1, 2, 31, 64, 1000, 16384] + torch.randint(1, 16385, (3,), generator=gen).tolist()
    x = _rand(max(sizes), hidden, seed=1, scale=3.0, device="cuda")
    w = (1.0 + 0.1 * _rand(hidden, seed=2)).to("cuda")
    singles = torch.cat([vk.rms_norm(x[i : i + 1], w, EPS) for i in range(x.shape[0])])
    for m in sizes:
        assert torch.equal(vk.rms_norm(x[:m], w, EPS), singles[:m]), f"M={m}"
    rows = torch.randperm(x.shape[0], generator=gen)[:777].cuda()
    assert torch.equal(vk.rms_norm(x[rows], w, EPS), singles[rows])
    ref = _reference(x[:64], w)
    torch.testing.assert_close(vk.rms_norm(x[:64], w, EPS, out_dtype=torch.float32).double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(vk.rms_norm(x[:64], w, EPS).double(), ref, rtol=2.0**-8, atol=1e-5)


@pytest.mark.gpu
def test_gpu_backward_matches_float64_and_is_deterministic():
    m, hidden = 4097, 4096
    x, w = _rand(m, hidden, seed=3, device="cuda"), (1.0 + 0.1 * _rand(hidden, seed=4)).to("cuda")
    dy = _rand(m, hidden, seed=5, device="cuda")
    dx, dw = _grads(x, w, dy, lambda a, b: vk.rms_norm(a, b, EPS))
    rdx, rdw = _grads(x.double(), w.double(), dy.double(), _reference)
    torch.testing.assert_close(dx.double(), rdx, rtol=2.0**-7, atol=1e-2)
    torch.testing.assert_close(dw.double(), rdw, rtol=2.0**-7, atol=1e-1)
    dx2, dw2 = _grads(x, w, dy, lambda a, b: vk.rms_norm(a, b, EPS))
    assert torch.equal(dx, dx2) and torch.equal(dw, dw2)
    # the forward gives the same bits whether or not autograd records
    y_grad = vk.rms_norm(x.clone().requires_grad_(), w, EPS).detach()
    assert torch.equal(y_grad, vk.rms_norm(x, w, EPS))
    # dx of a row does not depend on the other rows either
    dx1, _ = _grads(x[7:8], w, dy[7:8], lambda a, b: vk.rms_norm(a, b, EPS))
    assert torch.equal(dx1[0], dx[7])


def _check_pair(m1, m2, hidden, dtype, device, seed=0):
    """Two tensors' rows in one launch: each bitwise what its own launch gives (also a row-offset slice)."""
    ops = _ops()
    x1 = _rand(m1 + 1, hidden, seed=seed, dtype=dtype, scale=3.0, device=device)[1:]  # a view at a row offset
    x2 = _rand(m2, hidden, seed=seed + 1, dtype=dtype, scale=0.01, device=device)
    w1 = (1.0 + 0.1 * _rand(hidden, seed=seed + 2)).to(dtype).to(device)
    w2 = (1.0 + 0.1 * _rand(hidden, seed=seed + 3)).to(dtype).to(device)
    for out_dtype in (None, torch.float32):
        y1, y2 = ops.triton_rms_norm_pair(x1, w1, x2, w2, EPS, out_dtype)
        assert torch.equal(y1, ops.triton_rms_norm(x1, w1, EPS, out_dtype))
        assert torch.equal(y2, ops.triton_rms_norm(x2, w2, EPS, out_dtype))


@interp
@pytest.mark.parametrize("m1,m2,hidden", [(4, 2, 16), (1, 1, 100), (6, 3, 1500), (0, 2, 8)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_interpreted_pair_launch_is_bitwise_two_launches(m1, m2, hidden, dtype):
    _check_pair(m1, m2, hidden, dtype, "cpu", seed=m1 + hidden)


def test_public_pair_is_two_rms_norms():
    x1, x2 = _rand(3, 4, 32, seed=1), _rand(3, 2, 32, seed=2)
    w1, w2 = 1.0 + 0.1 * _rand(32, seed=3), 1.0 + 0.1 * _rand(32, seed=4)
    for backend in ("invariant", "fast"):
        with vk.use_backend(backend):
            y1, y2 = vk.rms_norm_pair(x1, w1, x2, w2, EPS)
            assert torch.equal(y1, vk.rms_norm(x1, w1, EPS)) and torch.equal(y2, vk.rms_norm(x2, w2, EPS))


def _qk_views(t, hq, hkv, d, dtype, device, seed=0, lead=()):
    """q ``[*lead, t, hq, d]`` and k ``[*lead, t, hkv, d]`` as DenseAttention makes them: split from one grouped q/k/v
    matmul output ``[*lead, t, (hq + 2 hkv) d]`` and viewed per head, so a token's stride is ``(hq + 2 hkv) d``."""
    qkv = _rand(*lead, t, (hq + 2 * hkv) * d, seed=seed, dtype=dtype, scale=3.0, device=device)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.view(*lead, t, hq, d), k.view(*lead, t, hkv, d)


def _check_pair_views(q, k, seed=0):
    """The pair kernel on views (read in place) gives the contiguous copies' bits: those of the pair launch and of
    two single launches, in today's output layout (contiguous, the input's shape); close to float64."""
    ops = _ops()
    d, dtype, device = q.shape[-1], q.dtype, q.device
    w1 = (1.0 + 0.1 * _rand(d, seed=seed + 2)).to(dtype).to(device)
    w2 = (1.0 + 0.1 * _rand(d, seed=seed + 3)).to(dtype).to(device)
    qc, kc = q.contiguous(), k.contiguous()
    for out_dtype in (None, torch.float32):
        y1, y2 = ops.triton_rms_norm_pair(q, w1, k, w2, EPS, out_dtype)
        c1, c2 = ops.triton_rms_norm_pair(qc, w1, kc, w2, EPS, out_dtype)
        assert y1.shape == q.shape and y2.shape == k.shape and y1.is_contiguous() and y2.is_contiguous()
        assert y1.dtype == y2.dtype == (out_dtype or dtype)
        assert torch.equal(y1, c1) and torch.equal(y2, c2)
        assert torch.equal(y1, ops.triton_rms_norm(qc, w1, EPS, out_dtype))
        assert torch.equal(y2, ops.triton_rms_norm(kc, w2, EPS, out_dtype))
    # fp32 out: within a few fp32 ulps of float64 (bf16 out is one rounding more, checked by the tests above)
    y1, y2 = ops.triton_rms_norm_pair(q, w1, k, w2, EPS, torch.float32)
    torch.testing.assert_close(y1.double(), _reference(q, w1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y2.double(), _reference(k, w2), rtol=1e-5, atol=1e-5)


VIEW_SHAPES = [(1, 4, 2, 16, ()), (3, 4, 2, 16, ()), (5, 2, 1, 32, ()), (5, 4, 2, 32, ()), (2, 4, 2, 100, ())]
VIEW_SHAPES += [(4, 3, 2, 8, ()), (2, 2, 2, 16, (2,))]  # the last with a leading batch dim: [2, T, H, D]


@interp
@pytest.mark.parametrize("t,hq,hkv,d,lead", VIEW_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_interpreted_pair_on_grouped_qkv_views_is_bitwise_the_copies(t, hq, hkv, d, lead, dtype):
    q, k = _qk_views(t, hq, hkv, d, dtype, "cpu", seed=t + d, lead=lead)
    assert not q.is_contiguous() or t == 1
    _check_pair_views(q, k, seed=t + d)


@interp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_interpreted_pair_on_other_layouts_is_bitwise_the_copies(dtype):
    """Inputs the kernel cannot read in place (last dim not contiguous, misaligned) or reads as [rows, H] (a 2-D
    view with a row stride, a zero token stride): the same bits as the contiguous copies."""
    q, k = _qk_views(4, 4, 2, 16, dtype, "cpu", seed=1)
    transposed = _rand(4, 16, 4, seed=2, dtype=dtype).transpose(1, 2)  # [4, 4, 16], last-dim stride 4
    misaligned = _rand(4 * 2 * 16 + 1, seed=3, dtype=dtype)[1:].view(4, 2, 16)
    rows_2d = q[:, 1]  # [4, 16], row stride (4 + 2 * 2) * 16
    broadcast = k[:1].expand(3, 2, 16)  # token stride 0
    for a, b in ((transposed, k), (q, misaligned), (rows_2d, k), (q, broadcast), (rows_2d, k[0])):
        _check_pair_views(a, b)


class _Recorder:
    """Stands in for the pair kernel: records what a launch would receive."""

    def __init__(self):
        self.args = None

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.args = args

        return launch


class _AtenOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


COPIES = {"clone", "copy_", "_to_copy", "contiguous"}


@pytest.mark.parametrize("t", [1, 2, 256])
def test_pair_reads_grouped_qkv_views_in_place(monkeypatch, t):
    """q and k, views into the grouped q/k/v output, reach the kernel as they are: no aten copy, the views' own
    storage and strides (the launch is only recorded here, so this runs without Triton's interpreter)."""
    ops = _ops()
    hq, hkv, d = 16, 8, 128
    q, k = _qk_views(t, hq, hkv, d, torch.bfloat16, "cpu")
    w = torch.ones(d, dtype=torch.bfloat16)
    kernel = _Recorder()
    monkeypatch.setattr(ops, "_rms_norm_fwd_pair_kernel", kernel)
    with _AtenOps() as seen:
        y1, y2 = ops.triton_rms_norm_pair(q, w, k, w, EPS)
    assert not COPIES & set(seen.ops), seen.ops
    x1, n1, s1t, s1h, x2, n2, s2t, s2h = (kernel.args[i] for i in (0, 5, 6, 7, 8, 12, 13, 14))
    assert x1.data_ptr() == q.data_ptr() and x2.data_ptr() == k.data_ptr()
    stride = (hq + 2 * hkv) * d
    # one token: its heads are one run of [H, D] rows (stride D), else a token stride and a head stride
    want = (1, d, d, 1, d, d) if t == 1 else (hq, stride, d, hkv, stride, d)
    assert (n1, s1t, s1h, n2, s2t, s2h) == want
    assert y1.shape == q.shape and y2.shape == k.shape and y1.is_contiguous() and y2.is_contiguous()
    # a last dim that is not contiguous is still copied (and the mode sees such a copy)
    with _AtenOps() as seen:
        ops.triton_rms_norm_pair(q.transpose(1, 2).contiguous().transpose(1, 2), w, k, w, EPS)
    assert COPIES & set(seen.ops)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden", [64, 128, 256, 2048])
def test_gpu_pair_launch_is_bitwise_two_launches(dtype, hidden):
    """Same compiled row code in both kernels, so the same sum-of-squares tree: checked on many rows."""
    for m1, m2 in ((16, 8), (1, 1), (4096 * 16, 4096 * 8), (333, 7)):
        _check_pair(m1, m2, hidden, dtype, "cuda", seed=m1 + hidden)
    x1, x2 = _rand(5, 16, hidden, seed=9, device="cuda"), _rand(5, 8, hidden, seed=10, device="cuda")
    w = (1.0 + 0.1 * _rand(hidden, seed=11)).cuda()
    with torch.no_grad():
        y1, y2 = vk.rms_norm_pair(x1, w, x2, w, EPS)
    assert torch.equal(y1, vk.rms_norm(x1, w, EPS)) and torch.equal(y2, vk.rms_norm(x2, w, EPS))
    # q and k as the dense model gives them (Qwen3's 16 and 8 heads): read in place, the copies' bits
    for t in (1, 2, 256, 4097) if hidden <= 256 else (1, 256):
        q, k = _qk_views(t, 16, 8, hidden, dtype, "cuda", seed=t + hidden)
        _check_pair_views(q, k, seed=t + hidden)
        with torch.no_grad():
            y1, y2 = vk.rms_norm_pair(q, w.to(dtype), k, w.to(dtype), EPS)
        assert torch.equal(y1, vk.rms_norm(q.contiguous(), w.to(dtype), EPS))
        assert torch.equal(y2, vk.rms_norm(k.contiguous(), w.to(dtype), EPS))


def _check_add(shape, dtype, device, seed=0):
    """The fused residual add + norm is torch's add, then the single kernel on the sum, bit for bit (x a view at a
    row offset, as a slice of a batch is)."""
    ops = _ops()
    x = _rand(shape[0] + 1, *shape[1:], seed=seed, dtype=dtype, scale=3.0, device=device)[1:]
    r = _rand(*shape, seed=seed + 1, dtype=dtype, device=device)
    w = (1.0 + 0.1 * _rand(shape[-1], seed=seed + 2)).to(dtype).to(device)
    s, y = ops.triton_add_rms_norm(x, r, w, EPS)
    assert s.shape == y.shape == x.shape and s.dtype == y.dtype == dtype
    assert torch.equal(s, x + r)
    assert torch.equal(y, ops.triton_rms_norm(x + r, w, EPS))


@interp
@pytest.mark.parametrize("shape", [(1, 8), (4, 100), (2, 3, 200), (3, 1500), (0, 16)], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_interpreted_add_rms_norm_is_the_add_then_the_norm(shape, dtype):
    _check_add(shape, dtype, "cpu", seed=shape[-1])


@interp
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's, on the inf sums (and then the norm of inf)
def test_interpreted_add_rounds_to_nearest_even_as_torch():
    """bf16 sums at the rounding edges (ties to even both ways, carries into the exponent, overflow to inf, inf,
    signed zeros), where a truncating or ties-away cast would differ from torch's add."""
    ops = _ops()
    a = torch.tensor([1.0, 1.0, 1.0 + 2.0**-7, 255.0, 3.0e38, -3.0e38, float("inf"), 0.0, -0.0, -1.0])
    b = torch.tensor([2.0**-8, 3 * 2.0**-9, 2.0**-8, 0.5, 3.0e38, -3.0e38, 1.0, -0.0, -0.0, -(2.0**-8)])
    a, b = a.bfloat16()[None], b.bfloat16()[None]
    s, _ = ops.triton_add_rms_norm(a, b, torch.ones(a.shape[-1], dtype=torch.bfloat16), EPS)
    assert torch.equal(s.view(torch.int16), (a + b).view(torch.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden", [64, 1000, 2048, 4096, 5120])
def test_gpu_add_rms_norm_is_the_add_then_the_norm(dtype, hidden):
    """On CUDA the fused kernel runs the single kernel's row code on the sum: the same bits, checked on many rows,
    through the kernel and through the public op (no autograd: the one-launch path)."""
    for m in (1, 7, 256, 4097):
        _check_add((m, hidden), dtype, "cuda", seed=m + hidden)
    x, r = _rand(3, 5, hidden, seed=1, device="cuda", scale=50.0), _rand(3, 5, hidden, seed=2, device="cuda")
    w = (1.0 + 0.1 * _rand(hidden, seed=3)).cuda()
    with torch.no_grad():
        s, y = vk.add_rms_norm(x, r, w, EPS)
    assert torch.equal(s, x + r) and torch.equal(y, vk.rms_norm(x + r, w, EPS))


def _check_add_grads(m, hidden, dtype, device):
    """Under autograd the fused add + norm keeps the forward's bits, and its gradients (the residual's gradient added
    inside the norm's dx kernel) are those of the add then the norm, within rounding, and run to run the same."""
    ops = _ops()
    x, r = _rand(m, hidden, seed=11, dtype=dtype, device=device), _rand(m, hidden, seed=12, dtype=dtype, device=device)
    w = (1.0 + 0.1 * _rand(hidden, seed=13)).to(dtype).to(device)
    ds, dy = (
        _rand(m, hidden, seed=14, dtype=dtype, device=device),
        _rand(m, hidden, seed=15, dtype=dtype, device=device),
    )
    s0, y0 = ops.triton_add_rms_norm(x, r, w, EPS)

    def run(fused: bool):
        xg, rg, wg = (t.clone().requires_grad_() for t in (x, r, w))
        if fused:
            s, y = ops.triton_add_rms_norm(xg, rg, wg, EPS)
        else:
            s = xg + rg
            y = ops.triton_rms_norm(s, wg, EPS)
        torch.autograd.backward((s, y), (ds, dy))
        return s.detach(), y.detach(), xg.grad, rg.grad, wg.grad

    s, y, dx, dr, dw = run(True)
    assert torch.equal(s, s0) and torch.equal(y, y0)
    assert torch.equal(dx, dr)
    _, _, rdx, _, rdw = run(False)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2.0**-7, atol=2e-2)
    torch.testing.assert_close(dx, rdx, **tol)
    assert torch.equal(dw, rdw)  # the same kernels on the same saved sum
    again = run(True)
    assert torch.equal(again[2], dx) and torch.equal(again[4], dw)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interpreted_add_rms_norm_under_autograd(dtype):
    _check_add_grads(70, 100, dtype, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [128, 2048])
def test_gpu_add_rms_norm_under_autograd(hidden):
    _check_add_grads(3001, hidden, torch.bfloat16, "cuda")
