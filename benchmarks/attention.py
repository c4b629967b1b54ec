"""GPU attention side by side in one run, as markdown tables (printed, and written to ``--out``).

Columns: ours (the invariant Triton kernel, ``triton_ops/attention.py``), FA4 (FlashAttention 4 through
``vexact_kernels.fa4_attention``, the ``VEXACT_ATTENTION=fa4`` path, when flash_attn.cute imports), torch's default
``scaled_dot_product_attention`` (cuDNN on H100) and SDPA's FLASH_ATTENTION backend.

- decode: one new token per sequence; ours and FA4 over a paged KV cache (``--page``, default 16; pages shuffled)
  inside a CUDA graph, as the engine runs it; SDPA over a dense [B, Hkv, ctx, D] cache (``enable_gqa``). Reported
  as achieved HBM bandwidth (K/V bytes read + q/o) in TB/s and as a fraction of a device-to-device copy measured in
  the same run;
- prefill / training forward: TFLOP/s of the causal kernels on packed equal-length sequences (SDPA sees a dense
  [B, H, L, D] batch, K/V heads repeated outside the timed region);
- forward + backward (training): TFLOP/s counting 3.5x the forward FLOPs; ours and FA4 with their deterministic
  backward;
- paged decode at RL shapes (``benchmarks/attention_decode.py``): VeXact's Triton and FA4 kernels, vLLM's FA3 paged
  decode (default and batch-invariant) and FA4's own paged call, batch 1-512, contexts 512-16k (equal lengths, and
  lengths uniform in [ctx/2, ctx] from batch 64), the Qwen3-1.7B / 8B / 30B-A3B head layouts, pages of ``--page``
  tokens: median µs per call and the fraction of the copy bandwidth. ``--decode-only`` runs this table alone; cases
  whose cache exceeds ``--decode-max-kv-gib`` or that would start past ``--decode-budget-s`` are listed as skipped.

Usage: ``PYTHONPATH=<packages' src dirs>:. python benchmarks/attention.py [--out FILE] [--quick] [--page 16]
[--heads 32:8] [--decode-batches 1,4,16,64,256] [--decode-contexts 1024,4096,16384] [--prefill 4x4096,...]`` (the
first tables meant to take under 4 minutes on an H100, the RL decode table at most ``--decode-budget-s`` more, 270 s
by default; the FA4 columns stay empty where flash-attn-4 is not installed, the ``[fa4]`` extra of vexact-kernels).
``--decode-only [--rl-layouts 1.7b,8b,30b-a3b] [--rl-batches ...] [--rl-contexts ...] [--vllm-site DIR]``: the RL
decode table alone. ``--heads 16:8`` is Qwen3-1.7B's attention; ``--page 128`` is FA4's tile_n at head_dim 128 (its
TMA paged path; it sets the RL decode table's pages too).
``--sweep`` times a few alternative Triton tile configurations instead (for choosing the fixed constants; a change
of the forward's constants changes the numerics of every GPU target).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import shlex
import sys
import tempfile
import time
from pathlib import Path

import hardware
import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench, do_bench_cudagraph

from vexact_kernels import fa4_attention
from vexact_kernels.triton_ops import attention as ta
from vexact_kernels.triton_ops import attention_bwd as tab

sys.path.insert(0, str(Path(__file__).resolve().parent))
import attention_decode as ad  # noqa: E402  (benchmarks/attention_decode.py: the paged decode sweep at RL shapes)

HQ, HKV, D = 32, 8, 128  # Qwen3-8B-shaped attention
PAGE = 16
DEV = "cuda"


def _paged_inputs(batch: int, ctx: int, d: int = D):
    """One decode step's inputs over a paged cache (pages of ``PAGE`` tokens, shuffled): q, k/v caches, block table,
    context lengths and cu_seqlens_q (one query per sequence)."""
    pages_per_seq = ctx // PAGE
    num_pages = batch * pages_per_seq
    kc = torch.randn(num_pages, PAGE, HKV, d, device=DEV, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    bt = torch.randperm(num_pages, device=DEV, dtype=torch.int32).view(batch, pages_per_seq)
    q = torch.randn(batch, HQ, d, device=DEV, dtype=torch.bfloat16)
    ctx_lens = torch.full((batch,), ctx, device=DEV, dtype=torch.int32)
    cu = torch.arange(batch + 1, device=DEV, dtype=torch.int32)
    return q, kc, vc, bt, ctx_lens, cu


def decode_case(batch: int, ctx: int, d: int = D):
    q, kc, vc, bt, ctx_lens, cu = _paged_inputs(batch, ctx, d)
    fn = lambda: ta.attention_paged(q, kc, vc, bt, ctx_lens, cu)  # noqa: E731
    fn()
    ms = do_bench_cudagraph(fn, rep=50)  # as the engine runs decode: in a CUDA graph (no host sync in the op)
    eager = do_bench(fn, warmup=10, rep=50)
    nbytes = 2 * kc.numel() * kc.element_size() + 2 * q.numel() * q.element_size()
    return ms, nbytes / (ms * 1e-3), eager


def _dense(batch, seqlen, d=D, grad=False):
    q = torch.randn(batch * seqlen, HQ, d, device=DEV, dtype=torch.bfloat16, requires_grad=grad)
    k = torch.randn(batch * seqlen, HKV, d, device=DEV, dtype=torch.bfloat16, requires_grad=grad)
    v = torch.randn(batch * seqlen, HKV, d, device=DEV, dtype=torch.bfloat16, requires_grad=grad)
    cu = torch.arange(0, batch * seqlen + 1, seqlen, device=DEV, dtype=torch.int32)
    return q, k, v, cu


def _sdpa_inputs(q, k, v, batch, seqlen):
    """[B, H, L, D] views for SDPA; K/V heads repeated for GQA (outside the timed region)."""
    g = HQ // HKV

    def bhld(t):
        return t.detach().view(batch, seqlen, t.shape[1], t.shape[2]).transpose(1, 2).contiguous()

    qs = bhld(q).requires_grad_()
    ks = bhld(k).repeat_interleave(g, 1).contiguous().requires_grad_()
    vs = bhld(v).repeat_interleave(g, 1).contiguous().requires_grad_()
    return qs, ks, vs


def causal_flops(batch, seqlen, d=D):
    return 4 * batch * seqlen * seqlen / 2 * HQ * d  # two matmuls, half the square


def prefill_case(batch, seqlen):
    q, k, v, cu = _dense(batch, seqlen)
    scale = D**-0.5
    ours = do_bench(lambda: ta._packed_fwd(q, k, v, cu, scale, False), warmup=10, rep=50)
    qs, ks, vs = _sdpa_inputs(q, k, v, batch, seqlen)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.no_grad():
        ref = do_bench(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True), warmup=10, rep=50)
    return causal_flops(batch, seqlen) / (ours * 1e-3) / 1e12, causal_flops(batch, seqlen) / (ref * 1e-3) / 1e12


def backward_case(batch, seqlen):
    q, k, v, cu = _dense(batch, seqlen)
    scale = D**-0.5
    o, lse = ta._packed_fwd(q, k, v, cu, scale, True)
    do = torch.randn_like(o)
    ours = do_bench(lambda: tab._bwd(q, k, v, o, lse, do, cu, scale), warmup=10, rep=50)
    qs, ks, vs = _sdpa_inputs(q, k, v, batch, seqlen)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        dos = torch.randn_like(out)
        ref = do_bench(lambda: torch.autograd.grad(out, (qs, ks, vs), dos, retain_graph=True), warmup=10, rep=50)
    fl = 2.5 * causal_flops(batch, seqlen)
    return fl / (ours * 1e-3) / 1e12, fl / (ref * 1e-3) / 1e12


PREFILL_SHAPES = [(1, 16384), (4, 4096), (8, 2048), (16, 1024), (32, 512)]


FWD_SWEEP = [(128, 64, 8, 3), (64, 64, 4, 3), (64, 64, 4, 2), (64, 128, 4, 2), (64, 128, 4, 3), (64, 32, 4, 3)]
BWD_SWEEP = [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 4, 2), (64, 32, 4, 2), (128, 32, 8, 2)]


def _set(names, cfg):
    old = tuple(getattr(ta, n) for n in names)
    for n, x in zip(names, cfg, strict=True):
        setattr(ta, n, x)
    return old


def sweep(fwd_configs=FWD_SWEEP, bwd_configs=BWD_SWEEP):
    """Time alternative constants. Prefer one forward config per process (``--fwd-config``): switching configs in
    one process after CUDA-graph captures once ended in an illegal memory access (H100, Triton 3.6) that the same
    configs never showed in fresh processes or in the tests."""
    fwd = ("BLOCK_M", "BLOCK_N", "NUM_WARPS", "NUM_STAGES")
    print("\n### Sweep: forward tile configs (prefill TFLOP/s; decode TB/s, CUDA graph)\n")
    print("| BLOCK_M | BLOCK_N | warps | stages | prefill 4x4096 | prefill 32x512 | decode 64x4096 | decode 256x4096 |")
    print("|---|---|---|---|---|---|---|---|")
    for cfg in fwd_configs:
        keep = _set(fwd, cfg)
        try:
            p1, _ = prefill_case(4, 4096)
            p2, _ = prefill_case(32, 512)
            _, b1, _ = decode_case(64, 4096)
            _, b2, _ = decode_case(256, 4096)
            row = f"{p1:.0f} | {p2:.0f} | {b1 / 1e12:.2f} | {b2 / 1e12:.2f}"
        except Exception as e:  # an out-of-resources config is a result, not a crash
            row = f"failed: {type(e).__name__} | | |"
        _set(fwd, keep)
        print(f"| {cfg[0]} | {cfg[1]} | {cfg[2]} | {cfg[3]} | {row} |")
    bwd = ("BWD_BLOCK_M", "BWD_BLOCK_N", "BWD_NUM_WARPS", "BWD_NUM_STAGES")
    print("\n### Sweep: backward configs (TFLOP/s)\n")
    print("| BLOCK_M | BLOCK_N | warps | stages | 4x4096 | 32x512 |")
    print("|---|---|---|---|---|---|")
    for cfg in bwd_configs:
        keep = _set(bwd, cfg)
        try:
            b1, _ = backward_case(4, 4096)
            b2, _ = backward_case(32, 512)
            row = f"{b1:.0f} | {b2:.0f}"
        except Exception as e:
            row = f"failed: {type(e).__name__} |"
        _set(bwd, keep)
        print(f"| {cfg[0]} | {cfg[1]} | {cfg[2]} | {cfg[3]} | {row} |")


def cross_config_check():
    """Informative only: are forward outputs bitwise equal across (BLOCK_M, num_warps) with BLOCK_N fixed?"""
    fwd = ("BLOCK_M", "BLOCK_N", "NUM_WARPS", "NUM_STAGES")
    print("\n### Cross-config bitwise check (same BLOCK_N=64; not relied upon)\n")
    for d in (64, 128):
        torch.manual_seed(d)
        lens = [1, 63, 64, 65, 700, 4096, 2000]
        t = sum(lens)
        q = torch.randn(t, HQ, d, device=DEV, dtype=torch.bfloat16)
        k = torch.randn(t, HKV, d, device=DEV, dtype=torch.bfloat16)
        v = torch.randn(t, HKV, d, device=DEV, dtype=torch.bfloat16)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEV, dtype=torch.int32)
        outs = {}
        for cfg in [(128, 64, 8, 3), (64, 64, 4, 3), (64, 64, 4, 2), (128, 64, 4, 3), (64, 64, 8, 3)]:
            keep = _set(fwd, cfg)
            outs[cfg] = ta._packed_fwd(q, k, v, cu, d**-0.5, False)[0]
            _set(fwd, keep)
        base = outs[(128, 64, 8, 3)]
        for cfg, o in outs.items():
            print(f"- D={d} {cfg} vs (128, 64, 8, 3): equal={torch.equal(o, base)} max diff {(o - base).abs().max()}")


DECODE_BATCHES, DECODE_CONTEXTS = [1, 4, 16, 64, 256], [1024, 4096, 16384]
RL_LAYOUTS, RL_BATCHES, RL_CONTEXTS = list(ad.LAYOUTS), list(ad.BATCHES), list(ad.CONTEXTS)


def _tflops(flops, ms):
    return flops / (ms * 1e-3) / 1e12


def _try(fn):
    """A column's timing, or why it has none (a backend refusing a shape is a result, not a crash)."""
    try:
        return fn()
    except Exception as e:
        return f"n/a ({type(e).__name__})"


