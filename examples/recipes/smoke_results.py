"""The one-GPU smoke runs of the recipes (scripts/checks/recipes_gpu.sh) as a results file: one table row a recipe.

Reads RUNS.jsonl, one line a recipe run as the script records it (``name``, ``shape``, ``layers``, ``steps`` asked for,
``rc``, ``wall_s``, ``metrics``: verl's file-logger JSONL of the run, ``env``: the run's environment line, ``skipped``:
why it did not run, if it did not), and each
run's metrics; a run passes when it exits 0, logs every step asked for, and its rollout/actor K3 KL and maximum
probability difference are exactly 0.0 at every step.

    python examples/recipes/smoke_results.py RUNS.jsonl --out recipes.md --header "- Date: ..." ...

Exit status 1 when a run fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_steps(path: Path) -> list[dict]:
    """The training steps' metrics in step order (validation before training is logged at step 0: left out)."""
    if not Path(path).is_file():
        return []
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [r["data"] for r in sorted(records, key=lambda r: r["step"]) if r["step"] > 0]


def _series(steps: list[dict], key: str, fmt: str = "{:.4g}") -> str:
    return ", ".join("-" if key not in m else fmt.format(m[key]) for m in steps) or "-"


def row(run: dict) -> tuple[str, bool]:
    """One run's table row, and whether it passed."""
    steps = read_steps(Path(run["metrics"]))
    k3 = [m.get("rollout_corr/k3_kl") for m in steps]
    probs = [m.get("training/rollout_probs_diff_max") for m in steps]
    exact = bool(steps) and all(v == 0.0 for v in k3 + probs)
    ok = run["rc"] == 0 and len(steps) == run["steps"] and exact
    why = [] if ok else [f"exit {run['rc']}" if run["rc"] else "", f"{len(steps)}/{run['steps']} steps",
                         "" if exact else "K3 KL or probability difference not 0.0"]  # fmt: skip
    verdict = "pass" if ok else "**FAIL** (" + ", ".join(filter(None, why)) + ")"
    if run.get("skipped"):  # not run at all: the reason instead
        ok, verdict = False, f"**not run** ({run['skipped']})"
    cells = [
        f"`{run['name']}`",
        f"{run['shape']}, {run['layers']} layers",
        f"{len(steps)}/{run['steps']}",
        ", ".join("-" if v is None else repr(v) for v in k3) or "-",
        _series(steps, "critic/score/mean"),
        _series(steps, "response_length/mean", "{:.1f}"),
        _series(steps, "timing_s/step", "{:.1f}"),
        f"{run['wall_s']}",
        verdict,
    ]
    return "| " + " | ".join(cells) + " |", ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", type=Path, help="the script's record of its runs, one JSON line each")
    ap.add_argument("--out", type=Path, required=True, help="the Markdown file to write")
    ap.add_argument("--header", action="append", default=[], help="a line above the table (date, GPU, commit, ...)")
    args = ap.parse_args(argv)
    runs = [json.loads(line) for line in args.runs.read_text().splitlines() if line.strip()]
    lines = [
        "| recipe | model (random weights) | steps | K3 KL per step | reward mean per step | response length per step "
        "| step time per step (s) | wall (s) | result |",
        "|:---|:---|---:|:---|:---|:---|:---|---:|:---|",
    ]
    ok = bool(runs)
    for run in runs:
        text, passed = row(run)
        lines.append(text)
        ok &= passed
    lines += ["", "Environment of each run (besides the command's overrides):", ""]
    lines += [f"- `{run['name']}`: `{run['env']}`" for run in runs]
    lines += ["", f"Result: {sum(row(r)[1] for r in runs)}/{len(runs)} recipes pass"]
    args.out.write_text("\n".join([*args.header, "", *lines]) + "\n")
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
