"""GPU sweep behind the matmul and logprobs launch constants (run on a GPU machine; prints tables).

    python scripts/tuning/tune_kernels.py [--parts agree,small,large,logprobs,wgrad] [--decode-ms 128,256]

(An earlier ``flat`` part compared a loop per split against one loop with the split boundary as a branch; the branch
won and is the only form kept: benchmarks/results/tune-matmul-h100.txt.)

agree:    every matmul variant (pointer tiles, one program per K split + combine, persistent TMA, warp-specialized)
          gives the same bits; this is what lets the tile be chosen per shape for speed.
small:    M <= 64 tile / split choices vs cuBLAS (CUDA-graph timing, like benchmarks/kernels.py).
large:    M >= 1024 tile choices vs cuBLAS.
mid:      M = 256 .. 4096 over the grouped projections (q/k/v, gate/up as one matmul), every tile form.
decode:   M = 128 and 256 (``--decode-ms``: other row counts, e.g. the sizes between, where vLLM captures a decode
          graph every 8 rows) over the grouped projections with cold weights, the TMA tiles at every pipeline depth
          (what ``matmul_tuning.TUNE_FORMS`` holds).
decode-small: M = 1-96 the same way, the pointer kernel's split programs and the TMA split forms at deeper pipelines.
draw:     the fused draw (lm_head + logprobs + Gumbel-max) at T = 64-512, its split kernel's stages and warps varied,
          each setting's tokens and logprobs against the default's.
logprobs: fused logprobs forward at small T for each LOGPROBS_SPLIT_TILES (a numerics constant: the sweep picks it
          once, then it is fixed), and the fused forward+backward vs torch at one training shape.
wgrad:    the MoE backward's grouped dW tiles (``moe.WGRAD_CONFIG``: BLOCK_N, BLOCK_K, warps, stages; speed only, the
          reduction over an expert's rows is fixed) at the Qwen3-30B-A3B and Moonlight training shapes: each
          config's dW against the shipped one (torch.equal), its time and TFLOP/s.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton.testing

from vexact_kernels.triton_ops import logprobs as lpk
from vexact_kernels.triton_ops import matmul as mm

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from kernels import LINEAR_SHAPES as SHAPES  # noqa: E402  (the benchmark's shapes: K = N = 4096, Qwen3-1.7B/8B)


def graph_ms(fn) -> float:
    fn()
    return triton.testing.do_bench_cudagraph(fn, rep=60)


def agree() -> None:
    variants = {
        "ptr16x32": dict(config=(16, 32, 4, 6), split_programs=False),
        "ptr16x32 split": dict(config=(16, 32, 4, 6), split_programs=True),
        "ptr16x64 split": dict(config=(16, 64, 4, 4), split_programs=True),
        "ptr64x64": dict(config=(64, 64, 4, 6), split_programs=False),
        "ptr64x64 split": dict(config=(64, 64, 4, 6), split_programs=True),
        "ptr128x128": dict(config=(128, 128, 8, 3), split_programs=False),
        "ptr256x128": dict(config=(256, 128, 8, 3), split_programs=False),
        "tma128x256": dict(config=(128, 256, 8, 3, False)),
        "tma128x128": dict(config=(128, 128, 8, 4, False)),
        "tma128x128 ws": dict(config=(128, 128, 8, 4, True)),
    }
    g = torch.Generator(device="cuda").manual_seed(0)
    for m, k, n in [(1, 4096, 4096), (64, 2048, 1024), (777, 2048, 1000), (1024, 6144, 2048), (3000, 1100, 520)]:
        a = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        w = torch.randn(n, k, device="cuda", generator=g).bfloat16()
        outs = {name: mm.matmul(a, w, out_dtype=torch.float32, **kw) for name, kw in variants.items()}
        ref = outs["ptr16x32"]
        bad = [name for name, o in outs.items() if not torch.equal(o, ref)]
        row0 = mm.matmul(a[:1], w, out_dtype=torch.float32)
        err = (ref.double() - a.double() @ w.double().T).abs().max().item()
        print(
            f"agree M={m} K={k} N={n}: {len(outs) - len(bad)}/{len(outs)} variants equal"
            f"{' (differ: ' + ', '.join(bad) + ')' if bad else ''}; row0==M1: {torch.equal(row0[0], ref[0])};"
            f" max err vs fp64 {err:.2e}"
        )


def small() -> None:
    cands = {
        "16x32": dict(config=(16, 32, 4, 6), split_programs=False),
        "16x32 s": dict(config=(16, 32, 4, 6), split_programs=True),
        "16x64 s": dict(config=(16, 64, 4, 4), split_programs=True),
        "16x128 s": dict(config=(16, 128, 4, 4), split_programs=True),
        "32x64 s": dict(config=(32, 64, 4, 4), split_programs=True),
        "64x64 s": dict(config=(64, 64, 4, 4), split_programs=True),
        "default": dict(),
    }
    print("\nsmall M: ratio cuBLAS_time / invariant_time (higher is better)")
    print(f"{'shape':14s} {'M':>4s} " + " ".join(f"{c:>9s}" for c in cands))
    best: dict[str, list[float]] = {c: [] for c in cands}
    for name, n, k in SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in (1, 8, 64):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t_ref = graph_ms(lambda x=x, w=w: torch.nn.functional.linear(x, w))
            row = []
            for c, kw in cands.items():
                r = t_ref / graph_ms(lambda x=x, w=w, kw=kw: mm.matmul(x, w, **kw))
                best[c].append(r)
                row.append(r)
            print(f"{name:14s} {m:4d} " + " ".join(f"{r:9.2f}" for r in row))
    for c, rs in best.items():
        geo = torch.tensor(rs).log().mean().exp().item()
        print(f"  {c:10s} geomean {geo:.3f} min {min(rs):.2f}")


def large() -> None:
    cands = {
        "ptr128x128": dict(config=(128, 128, 8, 3)),
        "ptr256x128": dict(config=(256, 128, 8, 3)),
        "tma128x256": dict(config=(128, 256, 8, 3, False)),
        "tma128x128": dict(config=(128, 128, 8, 4, False)),
        "tma128x256s4": dict(config=(128, 256, 8, 4, False)),
        "default": dict(),
    }
    print("\nlarge M: ratio cuBLAS_time / invariant_time")
    print(f"{'shape':14s} {'M':>6s} " + " ".join(f"{c:>12s}" for c in cands))
    for name, n, k in SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in (256, 1024, 4096, 16384):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t_ref = graph_ms(lambda x=x, w=w: torch.nn.functional.linear(x, w))
            row = []
            for kw in cands.values():
                try:
                    row.append(t_ref / graph_ms(lambda x=x, w=w, kw=kw: mm.matmul(x, w, **kw)))
                except Exception as e:  # noqa: BLE001 - a config that does not compile is reported, not fatal
                    print(f"  {kw}: {type(e).__name__}: {str(e)[:80]}")
                    row.append(float("nan"))
            print(f"{name:14s} {m:6d} " + " ".join(f"{r:12.2f}" for r in row))


# The engine's projections as they run now (grouped q/k/v and gate/up: one matmul each), 1.7B and 8B: (name, N, K)
GROUPED_SHAPES = (
    ("1.7B qkv", 4096, 2048), ("1.7B o", 2048, 2048), ("1.7B gate_up", 12288, 2048), ("1.7B down", 2048, 6144),
    ("8B qkv", 6144, 4096), ("8B o", 4096, 4096), ("8B gate_up", 24576, 4096), ("8B down", 4096, 12288),
)  # fmt: skip


def mid() -> None:
    """M = 256 .. 4096 (prefill chunks, mixed steps) over the grouped projections: every tile form vs cuBLAS, then
    the best per shape and M (what the picker should choose). Speed only: BLOCK_K and the splits never change."""
    cands = {
        "p64x64": dict(config=(64, 64, 4, 6), split_programs=False),
        "p64x128": dict(config=(64, 128, 4, 4), split_programs=False),
        "p128x64": dict(config=(128, 64, 4, 4), split_programs=False),
        "p128x128": dict(config=(128, 128, 8, 3), split_programs=False),
        "p128x128w4": dict(config=(128, 128, 4, 4), split_programs=False),
        "s64x128": dict(config=(64, 128, 4, 4), split_programs=True),
        "s128x128": dict(config=(128, 128, 8, 3), split_programs=True),
        "t64x64": dict(config=(64, 64, 4, 4, False)),
        "ts64x64": dict(config=(64, 64, 4, 4, False), split_programs=True),
        "ts64x128": dict(config=(64, 128, 4, 4, False), split_programs=True),
        "t64x128": dict(config=(64, 128, 4, 4, False)),
        "t128x128": dict(config=(128, 128, 8, 4, False)),
        "t128x128ws": dict(config=(128, 128, 8, 4, True)),
        "t128x256": dict(config=(128, 256, 8, 3, False)),
        "t128x256ws": dict(config=(128, 256, 8, 3, True)),
        "default": dict(),
    }
    print("\nmid M (grouped projections): ratio cuBLAS_time / invariant_time")
    print(f"{'shape':14s} {'M':>5s} " + " ".join(f"{c:>10s}" for c in cands) + "  best")
    picks = []
    for name, n, k in GROUPED_SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in (256, 512, 1024, 2048, 4096):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t_ref = graph_ms(lambda x=x, w=w: torch.nn.functional.linear(x, w))
            row = {}
            for c, kw in cands.items():
                try:
                    row[c] = t_ref / graph_ms(lambda x=x, w=w, kw=kw: mm.matmul(x, w, **kw))
                except Exception as e:  # noqa: BLE001 - a config that does not compile is reported, not fatal
                    print(f"  {c}: {type(e).__name__}: {str(e)[:80]}")
                    row[c] = float("nan")
            best = max((r, c) for c, r in row.items() if r == r)
            picks.append((name, m, best[1], best[0], row["default"]))
            print(f"{name:14s} {m:5d} " + " ".join(f"{r:10.2f}" for r in row.values()) + f"  {best[1]}", flush=True)
    print("\npicks: shape, M, best form, its ratio, default's ratio")
    for name, m, c, r, d in picks:
        print(f"  {name:14s} {m:5d} {c:>10s} {r:.2f} (default {d:.2f})")


def cold() -> None:
    """Small M with the weight streamed from HBM (copies rotated past the 50 MB L2), as in a real decode step."""
    cands = {
        "16x64 s": dict(config=(16, 64, 4, 4), split_programs=True),
        "32x64 s": dict(config=(32, 64, 4, 4), split_programs=True),
        "64x64 s": dict(config=(64, 64, 4, 6), split_programs=True),
        "64x64": dict(config=(64, 64, 4, 6), split_programs=False),
        "default": dict(),
    }
    print("\nsmall M, cold L2: ratio cuBLAS_time / invariant_time")
    print(f"{'shape':14s} {'M':>4s} " + " ".join(f"{c:>9s}" for c in cands))
    res: dict[str, list[float]] = {c: [] for c in cands}
    for name, n, k in SHAPES:
        copies = max(2, -(-256 * 2**20 // (n * k * 2)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        for m in (1, 8, 16, 32, 64):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

            def run(f, x=x, ws=ws):
                for w in ws:
                    f(x, w)

            t_ref = graph_ms(lambda: run(torch.nn.functional.linear))
            row = []
            for c, kw in cands.items():
                r = t_ref / graph_ms(lambda kw=kw: run(lambda xx, ww, kw=kw: mm.matmul(xx, ww, **kw)))
                res[c].append(r)
                row.append(r)
            print(f"{name:14s} {m:4d} " + " ".join(f"{r:9.2f}" for r in row))
    for c, rs in res.items():
        geo = torch.tensor(rs).log().mean().exp().item()
        print(f"  {c:10s} geomean {geo:.3f} min {min(rs):.2f}")


# ``decode``: the forms of the decode sweep (pipeline depth at M = 128-256), by name: (BLOCK_M, BLOCK_N, warps, stages)
DECODE_TILES = (
    (64, 64, 4, 4), (64, 64, 4, 6), (64, 64, 4, 8), (64, 64, 4, 10), (64, 64, 4, 12), (64, 64, 4, 14),
    (64, 128, 4, 4), (64, 128, 4, 6), (64, 128, 4, 8), (64, 128, 4, 10), (64, 128, 8, 8),
    (128, 64, 4, 6), (128, 64, 4, 8), (128, 64, 4, 10), (128, 64, 8, 8),
    (128, 128, 8, 4), (128, 128, 8, 5), (128, 128, 8, 6), (128, 128, 8, 7), (64, 256, 4, 4), (64, 256, 4, 5),
)  # fmt: skip


def decode(ms: tuple[int, ...] = (128, 256)) -> None:
    """M = ``ms`` (decode steps, whole or as two-stream halves) over the grouped projections, weights streamed
    from HBM (copies rotated past 160 MiB), each form against cuBLAS: the persistent TMA tiles at every pipeline depth
    of DECODE_TILES, two TMA split forms, the default pick; the best seven per row, ``!`` where a form's output is not
    the default's (``torch.equal``). ``matmul_tuning.TUNE_FORMS`` holds what won here."""
    cands = {f"t{bm}x{bn}w{w}s{st}": dict(config=(bm, bn, w, st, False)) for bm, bn, w, st in DECODE_TILES}
    cands["t128x128wss6"] = dict(config=(128, 128, 8, 6, True))
    for bn in (64, 128):
        cands[f"ts64x{bn}s8"] = dict(config=(64, bn, 4, 8, False), split_programs=True)
    _decode_sweep("decode M", ms, cands)