def _fmt(x, spec):
    return format(x, spec) if isinstance(x, float) else str(x)


def _graphed_tbs(fn, nbytes: int) -> float:
    fn()
    # do_bench_cudagraph runs fn on a stream of its own, unordered with the default stream: the inputs and the
    # layout made there must be done first (without this, a row could read a tile table still being written)
    torch.cuda.synchronize()
    return nbytes / (do_bench_cudagraph(fn, rep=30) * 1e-3) / 1e12


def _paged_decode(batch: int, ctx: int, fa4: bool, nbytes: int) -> list:
    """Ours (the launch the op picks, then forced to one program per tile; both with the step's layout built once,
    outside the timing, as the engine shares it across layers) and FA4 over one paged cache (pages of ``PAGE``
    tokens, shuffled), as the engine's decode graph runs them."""
    q, kc, vc, bt, ctx_lens, cu = _paged_inputs(batch, ctx)
    # the layout (int32 tables, tile table) built once, as the engine builds it once per step for every layer
    lay = ta.paged_layout(bt, ctx_lens, cu, PAGE, batch, HQ, HKV, q.device)
    ours = _graphed_tbs(lambda: ta.attention_paged(q, kc, vc, bt, ctx_lens, cu, layout=lay), nbytes)
    flat = (q, kc.flatten(0, 1), vc.flatten(0, 1), lay.table, PAGE, lay.q_start, lay.n_q, lay.ctx, D**-0.5, False)
    one_pass = _graphed_tbs(lambda: ta._fwd(*flat, lay.tiles, split_programs=False), nbytes)
    if not fa4:
        return [ours, one_pass, "-"]
    return [
        ours,
        one_pass,
        _try(lambda: _graphed_tbs(lambda: fa4_attention.attention_paged(q, kc, vc, bt, ctx_lens, cu), nbytes)),
    ]


