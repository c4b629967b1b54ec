"""One figure of a TIM sweep: reward, K3 KL, gradient norm and entropy per step (rows), one column per rollout
correction, one line per arm (a mismatch magnitude or an engine; the mean over seeds when the sweep ran several, each
seed faint behind it).

    python examples/tim_study/plot.py                                   # outputs/tim_study/cpu.jsonl -> cpu.png
    python examples/tim_study/plot.py outputs/tim_study/study.jsonl   # -> outputs/tim_study/study.png
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

OUTPUTS = Path("outputs") / "tim_study"  # where sweep.py writes by default, in the current directory


def read_rows(path: str | Path) -> list[dict]:
    """The rows of a sweep JSONL file, plain or gzip-compressed (``.jsonl.gz``, as the committed results are)."""
    path = Path(path)
    text = gzip.decompress(path.read_bytes()).decode() if path.name.endswith(".gz") else path.read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def plot(path: str | Path) -> Path:
    """Draw the sweep in JSONL file ``path``; the figure goes beside it, as ``<name>.png``."""
    rows = read_rows(path)
    corrections = list(dict.fromkeys(r["rollout_correction"] for r in rows))
    arm_of = lambda r: r.get("arm") or f"noise {r['logit_noise_std']:g}"  # noqa: E731 (files without arms)
    arms = sorted({arm_of(r) for r in rows}, key=lambda a: (a != "exact", a == "fast", a))
    metrics = (
        ("reward", "reward", "linear"),
        ("k3_kl", "K3 KL (rollout || trainer)", "symlog"),
        ("grad_norm", "grad norm", "linear"),
        ("entropy", "trainer entropy", "linear"),
    )
    fig, axes = plt.subplots(
        len(metrics), len(corrections), figsize=(4.2 * len(corrections), 10), squeeze=False, sharex=True
    )
    colors = plt.cm.viridis([i / max(1, len(arms) - 1) for i in range(len(arms))])
    for j, corr in enumerate(corrections):
        for i, (key, label, scale) in enumerate(metrics):
            ax = axes[i][j]
            for arm, color in zip(arms, colors, strict=True):
                sel = [r for r in rows if r["rollout_correction"] == corr and arm_of(r) == arm]
                if not sel and arm == "exact":  # sweep.py --arms runs it once: the same run under every correction
                    sel = [r for r in rows if arm_of(r) == arm]
                if not sel:
                    continue
                runs = {}  # seed -> its rows (files written before --seeds have one run, seed 0)
                for r in sel:
                    runs.setdefault(r.get("seed", 0), []).append(r)
                steps = sorted({r["step"] for r in sel})
                by_step = {st: [r[key] for r in sel if r["step"] == st] for st in steps}
                name = arm + (f" (mean of {len(runs)} seeds)" if len(runs) > 1 else "")
                ax.plot(steps, [sum(v) / len(v) for v in by_step.values()], color=color, lw=1.2, label=name)
                if len(runs) > 1:  # each seed faintly behind the mean
                    for run in runs.values():
                        ax.plot([r["step"] for r in run], [r[key] for r in run], color=color, lw=0.5, alpha=0.3)
            if scale == "symlog":
                ax.set_yscale("symlog", linthresh=1e-6)
            if j == 0:
                ax.set_ylabel(label)
            if i == 0:
                ax.set_title(f"rollout correction: {corr}")
            if i == len(metrics) - 1:
                ax.set_xlabel("GRPO step")
    legend = {}  # every arm once, whichever column drew it
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            legend.setdefault(label, handle)
    axes[0][0].legend(legend.values(), legend.keys(), fontsize=7)
    fig.suptitle(
        f"GRPO with a training-inference mismatch on the rollouts (model {rows[0]['model']}, task {rows[0]['task']})"
    )
    fig.tight_layout()
    out = Path(path).with_suffix(".png")
    fig.savefig(out, dpi=90)
    print(f"written: {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("sweep", nargs="?", default=str(OUTPUTS / "cpu.jsonl"), help="sweep.py's JSONL file")
    args = ap.parse_args(argv)
    if not Path(args.sweep).is_file():
        print(f"plot.py: error: {args.sweep!r}: no such file (sweep.py writes it)", file=sys.stderr)
        return 2
    plot(args.sweep)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
