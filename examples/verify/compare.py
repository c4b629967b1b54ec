"""Compare verl's rollout-correction metrics of the invariant and fast runs (JSONL from verl's file logger).

``python examples/verify/compare.py outputs/verify/verify-invariant.jsonl outputs/verify/verify-fast.jsonl``
prints a per-step table and a verdict; ``--plot out.png`` draws the K3 KL of both runs; ``--expect-exact`` exits
non-zero unless every step of the invariant run has exactly zero rollout/actor mismatch (use it once the actor runs in
invariant mode) while the fast run shows some.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PROBS_DIFF_MAX = "training/rollout_probs_diff_max"
METRICS = ("rollout_corr/k3_kl", "rollout_corr/kl", "rollout_corr/log_ppl_abs_diff", "rollout_corr/chi2_token")


def load(path: Path) -> dict[int, dict[str, float]]:
    """step -> metrics, from verl's file logger (one JSON object per line with 'step' and 'data')."""
    steps: dict[int, dict[str, float]] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        rec = json.loads(line)
        if "step" not in rec or "data" not in rec:
            raise ValueError(f"{path}:{n}: expected verl file-logger records with 'step' and 'data', got {sorted(rec)}")
        steps.setdefault(int(rec["step"]), {}).update(rec["data"])
    missing = [m for m in METRICS[:1] if not any(m in d for d in steps.values())]
    if missing:
        raise ValueError(f"{path}: no {missing} logged; run with actor_rollout_ref.rollout.calculate_log_probs=True")
    return steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("invariant", type=Path)
    ap.add_argument("fast", type=Path)
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--expect-exact", action="store_true")
    args = ap.parse_args()
    inv, fast = load(args.invariant), load(args.fast)
    steps = sorted(set(inv) & set(fast))
    if not steps:
        raise ValueError(f"the runs share no step: {sorted(inv)} vs {sorted(fast)}")
    print("step  " + "  ".join(f"{m.split('/')[1] + ' inv':>18} {m.split('/')[1] + ' fast':>18}" for m in METRICS))
    for s in steps:
        cells = [f"{inv[s].get(m, float('nan')):>18.3e} {fast[s].get(m, float('nan')):>18.3e}" for m in METRICS]
        print(f"{s:>4}  " + "  ".join(cells))
    k3 = "rollout_corr/k3_kl"
    # exact: verl's K3 and KL estimators, and its largest per-token |p_rollout - p_actor|, all exactly zero
    inv_exact = all(
        inv[s].get(k3) == 0.0 and inv[s].get("rollout_corr/kl") == 0.0 and inv[s].get(PROBS_DIFF_MAX, 0.0) == 0.0
        for s in steps
    )
    fast_mismatch = any(fast[s].get(k3, 0.0) > 0.0 for s in steps)
    print(f"invariant run exact at every step: {inv_exact}; fast run shows mismatch: {fast_mismatch}")
    if args.plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax, ax_r) = plt.subplots(1, 2, figsize=(11, 3.8))
        for name, run in (("invariant", inv), ("fast", fast)):
            ax.plot(steps, [run[s].get(k3, float("nan")) for s in steps], marker="o", label=name)
            ax_r.plot(steps, [run[s].get("critic/score/mean", float("nan")) for s in steps], marker=".", label=name)
        ax.set_xlabel("training step")
        ax.set_ylabel("K3 KL(rollout || actor)")
        ax.set_yscale("symlog", linthresh=1e-8)
        ax.set_title("verl rollout_corr/k3_kl")
        ax.legend()
        ax_r.set_xlabel("training step")
        ax_r.set_ylabel("mean reward")
        ax_r.set_title("critic/score/mean")
        ax_r.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")
    if args.expect_exact and not (inv_exact and fast_mismatch):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