def decode_row(batch: int, ctx: int, fa4: bool, copy_bw: float) -> list:
    """Achieved TB/s per implementation for one decode step of `batch` sequences at context `ctx`, then the best
    one's fraction of the copy bandwidth."""
    nbytes = 2 * 2 * batch * ctx * HKV * D + 2 * 2 * batch * HQ * D  # K and V read, q read and o written (bf16)
    row = _paged_decode(batch, ctx, fa4, nbytes)
    torch.cuda.empty_cache()
    kd = torch.randn(batch, HKV, ctx, D, device=DEV, dtype=torch.bfloat16)
    vd = torch.randn_like(kd)
    qd = torch.randn(batch, HQ, 1, D, device=DEV, dtype=torch.bfloat16)

    def sdpa():
        return F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True)

    def sdpa_flash():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True)

    row += [_try(lambda: _graphed_tbs(sdpa, nbytes)), _try(lambda: _graphed_tbs(sdpa_flash, nbytes))]
    best = max(x for x in row if isinstance(x, float))
    return [*row, best * 1e12 / copy_bw]


def prefill_row(batch: int, seqlen: int, fa4: bool, backward: bool) -> list:
    """TFLOP/s per implementation, forward only or forward + backward."""
    q, k, v, cu = _dense(batch, seqlen)
    qs, ks, vs = _sdpa_inputs(q, k, v, batch, seqlen)
    flops = causal_flops(batch, seqlen) * (3.5 if backward else 1.0)

    def timed(fwd, inputs):
        if not backward:
            with torch.no_grad():
                return _tflops(flops, do_bench(fwd, warmup=5, rep=30))
        leaves = [t.detach().requires_grad_() for t in inputs]
        do = torch.randn_like(fwd(*leaves))

        def step():
            torch.autograd.grad(fwd(*leaves), leaves, do)

        return _tflops(flops, do_bench(step, warmup=5, rep=30))

    def flash(a, b, c):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(a, b, c, is_causal=True)

    def bind(fn, inputs):
        return lambda *t: fn(*(t or inputs))

    row = [timed(bind(lambda a, b, c: tab.attention_packed(a, b, c, cu), (q, k, v)), (q, k, v))]
    fa = bind(lambda a, b, c: fa4_attention.attention_packed(a, b, c, cu), (q, k, v))
    row.append(_try(lambda: timed(fa, (q, k, v))) if fa4 else "-")
    sd = bind(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True), (qs, ks, vs))
    row += [_try(lambda: timed(sd, (qs, ks, vs))), _try(lambda: timed(bind(flash, (qs, ks, vs)), (qs, ks, vs)))]
    return row


