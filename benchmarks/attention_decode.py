"""Paged decode attention at RL shapes: one query token per sequence over a paged bf16 KV cache, as
a rollout's decode step runs it, for VeXact's invariant kernels and the kernels vLLM and FA4 ship.

Rows (each optional: one that does not import gives "not installed" cells):

- ``VeXact Triton`` / ``VeXact FA4``: the two implementations behind ``vexact_kernels.attention_paged`` (the
  ``VEXACT_ATTENTION`` switch is fixed once per process, so each is called through the module the public op
  dispatches to), with the step's layout built once outside the timing, as the engine shares it across layers;
- ``vLLM FA3``: ``vllm.vllm_flash_attn.flash_attn_varlen_func`` with ``block_table``, as vLLM's FlashAttention backend
  calls it at decode under its full CUDA graph (``fa_version=3``, an ahead-of-time ``get_scheduler_metadata`` and
  ``num_splits=16``, its ``_DEFAULT_MAX_NUM_SPLITS_FOR_CUDA_GRAPH``); ``vLLM FA3 b-i``: its batch-invariant mode
  (``num_splits=1``, no ahead-of-time schedule). vLLM's site carries its own apache-tvm-ffi, so these run in a
  subprocess with vLLM's site on the path and FA4's off it (as ``benchmarks/peers.py`` runs vLLM);
- ``FA4``: ``flash_attn.cute``'s ``flash_attn_varlen_func`` with ``page_table`` and its own defaults.

Each call is captured in a CUDA graph (as both engines run decode) and timed with CUDA events around one replay,
after warm-up, with L2 flushed before each replay; the cell is the median time and the fraction of the
device-to-device copy bandwidth measured in the same run (``hardware.copy_bandwidth``: bytes read + written), for
the bytes one call must move: K and V of every sequence's context, q read and the output written.

Run through ``benchmarks/attention.py`` (``--decode-only`` for this table alone).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

# Attention shapes of the models RL trains here: (query heads, KV heads, head_dim).
LAYOUTS = {"1.7b": (16, 8, 128), "8b": (32, 8, 128), "30b-a3b": (32, 4, 128)}
LAYOUT_NAMES = {"1.7b": "Qwen3-1.7B", "8b": "Qwen3-8B", "30b-a3b": "Qwen3-30B-A3B"}
BATCHES = [1, 4, 16, 64, 128, 256, 512]
CONTEXTS = [512, 1024, 2048, 4096, 8192, 16384]
MIXED_FROM_BATCH = 64  # the mixed-length variant (lengths uniform in [ctx/2, ctx]) from this batch up
ELEM = 2  # bf16
WARMUP, REPS = 5, 30
L2_FLUSH_BYTES = 256 << 20  # larger than an H100's or H200's L2 (50 MB / 60 MB)
# vLLM's FlashAttention backend: at most this many KV splits under its full CUDA graph (vLLM 0.24,
# vllm/v1/attention/backends/flash_attn.py, _DEFAULT_MAX_NUM_SPLITS_FOR_CUDA_GRAPH); 1 in its batch-invariant mode.
VLLM_MAX_NUM_SPLITS = 16

IMPLS = ["vexact-triton", "vexact-fa4", "vllm-fa3", "vllm-fa3-bi", "fa4"]
IMPL_TITLES = {
    "vexact-triton": "VeXact Triton",
    "vexact-fa4": "VeXact FA4",
    "vllm-fa3": "vLLM FA3",
    "vllm-fa3-bi": "vLLM FA3 b-i",
    "fa4": "FA4",
}
VLLM_IMPLS = ("vllm-fa3", "vllm-fa3-bi")
NOT_INSTALLED = "not installed"


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    """One decode step: ``batch`` sequences of one query token each, in pages of ``page`` tokens."""

    layout: str
    batch: int
    ctx: int
    mixed: bool
    page: int

    @property
    def heads(self) -> tuple[int, int, int]:
        return LAYOUTS[self.layout]

    @property
    def key(self) -> str:
        return f"{self.layout}/{self.batch}/{self.ctx}/{'mixed' if self.mixed else 'equal'}/{self.page}"

    def lengths(self) -> list[int]:
        """Each sequence's context (its new token included); mixed: uniform in [ctx/2, ctx], seeded by the case."""
        if not self.mixed:
            return [self.ctx] * self.batch
        rng = random.Random(f"{self.batch}:{self.ctx}")
        return [rng.randint(self.ctx // 2, self.ctx) for _ in range(self.batch)]


def build_sweep(layouts, batches, contexts, page: int, mixed_from: int = MIXED_FROM_BATCH) -> list[DecodeCase]:
    """The sweep in run order: per layout, per batch, per context, equal lengths then (batch >= ``mixed_from``)
    mixed."""
    for name in layouts:
        if name not in LAYOUTS:
            raise ValueError(f"unknown head layout {name!r}; known: {', '.join(LAYOUTS)}")
    cases = []
    for name in layouts:
        for batch in batches:
            for ctx in contexts:
                cases.append(DecodeCase(name, batch, ctx, False, page))
                if batch >= mixed_from:
                    cases.append(DecodeCase(name, batch, ctx, True, page))
    return cases


def kv_bytes(case: DecodeCase) -> int:
    """K and V of every sequence's context (the KV a decode call must read)."""
    _, hkv, d = case.heads
    return 2 * sum(case.lengths()) * hkv * d * ELEM


def cache_bytes(case: DecodeCase) -> int:
    """What the case allocates for its paged cache (whole pages)."""
    _, hkv, d = case.heads
    pages = sum(math.ceil(n / case.page) for n in case.lengths())
    return 2 * pages * case.page * hkv * d * ELEM


def call_bytes(case: DecodeCase) -> int:
    """Bytes one decode call moves at least: the KV read, q read and the output written (bf16)."""
    hq, _, d = case.heads
    return kv_bytes(case) + 2 * case.batch * hq * d * ELEM


def fraction(case: DecodeCase, us: float, copy_bw: float) -> float:
    """Achieved bytes/s over the copy bandwidth (bytes read + written per second)."""
    return call_bytes(case) / (us * 1e-6) / copy_bw


def make_inputs(case: DecodeCase, device: str = "cuda", seed: int = 0) -> dict:
    """q [B, Hq, D], caches [num_pages, page, Hkv, D] (every row finite: FA4 reads a last page's rows past the
    context), block table [B, ceil(ctx / page)] int32 over shuffled pages (unused entries 0), context lengths and
    cu_seqlens_q (one query per sequence), all on ``device``."""
    import torch

    hq, hkv, d = case.heads
    lengths = case.lengths()
    pages = [math.ceil(n / case.page) for n in lengths]
    width = math.ceil(case.ctx / case.page)
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(sum(pages), generator=gen, dtype=torch.int32)
    table = torch.zeros(case.batch, width, dtype=torch.int32)
    start = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[start : start + n]
        start += n
    torch.manual_seed(seed)
    kc = torch.randn(sum(pages), case.page, hkv, d, device=device, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(case.batch, hq, d, device=device, dtype=torch.bfloat16)
    return {
        "q": q,
        "kc": kc,
        "vc": vc,
        "bt": table.to(device),
        "ctx": torch.tensor(lengths, dtype=torch.int32, device=device),
        "cu": torch.arange(case.batch + 1, dtype=torch.int32, device=device),
        "max_ctx": max(lengths),
    }


def time_call(fn, warmup: int = WARMUP, reps: int = REPS) -> float:
    """Median microseconds of one CUDA-graph replay of ``fn`` (CUDA events; L2 flushed before each replay)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # first calls (compilation, workspace allocation) outside the capture
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")
    for _ in range(warmup):
        graph.replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends, strict=True):
        flush.zero_()
        s.record()
        graph.replay()
        e.record()
    torch.cuda.synchronize()
    ms = statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))
    del graph
    return ms * 1e3


def try_time(make_fn, reps: int = REPS):
    """A cell: microseconds, or why there are none (a kernel refusing a shape is a result, not a crash)."""
    try:
        return time_call(make_fn(), reps=reps)
    except Exception as e:  # noqa: BLE001
        return f"n/a ({type(e).__name__})"


def vexact_fns(inputs: dict, case: DecodeCase) -> dict:
    """Builders of the VeXact rows' calls (a builder may raise: the cell then names the error), or a reason why a
    row has none."""
    hq, hkv, _ = case.heads
    q, kc, vc, bt, ctx, cu = (inputs[k] for k in ("q", "kc", "vc", "bt", "ctx", "cu"))
    out = {}
    try:
        from vexact_kernels.triton_ops import attention as ta
    except ImportError as e:
        out["vexact-triton"] = f"{NOT_INSTALLED} ({e})"
    else:

        def triton_fn():
            lay = ta.paged_layout(bt, ctx, cu, case.page, case.batch, hq, hkv, q.device)
            return lambda: ta.attention_paged(q, kc, vc, bt, ctx, cu, layout=lay)

        out["vexact-triton"] = triton_fn
    try:
        from vexact_kernels import fa4_attention

        ok, why = fa4_attention.fa4_importable()
    except ImportError as e:
        ok, why = False, str(e)
    if not ok:
        out["vexact-fa4"] = out["fa4"] = f"{NOT_INSTALLED} ({why.split(';')[0]})"
        return out

    def vexact_fa4_fn():
        lay = fa4_attention.paged_layout(bt, ctx, cu, q.device)
        return lambda: fa4_attention.attention_paged(q, kc, vc, bt, ctx, cu, layout=lay)

    def fa4_fn():
        from flash_attn.cute.interface import flash_attn_varlen_func

        return lambda: flash_attn_varlen_func(
            q, kc, vc, cu_seqlens_q=cu, seqused_k=ctx, page_table=bt, max_seqlen_q=1, causal=True
        )

    out["vexact-fa4"], out["fa4"] = vexact_fa4_fn, fa4_fn
    return out


# Launch shapes of VeXact's Triton decode other than the one the op picks: (split_programs, (BLOCK_M, warps, stages)
# or None for the constants, and optionally options of the launch: ``one_warp_sum`` (whether rows sum P in the one-warp
# order; default the op's rule), ``longest_first`` (the tile table longest context first) and ``heads_first`` (the
# grid as (KV heads, tiles)): the launch orders of DECODE_LONGEST_FIRST / DECODE_HEADS_FIRST). Each is timed and its
# output compared with the op's, torch.equal: a shape that keeps the bits can become the op's launch for decode; one
# that does not is a different kernel.
VARIANTS = {
    "split": (True, None),
    "one-pass": (False, None),
    "s3": (False, (64, 4, 3)),
    "split-s3": (True, (64, 4, 3)),
    "m16": (False, (16, 1, 2)),
    "m16-split": (True, (16, 1, 2)),
    "m16-w2": (False, (16, 2, 2)),
    "m16-w2-split": (True, (16, 2, 2)),
    "m16-w2-s3": (False, (16, 2, 3)),
    "m16-w4": (False, (16, 4, 2)),
    "m16-w4-s3": (False, (16, 4, 3)),
    "m16-w4-split": (True, (16, 4, 2)),
    "m16-w4-plain": (False, (16, 4, 2), {"one_warp_sum": False}),
    "m16-w2-lf": (False, (16, 2, 2), {"longest_first": True}),
    "m16-w2-hf": (False, (16, 2, 2), {"heads_first": True}),
    "m16-w2-lf-hf": (False, (16, 2, 2), {"longest_first": True, "heads_first": True}),
    "lf": (False, None, {"longest_first": True}),
    "lf-hf": (False, None, {"longest_first": True, "heads_first": True}),
    "m16-w4-split-lf-hf": (True, (16, 4, 2), {"longest_first": True, "heads_first": True}),
    "split-lf-hf": (True, None, {"longest_first": True, "heads_first": True}),
    "m16-w2-split-lf-hf": (True, (16, 2, 2), {"longest_first": True, "heads_first": True}),
    "m16-w4-split-s3": (True, (16, 4, 3)),
    "m16-w4-split-s4": (True, (16, 4, 4)),
    "m16-w2-split-s4": (True, (16, 2, 4)),
}


def variant_fns(inputs: dict, case: DecodeCase, names) -> dict:
    """Builders of the Triton launch variants ``names`` (keys of ``VARIANTS``) of this case's decode call; each
    builds its tile table outside the timed call, as the engine does once per step."""
    from vexact_kernels.triton_ops import attention as ta

    hq, hkv, d = case.heads
    q, kc, vc, bt, ctx, cu = (inputs[k] for k in ("q", "kc", "vc", "bt", "ctx", "cu"))
    kf, vf = kc.flatten(0, 1), vc.flatten(0, 1)

    def make(split: bool, launch, options=None):
        options = dict(options or {})
        longest = options.pop("longest_first", False)

        def build():
            lay = ta.paged_layout(bt, ctx, cu, case.page, case.batch, hq, hkv, q.device)
            block_m = launch[0] if launch else ta.BLOCK_M
            tiles = ta._fwd_tiles(lay.n_q, hq // hkv, case.batch, block_m)
            if longest:
                tiles = ta.longest_first(tiles, lay.ctx)
            args = (q, kf, vf, lay.table, case.page, lay.q_start, lay.n_q, lay.ctx, d**-0.5, False, tiles)
            return lambda: ta._fwd(*args, split_programs=split, launch=launch, **options)[0]

        return build

    return {name: make(*VARIANTS[name]) for name in names}


def run_variants(cases, names, budget_s: float, max_bytes: float, reps: int = REPS) -> dict:
    """``{case.key: {"op": us, name: (us | reason, same bits as the op's launch)}}`` for the launch variants."""
    import torch

    t0 = time.time()
    results = {}
    for case in cases:
        reason = skip_reason(case, max_bytes, t0, budget_s)
        if reason:
            results[case.key] = {"op": reason}
            continue
        inputs = make_inputs(case)
        op = vexact_fns(inputs, case)["vexact-triton"]
        builders = variant_fns(inputs, case, names)
        row = {"op": try_time(op, reps)}
        ref = op()()
        for name in names:
            try:
                same = bool(torch.equal(builders[name]()(), ref))
            except Exception as e:  # noqa: BLE001
                row[name] = (f"n/a ({type(e).__name__})", False)
                continue
            row[name] = (try_time(builders[name], reps), same)
        results[case.key] = row
        del inputs, builders, ref
        torch.cuda.empty_cache()
    return results


def variant_table(cases, results: dict, names, copy_bw: float) -> list[str]:
    """Markdown: per case the op's launch and each variant (µs, fraction of the copy bandwidth; "bits differ" where
    its output is not the op's, torch.equal)."""
    lines = ["| layout | batch | context | lengths | op's launch | " + " | ".join(names) + " |"]
    lines.append("|---" * (5 + len(names)) + "|")
    for case in cases:
        row = results.get(case.key, {})
        cells = [_cell(case, row.get("op", "-"), copy_bw)]
        for name in names:
            x = row.get(name)
            if x is None:
                cells.append("-")
                continue
            t, same = x
            cells.append(_cell(case, t, copy_bw) + ("" if same or not isinstance(t, float) else ", **bits differ**"))
        lengths = f"[{case.ctx // 2}, {case.ctx}]" if case.mixed else "equal"
        lines.append(f"| {case.layout} | {case.batch} | {case.ctx} | {lengths} | " + " | ".join(cells) + " |")
    return lines


def vllm_fns(inputs: dict, case: DecodeCase, flash_attn_varlen_func, get_scheduler_metadata, fa_version: int):
    """Builders of vLLM's FA3 paged decode as its FlashAttention backend calls it (default, and batch-invariant)."""
    hq, hkv, d = case.heads
    q, kc, vc, bt, ctx, cu = (inputs[k] for k in ("q", "kc", "vc", "bt", "ctx", "cu"))
    max_ctx = inputs["max_ctx"]

    def make(num_splits: int, aot: bool):
        def build():
            out = q.new_empty(q.shape)
            meta = None
            if aot and get_scheduler_metadata is not None and fa_version == 3:
                meta = get_scheduler_metadata(
                    batch_size=case.batch, max_seqlen_q=1, max_seqlen_k=max_ctx, num_heads_q=hq,
                    num_heads_kv=hkv, headdim=d, cache_seqlens=ctx, qkv_dtype=q.dtype, cu_seqlens_q=cu,
                    page_size=case.page, causal=True, window_size=(-1, -1), num_splits=num_splits,
                )  # fmt: skip
            return lambda: flash_attn_varlen_func(
                q=q, k=kc, v=vc, out=out, cu_seqlens_q=cu, max_seqlen_q=1, seqused_k=ctx, max_seqlen_k=max_ctx,
                softmax_scale=d**-0.5, causal=True, window_size=[-1, -1], block_table=bt, softcap=0.0,
                scheduler_metadata=meta, fa_version=fa_version, num_splits=num_splits,
            )  # fmt: skip

        return build

    return {"vllm-fa3": make(VLLM_MAX_NUM_SPLITS, True), "vllm-fa3-bi": make(1, False)}


def too_big(case: DecodeCase, max_bytes: float) -> str | None:
    need = cache_bytes(case)
    if need > max_bytes:
        return f"skipped: {need / 2**30:.1f} GiB of KV over the cap {max_bytes / 2**30:.1f} GiB"
    return None


def skip_reason(case: DecodeCase, max_bytes: float, t0: float, budget_s: float) -> str | None:
    """Why a case is not timed: its cache over ``max_bytes``, or the run past ``budget_s`` since ``t0``."""
    reason = too_big(case, max_bytes)
    if reason is None and time.time() - t0 > budget_s:
        reason = f"skipped: past the {budget_s:.0f} s budget"
    return reason


def run_cases(cases, fns_for, impls, budget_s: float, max_bytes: float, reps: int = REPS) -> dict:
    """``{case.key: {impl: us | reason}}`` for ``impls``; cases over ``max_bytes`` of cache or past ``budget_s`` get
    the reason in every cell."""
    import torch

    t0 = time.time()
    results = {}
    for case in cases:
        reason = skip_reason(case, max_bytes, t0, budget_s)
        if reason:
            results[case.key] = dict.fromkeys(impls, reason)
            continue
        inputs = make_inputs(case)
        builders = fns_for(inputs, case)
        results[case.key] = {
            impl: try_time(builders[impl], reps) if callable(builders[impl]) else builders[impl] for impl in impls
        }
        del inputs, builders
        torch.cuda.empty_cache()
    return results


def _worker_env(site: str | None) -> dict:
    env = dict(os.environ)
    # FA4's site carries apache-tvm-ffi in another version than vLLM's: off vLLM's path (as benchmarks/peers.py)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and "fa4site" not in p]
    env["PYTHONPATH"] = os.pathsep.join(([site] if site else []) + parts)
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    return env


def default_vllm_site() -> str | None:
    """``$VLLM_SITE``, else /tmp/vllmsite where scripts/staging/vllm_device_wheels.sh installed vLLM, else None."""
    site = os.environ.get("VLLM_SITE")
    if site:
        return site
    return "/tmp/vllmsite" if Path("/tmp/vllmsite").is_dir() else None


def run_vllm(cases, site: str | None, budget_s: float, max_bytes: float, reps: int, workdir: Path) -> tuple[dict, str]:
    """vLLM's rows from a subprocess: ``({case.key: {impl: us | reason}}, vLLM version or why none)``. Any failure
    of the subprocess gives every vLLM cell a reason, never an exception."""
    spec = {"cases": [dataclasses.asdict(c) for c in cases], "budget_s": budget_s, "max_bytes": max_bytes, "reps": reps}
    inp, out = workdir / "vllm-decode-in.json", workdir / "vllm-decode-out.json"
    inp.write_text(json.dumps(spec))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--vllm-worker", str(inp), str(out)]
    try:
        proc = subprocess.run(cmd, env=_worker_env(site), capture_output=True, text=True, timeout=budget_s + 300)
        res = json.loads(out.read_text()) if out.exists() else None
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError) as e:
        proc, res = None, {"error": f"n/a ({type(e).__name__})"}
    if res is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] if proc else []
        res = {"error": f"n/a (worker exit {proc.returncode if proc else '?'}: {' '.join(tail)[:120]})"}
    if "error" in res:
        return {c.key: dict.fromkeys(VLLM_IMPLS, res["error"]) for c in cases}, res["error"]
    return res["results"], res["version"]


def vllm_worker(inp: str, out: str) -> None:
    """The subprocess: time vLLM's rows for the cases in ``inp``, write the results to ``out``."""
    spec = json.loads(Path(inp).read_text())
    try:
        import torch
        import vllm
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except Exception as e:  # noqa: BLE001  (a broken install is "not installed" too)
        Path(out).write_text(json.dumps({"error": f"{NOT_INSTALLED} ({type(e).__name__}: {str(e)[:80]})"}))
        return
    try:
        from vllm.vllm_flash_attn import get_scheduler_metadata
    except ImportError:
        get_scheduler_metadata = None
    fa_version = 3 if torch.cuda.get_device_capability()[0] == 9 else 2  # vLLM runs FA3 on 9.x only

    def fns_for(inputs, case):
        return vllm_fns(inputs, case, flash_attn_varlen_func, get_scheduler_metadata, fa_version)

    cases = [DecodeCase(**c) for c in spec["cases"]]
    results = run_cases(cases, fns_for, VLLM_IMPLS, spec["budget_s"], spec["max_bytes"], spec["reps"])
    Path(out).write_text(json.dumps({"results": results, "version": f"vLLM {vllm.__version__}, FA{fa_version}"}))


def commit() -> str:
    """``$VEXACT_COMMIT`` when set (a copy of the tree without its git directory), else git's short HEAD, marked when
    tracked files differ from it."""
    if os.environ.get("VEXACT_COMMIT"):
        return os.environ["VEXACT_COMMIT"]
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True).stdout.strip()  # fmt: skip
    except OSError:
        return "unknown (set VEXACT_COMMIT)"
    if head.returncode != 0:
        return "unknown (not a git checkout: set VEXACT_COMMIT)"
    return head.stdout.strip() + (" (with uncommitted changes)" if dirty else "")


def _cell(case: DecodeCase, x, copy_bw: float) -> str:
    if isinstance(x, float):
        return f"{x:.1f} µs, {fraction(case, x, copy_bw):.2f}"
    return str(x)


def _best(row: dict, impls) -> float | None:
    times = [row[i] for i in impls if isinstance(row.get(i), float)]
    return min(times) if times else None


def decode_table(cases, results: dict, copy_bw: float, impls=IMPLS) -> list[str]:
    """Markdown: one table per head layout; a cell is the median µs per call and its fraction of the copy
    bandwidth; the last column the best VeXact time over the best peer's (> 1: VeXact slower)."""
    lines = []
    layouts = list(dict.fromkeys(c.layout for c in cases))
    for name in layouts:
        hq, hkv, d = LAYOUTS[name]
        lines += ["", f"### {LAYOUT_NAMES[name]} shape: {hq} query heads, {hkv} KV heads, head_dim {d}", ""]
        lines.append(
            "| batch | context | lengths | MiB moved | "
            + " | ".join(IMPL_TITLES[i] for i in impls)
            + " | VeXact / peer |"
        )
        lines.append("|---" * (5 + len(impls)) + "|")
        for case in (c for c in cases if c.layout == name):
            row = results.get(case.key, {})
            ours = _best(row, [i for i in impls if i.startswith("vexact")])
            peer = _best(row, [i for i in impls if not i.startswith("vexact")])
            ratio = f"{ours / peer:.2f}" if ours and peer else "-"
            lengths = f"[{case.ctx // 2}, {case.ctx}]" if case.mixed else "equal"
            cells = [_cell(case, row.get(i, "-"), copy_bw) for i in impls]
            lines.append(
                f"| {case.batch} | {case.ctx} | {lengths} | {call_bytes(case) / 2**20:.1f} | "
                + " | ".join(cells)
                + f" | {ratio} |"
            )
    return lines


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--vllm-worker":
        vllm_worker(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit("run benchmarks/attention.py --decode-only (this module's --vllm-worker is its subprocess)")
