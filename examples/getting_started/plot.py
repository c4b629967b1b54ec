"""Plot the GRPO runs side by side: reward, rollout/trainer K3 KL, mismatched-token fraction, gradient norm.

python examples/getting_started/plot.py    # outputs/getting_started/{invariant,fast}.jsonl -> ..._vs_fast.png
python examples/getting_started/plot.py A.jsonl B.jsonl -o grpo.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUTPUTS = Path("outputs") / "getting_started"  # where grpo.py writes by default, in the current directory
PANELS = [
    ("reward", "mean reward (exact match)"),
    ("k3_kl", "K3 KL(rollout || trainer)"),
    ("mismatch_fraction", "fraction of mismatched tokens"),
    ("grad_norm", "gradient norm (before clipping)"),
]


def load(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot(runs: dict[str, list[dict]], out: str | Path, window: int = 10) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.6))
    colors = {"invariant": "tab:blue", "fast": "tab:red"}
    styles = {"invariant": "-", "fast": "--"}
    for ax, (key, title) in zip(axes, PANELS, strict=True):
        for name, rows in runs.items():
            steps = [r["step"] for r in rows]
            values = [r[key] for r in rows]
            color, style = colors.get(name), styles.get(name, "-")
            if key == "reward":
                ax.plot(steps, values, color=color, alpha=0.25, linewidth=0.8)
                label = f"{name} rollouts ({window}-step mean)"
                ax.plot(steps, smooth(values, window), style, color=color, label=label)
            else:
                ax.plot(steps, values, style, color=color, linewidth=1.0, label=f"{name} rollouts")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
        if key == "k3_kl":
            ax.set_yscale("symlog", linthresh=1e-7)  # the invariant run is exactly 0, which a log axis cannot show
    axes[0].legend(fontsize=8)
    first = next(iter(runs.values()))[:1]
    about = f"task {first[0].get('task', '?')}, model {first[0].get('model', '?')}" if first else ""
    fig.suptitle(f"GRPO ({about}): trainer on invariant kernels, rollouts on invariant vs fast kernels")
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    default_runs = [str(OUTPUTS / "invariant.jsonl"), str(OUTPUTS / "fast.jsonl")]
    ap.add_argument("runs", nargs="*", default=default_runs, help="grpo.py JSONL files, one curve each")
    ap.add_argument("-o", "--out", default=str(OUTPUTS / "grpo_invariant_vs_fast.png"), help="the PNG to write")
    ap.add_argument("--window", type=int, default=10, help="steps in the reward's moving mean")
    args = ap.parse_args(argv)
    missing = [p for p in args.runs if not Path(p).is_file()]
    if missing:
        print(f"plot.py: error: {missing[0]!r}: no such file (grpo.py writes it)", file=sys.stderr)
        return 2
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    runs = {}
    for path in args.runs:
        rows = load(path)
        runs[rows[0]["rollout_backend"] if rows else Path(path).stem] = rows
    print(plot(runs, args.out, args.window))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