def _ints(ap, flag: str, text: str, sep: str = ",") -> list[int]:
    try:
        values = [int(x) for x in text.split(sep)]
    except ValueError:
        ap.error(f"{flag}: expected integers separated by {sep!r}, got {text!r}")
    if any(v < 1 for v in values):
        ap.error(f"{flag}: values must be positive, got {text!r}")
    return values


def configure(ap, args) -> None:
    """Set the module's shape globals from the command line (each case reads them when it runs); ``--quick`` takes
    fewer shapes where none are given."""
    global PAGE, HQ, HKV, DECODE_BATCHES, DECODE_CONTEXTS, PREFILL_SHAPES, RL_LAYOUTS, RL_BATCHES, RL_CONTEXTS
    if args.quick:
        DECODE_BATCHES, DECODE_CONTEXTS, PREFILL_SHAPES = [1, 64], [4096], [(4, 4096), (32, 512)]
        RL_LAYOUTS, RL_BATCHES, RL_CONTEXTS = ["8b"], [1, 64, 256], [1024, 4096]
    else:
        RL_LAYOUTS, RL_BATCHES, RL_CONTEXTS = list(ad.LAYOUTS), list(ad.BATCHES), list(ad.CONTEXTS)
    if args.rl_layouts:
        RL_LAYOUTS = args.rl_layouts.split(",")
        unknown = [x for x in RL_LAYOUTS if x not in ad.LAYOUTS]
        if unknown:
            ap.error(f"--rl-layouts: unknown {unknown}; known: {','.join(ad.LAYOUTS)}")
    if args.rl_batches:
        RL_BATCHES = _ints(ap, "--rl-batches", args.rl_batches)
    if args.rl_contexts:
        RL_CONTEXTS = _ints(ap, "--rl-contexts", args.rl_contexts)
    if args.variants and args.variants != "all":
        bad = [n for n in args.variants.split(",") if n not in ad.VARIANTS]
        if bad:
            ap.error(f"--variants: unknown {bad}; known: {', '.join(ad.VARIANTS)}")
    if args.decode_budget_s <= 0 or args.decode_max_kv_gib <= 0 or args.reps < 1:
        ap.error("--decode-budget-s, --decode-max-kv-gib and --reps must be positive")
    (PAGE,) = _ints(ap, "--page", str(args.page))
    if args.heads.count(":") != 1:
        ap.error(f"--heads: expected query heads:KV heads, e.g. 16:8; got {args.heads!r}")
    HQ, HKV = _ints(ap, "--heads", args.heads, ":")
    if HQ % HKV:
        ap.error(f"--heads: {HQ} query heads is not a multiple of {HKV} KV heads")
    if args.decode_batches:
        DECODE_BATCHES = _ints(ap, "--decode-batches", args.decode_batches)
    if args.decode_contexts:
        DECODE_CONTEXTS = _ints(ap, "--decode-contexts", args.decode_contexts)
    bad = [c for c in DECODE_CONTEXTS if c % PAGE]
    if bad:
        ap.error(f"--decode-contexts: {bad} are not multiples of the page size {PAGE}")
    if args.prefill:
        shapes = [_ints(ap, "--prefill", shape, "x") for shape in args.prefill.split(",")]
        if any(len(shape) != 2 for shape in shapes):
            ap.error(f"--prefill: expected BATCHxSEQLEN shapes, e.g. 4x4096; got {args.prefill!r}")
        PREFILL_SHAPES = [tuple(shape) for shape in shapes]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="also write the markdown tables to this file")
    ap.add_argument("--quick", action="store_true", help="fewer shapes (a smoke run)")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--cross-config", action="store_true")
    ap.add_argument("--fwd-config", help="sweep only this forward config, e.g. 64,64,4,3 (one per process)")
    ap.add_argument("--page", type=int, default=PAGE, help="tokens per KV page of the paged decode cases")
    ap.add_argument("--heads", default=f"{HQ}:{HKV}", help="query heads:KV heads (16:8 is Qwen3-1.7B, 32:8 Qwen3-8B)")
    ap.add_argument("--decode-batches", help=f"comma-separated (default {DECODE_BATCHES})")
    ap.add_argument("--decode-contexts", help=f"comma-separated multiples of --page (default {DECODE_CONTEXTS})")
    ap.add_argument("--decode-only", action="store_true", help="only the paged decode table at RL shapes")
    ap.add_argument("--rl-layouts", help=f"RL decode head layouts, comma-separated (default {','.join(ad.LAYOUTS)})")
    ap.add_argument("--rl-batches", help=f"RL decode batches, comma-separated (default {ad.BATCHES})")
    ap.add_argument("--rl-contexts", help=f"RL decode contexts, comma-separated (default {ad.CONTEXTS})")
    ap.add_argument(
        "--decode-budget-s",
        type=float,
        default=270.0,
        help="RL decode: no case starts past this many seconds (vLLM's subprocess gets 2/5 of it)",
    )
    ap.add_argument(
        "--decode-max-kv-gib",
        type=float,
        default=32.0,
        help="RL decode: skip cases whose paged cache exceeds this (and 0.45 of free GPU memory)",
    )
    ap.add_argument("--reps", type=int, default=ad.REPS, help="RL decode: timed replays per cell (the median)")
    ap.add_argument(
        "--variants",
        help=f"RL decode: also time these launch shapes of the Triton kernel and compare their bits with the op's "
        f"(comma-separated of {','.join(ad.VARIANTS)}, or 'all')",
    )
    ap.add_argument(
        "--vllm-site",
        default=ad.default_vllm_site(),
        help="vLLM's site for its FA3 rows (default $VLLM_SITE, else /tmp/vllmsite if present)",
    )
    ap.add_argument("--prefill", help="comma-separated BATCHxSEQLEN shapes (default: " +
                    ",".join(f"{b}x{n}" for b, n in PREFILL_SHAPES) + ")")  # fmt: skip
    return ap


