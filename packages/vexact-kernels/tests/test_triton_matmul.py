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
    assert torch.equal(mm.matmul(a, w, b, torch.float32, split_programs=True, fused_combine=False), one)
    assert torch.equal(mm.matmul(a[2:3], w, b, torch.float32, split_programs=True)[0], one[2])
    ref = a.double() @ w.double().T + (b.double() if bias else 0)
    assert torch.allclose(one.double(), ref, atol=1e-3 * 2100**0.5, rtol=1e-3)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@interp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_interpreted_fused_combine_gives_the_combine_kernels_bits(dtype):
    """The last split program of a tile adds the tile's partials (one launch): the bits of the combine kernel (two
    launches), with and without bias, into bf16 and fp32 outputs and into ``accumulate_into`` (strided too); the
    counts are back at zero after every launch, so the next launch starts clean."""
    mm = _mm()
    g = torch.Generator().manual_seed(11)
    for m, k, n in [(1, 2100, 20), (2, 1100, 33), (17, 3000, 16), (64, 2049, 24)]:
        a = torch.randn(m, k, generator=g).to(dtype)
        w = torch.randn(n, k, generator=g).to(dtype)
        for b in (None, torch.randn(n, generator=g).to(dtype)):
            for out_dtype in {dtype, torch.float32}:
                fused = mm.matmul(a, w, b, out_dtype, split_programs=True, fused_combine=True)
                two = mm.matmul(a, w, b, out_dtype, split_programs=True, fused_combine=False)
                assert fused.dtype == out_dtype and torch.equal(_bits(fused), _bits(two)), (m, k, n, out_dtype)
            acc = torch.randn(n, m, generator=g).t()  # [m, n], column-major
            fused = mm.matmul(a, w, b, split_programs=True, accumulate_into=acc.clone(), fused_combine=True)
            two = mm.matmul(a, w, b, split_programs=True, accumulate_into=acc.clone(), fused_combine=False)
            assert torch.equal(_bits(fused), _bits(two)), (m, k, n, "accumulate_into")
        assert torch.equal(_bits(mm.matmul(a, w, split_programs=False)), _bits(mm.matmul(a, w, split_programs=True)))
    assert not mm._counter_buffers[torch.device("cpu")].any()


@interp
def test_interpreted_fused_combine_falls_back_to_two_launches(monkeypatch):
    """A launch with more output tiles than a counter slot holds runs the combine kernel: same bits; asking for the
    fused combine there is an error that names the limit."""
    mm = _mm()
    g = torch.Generator().manual_seed(12)
    a, w = torch.randn(20, 1500, generator=g).bfloat16(), torch.randn(40, 1500, generator=g).bfloat16()
    fused = mm.matmul(a, w, split_programs=True, fused_combine=True)  # 2 x 3 tiles of 16 x 16
    monkeypatch.setattr(mm, "COMBINE_SLOT_TILES", 5)
    assert torch.equal(_bits(mm.matmul(a, w, split_programs=True)), _bits(fused))
    with pytest.raises(RuntimeError, match="fused_combine=True, but 6 output tiles need a counter slot"):
        mm.matmul(a, w, split_programs=True, fused_combine=True)


