"""The linear's form picked per shape by timing (``triton_ops/matmul_tuning.py``): which calls are noted, that a pick
routes a call to its form, that a form whose bits differ from the default's or that is not clearly faster is never
picked; on the GPU, that every form timed gives the default's bits and that picks inside a CUDA graph keep them."""

from __future__ import annotations

import pytest
import torch

import vexact_kernels as vk
from vexact_kernels.triton_ops import triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


def _mods():
    from vexact_kernels.triton_ops import matmul, matmul_tuning

    return matmul, matmul_tuning


def test_tune_threshold_is_the_kernels_own():
    mm, _ = _mods()
    assert vk.LINEAR_TUNE_MIN_M == mm.TUNE_MIN_M


@pytest.fixture
def as_if_tma(monkeypatch):
    """Host logic on CPU: operands count as TMA-readable and M = 4 is enough to be noted; the forms given in a test
    are pointer-kernel forms, which the interpreter runs."""
    mm, _ = _mods()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(mm, "_tma_ok", lambda a, b: True)
    monkeypatch.setattr(mm, "TUNE_MIN_M", 4)
    return mm


def test_record_notes_default_form_calls_only(as_if_tma):
    mm = as_if_tma
    g = torch.Generator().manual_seed(0)
    a = torch.randn(6, 32, generator=g).bfloat16()
    w = torch.randn(16, 32, generator=g).bfloat16()
    with vk.record_linears() as calls:
        mm.matmul(a, w)
        mm.matmul(a[:3], w)  # below TUNE_MIN_M
        mm.matmul(a, w, config=(16, 16, 4, 1))  # the form is the caller's
        mm.matmul(a.float(), w.float())  # fp32: never picked
        mm.matmul(a, w.t().contiguous().t())  # a column-major weight
    assert [(m, n, k, d) for m, n, k, d, _ in calls] == [(6, 16, 32, torch.bfloat16)]
    assert calls[0][4] is w
    mm.matmul(a, w)
    assert len(calls) == 1  # nothing noted outside the block


def test_record_with_its_own_least_m_notes_smaller_calls(as_if_tma):
    mm = as_if_tma
    a = torch.randn(6, 32).bfloat16()
    w = torch.randn(16, 32).bfloat16()
    with vk.record_linears(1) as calls:
        mm.matmul(a, w)
        mm.matmul(a[:1], w)
    assert [c[0] for c in calls] == [6, 1]
    with vk.record_linears(7) as calls:
        mm.matmul(a, w)
    assert calls == []
    for bad in (0, 1.5, None.__class__):
        with pytest.raises(ValueError, match="min_m must be an int >= 1"):
            with vk.record_linears(bad):
                pass


def test_a_pick_routes_its_shape_to_its_form(as_if_tma, monkeypatch):
    mm = as_if_tma
    g = torch.Generator().manual_seed(1)
    a = torch.randn(6, 128, generator=g).bfloat16()
    w = torch.randn(16, 128, generator=g).bfloat16()
    monkeypatch.setattr(mm, "SPLIT_TILES", 1)  # K = 128: two K tiles, so two splits
    ref = mm.matmul(a, w)
    combined = []
    real = mm._combine_partials
    monkeypatch.setattr(mm, "_combine_partials", lambda *x, **k: combined.append(1) or real(*x, **k))
    form = dict(config=(16, 16, 4, 1), split_programs=True, fused_combine=False)
    with vk.linear_picks({(6, 16, 128, torch.bfloat16): form}):
        got = mm.matmul(a, w)
        other = mm.matmul(a[:5], w)  # no pick for M = 5
    assert combined == [1], "the picked split form ran once, the unpicked shape took the default"
    assert torch.equal(got, ref) and torch.equal(other, ref[:5])


def _fake_times(monkeypatch, mt, times: dict):
    """``graph_time`` returning ``times[form]`` (per weight) by the keywords each form is run with."""
    by_kw = {repr(sorted(kw.items())): name for name, kw in {"default": {}, **mt.TUNE_FORMS}.items()}

    def fake(run, replays):
        kw = run.__defaults__[0]
        return times[by_kw[repr(sorted(kw.items()))]] * len(fake.weights), None

    monkeypatch.setattr(mt, "graph_time", fake)
    return fake


def test_tune_shape_picks_only_a_clearly_faster_form_with_the_default_bits(as_if_tma, monkeypatch):
    mm = as_if_tma
    _, mt = _mods()
    forms = {"fast": dict(config=(16, 16, 4, 1)), "faster_but_wrong": dict(config=(16, 32, 4, 1)),
             "close": dict(config=(32, 16, 4, 1))}  # fmt: skip
    monkeypatch.setattr(mt, "TUNE_FORMS", forms)
    g = torch.Generator().manual_seed(2)
    weights = [torch.randn(16, 32, generator=g).bfloat16() for _ in range(3)]
    real = mm.matmul

    def perturbing(a, b_t, *args, **kw):  # the "wrong" form loses one ulp somewhere
        out = real(a, b_t, *args, **kw)
        if kw.get("config") == (16, 32, 4, 1):
            out = out.clone()
            out.view(torch.int16)[0, 0] += 1
        return out

    monkeypatch.setattr(mt.mm, "matmul", perturbing)
    fake = _fake_times(monkeypatch, mt, {"default": 1.0, "fast": 0.9, "faster_but_wrong": 0.5, "close": 0.98})
    fake.weights = weights
    res = mt.tune_shape(4, weights)
    assert res["differ"] == ["faster_but_wrong"] and "faster_but_wrong" not in res["ms"]
    assert res["pick"] == "fast" and res["ms"]["fast"] == pytest.approx(0.9)
    fake2 = _fake_times(monkeypatch, mt, {"default": 1.0, "fast": 0.98, "faster_but_wrong": 0.5, "close": 0.99})
    fake2.weights = weights
    assert mt.tune_shape(4, weights)["pick"] is None  # within TUNE_MARGIN: the default stays


