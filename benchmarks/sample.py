"""Fused draw benchmark (GPU): the sampling form of the fused logprobs kernel against the scoring form on the same
rows, the draw a user would write, and the lm_head read bound, measured side by side in one run.

    PYTHONPATH=... python benchmarks/sample.py [--out FILE.md] [--rows 1,16,64,256] [--peak-scale 16] [--hidden 2048]

V = 151936, H = 2048 (Qwen3-1.7B's lm_head; ``--hidden 4096``: Qwen3-8B's), bf16, T rows. Bound: the lm_head's bytes
over the device's copy bandwidth (``hardware.copy_bandwidth``: a 2 GiB ``copy_``, bytes read + written, measured
here): the least time of any method that reads the lm_head once. Every time is a median (microseconds) with its ratio
to the bound.

Device time (CUDA-graph replay, triton.testing.do_bench_cudagraph: no launch overhead or host sync, as in the
engine's captured decode step; each callable starts from the pre-norm hidden states):

- draw: ``vk.rms_norm`` then the fused draw (``triton_sample_logprobs``: the noise kernel, then token and its
  logprob in one pass over the lm_head); at T <= 16 its draw covers 1 or 16 rows of the 64-row block
  (``SAMPLE_DRAW_ROWS``); its logits tiles read through TMA descriptors from ``LOGPROBS_TMA_MIN_ROWS`` rows, through
  pointers below;
- draw, pointer tiles / TMA tiles: the same with ``LOGPROBS_TMA = False`` (the logits tiles and noise tiles read
  through pointers at every T), and below ``LOGPROBS_TMA_MIN_ROWS`` with ``LOGPROBS_TMA_MIN_ROWS = 1`` (through TMA
  descriptors; "-" where the draw reads them so already) (checked: the same tokens and logprob bits);
- draw, 64-row noise: the same with ``SAMPLE_DRAW_ROWS = ()``, the draw over all 64 rows of the block, padding
  included (checked: the same tokens and logprob bits);
- draw, no skip: the draw with ``GUMBEL_NOISE_MAX = inf``, every tile's noise read (checked: the same tokens and
  bits);
- scoring: ``vk.rms_norm`` then the fused scoring form (``triton_logprobs``) of the drawn tokens; and with pointer
  tiles and TMA tiles as above;
- torch, the draw a user would pick: ``vk.rms_norm``, cuBLAS lm_head (``F.linear``), ``torch.softmax`` in fp32,
  ``torch.multinomial``; eager (triton.testing.do_bench), since ``torch.multinomial`` checks its input on the host
  (two syncs) and cannot be captured.

Public API, eager (triton.testing.do_bench): ``vk.sample_from_hidden`` and ``vk.logprobs_from_hidden``, what a caller
pays with launch overhead and each one's host sync (the temperature copy or check, the target range check).

Row sets: random logits (about N(0, 1) per row) and peaked ones: the final norm weight scaled by ``--peak-scale``
(the hidden states are RMS-normalised, so scaling them would change nothing), logits about N(0, scale**2), the top
token holding most of the mass. Skipped: the share of (row block, tile) pairs whose noise the kernel's rule skips,
computed from the reference scores (``vk.compute_logits``, ``vk.gumbel_uniform``); at most: the share that a bound
shared by all vocabulary splits (the row's final best score) would skip, for comparison.
"""

from __future__ import annotations

import argparse
import datetime
import sys

import hardware
import torch

VOCAB = 151936
HIDDEN = 2048
EPS = 1e-6
ROWS = (1, 16, 64, 256)


