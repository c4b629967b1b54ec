"""Plot the steps of ``benchmarks/throughput.py`` runs side by side: the JSON its full results name
(``<out>-steps-<shape>.json``: ``{"<batch limit> <mode>": [[requests, prompt tokens, seconds], ...]}``).

Two panels over the run's wall time, one line per engine: requests a step (how the batch fills, stays full and
drains), and the mean step time over a window of steps, split into steps that only decode and all steps. Where one
engine's line runs above another's at the same batch, that is where its wall time goes.

    python benchmarks/plot_steps.py RESULTS/throughput-rl-h200-1.7b-full-steps-1.7b.json --out steps-1.7b.png \
        [--runs "256 invariant,256 vllm"] [--window 50] [--title ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

NAMES = {
    "invariant": "VeXact invariant", "vllm": "vLLM default", "vllm-bi": "vLLM batch-invariant",
    "invariant-slot": "VeXact invariant, decode attention in slot order",
    # the name a3582c3's runs recorded for the decode attention's launch orders (the default from fcfa16e)
    "invariant-lf-hf": "VeXact invariant, longest first + KV heads first",
}  # fmt: skip


def load(path: Path, runs: list[str] | None) -> dict[str, list]:
    """The runs of a steps JSON (all, or those named, in that order); raises naming a run it lacks."""
    data = json.loads(Path(path).read_text())
    if not runs:
        return data
    missing = [r for r in runs if r not in data]
    if missing:
        raise SystemExit(f"{path}: no run {missing[0]!r} (runs: {', '.join(data)})")
    return {r: data[r] for r in runs}


def series(steps: list, window: int) -> dict[str, list[float]]:
    """Per step: the wall time at its end (s), its requests, and the mean ms a step over the last ``window`` steps
    (all steps, and the decode-only ones; NaN where the window holds none)."""
    t, ends, rows, mean_all, mean_dec = 0.0, [], [], [], []
    for i, (n, _prompt, sec) in enumerate(steps):
        t += sec
        ends.append(t)
        rows.append(n)
        win = steps[max(0, i - window + 1) : i + 1]
        mean_all.append(sum(s[2] for s in win) / len(win) * 1e3)
        dec = [s[2] for s in win if not s[1]]
        mean_dec.append(sum(dec) / len(dec) * 1e3 if dec else float("nan"))
    return {"t": ends, "rows": rows, "ms": mean_all, "ms_decode": mean_dec}


def plot(data: dict[str, list], out: Path, window: int, title: str | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    for i, (run, steps) in enumerate(data.items()):
        limit, _, mode = run.partition(" ")
        label = f"{NAMES.get(mode, mode)} (limit {limit})"
        s = series(steps, window)
        color = f"C{i}"
        top.plot(s["t"], s["rows"], color=color, lw=1, label=label)
        bottom.plot(s["t"], s["ms_decode"], color=color, lw=1.2, label=f"{label}, decode-only steps")
        bottom.plot(s["t"], s["ms"], color=color, lw=0.8, ls=":", label=f"{label}, all steps")
    top.set_ylabel("requests a step")
    top.legend(fontsize=8)
    bottom.set_ylabel(f"ms a step (mean of {window})")
    bottom.set_xlabel("wall time of the run (s)")
    bottom.legend(fontsize=7)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("steps", type=Path, help="a steps JSON of benchmarks/throughput.py")
    ap.add_argument("--out", type=Path, required=True, help="the PNG to write")
    ap.add_argument("--runs", help='comma-separated "<batch limit> <mode>" keys (default: every run in the file)')
    ap.add_argument("--window", type=int, default=50, help="steps in the moving mean (default 50)")
    ap.add_argument("--title")
    args = ap.parse_args(argv)
    if args.window < 1:
        ap.error(f"--window must be >= 1, got {args.window}")
    data = load(args.steps, [r.strip() for r in args.runs.split(",")] if args.runs else None)
    plot(data, args.out, args.window, args.title)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