def rl_decode(args, emit, copy_bw: float) -> None:
    """The paged decode table at RL shapes (benchmarks/attention_decode.py): vLLM's rows first, in a subprocess,
    while this process holds no cache; then VeXact's and FA4's."""
    cases = ad.build_sweep(RL_LAYOUTS, RL_BATCHES, RL_CONTEXTS, PAGE)
    max_bytes = min(args.decode_max_kv_gib * 2**30, 0.45 * torch.cuda.mem_get_info()[0])
    budget = args.decode_budget_s
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        vllm_res, vllm_version = ad.run_vllm(cases, args.vllm_site, 0.4 * budget, max_bytes, args.reps, Path(tmp))
    left = max(budget - (time.time() - t0), 1.0)
    ours = ad.run_cases(cases, ad.vexact_fns, [i for i in ad.IMPLS if i not in ad.VLLM_IMPLS], left, max_bytes,
                        args.reps)  # fmt: skip
    results = {c.key: {**ours.get(c.key, {}), **vllm_res.get(c.key, {})} for c in cases}
    emit(f"\n## Paged decode at RL shapes (1 query token per sequence, bf16 KV in pages of {PAGE}, CUDA graph)\n")
    emit(f"vLLM: {vllm_version}; cells: median µs per call over {args.reps} replays (L2 flushed before each), then")
    emit("the bytes it moves (K/V of every context + q + out) per second over the copy bandwidth; VeXact / peer: the")
    emit("best VeXact time over the best peer time (below 1: VeXact faster). vLLM FA3: as its backend calls it at")
    emit(f"decode under its full CUDA graph (AOT schedule, num_splits={ad.VLLM_MAX_NUM_SPLITS}); b-i: its")
    emit(f"batch-invariant mode (num_splits=1). Took {time.time() - t0:.0f} s.")
    for line in ad.decode_table(cases, results, copy_bw):
        emit(line)
    if args.variants:
        names = list(ad.VARIANTS) if args.variants == "all" else args.variants.split(",")
        t1 = time.time()
        var = ad.run_variants(cases, names, budget, max_bytes, args.reps)
        emit("\n### Launch shapes of the Triton kernel (the same source; split / one-pass, BLOCK_M, warps, stages)\n")
        emit(", ".join(f"{n}: {ad.VARIANTS[n]}" for n in names) + f". Took {time.time() - t1:.0f} s.\n")
        for line in ad.variant_table(cases, var, names, copy_bw):
            emit(line)


