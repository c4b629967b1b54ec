"""A summary figure: K3 KL and reward per step, verl's default stack against VeXact, one row per model.

    python examples/verify/headline.py examples/verify/results/h100-qwen3-1.7b-{vllm,vexact}.jsonl \\
        examples/verify/results/h100-qwen3-30b-a3b-{vllm,vexact}.jsonl --out examples/verify/results/h100-pair.png

Runs are grouped by model (the meta's ``model``, else the file name's ``<gpu>-<model>`` stem) in the order given;
each group must hold at least two arms that compare.py would accept together (same config and step count), or the
script exits 2 naming the difference. K3 KL is drawn on a log axis with exact zeros on a floor line labelled
"0.0 (exact)", as in compare.py's six-panel plot.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from compare import PANELS, describe, draw, save
from runs import K3, REWARD, Run, RunError, check_comparable, read_run

TITLES = {key: title for key, title, _ in PANELS}  # compare.py's panel titles
LOG = {key: log for key, _, log in PANELS}


def group(runs: list[Run]) -> list[list[Run]]:
    """Runs by model, in the order first seen; each group checked as compare.py checks one comparison."""
    groups: dict[str, list[Run]] = {}
    for r in runs:
        key = str(r.meta["model"]) if r.meta is not None else r.path.name.removesuffix(".jsonl").rsplit("-", 1)[0]
        groups.setdefault(key, []).append(r)
    for model, members in groups.items():
        if len(members) < 2:
            raise RunError(f"model {model!r} has one run ({members[0].path.name}); each model needs two arms or more")
        arms = [r.arm for r in members]
        if len(set(arms)) != len(arms):
            raise RunError(f"model {model!r} has the arm(s) {sorted({a for a in arms if arms.count(a) > 1})} twice")
        check_comparable(members)
    return list(groups.values())


def plot(groups: list[list[Run]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(groups), 2, figsize=(12, 3.6 * len(groups)), squeeze=False)
    for row, runs in zip(axes, groups, strict=True):
        what = describe(runs)
        for ax, key in zip(row, (K3, REWARD), strict=True):
            draw(ax, runs, key, f"{what}\n{TITLES[key]}", LOG[key])
    save(fig, out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", type=Path, nargs="+", help="<gpu>-<model>-<arm>.jsonl, two arms or more per model")
    ap.add_argument("--out", type=Path, required=True, help="the PNG to write")
    args = ap.parse_args(argv)
    try:
        groups = group([read_run(p) for p in args.runs])
    except RunError as e:
        print(f"headline.py: {e}", file=sys.stderr)
        return 2
    plot(groups, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