def _graph_us(fn) -> float:
    """Median microseconds of ``fn`` replayed in a CUDA graph (compiled outside the graph first)."""
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def _eager_us(fn) -> float:
    import triton.testing

    return 1e3 * triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def skip_shares(hidden, norm_w, head, temps, seeds) -> tuple[float, float]:
    """(share of (row block, tile) pairs the kernel's rule skips, share a bound shared across splits could skip):
    from the reference scores, with the kernel's tiling (LOGPROBS_BLOCK_T rows, LOGPROBS_VOCAB_BLOCK columns,
    LOGPROBS_SPLIT_TILES tiles per split, the last split's tiles past V empty)."""
    import vexact_kernels as vk
    from vexact_kernels.triton_ops import logprobs as ops

    t, v = hidden.shape[0], head.shape[0]
    with vk.use_backend("invariant"):
        z = vk.compute_logits(hidden, norm_w, EPS, head) / temps[:, None]
    score = z - torch.log(-torch.log(vk.gumbel_uniform(seeds, v)))
    n_splits, tiles, width = ops.n_vocab_splits(v), ops.LOGPROBS_SPLIT_TILES, ops.LOGPROBS_VOCAB_BLOCK
    rows_pad = -(-t // ops.LOGPROBS_BLOCK_T) * ops.LOGPROBS_BLOCK_T

    def tiled_max(x):  # [row blocks, block rows, splits, tiles]; columns past V are -inf (empty tiles)
        full = x.new_full((rows_pad, n_splits * tiles * width), float("-inf"))
        full[:t, :v] = x
        return full.view(-1, ops.LOGPROBS_BLOCK_T, n_splits, tiles, width).amax(-1)

    zmax, best = tiled_max(z), tiled_max(score)
    before = torch.cat((torch.full_like(best[..., :1], float("-inf")), best.cummax(-1).values[..., :-1]), -1)
    final = best.amax((-1, -2), keepdim=True)
    real = (torch.arange(rows_pad, device=z.device) < t).view(-1, ops.LOGPROBS_BLOCK_T, 1, 1)  # pad rows: no say
    rule = (~real | (zmax + ops.GUMBEL_NOISE_MAX < before)).all(1)
    shared = (~real | (zmax + ops.GUMBEL_NOISE_MAX < final)).all(1)
    return float(rule.float().mean()), float(shared.float().mean())


def bench(lines: list[str], rows: tuple[int, ...], peak_scale: float, hidden_size: int = HIDDEN) -> None:
    bound_us = VOCAB * hidden_size * 2 / hardware.copy_bandwidth("cuda") * 1e6
    g = torch.Generator(device="cuda").manual_seed(0)
    head = (torch.randn(VOCAB, hidden_size, device="cuda", generator=g) / hidden_size**0.5).to(torch.bfloat16)
    norm_w = (1.0 + 0.1 * torch.randn(hidden_size, device="cuda", generator=g)).to(torch.bfloat16)
    cell = lambda us: f"{us:.0f} ({us / bound_us:.2f}x)"  # noqa: E731

    def checked(us: dict, key: str, same: str = "") -> str:
        """A variant's cell, marked DIFFERS where its tokens or logprobs are not the draw's bits; "-" where the
        variant does not apply at this T."""
        if key not in us:
            return "-"
        return f"{cell(us[key])} {same if us[key + ' same'] else 'DIFFERS'}".rstrip()

    lines += [
        f"lm_head {VOCAB} x {hidden_size} bf16: {VOCAB * hidden_size * 2 / 2**20:.0f} MiB; bound {bound_us:.1f} us at "
        "the measured copy bandwidth. Cells: median us (ratio to the bound).",
        "",
        "### Device time (CUDA-graph replay)",
        "",
        "| logits | T | draw | draw, pointer tiles | draw, TMA tiles | draw, 64-row noise | draw, no skip | scoring "
        "| scoring, pointer tiles | scoring, TMA tiles | torch, eager (F.linear, softmax, multinomial) | skipped "
        "| at most |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    eager = [
        "",
        "### Public API, eager (launch overhead and host syncs included)",
        "",
        "| logits | T | vk.sample_from_hidden | vk.logprobs_from_hidden |",
        "|---|---|---|---|",
    ]
    for name, scale in (("random", 1.0), (f"peaked (norm x {peak_scale:g})", peak_scale)):
        nw = (norm_w.float() * scale).to(torch.bfloat16)
        for t in rows:
            hidden = torch.randn(t, hidden_size, device="cuda", generator=g).to(torch.bfloat16)
            temps = torch.full((t,), 0.9, device="cuda")
            seeds = torch.randint(0, 2**62, (t,), device="cuda", generator=g)
            us = measure(hidden, nw, head, temps, seeds)
            rule, shared = skip_shares(hidden, nw, head, temps, seeds)
            lines.append(
                f"| {name} | {t} | {cell(us['draw'])} | {checked(us, 'draw, pointer tiles')} "
                f"| {checked(us, 'draw, TMA tiles')} | {checked(us, 'draw, 64-row noise')} "
                f"| {checked(us, 'draw, no skip')} | {cell(us['scoring'])} | {checked(us, 'scoring, pointer tiles')} "
                f"| {checked(us, 'scoring, TMA tiles')} | {cell(us['torch'])} | {100 * rule:.1f}% "
                f"| {100 * shared:.1f}% |"
            )
            eager.append(f"| {name} | {t} | {cell(us['api draw'])} | {cell(us['api scoring'])} |")
            print(lines[-1], eager[-1], sep="\n", flush=True)
    lines += eager + [""]


def measure(hidden, norm_w, head, temps, seeds) -> dict:
    """Median microseconds of each method on these rows (see the module docstring)."""
    import vexact_kernels as vk
    from vexact_kernels.triton_ops import logprobs as ops
    from vexact_kernels.triton_ops.sample import triton_sample_logprobs

    def draw():
        return triton_sample_logprobs(vk.rms_norm(hidden, norm_w, EPS), head, temps, seeds)

    def score():
        return ops.triton_logprobs(vk.rms_norm(hidden, norm_w, EPS), head, tokens, temps)

    def torch_draw():
        logits = torch.nn.functional.linear(vk.rms_norm(hidden, norm_w, EPS), head)
        return torch.multinomial(torch.softmax(logits.float() / temps[:, None], dim=-1), 1)

    tokens, lp = draw()
    lp_score = score()[0]
    us = {"draw": _graph_us(draw)}

    def variant(key, fn, want, **consts):
        """``fn`` with these module constants (the launch compiles and captures that variant): its time, and whether
        its outputs are ``want``, bit for bit."""
        saved = {name: getattr(ops, name) for name in consts}
        try:
            for name, value in consts.items():
                setattr(ops, name, value)
            got = fn()
            us[key + " same"] = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
            us[key] = _graph_us(fn)
        finally:
            for name, value in saved.items():
                setattr(ops, name, value)

    variant("draw, pointer tiles", draw, (tokens, lp), LOGPROBS_TMA=False)
    variant("draw, 64-row noise", draw, (tokens, lp), SAMPLE_DRAW_ROWS=())
    variant("draw, no skip", draw, (tokens, lp), GUMBEL_NOISE_MAX=float("inf"))  # every tile's noise
    variant("scoring, pointer tiles", lambda: score()[:1], (lp_score,), LOGPROBS_TMA=False)
    if hidden.shape[0] < ops.LOGPROBS_TMA_MIN_ROWS:
        variant("draw, TMA tiles", draw, (tokens, lp), LOGPROBS_TMA_MIN_ROWS=1)
        variant("scoring, TMA tiles", lambda: score()[:1], (lp_score,), LOGPROBS_TMA_MIN_ROWS=1)
    us["scoring"], us["torch"] = _graph_us(score), _eager_us(torch_draw)
    host_temps = temps.cpu()  # as the engine passes them
    us["api draw"] = _eager_us(lambda: vk.sample_from_hidden(hidden, norm_w, EPS, head, host_temps, seeds))
    us["api scoring"] = _eager_us(lambda: vk.logprobs_from_hidden(hidden, norm_w, EPS, head, tokens, host_temps))
    return us


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="also write the markdown table to this file")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts T, comma-separated")
    ap.add_argument("--peak-scale", type=float, default=16.0, help="final norm weight scale of the peaked row set")
    ap.add_argument("--hidden", type=int, default=HIDDEN, help="the lm_head's hidden size (2048: 1.7B, 4096: 8B)")
    args = ap.parse_args()
    if args.hidden < 1:
        ap.error(f"--hidden must be positive, got {args.hidden}")
    if not torch.cuda.is_available():
        print("benchmarks/sample.py needs a CUDA device", file=sys.stderr)
        return 2
    import triton

    import vexact_kernels as vk

    rows = tuple(int(r) for r in args.rows.split(","))
    lines = [
        f"# Fused draw benchmark ({datetime.date.today().isoformat()})",
        "",
        f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; triton {triton.__version__}; "
        f"vexact-kernels {vk.__version__}.",
        "",
    ]
    print("\n".join(lines), flush=True)
    with vk.use_backend("invariant"):
        bench(lines, rows, args.peak_scale, args.hidden)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
