"""Compare the arms of the verify pair: verl's rollout/actor mismatch, reward and step time per arm.

    python examples/verify/compare.py results/h100-qwen3-1.7b-vllm.jsonl results/h100-qwen3-1.7b-vexact.jsonl \\
        [results/h100-qwen3-1.7b-fast.jsonl] --plot results/h100-qwen3-1.7b.png --expect-exact vexact

Each run is verl's file-logger JSONL, named ``<gpu>-<model>-<arm>.jsonl`` (arm in vllm, vexact, fast), with the run
script's ``<same stem>.meta.json`` beside it (``runs.py`` lists its keys). Runs of different configs (another pair
shape, lengths, batch, token budgets, planned steps, ...) are refused (exit 2, naming the first differing setting and
both values); runs without a meta file are compared without that check. An arm that logged fewer steps than another
(a run stopped early) limits the tables to the steps every arm logged; the output says how many each has.
Prints the per-step K3 KL and largest per-token probability gap, a per-arm summary and the mean phase times after
``--warmup`` steps (default 1: step 1 holds each stack's warm-up, graph capture and compilation; where no common step
is left after it, the means include it and say so), with the ratio to the vllm arm. ``--plot`` draws, over every
step each arm logged, K3 KL, rollout_probs_diff mean and max (log scales, an exact 0.0 drawn on a floor line),
reward, grad norm and entropy. ``--expect-exact ARM`` exits 1 unless ARM's ``rollout_corr/k3_kl`` and
``training/rollout_probs_diff_max`` are exactly 0.0 at every step it logged and every other arm's are above 0 at every
step.
"""

from __future__ import annotations

import argparse
import math
import sys
from functools import partial
from pathlib import Path

from runs import (
    DEFAULT_ARM,
    ENTROPY,
    GRAD_NORM,
    K3,
    PHASES,
    PROBS_DIFF_MAX,
    PROBS_DIFF_MEAN,
    REWARD,
    Run,
    RunError,
    check_comparable,
    common,
    fmt_float,
    read_run,
    span,
)

COLORS = {"vllm": "tab:red", "vexact": "tab:blue", "fast": "tab:orange", "invariant": "tab:purple"}
# (metric, panel title, log scale)
PANELS = (
    (K3, "rollout_corr/k3_kl: K3 KL(rollout || actor)", True),
    (PROBS_DIFF_MEAN, "rollout_probs_diff_mean: mean |p_rollout - p_actor|", True),
    (PROBS_DIFF_MAX, "rollout_probs_diff_max: max |p_rollout - p_actor|", True),
    (REWARD, "critic/score/mean: mean reward", False),
    (GRAD_NORM, "actor/grad_norm", False),
    (ENTROPY, "actor/entropy", False),
)


def finite(vals: list[float]) -> list[float]:
    return [v for v in vals if not math.isnan(v)]


def print_steps(runs: list[Run]) -> None:
    head = "".join(f"{'k3_kl ' + r.arm:>22}" for r in runs) + "".join(f"{'probs_diff_max ' + r.arm:>28}" for r in runs)
    print(f"{'step':>4}{head}")
    for i, s in enumerate(runs[0].steps):
        k3 = "".join(f"{r.series(K3)[i]:>22.3e}" for r in runs)
        pd = "".join(f"{r.series(PROBS_DIFF_MAX)[i]:>28.3e}" for r in runs)
        print(f"{s:>4}{k3}{pd}")


def print_summary(runs: list[Run]) -> None:
    cols = ("K3 KL min", "K3 KL max", "pdiff_max min", "pdiff_max max")
    print(f"\n{'arm':<10}" + "".join(f"{c:>15}" for c in cols) + "  reward first -> last")
    for r in runs:
        k3, pd, rw = finite(r.series(K3)), finite(r.series(PROBS_DIFF_MAX)), r.series(REWARD)
        cells = [min(k3, default=None), max(k3, default=None), min(pd, default=None), max(pd, default=None)]
        line = f"{r.arm:<10}" + "".join(f"{fmt_float(c, '.3e'):>15}" for c in cells)
        print(f"{line}  {fmt_float(rw[0], '.4f')} -> {fmt_float(rw[-1], '.4f')}")


def print_timing(runs: list[Run], warmup: int) -> None:
    steps = runs[0].steps
    base = next((r.phase_means(warmup) for r in runs if r.arm == DEFAULT_ARM), None)
    ratio = f"(x) = ratio to the {DEFAULT_ARM} arm" if base is not None else f"no {DEFAULT_ARM} arm: no ratios"
    print(f"\ntiming_s/*: mean s over steps {steps[warmup]}..{steps[-1]} (after {warmup} warm-up); {ratio}")
    print(f"{'arm':<10}" + "".join(f"{p:>22}" for p in PHASES))
    for r in runs:
        cells = []
        for p, v in r.phase_means(warmup).items():
            cell = fmt_float(v, ".3f")
            if base is not None and r.arm != DEFAULT_ARM and v is not None and base[p]:
                cell += f" ({v / base[p]:.2f}x)"
            cells.append(f"{cell:>22}")
        print(f"{r.arm:<10}" + "".join(cells))


