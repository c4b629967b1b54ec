"""The TIM study's report: per arm and rollout correction, the mean and spread over seeds of the reward, K3 KL, gradient
norm, entropy and collapse step, as a Markdown table (for README.md), with plot.py's figure of the same runs.

    python examples/tim_study/report.py outputs/tim_study/study-*.jsonl --out outputs/tim_study/study

reads sweep.py's JSONL files (one per ``--shard``; their ``.meta.jsonl`` say how they were made) and writes
``<out>.jsonl`` (every row, merged and sorted), ``<out>.png`` and ``<out>.md``.

Collapse, fixed before the study runs (``collapse_step``): a run collapses at the first step from which its reward,
averaged over the trailing ``SMOOTH`` steps, stays below ``DROP`` times its peak so far (of the same average) for
``PATIENCE`` steps in a row; or at a gradient-norm blow-up: a step skipped for a non-finite loss or gradient, or a
gradient norm above ``BLOWUP`` times the median of the run's first ``PATIENCE`` steps (of those with a gradient).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SMOOTH = 10  # steps in the trailing reward average
DROP = 0.5  # collapse: the average below this fraction of its peak so far ...
PATIENCE = 20  # ... for this many steps in a row
BLOWUP = 10.0  # collapse: a gradient norm above this many times the median of the first PATIENCE steps
TAIL = 0.2  # "final" reward and entropy: the mean over this fraction of the last steps
STALL = 0.05  # the lr probe: a run stalls when its final reward is less than this above its start


def read_rows(path: str | Path) -> list[dict]:
    """The rows of a sweep JSONL file, plain or gzip-compressed (plot.py's reader)."""
    return _plot().read_rows(path)


def collapse_step(rows: list[dict]) -> int | None:
    """The step at which the run of ``rows`` (one run, by step) collapses, or None (definition: the module's)."""
    rows = sorted(rows, key=lambda r: r["step"])
    norms = [r["grad_norm"] for r in rows[:PATIENCE]]
    moving = [g for g in norms if math.isfinite(g) and g > 0]  # a group with one reward has no gradient
    limit = BLOWUP * statistics.median(moving) if moving else math.inf
    below, peak = 0, -math.inf
    for i, r in enumerate(rows):
        if r.get("skipped") or not math.isfinite(r["grad_norm"]) or r["grad_norm"] > limit:
            return r["step"]
        window = rows[max(0, i - SMOOTH + 1) : i + 1]
        avg = sum(w["reward"] for w in window) / len(window)
        peak = max(peak, avg)
        below = below + 1 if avg < DROP * peak else 0
        if below == PATIENCE:
            return rows[i - PATIENCE + 1]["step"]
    return None


def _runs(rows: list[dict]) -> dict[tuple, dict[int, list[dict]]]:
    """(arm, correction, lr) -> seed -> that run's rows."""
    out: dict[tuple, dict[int, list[dict]]] = {}
    for r in rows:
        arm = r.get("arm") or f"noise:{r['logit_noise_std']:g}"
        out.setdefault((arm, r["rollout_correction"], r.get("lr") or 0.0), {}).setdefault(r.get("seed", 0), []).append(
            r
        )
    return out


def _spread(values: list[float], fmt: str) -> str:
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(statistics.mean(values), fmt)} ± {format(statistics.stdev(values), fmt)}"


