"""The linear's form picked per shape on the running GPU, by timing: speed only, never a bit of the result.

Every form of ``matmul.py`` (tile shape, warps, stages, whether K splits run as programs of their own, read through
pointers or TMA) reduces each output element over K in the same fixed structure, so they give the same bits; the GPU
tests compare them bitwise (``tests/test_triton_matmul.py``). Which is fastest depends on the shape and the GPU: at
M = 256 the default pick (``matmul.tma_config``, fitted to one H200 sweep) ranged from 0.71 to 0.98 of cuBLAS over
the Qwen3-1.7B / 8B projections (``benchmarks/results/tune-mid-h200.txt``). An engine knows the few shapes its decode
steps run, so it can time the forms once, on its own GPU, with its own weights:

    with record_linears() as calls:      # one eager step at each batch size to tune
        model(...)
    picks = tune_linears(calls)          # {(M, N, K, dtype): matmul keywords}
    with linear_picks(picks):            # the captures (or eager steps) that should run the picks
        ...

``tune_linears`` times each form of :data:`TUNE_FORMS` that runs on the device, plus the default pick, over the
recorded weights of a shape in turn (so, for a model of many layers, the weights stream from memory as in a real step,
not from L2), each as one CUDA graph replayed :data:`TUNE_REPLAYS` times. Before timing, each form's output on the
first weight is compared with the default pick's with ``torch.equal``; a form that differs is never picked and is
reported (the GPU tests say this cannot happen; the check keeps a GPU those tests never ran on from picking one). A
form is picked only where it takes at most :data:`TUNE_MARGIN` of the default pick's time.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

from . import matmul as mm

log = logging.getLogger(__name__)

# The forms timed (name: ``matmul`` keywords). 5-value configs: the persistent TMA kernel, or with
# ``split_programs=True`` a program per output tile and K split read through TMA; 4 values: the pointer kernel.
# The deeper pipelines (``s8``: 8 stages of 64-deep K tiles in flight, ``s6``, ``s5``) are what decode sizes need: at
# M = 128-256 a GPU holds about one tile per SM, and only a deep pipeline keeps its weight stream busy. On an H200,
# cold weights (benchmarks/results/tune-decode-gemm-h200.txt): Qwen3-1.7B down_proj at M = 256 took 0.44 of
# cuBLAS's speed with the default pick and 0.72 with ``t64x64s8``; 8B o_proj 0.72 -> 1.00 with ``t64x128s8``.
TUNE_FORMS: dict[str, dict] = {
    "t64x64s8": dict(config=(64, 64, 4, 8, False)),
    "t64x128s8": dict(config=(64, 128, 4, 8, False)),
    "t128x64s8": dict(config=(128, 64, 4, 8, False)),
    "t128x128s6": dict(config=(128, 128, 8, 6, False)),
    "t64x256s5": dict(config=(64, 256, 4, 5, False)),
    "t64x64": dict(config=(64, 64, 4, 4, False)),
    "t64x128": dict(config=mm.TMA_CONFIG_NARROW),
    "t128x128ws": dict(config=mm.TMA_CONFIG_MID),
    "t128x256": dict(config=mm.TMA_CONFIG),
    "ts64x64": dict(config=(64, 64, 4, 4, False), split_programs=True),
    "ts64x128": dict(config=(64, 128, 4, 4, False), split_programs=True),
    "ts128x128": dict(config=(128, 128, 8, 4, False), split_programs=True),
    "s64x64": dict(config=mm.CONFIGS[1], split_programs=True),
}
# A form replaces the default pick only where it takes at most this share of the default's time (timing noise of a
# few percent must not flip picks between two runs).
TUNE_MARGIN = 0.97
# Replays of each form's graph (each replay runs the form over every recorded weight of the shape once).
TUNE_REPLAYS = 5
# Recorded weights of one shape timed in turn: as many as hold at least this many bytes together (past the 50 MB L2
# of an H100 / H200, so the weights stream from memory as in a step), at least one. More adds time and memory (each
# form's outputs and K-split partials, per weight, live until its timing ends), not information.
TUNE_STREAM_BYTES = 128 << 20
# Results of :func:`tune_shape` this process has, by (device, M, N, K, dtype, form names): a second engine of the same
# shapes (a benchmark's next mode, a test's next engine) reuses them instead of timing again (speed only: any weights
# of a shape take the same time).
_TIMED: dict[tuple, dict] = {}


@contextlib.contextmanager
def record_linears(min_m: int | None = None) -> Iterator[list]:
    """Within: the matmuls a pick could take (16-bit, row-major operands TMA can read, ``M >= min_m``, by default
    ``matmul.TUNE_MIN_M``, the form left to the default) are noted as ``(M, N, K, dtype, weight)`` in the yielded
    list; they run as usual."""
    if min_m is not None and (not isinstance(min_m, int) or min_m < 1):
        raise ValueError(f"record_linears: min_m must be an int >= 1, got {min_m!r}")
    calls: list = []
    token = mm._recorder.set((calls, mm.TUNE_MIN_M if min_m is None else min_m))
    try:
        yield calls
    finally:
        mm._recorder.reset(token)


@contextlib.contextmanager
def linear_picks(picks: dict | None) -> Iterator[None]:
    """Within: matmuls whose ``(M, N, K, dtype)`` has an entry in ``picks`` run that form (see ``matmul.matmul``);
    None or ``{}``: the default pick everywhere."""
    token = mm._active_picks.set(picks or None)
    try:
        yield
    finally:
        mm._active_picks.reset(token)


def graph_time(run, replays: int, warmups: int = 1):
    """``(mean ms of one replay, output)`` of ``run()`` captured as one CUDA graph, after ``warmups`` eager runs
    (they compile the kernels and make what a first launch makes, such as the fused combine's counter slots); the
    output is the captured run's, valid after a replay."""
    for _ in range(warmups):
        run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays, out


def tune_shape(m: int, weights: list[torch.Tensor], forms: dict[str, dict] | None = None) -> dict:
    """Time every form at ``[m, K] @ w.T`` over ``weights`` (one shape ``[N, K]``, one dtype, on one CUDA device):
    ``{"ms": {form: ms per matmul}, "differ": [forms whose output was not the default's], "pick": form or None}``;
    ``"default"`` is the default pick's own row; ``pick`` None keeps it."""
    forms = TUNE_FORMS if forms is None else forms
    w0 = weights[0]
    gen = torch.Generator(device=w0.device).manual_seed(0)
    a = torch.randn(m, w0.shape[1], device=w0.device, generator=gen).to(w0.dtype)
    with linear_picks(None):
        ref = mm.matmul(a, w0)
        ms, differ = {}, []
        candidates = {"default": {}, **forms}
        for name, kw in candidates.items():
            try:
                if not torch.equal(mm.matmul(a, w0, **kw), ref):
                    differ.append(name)
                    continue
                ms[name] = graph_time(lambda kw=kw: [mm.matmul(a, w, **kw) for w in weights], TUNE_REPLAYS)[0]
            except Exception as e:  # noqa: BLE001 - a form this GPU or Triton cannot run is left out, not fatal
                log.debug("matmul form %s at M=%d %s: %s: %s", name, m, tuple(w0.shape), type(e).__name__, e)
    ms = {name: t / len(weights) for name, t in ms.items()}
    best = min((t, name) for name, t in ms.items() if name != "default") if len(ms) > 1 else None
    pick = best[1] if best is not None and "default" in ms and best[0] <= TUNE_MARGIN * ms["default"] else None
    return dict(ms=ms, differ=differ, pick=pick)


def tune_linears(calls: list, forms: dict[str, dict] | None = None) -> tuple[dict, dict]:
    """``(picks, report)`` from the calls :func:`record_linears` noted: for each ``(M, N, K, dtype)`` among them,
    :func:`tune_shape` over its distinct weights (the first that hold :data:`TUNE_STREAM_BYTES`); ``picks`` maps
    the shapes whose pick is not the default to their ``matmul`` keywords (:func:`linear_picks` takes it),
    ``report`` every shape to its :func:`tune_shape` result. A shape this process timed before on the same device
    with the same forms is not timed again (:data:`_TIMED`)."""
    forms = TUNE_FORMS if forms is None else forms
    by_shape: dict[tuple, dict[int, torch.Tensor]] = {}
    for m, n, k, dtype, w in calls:
        ws = by_shape.setdefault((m, n, k, dtype), {})
        if sum(t.numel() * t.element_size() for t in ws.values()) < TUNE_STREAM_BYTES:
            ws.setdefault(w.data_ptr(), w)
    picks, report, timed = {}, {}, False
    for key, ws in by_shape.items():
        first = next(iter(ws.values()))
        seen = (first.device, *key, tuple(sorted(forms)))
        res = _TIMED.get(seen)
        if res is None:  # a shape this process has not timed on this device with these forms
            res = _TIMED[seen] = tune_shape(key[0], list(ws.values()), forms)
            timed = True
        report[key] = res
        if res["differ"]:
            log.warning(
                "matmul forms %s gave other bits than the default at M=%d N=%d K=%d on this GPU: never picked",
                res["differ"], *key[:3],
            )  # fmt: skip
        if res["pick"] is not None:
            picks[key] = dict(forms[res["pick"]])
    if timed:
        torch.cuda.empty_cache()  # the timing graphs' outputs and partials: back to the device for the caller's pool
    return picks, report