def expect_exact(runs: list[Run], arm: str) -> bool:
    """ARM exactly 0.0 at every step in both metrics; every other arm above 0.0 at every step in both."""
    ok = True
    print(f"\nexpect-exact {arm}:")
    for r in runs:
        exact = r.arm == arm
        for key in (K3, PROBS_DIFF_MAX):
            vals = r.series(key)
            good = [v == 0.0 if exact else v > 0.0 for v in vals]  # NaN (not logged) is neither
            ok &= all(good)
            want = "exactly 0.0" if exact else "> 0"
            bad = [f"step {s}: {v!r}" for s, v, g in zip(r.steps, vals, good, strict=True) if not g]
            lo, hi = min(finite(vals), default=None), max(finite(vals), default=None)
            line = f"  {r.arm}: {key} {want} at {sum(good)}/{len(vals)} steps (min {lo!r}, max {hi!r})"
            print(line + (f"; fails at {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}" if bad else ""))
    print(f"expect-exact: {'PASS' if ok else 'FAIL'}")
    return ok


def log_tick(y: float, _pos: int, floor: float) -> str:
    """Decade labels of a log axis, with the floor that stands for exact zeros labelled as such."""
    if y <= 0.0:
        return ""
    if math.isclose(y, floor, rel_tol=1e-6):
        return "0.0 (exact)"
    e = math.log10(y)
    return f"$10^{{{round(e)}}}$" if math.isclose(e, round(e), abs_tol=1e-6) else ""


def draw(ax, runs: list[Run], key: str, title: str, log: bool) -> None:
    """One panel: ``key`` per step for every arm; on a log axis exact zeros sit on a floor line labelled so."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    series = {r.arm: r.series(key) for r in runs}
    positive = [v for vals in series.values() for v in vals if v > 0.0]
    # a log axis cannot show 0.0: exact zeros sit on a floor a decade below the smallest positive value
    floor = 10 ** (math.floor(math.log10(min(positive))) - 1) if positive else 1e-8
    any_zero = False
    for r in runs:
        vals, color = series[r.arm], COLORS.get(r.arm)
        if not log:
            ax.plot(r.steps, vals, marker=".", color=color, label=r.arm)
            continue
        above = [v if v > 0.0 else math.nan for v in vals]
        if any(not math.isnan(v) for v in above):
            ax.plot(r.steps, above, marker=".", color=color, label=r.arm)
        zeros = [floor if v == 0.0 else math.nan for v in vals]
        if any(not math.isnan(z) for z in zeros):
            any_zero = True
            ax.plot(r.steps, zeros, marker="s", ms=4, color=color, label=f"{r.arm}: 0.0 (exact)")
    if log:
        ax.set_yscale("log")
        if any_zero:
            ax.axhline(floor, color="grey", lw=0.6, ls=":")
            ax.yaxis.set_major_formatter(FuncFormatter(partial(log_tick, floor=floor)))
            ax.set_ylim(bottom=floor / 3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("training step")
    ax.legend(fontsize=8)


def describe(runs: list[Run]) -> str:
    meta = next((r.meta for r in runs if r.meta is not None), None)
    if meta is not None:
        return f"{meta['model']} on {meta['gpu']}, verl GRPO"
    return runs[0].path.name.removesuffix(".jsonl").rsplit("-", 1)[0]


def plot(runs: list[Run], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16, 8))
    for ax, (key, title, log) in zip(axes.flat, PANELS, strict=True):
        draw(ax, runs, key, title, log)
    fig.suptitle(f"{describe(runs)}: {', '.join(r.arm for r in runs)}")
    save(fig, out)


def save(fig, out: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", type=Path, nargs="+", help="2 or 3 runs: <gpu>-<model>-<arm>.jsonl")
    ap.add_argument("--plot", type=Path, default=None, metavar="PATH", help="write the six-panel PNG here")
    ap.add_argument("--warmup", type=int, default=1,
                    help="steps left out of the timing means (default 1: each stack's warm-up)")  # fmt: skip
    ap.add_argument("--expect-exact", default=None, metavar="ARM",
                    help="exit 1 unless ARM is exactly 0.0 and every other arm above 0 at every step")  # fmt: skip
    args = ap.parse_args(argv)
    try:
        if not 2 <= len(args.runs) <= 3:
            raise RunError(f"got {len(args.runs)} runs; compare.py takes 2 or 3 (one per arm)")
        full = [read_run(p) for p in args.runs]
        notes = check_comparable(full)
        runs, warmup, more = common(full, args.warmup)  # the steps every arm logged
        notes += more
        if args.expect_exact is not None and args.expect_exact not in {r.arm for r in runs}:
            raise RunError(f"--expect-exact {args.expect_exact}: no such arm; the runs are {[r.arm for r in runs]}")
    except RunError as e:
        print(f"compare.py: {e}", file=sys.stderr)
        return 2
    logged = ", ".join(f"{r.arm} {span(r.steps)}" for r in full)
    print(f"runs ({logged}): " + ", ".join(f"{r.arm}={r.path}" for r in runs))
    for r in runs:
        if r.meta is not None:
            m = r.meta
            print(f"  {r.arm}: {m['model']} on {m['gpu']}, {m['date']}, commit {m['commit']}; stack {m['stack']}; "
                  f"peak GPU memory {m['peak_gpu_mem_mib']} MiB")  # fmt: skip
    gpus = sorted({str(r.meta["gpu"]) for r in runs if r.meta is not None})
    if len(gpus) > 1:
        notes.append(f"runs of different GPUs ({', '.join(gpus)}): the timing ratios compare unlike machines")
    for note in notes:
        print(f"note: {note}")
    print_steps(runs)
    print_summary(runs)
    print_timing(runs, warmup)
    if args.plot is not None:
        plot(full, args.plot)  # every step each arm logged
    if args.expect_exact is not None and not expect_exact(full, args.expect_exact):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