def summarize(rows: list[dict]) -> list[dict]:
    """One entry per (arm, correction, lr): per-seed values and their mean and spread."""
    out = []
    order = lambda k: (k[2], k[0] != "exact", k[0] == "fast", k[0], k[1])  # noqa: E731
    for (arm, corr, lr), seeds in sorted(_runs(rows).items(), key=lambda kv: order(kv[0])):
        per_seed = []
        for seed, run in sorted(seeds.items()):
            run = sorted(run, key=lambda r: r["step"])
            tail = run[-max(1, round(len(run) * TAIL)) :]
            mean = lambda xs, k: sum(x[k] for x in xs) / len(xs)  # noqa: E731
            per_seed.append(
                {
                    "seed": seed,
                    "steps": len(run),
                    "reward_start": run[0]["reward"],
                    "reward_peak": max(mean(run[max(0, i - SMOOTH + 1) : i + 1], "reward") for i in range(len(run))),
                    "reward_final": mean(tail, "reward"),
                    "k3_kl": mean(run, "k3_kl"),
                    "grad_norm": mean([r for r in run if math.isfinite(r["grad_norm"])] or run, "grad_norm"),
                    "entropy_final": mean(tail, "entropy"),
                    "collapse_step": collapse_step(run),
                }
            )
        out.append({"arm": arm, "correction": corr, "lr": lr, "seeds": per_seed,
                    "noise_std": seeds[next(iter(seeds))][0]["logit_noise_std"]})  # fmt: skip
    return out


def table(summary: list[dict]) -> str:
    """The Markdown table: mean ± standard deviation over seeds; collapse as collapsed/seeds and the mean step."""
    several_lrs = len({s["lr"] for s in summary}) > 1
    head = (
        "| "
        + "lr | " * several_lrs
        + "arm | correction | noise std | seeds | steps | reward start | reward peak | reward final | K3 KL (mean) | "
        "grad norm (mean) | entropy final | collapsed (step) |\n" + "|---" * (12 + several_lrs) + "|\n"
    )
    lines = []
    exact_corrections = {s["correction"] for s in summary if s["arm"] == "exact"}
    for s in summary:
        ps = s["seeds"]
        col = lambda k, ps=ps: [p[k] for p in ps]  # noqa: E731
        collapsed = [p["collapse_step"] for p in ps if p["collapse_step"] is not None]
        when = f" (step {statistics.mean(collapsed):.0f})" if collapsed else ""
        corr = s["correction"]
        if s["arm"] == "exact" and exact_corrections == {"none"}:
            corr = "any (bitwise the same run)"  # sweep.py runs exact once: TIS and MIS are no-ops at ratio 1
        lines.append(
            "| "
            + f"{s['lr']:g} | " * several_lrs
            + f"{s['arm']} | {corr} | {s['noise_std']:g} | {len(ps)} | {min(col('steps'))} | "
            f"{_spread(col('reward_start'), '.3f')} | {_spread(col('reward_peak'), '.3f')} | "
            f"{_spread(col('reward_final'), '.3f')} | {_spread(col('k3_kl'), '.2e')} | "
            f"{_spread(col('grad_norm'), '.3f')} | {_spread(col('entropy_final'), '.3f')} | "
            f"{len(collapsed)}/{len(ps)}{when} |"
        )
    return head + "\n".join(lines) + "\n"


