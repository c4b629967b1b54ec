"""Two runs of run_grpo.sh compared bitwise: a rerun, or a resumed run against the uninterrupted one.

Metrics: the per-step lines of verl's file logger (``VERL_FILE_LOGGER_PATH``), every number except wall-clock
timings, throughput and memory, compared with ``==``. Checkpoints: every file verl saves in a ``global_step_N``
directory (the actor's model, optimizer, and LR-scheduler + RNG-state shards, and the dataloader position), tensors
compared with ``torch.equal``.

    python examples/verl_grpo/compare_runs.py A/grpo.jsonl C/grpo.jsonl --steps 11-20 \\
        --checkpoints A/checkpoints/grpo/global_step_20 C/checkpoints/grpo/global_step_20

One line per step and per checkpoint file; exit status 1 when anything differs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def wall_clock(key: str) -> bool:
    """Timings, throughput and memory: what a rerun may change."""
    return key.startswith(("timing_s/", "timing_per_token_ms/")) or ("perf/" in key and key != "perf/total_num_tokens")


def read_metrics(path: Path) -> dict[int, dict]:
    lines = Path(path).read_text().splitlines()
    return {r["step"]: r["data"] for r in map(json.loads, filter(str.strip, lines))}


def metric_diffs(got: dict[int, dict], want: dict[int, dict], steps: list[int]) -> dict[int, list[str]]:
    """Per step, the keys whose values differ (or that only one run logged); wall-clock keys left out."""
    out = {}
    for step in steps:
        if step not in got or step not in want:
            out[step] = [f"step {step} logged by {'neither' if step not in got | want else 'one'} run"]
            continue
        g, w = ({k: v for k, v in m[step].items() if not wall_clock(k)} for m in (got, want))
        out[step] = [f"{k}: {g.get(k)!r} != {w.get(k)!r}" for k in sorted(g.keys() | w.keys()) if g.get(k) != w.get(k)]
    return out


def load_checkpoint(step_dir: Path) -> dict[str, object]:
    """Every ``.pt`` file of a ``global_step_N`` directory, by its path inside it."""
    import torch

    step_dir = Path(step_dir)
    files = sorted(step_dir.rglob("*.pt"))
    if not files:
        raise FileNotFoundError(f"no .pt files under {step_dir}")
    return {str(f.relative_to(step_dir)): torch.load(f, weights_only=False, map_location="cpu") for f in files}


def state_diffs(a, b, where: str = "") -> list[str]:
    """Where two loaded states differ: tensors by ``torch.equal`` (a DTensor by its local shard), numpy arrays by
    ``array_equal``, containers item by item, anything else by ``==``."""
    import numpy as np
    import torch

    if isinstance(a, dict) or isinstance(b, dict):
        if not (isinstance(a, dict) and isinstance(b, dict)) or a.keys() != b.keys():
            return [f"{where}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"]
        return [d for k in a for d in state_diffs(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            return [f"{where}: lengths differ"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in state_diffs(x, y, f"{where}[{i}]")]
    if isinstance(a, torch.Tensor):
        a, b = (t.to_local() if hasattr(t, "to_local") else t for t in (a, b))
        same = isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        return [] if same else [f"{where}: tensors differ"]
    if isinstance(a, np.ndarray):
        return [] if isinstance(b, np.ndarray) and np.array_equal(a, b) else [f"{where}: arrays differ"]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def _steps(text: str) -> list[int]:
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("got", type=Path, help="metrics JSONL of the rerun or resumed run")
    ap.add_argument("want", type=Path, help="metrics JSONL of the reference (uninterrupted) run")
    ap.add_argument("--steps", type=_steps, required=True, help="steps to compare, e.g. 11-20")
    ap.add_argument("--checkpoints", type=Path, nargs=2, metavar=("GOT_DIR", "WANT_DIR"),
                    help="two global_step_N directories to compare file by file")  # fmt: skip
    args = ap.parse_args(argv)
    differ = False
    for step, diffs in metric_diffs(read_metrics(args.got), read_metrics(args.want), args.steps).items():
        differ |= bool(diffs)
        print(f"step {step}: " + ("equal" if not diffs else f"{len(diffs)} differ: " + "; ".join(diffs[:5])))
    if args.checkpoints:
        got, want = (load_checkpoint(d) for d in args.checkpoints)
        if got.keys() != want.keys():
            print(f"checkpoint files differ: {sorted(got)} vs {sorted(want)}")
            return 1
        for name in got:
            diffs = state_diffs(got[name], want[name], name)
            differ |= bool(diffs)
            print(f"{name}: " + ("equal" if not diffs else f"{len(diffs)} differ: " + "; ".join(diffs[:5])))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