# ``decode-small``: forms for decode steps below 128 rows (the tail of an RL rollout, where requests finish and the
# batch shrinks): the pointer kernel's split programs with deeper pipelines and wider tiles, and the TMA split forms.
DECODE_SMALL_FORMS = {
    **{f"p{bm}x{bn}w{w}s{st}": dict(config=(bm, bn, w, st), split_programs=True)
       for bm, bn, w, st in ((16, 32, 4, 8), (16, 64, 4, 6), (16, 64, 4, 8), (16, 128, 4, 4), (16, 128, 4, 6),
                             (32, 64, 4, 6), (32, 128, 4, 4), (64, 64, 4, 8), (64, 128, 4, 4))},
    "p16x32w4s6 whole": dict(config=(16, 32, 4, 6), split_programs=False),
    **{f"ts64x{bn}s{st}": dict(config=(64, bn, 4, st, False), split_programs=True)
       for bn, st in ((64, 6), (64, 8), (64, 10), (128, 6), (128, 8))},
    "t64x64s8": dict(config=(64, 64, 4, 8, False)),
    "t64x128s8": dict(config=(64, 128, 4, 8, False)),
}  # fmt: skip


def decode_small() -> None:
    """M = 1-96 over the grouped projections, cold weights, :data:`DECODE_SMALL_FORMS` against cuBLAS and the default
    pick (the pointer kernel's small-M configs): whether timing forms below ``matmul.TUNE_MIN_M`` would pay."""
    _decode_sweep("decode-small M", (1, 16, 32, 64, 96), DECODE_SMALL_FORMS)