def test_tune_linears_groups_calls_by_shape_and_streams_enough_weights(as_if_tma, monkeypatch):
    _, mt = _mods()
    monkeypatch.setattr(mt, "_TIMED", {})
    seen = {}
    monkeypatch.setattr(mt, "tune_shape", lambda m, ws, forms: seen.setdefault(m, ws) and dict(ms={}, differ=[],
                        pick="t64x64" if m == 8 else None))  # fmt: skip
    monkeypatch.setattr(mt, "TUNE_STREAM_BYTES", 3 * 16 * 32 * 2)
    ws = [torch.zeros(16, 32, dtype=torch.bfloat16) for _ in range(5)]
    calls = [(8, 16, 32, torch.bfloat16, w) for w in ws + ws] + [(12, 16, 32, torch.bfloat16, ws[0])]
    picks, report = vk.tune_linears(calls)
    assert [len(v) for v in seen.values()] == [3, 1]  # three weights hold the bytes asked for; repeats once
    assert picks == {(8, 16, 32, torch.bfloat16): mt.TUNE_FORMS["t64x64"]} and len(report) == 2
    assert vk.tune_linears([]) == ({}, {})


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 24, 64, 128, 256, 320, 512])
def test_gpu_every_timed_form_gives_the_default_bits(m):
    """Each form ``tune_linears`` may pick, at decode sizes over the Qwen3-1.7B / 8B projection shapes (and a bias):
    the default pick's output, bitwise."""
    mm, mt = _mods()
    g = torch.Generator(device="cuda").manual_seed(m)
    for n, k in ((4096, 2048), (2048, 2048), (12288, 2048), (2048, 6144), (4096, 4096), (4096, 12288)):
        a = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        w = torch.randn(n, k, device="cuda", generator=g).bfloat16()
        bias = torch.randn(n, device="cuda", generator=g).bfloat16()
        for b in (None, bias):
            ref = mm.matmul(a, w, b)
            for name, kw in mt.TUNE_FORMS.items():
                assert torch.equal(mm.matmul(a, w, b, **kw), ref), (m, n, k, name, b is not None)


@pytest.mark.gpu
def test_gpu_tuned_picks_in_a_graph_keep_the_bits():
    """Record a few layers' matmuls at M = 256, time the forms, replay them under the picks in a CUDA graph: the same
    outputs as without picks; the report holds the default's time and every form that ran."""
    mm, mt = _mods()
    g = torch.Generator(device="cuda").manual_seed(7)
    layers = [torch.randn(2048, 2048, device="cuda", generator=g).bfloat16() for _ in range(4)]
    x = torch.randn(256, 2048, device="cuda", generator=g).bfloat16()

    def step():
        return [vk.linear(x, w) for w in layers]

    ref = step()
    with vk.record_linears() as calls:
        step()
    assert len(calls) == 4
    picks, report = vk.tune_linears(calls)
    res = report[(256, 2048, 2048, torch.bfloat16)]
    assert not res["differ"] and "default" in res["ms"] and len(res["ms"]) >= 5, res
    forced = {(256, 2048, 2048, torch.bfloat16): mt.TUNE_FORMS["ts64x64"]}
    for p in (picks, forced):
        with vk.linear_picks(p):
            step()  # compiles outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs = step()
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(o, r) for o, r in zip(outs, ref, strict=True))


def test_a_shape_timed_once_in_a_process_is_not_timed_again(as_if_tma, monkeypatch):
    _, mt = _mods()
    monkeypatch.setattr(mt, "_TIMED", {})
    timed = []
    monkeypatch.setattr(mt, "tune_shape", lambda m, ws, forms: timed.append(m) or dict(ms={}, differ=[], pick="t64x64"))
    w = torch.zeros(16, 32, dtype=torch.bfloat16)
    first = vk.tune_linears([(8, 16, 32, torch.bfloat16, w)])
    again = vk.tune_linears([(8, 16, 32, torch.bfloat16, torch.ones(16, 32, dtype=torch.bfloat16)),
                             (12, 16, 32, torch.bfloat16, w)])  # fmt: skip
    assert timed == [8, 12]  # M = 8 timed once; M = 12 is new
    assert first[0] == {(8, 16, 32, torch.bfloat16): mt.TUNE_FORMS["t64x64"]}
    assert again[0][(8, 16, 32, torch.bfloat16)] == mt.TUNE_FORMS["t64x64"] and len(again[1]) == 2
    mt.tune_linears([(8, 16, 32, torch.bfloat16, w)], forms={"t64x64": mt.TUNE_FORMS["t64x64"]})
    assert timed == [8, 12, 8]  # other forms: timed again