def main(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    configure(ap, args)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/attention.py measures GPU kernels: no CUDA device is visible")
    t0 = time.time()
    lines: list[str] = []

    def emit(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    free = torch.cuda.mem_get_info()[0]
    fa4, why = fa4_attention.fa4_importable()
    emit(f"# Attention on the GPU, {torch.cuda.get_device_name()}, {datetime.date.today()}")
    emit()
    emit(f"- Date: {datetime.date.today()}")
    emit(f"- GPU: {torch.cuda.get_device_name()}")
    emit(f"- Commit: {ad.commit()}")
    emit(f"- Command: `python benchmarks/attention.py {shlex.join(sys.argv[1:] if argv is None else argv)}`")
    emit()
    emit(f"torch {torch.__version__}, triton {triton.__version__}; Hq={HQ}, Hkv={HKV}, D={D}, bf16, causal")
    emit(
        f"ours (Triton) forward tiles: BLOCK_M={ta.BLOCK_M} BLOCK_N={ta.BLOCK_N} warps={ta.NUM_WARPS} "
        f"stages={ta.NUM_STAGES}; backward: {tab.BWD_BLOCK_M}x{tab.BWD_BLOCK_N} warps={tab.BWD_NUM_WARPS} "
        f"stages={tab.BWD_NUM_STAGES}"
    )
    if fa4:
        from importlib import metadata

        emit(f"FA4: flash-attn-4 {metadata.version('flash-attn-4')}, settings {fa4_attention.FA4_SETTINGS}")
    else:
        emit(f"FA4: not importable here ({why})")
    if args.sweep or args.cross_config:  # exploration runs: only what was asked for
        if args.sweep and args.fwd_config:
            sweep([tuple(int(x) for x in args.fwd_config.split(","))], [])
        elif args.sweep:
            sweep()
        if args.cross_config:
            cross_config_check()
        return
    copy_bw = hardware.copy_bandwidth(DEV)
    emit(f"\ndevice-to-device copy: {copy_bw / 1e12:.2f} TB/s (read + write)\n")
    torch.cuda.empty_cache()
    rl_decode(args, emit, copy_bw)
    if args.decode_only:
        emit(f"\n(run took {time.time() - t0:.0f} s, compilation included)")
        _write(args.out, lines)
        return
    emit(f"## Decode (1 query token per sequence; achieved TB/s; ours and FA4 paged, page {PAGE}, in a CUDA graph)\n")
    emit(
        f"ours: the launch the op picks (one program per split of {ta.SPLIT_N} keys + the ordered combine where the "
        f"one-pass launch has fewer than {ta.SPLIT_BELOW_PROGRAMS} programs); one pass: one program per tile, "
        "folding its splits in registers (the same bits)\n"
    )
    emit("| batch | context | ours | ours, one pass | FA4 | SDPA default | SDPA flash | best / copy |")
    emit("|---|---|---|---|---|---|---|---|")
    batches, contexts = DECODE_BATCHES, DECODE_CONTEXTS
    for batch, ctx in itertools.product(batches, contexts):
        need = 2 * batch * ctx * HKV * D * 2  # K and V, paged then (freed) dense
        if need > 0.6 * free:
            emit(f"| {batch} | {ctx} | skipped: {need / 2**30:.0f} GiB of KV | | | | | |")
            continue
        row = decode_row(batch, ctx, fa4, copy_bw)
        emit(f"| {batch} | {ctx} | " + " | ".join(_fmt(x, ".2f") for x in row) + " |")
        torch.cuda.empty_cache()
    shapes = PREFILL_SHAPES
    for backward in (False, True):
        title = "Forward + backward (training; 3.5x forward FLOPs)" if backward else "Prefill / training forward"
        emit(f"\n## {title}: TFLOP/s, causal, packed equal-length sequences\n")
        emit("| batch x seqlen | ours | FA4 | SDPA default | SDPA flash | ours / best | FA4 / best |")
        emit("|---|---|---|---|---|---|---|")
        for batch, seqlen in shapes:
            row = prefill_row(batch, seqlen, fa4, backward)
            best = max(x for x in row if isinstance(x, float))
            ratios = [row[0] / best, row[1] / best if isinstance(row[1], float) else "-"]
            emit(
                f"| {batch} x {seqlen} | "
                + " | ".join(_fmt(x, ".0f") for x in row)
                + " | "
                + " | ".join(_fmt(x, ".2f") for x in ratios)
                + " |"
            )
            torch.cuda.empty_cache()
    emit(f"\n(run took {time.time() - t0:.0f} s, FA4 compilation included)")
    _write(args.out, lines)


def _write(path: str | None, lines: list[str]) -> None:
    if path:
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