def test_dtype_mismatch_is_an_error():
    mm = _mm()
    with pytest.raises(TypeError, match="cast the weight"):
        mm.matmul(torch.zeros(2, 4), torch.zeros(3, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="expected a"):
        mm.matmul(torch.zeros(2, 4), torch.zeros(3, 5))


def test_fp32_precision_is_an_explicit_choice():
    """fp32 means fp32 unless tf32 is asked for; a bad name is refused; 16-bit operands are not affected."""
    mm = _mm()
    assert vk.get_fp32_matmul_precision() == "ieee" and mm.input_precision(torch.float32) == "ieee"
    with vk.use_fp32_matmul_precision("tf32"):
        assert mm.input_precision(torch.float32) == "tf32"
        assert mm.input_precision(torch.bfloat16) == "tf32"  # Triton's default: not applied to 16-bit operands
    assert vk.get_fp32_matmul_precision() == "ieee"
    with pytest.raises(ValueError, match=r"fp32 matmul precision 'fp16'; expected one of \('ieee', 'tf32', 'tf32x3'\)"):
        with vk.use_fp32_matmul_precision("fp16"):
            pass


@interp
def test_interpreted_fp32_matmul_ignores_the_precision_choice():
    """The interpreter path sums fp32 products explicitly (no tl.dot), and the CPU reference is exact fp32: neither
    depends on the choice."""
    mm = _mm()
    g = torch.Generator().manual_seed(5)
    a, w = torch.randn(6, 150, generator=g), torch.randn(20, 150, generator=g)
    ieee, ref = mm.matmul(a, w), vk.linear(a, w)
    with vk.use_fp32_matmul_precision("tf32"):
        assert torch.equal(mm.matmul(a, w), ieee) and torch.equal(vk.linear(a, w), ref)


@pytest.mark.gpu
def test_gpu_fp32_linear_runs_in_the_chosen_precision():
    """fp32 linear on the GPU: ``ieee`` by default, within fp32 rounding of torch's fp32 matmul with TF32 off, and
    row-invariant; ``tf32`` when chosen, which the same check catches (so it can fail)."""
    mm = _mm()
    # 1 + 2**-12 is an fp32 number that a tf32 operand (10-bit mantissa) rounds to 1: the product shows what ran
    for m in (1, 40, 300, 5000):
        a = torch.full((m, 2100), 1 + 2**-12, device="cuda")
        w = torch.zeros(64, 2100, device="cuda")
        w[:, 0] = 1.0
        assert torch.equal(vk.linear(a, w), torch.full((m, 64), 1 + 2**-12, device="cuda")), f"M={m}"
        with vk.use_fp32_matmul_precision("tf32"):
            assert torch.equal(vk.linear(a, w), torch.ones(m, 64, device="cuda")), f"M={m}: tf32 was asked for"
    g = torch.Generator(device="cuda").manual_seed(4)
    k = 4096
    a = torch.randn(777, k, device="cuda", generator=g)
    w = torch.randn(1536, k, device="cuda", generator=g)
    b = torch.randn(1536, device="cuda", generator=g)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        ref = (a.double() @ w.double().T + b.double()).float()
        ref_torch = torch.nn.functional.linear(a, w, b)  # cuBLAS fp32, TF32 off
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    bound = 1e-6 * (a.abs() @ w.abs().T + b.abs())  # fp32 rounding; tf32 operands err ~10x more
    y = vk.linear(a, w, b)
    assert ((y - ref).abs() <= bound).all() and ((ref_torch - ref).abs() <= bound).all()
    with vk.use_fp32_matmul_precision("tf32"):
        assert not ((vk.linear(a, w, b) - ref).abs() <= bound).all()
    # fp32 keeps the invariance: a row alone, any config, split programs or not, gives the same bits
    for i in (0, 400, 776):
        assert torch.equal(vk.linear(a[i : i + 1], w, b)[0], y[i])
    for cfg in (*(c[:4] for c in mm.FP32_CONFIGS), (32, 32, 4, 2)):
        for split, fused in ((False, None), (True, False), (True, True)):
            out = mm.matmul(a, w, b, config=cfg, split_programs=split, fused_combine=fused)
            assert torch.equal(out, y), (cfg, split, fused)


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
        bf16 = [mm.matmul(a, w, config=cfg) for cfg, _ in mm.TMA_PICKS]  # the bf16-output TMA tiles the picker uses
        assert all(torch.equal(o, mm.matmul(a, w, config=mm.CONFIGS[0])) for o in bf16), (m, k, n)
        for cfg in ((16, 32, 4, 6), (16, 64, 4, 4), (64, 64, 4, 6), (64, 64, 4, 4, False), (64, 128, 4, 4, False)):
            # a program per K split, then the combine (5 values: the tiles read through TMA)
            for fused in (False, True):  # a combine kernel, or the last split program of each tile
                outs.append(
                    mm.matmul(a, w, out_dtype=torch.float32, config=cfg, split_programs=True, fused_combine=fused)
                )
        for o in outs[1:]:
            assert torch.equal(o, outs[0]), f"config changed bits at {(m, k, n)}"


def test_tma_layout_names_row_and_column_major_operands(monkeypatch):
    """Host logic only: which 2-D operands a TMA descriptor may read, and in which orientation."""
    mm = _mm()
    x = torch.zeros(64, 96, dtype=torch.bfloat16)
    assert mm._tma_layout(x) == "rows"
    assert mm._tma_layout(x.t()) == "cols"
    assert mm._tma_layout(x[:, 1:]) is None  # base not 16-byte aligned
    assert mm._tma_layout(torch.zeros(64, 7, dtype=torch.bfloat16)) is None  # 14-byte rows
    assert mm._tma_layout(x[::2]) == "rows" and mm._tma_layout(x[:, ::2]) is None
    monkeypatch.setattr(mm, "TMA_COLUMN_MAJOR", False)
    assert mm._tma_layout(x.t()) is None


@pytest.mark.gpu
def test_gpu_column_major_operands_through_tma_give_the_pointer_kernels_bits():
    """The backward's operands (``dY @ W``: ``W.T`` column-major; ``dY.T @ X``: both column-major) read through TMA
    descriptors over the row-major tensors: the same bits as the pointer kernel and as row-major copies, with bias,
    bf16 output and ``accumulate_into``; and the launch really took the TMA kernel."""
    mm = _mm()
    g = torch.Generator(device="cuda").manual_seed(3)
    for m, k, n in [(312, 2048, 6144), (4096, 3000, 1024), (2048, 6969, 2048)]:  # column strides of 16-byte rows
        a = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        w = torch.randn(n, k, device="cuda", generator=g).bfloat16()
        bias = torch.randn(n, device="cuda", generator=g).bfloat16()
        a_cols, w_cols = a.t().contiguous().t(), w.t().contiguous().t()
        assert mm._tma_layout(a_cols) == mm._tma_layout(w_cols) == "cols"
        ref = mm.matmul(a, w, bias, config=mm.CONFIGS[2])  # pointer kernel, row-major
        acc0 = torch.randn(m, n, device="cuda", generator=g)
        ref_acc = mm.matmul(a, w, config=mm.CONFIGS[2], accumulate_into=acc0.clone())
        for x, y in ((a_cols, w), (a, w_cols), (a_cols, w_cols)):
            assert torch.equal(mm.matmul(x, y, bias), ref), (m, k, n)
            for cfg in (mm.TMA_CONFIG, mm.TMA_CONFIG_MID, mm.TMA_CONFIG_NARROW):
                assert torch.equal(mm.matmul(x, y, bias, config=cfg), ref), (m, k, n, cfg)
            assert torch.equal(mm.matmul(x, y, bias, config=mm.CONFIGS[2]), ref), (m, k, n, "pointer")
            got = mm.matmul(x, y, accumulate_into=acc0.clone())
            assert torch.equal(got, ref_acc), (m, k, n, "accumulate_into")
    calls = []
    launch = mm._launch_tma
    mm._launch_tma = lambda *args, **kw: calls.append(1) or launch(*args, **kw)
    try:
        mm.matmul(a_cols, w_cols)
    finally:
        mm._launch_tma = launch
    assert calls, "column-major operands did not take the TMA kernel"


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


@pytest.mark.gpu
def test_gpu_fused_combine_bits_graphs_and_streams():
    """The fused combine on the GPU, at decode shapes (many K splits, a count per tile): the combine kernel's bits
    over many launches (a memory-ordering slip would show as a stray element), with bias, bf16 output and
    ``accumulate_into``; replayed from a CUDA graph; on two streams at once (each stream its own counts); the counts
    back at zero after all of it."""
    mm = _mm()
    g = torch.Generator(device="cuda").manual_seed(9)
    dev = torch.device("cuda", torch.cuda.current_device())
    for m, k, n in [(1, 2048, 6144), (1, 6144, 2048), (4, 14336, 4096), (32, 4100, 1000)]:
        w = torch.randn(n, k, device="cuda", generator=g).bfloat16()
        b = torch.randn(n, device="cuda", generator=g).bfloat16()
        for _ in range(20):
            a = torch.randn(m, k, device="cuda", generator=g).bfloat16()
            for bias, out_dtype in ((None, torch.float32), (b, torch.bfloat16)):
                two = mm.matmul(a, w, bias, out_dtype, split_programs=True, fused_combine=False)
                fused = mm.matmul(a, w, bias, out_dtype, split_programs=True, fused_combine=True)
                assert torch.equal(_bits(fused), _bits(two)), (m, k, n, out_dtype)
        acc = torch.randn(m, n, device="cuda", generator=g)
        two = mm.matmul(a, w, b, split_programs=True, accumulate_into=acc.clone(), fused_combine=False)
        fused = mm.matmul(a, w, b, split_programs=True, accumulate_into=acc.clone(), fused_combine=True)
        assert torch.equal(_bits(fused), _bits(two)), (m, k, n, "accumulate_into")
    assert not mm._counter_buffers[dev].any()

    # CUDA graph: the counts are reset inside each replay, so replays with new inputs stay exact
    k, n = 4096, 4096
    w = torch.randn(n, k, device="cuda", generator=g).bfloat16()
    x = torch.randn(8, k, device="cuda", generator=g).bfloat16()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        mm.matmul(x, w, split_programs=True, fused_combine=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = mm.matmul(x, w, split_programs=True, fused_combine=True)
    for _ in range(10):
        x.copy_(torch.randn(8, k, device="cuda", generator=g).bfloat16())
        graph.replay()
        assert torch.equal(_bits(y), _bits(mm.matmul(x, w, split_programs=True, fused_combine=False)))

    # two streams at once: many launches each, interleaved on the device
    xs = [torch.randn(2, k, device="cuda", generator=g).bfloat16() for _ in range(2)]
    refs = [mm.matmul(xi, w, split_programs=True, fused_combine=False) for xi in xs]
    streams = [torch.cuda.Stream() for _ in xs]
    outs: list[list[torch.Tensor]] = [[], []]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    for _ in range(50):
        for i, s in enumerate(streams):
            with torch.cuda.stream(s):
                outs[i].append(mm.matmul(xs[i], w, split_programs=True, fused_combine=True))
    for s in streams:
        torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    for i in range(2):
        assert all(torch.equal(_bits(o), _bits(refs[i])) for o in outs[i]), f"stream {i}"
    assert not mm._counter_buffers[dev].any()


@pytest.mark.parametrize(
    ("m", "n", "want"),
    [
        (256, 4096, "TMA_CONFIG_NARROW"),  # 1.7B q/k/v chunk: 64 tiles of 128x128 would leave half of 132 SMs idle
        (256, 6144, "TMA_CONFIG_MID"),  # 8B q/k/v: 96 tiles
        (256, 24576, "TMA_CONFIG_MID"),  # 8B gate/up: 384 tiles, three full waves
        (512, 24576, "TMA_CONFIG"),  # 768 tiles: the 128x256 tile fills the same waves with fewer, larger tiles
        (4096, 4096, "TMA_CONFIG"),
    ],
)
def test_the_tma_tile_follows_how_full_the_sms_are(m, n, want):
    """Speed only (every config gives the same bits, test above): the pick the H200 sweep behind TMA_PICKS made."""
    mm = _mm()
    assert mm.tma_config(m, n, 132) == getattr(mm, want)
    assert mm.tma_config(m, n, 132) in {cfg for cfg, _ in mm.TMA_PICKS}