def _plot():
    spec = importlib.util.spec_from_file_location("tim_study_plot", HERE / "plot.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def report(paths: list[Path], out: Path) -> Path:
    """Merge ``paths`` into ``<out>.jsonl``, draw ``<out>.png`` and write ``<out>.md``; returns the .md path."""
    rows, meta = [], []
    for p in [p for p in paths if not p.name.endswith(".meta.jsonl")]:  # a shell glob of the shards matches those
        rows += read_rows(p)
        m = p.with_name(p.stem + ".meta.jsonl")
        if m.is_file():
            meta += [json.loads(line) for line in m.read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"no rows in {[str(p) for p in paths]}")
    rows.sort(key=lambda r: (r.get("arm") or "", r["rollout_correction"], r.get("seed", 0), r["step"]))
    out.parent.mkdir(parents=True, exist_ok=True)
    merged = out.with_suffix(".jsonl")
    merged.write_text("".join(json.dumps(r) + "\n" for r in rows))
    png = _plot().plot(merged)
    lrs = ", ".join(f"{lr:g}" for lr in sorted({r["lr"] for r in rows if r.get("lr")})) or "not recorded"
    header = [f"Runs of `{rows[0]['model']}` on task `{rows[0]['task']}`, lr {lrs}."]
    for m in meta:
        header.append(f"- {m['date']}, {m['device']}, torch {m['torch']}, commit {m['commit']}: "
                      f"`{m['command']}`")  # fmt: skip
    header.append(
        f"\nReward final and entropy final: the mean over the last {TAIL:.0%} of the steps; reward peak: the best "
        f"{SMOOTH}-step average. Collapse: the {SMOOTH}-step reward average below {DROP:g} x its peak so far for "
        f"{PATIENCE} steps in a row, or a gradient norm non-finite or above {BLOWUP:g} x the median of the first "
        f"{PATIENCE} steps (of those with a gradient). Values: mean ± standard deviation over seeds.\n"
    )
    md = out.with_suffix(".md")
    md.write_text("\n".join(header) + "\n" + table(summarize(rows)) + f"\n![TIM study]({png.name})\n")
    print(md.read_text())
    print(f"written: {merged}, {png}, {md}")
    return md


def pick_lr(rows: list[dict], stall: float = STALL) -> tuple[float | None, list[str]]:
    """The lr probe's rule: the largest learning rate at which the exact arm neither collapses (no seed's run does)
    nor stalls (its final reward, averaged over seeds, at least ``stall`` above its start, likewise averaged).
    Returns that rate (None where no rate qualifies) and one line of reasons per rate."""
    exact = summarize([r for r in rows if r.get("arm") == "exact"])
    if not exact:
        raise ValueError("no rows of the exact arm: the lr probe runs sweep.py --arms exact")
    best, lines = None, []
    for s in sorted(exact, key=lambda s: s["lr"]):
        ps = s["seeds"]
        collapsed = [p["seed"] for p in ps if p["collapse_step"] is not None]
        gain = statistics.mean(p["reward_final"] - p["reward_start"] for p in ps)
        ok = not collapsed and gain >= stall
        lines.append(
            f"lr {s['lr']:g}: {len(ps)} seeds, {min(p['steps'] for p in ps)} steps, final - start reward "
            f"{gain:+.3f} (stall below {stall:+.3f}), collapsed seeds {collapsed or 'none'}: {'ok' if ok else 'no'}"
        )
        if ok:
            best = s["lr"]
    return best, lines


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("sweeps", nargs="+", help="sweep.py's JSONL files (one per shard)")
    ap.add_argument("--out", default="outputs/tim_study/study", help="prefix of the .jsonl, .png and .md written")
    ap.add_argument(
        "--pick-lr",
        action="store_true",
        help="the lr probe: print the largest lr at which the exact arm neither collapses nor stalls (last line: the "
        "rate, or 'none'), and write nothing",
    )
    ap.add_argument("--stall", type=float, default=STALL, help="--pick-lr: the least final - start reward gain")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    missing = [p for p in args.sweeps if not Path(p).is_file()]
    if missing:
        print(f"report.py: error: {missing[0]!r}: no such file (sweep.py writes it)", file=sys.stderr)
        return 2
    if args.pick_lr:
        rows = [r for p in args.sweeps for r in read_rows(p)]
        try:
            lr, lines = pick_lr(rows, args.stall)
        except ValueError as e:
            print(f"report.py: error: {e}", file=sys.stderr)
            return 2
        print("\n".join(lines))
        print("none" if lr is None else f"{lr:g}")
        return 0
    out = Path(args.out)
    if out.suffix:
        print(
            f"report.py: error: --out {args.out!r}: a prefix without a suffix (.jsonl/.png/.md are added)",
            file=sys.stderr,
        )
        return 2
    if any(Path(p).resolve() == out.with_suffix(".jsonl").resolve() for p in args.sweeps):
        print(
            f"report.py: error: --out {args.out!r} would overwrite its input {out.with_suffix('.jsonl')}",
            file=sys.stderr,
        )
        return 2
    report([Path(p) for p in args.sweeps], out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
