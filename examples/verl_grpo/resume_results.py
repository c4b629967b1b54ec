"""The rerun and resume comparison of scripts/checks/resume_gpu.sh as a results file: one Markdown table a step.

Three runs of examples/verl_grpo/run_grpo.sh: A, N steps uninterrupted; B, the same job stopped after step K; C, B
resumed from its step-K checkpoint (``trainer.resume_mode=auto``) up to step N. Rerun: B's steps 1..K against A's.
Resume: C's steps K+1..N against A's, and C's step-N checkpoint against A's, file by file. Both through
examples/verl_grpo/compare_runs.py (every logged number except timings, throughput and memory, with ``==``; tensors
with ``torch.equal``).

    python examples/verl_grpo/resume_results.py A.jsonl B.jsonl C.jsonl --stop 10 --steps 20 \\
        --checkpoints C_DIR/global_step_20 A_DIR/global_step_20 --out resume.md --header "Date: ..." ...

Exit status 1 when anything differs, or when the run is vacuous: a nonzero rollout/actor K3 KL, a missing step, or
a zero gradient norm at more than ``--max-zero-grad`` (2) of A's steps. GRPO's gradient is zero only where every
prompt's responses all get the same reward (all advantages zero). An untrained policy can do that at a step or two
(every response scoring 0), but a policy that has collapsed to one answer does it at every step from then on, and
those steps compare trivially: each repeats the last. Two of twenty steps (10 %) tells the two apart.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
COLUMNS = ("critic/score/mean", "response_length/mean", "rollout_corr/k3_kl", "actor/grad_norm")  # A's, per step
MAX_ZERO_GRAD = 2  # steps of A with a zero gradient norm that still pass (see the module docstring)


def _compare_runs():
    spec = importlib.util.spec_from_file_location("compare_runs", HERE / "compare_runs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.6g}" if isinstance(value, float) else str(value)


def report(a: Path, b: Path, c: Path, stop: int, steps: int, checkpoints: list[Path] | None,
           max_zero_grad: int = MAX_ZERO_GRAD) -> tuple[list[str], bool]:  # fmt: skip
    """The Markdown lines of the comparison, and whether it passed."""
    cmp = _compare_runs()
    ra, rb, rc = (cmp.read_metrics(p) if Path(p).is_file() else {} for p in (a, b, c))  # a failed job: no file
    rerun = cmp.metric_diffs(rb, ra, list(range(1, stop + 1)))
    resumed = cmp.metric_diffs(rc, ra, list(range(stop + 1, steps + 1)))
    ok = True
    lines = [
        "| step | reward mean | response length | K3 KL (rollout vs actor) | grad norm | rerun: B == A | "
        "resumed: C == A |",
        "|---:|---:|---:|---:|---:|:---|:---|",
    ]
    for step in range(1, steps + 1):
        m = ra.get(step, {})
        diffs = rerun.get(step, resumed.get(step, []))
        verdict = "equal" if not diffs else f"**{len(diffs)} differ**: " + "; ".join(diffs[:3])
        ok &= not diffs and "actor/grad_norm" in m and m.get("rollout_corr/k3_kl") == 0.0
        cells = [m.get(k) for k in COLUMNS]
        b_cell, c_cell = (verdict, "") if step <= stop else ("", verdict)
        cells[2] = "-" if cells[2] is None else repr(cells[2])  # K3 KL as logged: exactly 0.0, or the value
        lines.append(f"| {step} | " + " | ".join(map(_fmt, cells)) + f" | {b_cell} | {c_cell} |")
    first = rc.get(stop + 1, {})
    lines += ["", f"C's first step after the resume (step {stop + 1}): rollout/actor K3 KL "
              f"{first.get('rollout_corr/k3_kl')!r}, max probability difference "
              f"{first.get('training/rollout_probs_diff_max')!r} (the engine's weights are synced from the "
              "restored actor)."]  # fmt: skip
    ok &= first.get("rollout_corr/k3_kl") == 0.0
    zero = [s for s in range(1, steps + 1) if ra.get(s, {}).get("actor/grad_norm") == 0]
    ok &= len(zero) <= max_zero_grad
    listed = f" {zero}" if zero else ""
    lines += ["", f"Steps of A with a zero gradient norm: {len(zero)} of {steps}{listed} (at most {max_zero_grad} "
              "pass; more means a collapsed policy, whose steps compare trivially)."]  # fmt: skip
    if checkpoints:
        try:
            got, want = (cmp.load_checkpoint(d) for d in checkpoints)
        except FileNotFoundError as e:
            got, want = {}, {"(no checkpoint)": str(e)}
        lines += ["", f"Final checkpoint, C `{checkpoints[0]}` against A `{checkpoints[1]}` (torch.equal per tensor):",
                  "", "| file | result |", "|:---|:---|"]  # fmt: skip
        if got.keys() != want.keys():
            ok = False
            lines.append(f"| (file sets) | **differ**: {sorted(got)} vs {sorted(want)} |")
        for name in sorted(got.keys() & want.keys()):
            diffs = cmp.state_diffs(got[name], want[name], name)
            ok &= not diffs
            lines.append(f"| {name} | " + ("equal" if not diffs else f"**{len(diffs)} differ**: {diffs[:3]}") + " |")
    lines += ["", f"Result: {'PASS' if ok else 'FAIL'}"]
    return lines, ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", type=Path, help="metrics JSONL of A (uninterrupted)")
    ap.add_argument("b", type=Path, help="metrics JSONL of B (stopped after --stop)")
    ap.add_argument("c", type=Path, help="metrics JSONL of C (B resumed)")
    ap.add_argument("--stop", type=int, required=True, help="the step B stops after (K)")
    ap.add_argument("--steps", type=int, required=True, help="the steps of A and C (N)")
    ap.add_argument("--checkpoints", type=Path, nargs=2, metavar=("C_DIR", "A_DIR"),
                    help="the global_step_N directories of C and A")  # fmt: skip
    ap.add_argument("--out", type=Path, required=True, help="the Markdown file to write")
    ap.add_argument("--header", action="append", default=[], help="a line above the table (date, GPU, commit, ...)")
    ap.add_argument("--max-zero-grad", type=int, default=MAX_ZERO_GRAD,
                    help="steps of A with a zero gradient norm that still pass (default %(default)s)")  # fmt: skip
    args = ap.parse_args(argv)
    if not 0 < args.stop < args.steps:
        raise SystemExit(f"--stop must be in 1..{args.steps - 1} (below --steps), got {args.stop}")
    if args.max_zero_grad < 0:
        raise SystemExit(f"--max-zero-grad must be 0 or more, got {args.max_zero_grad}")
    lines, ok = report(args.a, args.b, args.c, args.stop, args.steps, args.checkpoints, args.max_zero_grad)
    args.out.write_text("\n".join([*args.header, "", *lines]) + "\n")
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