def _decode_sweep(title: str, ms: tuple[int, ...], cands: dict) -> None:
    """Each of ``cands`` and the default pick at each M of ``ms`` over GROUPED_SHAPES, cold weights, against cuBLAS."""
    from vexact_kernels.triton_ops.matmul_tuning import graph_time

    cands = {**cands, "default": {}}
    print(f"\n{title}, cold weights: ratio cuBLAS_time / invariant_time, best seven")
    for name, n, k in GROUPED_SHAPES:
        copies = max(1, -(-160 * 2**20 // (n * k * 2)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        for m in ms:
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = mm.matmul(a, ws[0])
            t_ref = graph_time(lambda a=a, ws=ws: [torch.nn.functional.linear(a, w) for w in ws], 5)[0] / copies
            row = []
            for c, kw in cands.items():
                try:
                    same = torch.equal(mm.matmul(a, ws[0], **kw), ref)
                    t = graph_time(lambda a=a, kw=kw, ws=ws: [mm.matmul(a, w, **kw) for w in ws], 5)[0] / copies
                    row.append((t_ref / t, c, same))
                except Exception as e:  # noqa: BLE001 - a form that does not compile is reported, not fatal
                    row.append((0.0, f"{c}:{type(e).__name__}", False))
            default = next(r for r, c, _ in row if c == "default")
            row.sort(reverse=True)
            best = " ".join(f"{c}={r:.2f}{'' if same else '!'}" for r, c, same in row[:7])
            print(f"{name:14s} M={m:3d} cuBLAS {t_ref * 1e3:6.1f} us | {best} | default={default:.2f}", flush=True)


def draw() -> None:
    """The fused draw (lm_head, logprobs and Gumbel-max in one pass: ``sample.triton_sample_logprobs``) at decode sizes
    with the pipeline depth and warps of its split kernel varied (``LOGPROBS_DRAW_NUM_STAGES``,
    ``LOGPROBS_NUM_WARPS``), against the default and against cuBLAS's lm_head GEMM alone; ``!`` where a setting's
    tokens or logprobs are not the default's (``torch.equal``). A setting whose bits equal the default's can become
    the default (speed only); one whose bits differ is a numerics change."""
    from vexact_kernels.triton_ops import sample as spk
    from vexact_kernels.triton_ops.matmul_tuning import graph_time

    v = 151936
    stages0, warps0 = lpk.LOGPROBS_DRAW_NUM_STAGES, lpk.LOGPROBS_NUM_WARPS
    settings = [(st, w) for w in (4, 8) for st in (2, 3, 4, 5, 6)]
    print("\nfused draw: ratio default_time / setting_time (stages s, warps w), cuBLAS lm_head alone as a bound")
    for h in (2048, 4096):
        head = torch.randn(v, h, device="cuda", dtype=torch.bfloat16) * 0.02
        for t in (64, 128, 256, 512):
            x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
            temps = torch.ones(t, device="cuda")
            seeds = torch.arange(t, device="cuda", dtype=torch.int64)

            def run(x=x, head=head, temps=temps, seeds=seeds):
                return spk.triton_sample_logprobs(x, head, temps, seeds)

            ref_tok, ref_lp = run()
            t_def = graph_time(run, 10)[0]
            t_gemm = graph_time(lambda x=x, head=head: torch.nn.functional.linear(x, head), 10)[0]
            cells = []
            for st, w in settings:
                lpk.LOGPROBS_DRAW_NUM_STAGES, lpk.LOGPROBS_NUM_WARPS = st, w
                try:
                    tok, lp = run()
                    same = torch.equal(tok, ref_tok) and torch.equal(lp, ref_lp)
                    cells.append(f"s{st}w{w}={t_def / graph_time(run, 10)[0]:.2f}{'' if same else '!'}")
                except Exception as e:  # noqa: BLE001 - a setting that does not compile is reported, not fatal
                    cells.append(f"s{st}w{w}:{type(e).__name__}")
                finally:
                    lpk.LOGPROBS_DRAW_NUM_STAGES, lpk.LOGPROBS_NUM_WARPS = stages0, warps0
            print(f"H={h} T={t:4d} default {t_def * 1e3:7.1f} us (cuBLAS lm_head {t_gemm * 1e3:6.1f} us) | "
                  + " ".join(cells), flush=True)  # fmt: skip


def logprobs() -> None:
    h, v = 2048, 151936
    head = torch.randn(v, h, device="cuda", dtype=torch.bfloat16) * 0.02
    print("\nlogprobs forward: ratio torch_time / fused_time per LOGPROBS_SPLIT_TILES")
    default = lpk.LOGPROBS_SPLIT_TILES
    for t in (1, 16, 64, 256, 1024, 4096):
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
        tg = torch.randint(0, v, (t,), device="cuda")
        temps = torch.ones(t, device="cuda")

        def ref(x=x, tg=tg):
            return torch.log_softmax((x @ head.T).float(), -1).gather(1, tg[:, None])

        t_ref = triton.testing.do_bench(ref, warmup=10, rep=50)
        row = []
        for st in (1, 2, 4, 8):
            lpk.LOGPROBS_SPLIT_TILES = st
            ms = triton.testing.do_bench(lambda x=x, tg=tg, tp=temps: lpk.logprobs_fwd(x, head, tg, tp, False))
            row.append(t_ref / ms)
        print(f"  T={t:5d} " + " ".join(f"st{st}={r:.2f}" for st, r in zip((1, 2, 4, 8), row, strict=True)))
    lpk.LOGPROBS_SPLIT_TILES = default
    t = 4096
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = head.clone().requires_grad_()
    tg = torch.randint(0, v, (t,), device="cuda")
    temps = torch.ones(t, device="cuda")
    gl = torch.randn(t, device="cuda")

    def fused():
        lp, _ = lpk.FusedLogprobsFunction.apply(x, w, tg, temps, False)
        torch.autograd.grad(lp, (x, w), gl)

    def torch_ref():
        lp = torch.log_softmax((x @ w.T).float(), -1).gather(1, tg[:, None])[:, 0]
        torch.autograd.grad(lp, (x, w), gl)

    a, b = triton.testing.do_bench(torch_ref, rep=50), triton.testing.do_bench(fused, rep=50)
    print(f"logprobs fwd+bwd T={t} H={h} V={v}: torch {a:.2f} ms, fused {b:.2f} ms, ratio {a / b:.2f}")


# (BLOCK_N, BLOCK_K, num_warps, num_stages) of the grouped dW tiles; the first is moe.WGRAD_CONFIG as shipped
WGRAD_SWEEP = [(64, 64, 4, 3), (128, 64, 4, 3), (64, 128, 4, 3), (128, 128, 4, 3), (128, 128, 8, 3), (128, 128, 8, 4),
               (128, 256, 8, 3)]  # fmt: skip
# experts, top-k, hidden, expert width; 14336 tokens, as benchmarks/moe_train.py's packed batch
WGRAD_SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "moonlight": (64, 6, 2048, 1408)}


def wgrad(tokens: int = 14336) -> None:
    from vexact_kernels.triton_ops import moe

    print(f"\ngrouped dW tiles (moe.WGRAD_CONFIG, shipped {moe.WGRAD_CONFIG}); {tokens} tokens, random routing")
    for name, shape in WGRAD_SHAPES.items():
        _wgrad_shape(moe, name, *shape, tokens)


def _wgrad_shape(moe, name: str, e: int, k: int, h: int, inter: int, tokens: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.rand(tokens, e, device="cuda", generator=g).topk(k, dim=1).indices
    plan = moe._Plan(ids, e)
    x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16, generator=g)
    dh = torch.randn(tokens * k, 2 * inter, device="cuda", dtype=torch.bfloat16, generator=g)
    act = torch.randn(tokens * k, inter, device="cuda", dtype=torch.bfloat16, generator=g)
    dy = torch.randn(tokens * k, h, device="cuda", dtype=torch.bfloat16, generator=g)
    cases = {  # as the fused MoE's backward calls it: dW of gate/up (rows gathered) and of down
        "gate/up": lambda: moe._grouped_wgrad(dh, x, plan.tok, plan, torch.bfloat16),
        "down": lambda: moe._grouped_wgrad(dy, act, None, plan, torch.bfloat16),
    }
    flops = {"gate/up": 2 * tokens * k * 2 * inter * h, "down": 2 * tokens * k * h * inter}
    shipped = moe.WGRAD_CONFIG
    ref = {c: fn() for c, fn in cases.items()}
    print(f"  {name} (E {e}, top-{k}, H {h}, I {inter})")
    for cfg in WGRAD_SWEEP:
        moe.WGRAD_CONFIG = cfg
        cells = []
        for c, fn in cases.items():
            try:
                bits = "same bits" if torch.equal(fn(), ref[c]) else "BITS DIFFER"
                ms = triton.testing.do_bench(fn, warmup=5, rep=40)
                cells.append(f"{c} {ms:7.3f} ms {flops[c] / ms / 1e9:4.0f} TFLOP/s {bits}")
            except Exception as err:  # an out-of-resources config is a result, not a crash
                cells.append(f"{c} failed: {type(err).__name__}")
        print(f"    {str(cfg):20s} " + " | ".join(cells))
    moe.WGRAD_CONFIG = shipped


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="agree,small,large,logprobs")
    ap.add_argument("--decode-ms", default="128,256", help="the decode part's row counts, comma-separated")
    args = ap.parse_args()
    try:
        decode_ms = tuple(int(m) for m in args.decode_ms.split(","))
    except ValueError:
        ap.error(f"--decode-ms must be comma-separated integers, got {args.decode_ms!r}")
    if any(m < 1 for m in decode_ms):
        ap.error(f"--decode-ms must be positive, got {args.decode_ms!r}")
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    for part in args.parts.split(","):
        parts = {"agree": agree, "small": small, "large": large, "mid": mid, "logprobs": logprobs, "cold": cold,
                 "wgrad": wgrad, "decode": lambda: decode(decode_ms), "decode-small": decode_small,
                 "draw": draw}  # fmt: skip
        parts[part]()


if __name__ == "__main__":
    main()
