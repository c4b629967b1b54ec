"""The asynchronous-RL comparison (scripts/checks/async_gpu.sh) as a results file: verl's ``sync`` trainer against its
``separate_async`` trainer on the same GPUs, from each run's metrics (verl's file-logger JSONL).

Per mode: training tokens/s of the host (``perf/total_num_tokens / perf/time_per_step``, mean over the steps after
the first, which includes warm-up), step time, weight-sync time (``timing_s/update_weights``), staleness
(``training/off_policy/trajectory_staleness*``: versions behind the trainer, from the versions the vexact server
stamps) and ``rollout_corr/k3_kl``, split by staleness: against the trainer's current weights it must be exactly 0.0
on a step of staleness 0 (the run fails otherwise); on a stale step it measures staleness. The weight-sync bound is
``params x wire bytes / NCCL bandwidth`` when ``--nccl-gbps`` (a measured broadcast bandwidth, GB/s) is given.

With ``--versions`` the ``separate_async`` run must also log the vexact actor's per-version check at every step
(``actor/vexact/behavior/*``, with ``vexact_verl.agent_loop.VersionedAgentLoopManager`` and
``vexact.keep_previous_version=true``): each token rescored at the version that produced it, K3 exactly 0.0, no token
differing, none left unchecked, stale steps included. The actor learns its version from verl's
``update_weights(global_steps=v)`` whatever the checkpoint-engine backend, so on GPUs this checks the versions that
travel with verl's NCCL sync.

    python examples/recipes/async_results.py SYNC.jsonl SEPARATE.jsonl --params N --out async.md --header "..."

Exit status 1 when a run logged no step, an on-policy step is not exact, or (``--versions``) a separate_async step's
per-version check is absent or not exact.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

STALE = "training/off_policy/trajectory_staleness_worst/max"
BEHAVIOR = "actor/vexact/behavior/"


def read_steps(path: Path) -> list[dict]:
    """The training steps' metrics in step order."""
    if not Path(path).is_file():
        return []
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [r["data"] for r in sorted(records, key=lambda r: r["step"]) if r["step"] > 0]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _fmt(value, spec: str = "{:.4g}") -> str:
    return "-" if value is None else spec.format(value)


def version_exact(m: dict) -> bool:
    """A step's per-version check: logged, every token checked at its own version, K3 exactly 0.0, none differing."""
    checked, unchecked = m.get(BEHAVIOR + "tokens_checked"), m.get(BEHAVIOR + "tokens_unchecked")
    return (m.get(BEHAVIOR + "k3") == 0.0 and m.get(BEHAVIOR + "tokens_differ") == 0 and bool(checked)
            and unchecked == 0)  # fmt: skip


def summary(steps: list[dict]) -> dict:
    """One mode's figures; ``exact``: every step of staleness 0 logs K3 and max |p diff| exactly 0.0;
    ``versions_exact``: every step's per-version check (:func:`version_exact`) passes."""
    later = steps[1:] or steps
    tps = [m["perf/total_num_tokens"] / m["perf/time_per_step"] for m in later if m.get("perf/time_per_step")]
    on_policy = [m for m in steps if m.get(STALE, 0) == 0]
    stale = [m for m in steps if m.get(STALE, 0) > 0]
    exact = all(
        m.get("rollout_corr/k3_kl") == 0.0 and m.get("training/rollout_probs_diff_max") == 0.0 for m in on_policy
    )
    return {
        "steps": len(steps),
        "tokens_per_s": _mean(tps),
        "step_s": _mean([m["timing_s/step"] for m in later if "timing_s/step" in m]),
        "sync_s": _mean([m["timing_s/update_weights"] for m in later if "timing_s/update_weights" in m]),
        "staleness_mean": _mean([m.get("training/off_policy/trajectory_staleness/mean", 0.0) for m in steps]),
        "staleness_max": max((m.get(STALE, 0) for m in steps), default=None),
        "on_policy_steps": len(on_policy),
        "k3_stale": [m.get("rollout_corr/k3_kl") for m in stale],
        "exact": bool(steps) and exact,
        "versions_exact": bool(steps) and all(map(version_exact, steps)),
    }


def render(
    runs: dict[str, list[dict]],
    params: int,
    wire_bytes: int,
    nccl_gbps: float | None,
    header: list[str],
    versions: bool = False,
):
    s = {mode: summary(steps) for mode, steps in runs.items()}
    columns = ["mode", "steps", "training tokens/s", "step s", "weight sync s", "staleness mean / max",
               "steps of staleness 0: K3", "stale steps: K3"]  # fmt: skip
    lines = [*header, "", "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for mode, f in s.items():
        k3_stale = ", ".join(_fmt(v, "{:.3g}") for v in f["k3_stale"]) or "-"
        exact = f"exactly 0.0 ({f['on_policy_steps']})" if f["exact"] else "**not exact**"
        lines.append(f"| {mode} | {f['steps']} | {_fmt(f['tokens_per_s'], '{:.0f}')} | {_fmt(f['step_s'], '{:.2f}')} "
                     f"| {_fmt(f['sync_s'], '{:.3f}')} | {_fmt(f['staleness_mean'], '{:.2f}')} / "
                     f"{_fmt(f['staleness_max'])} | {exact} | {k3_stale} |")  # fmt: skip
    lines.append("")
    sync, sep = s.get("sync"), s.get("separate_async")
    if sync and sep and sync["tokens_per_s"] and sep["tokens_per_s"]:
        ratio = sep["tokens_per_s"] / sync["tokens_per_s"]
        lines.append(f"- separate_async / sync training tokens/s: {ratio:.2f}x (goal: at least 1.3x)")
    nbytes = params * wire_bytes
    lines.append(f"- Weight sync: {params} parameters x {wire_bytes} bytes = {nbytes / 1e9:.3f} GB a sync")
    if sep and sep["sync_s"]:
        lines.append(f"  - separate_async: {sep['sync_s']:.3f} s, {nbytes / sep['sync_s'] / 1e9:.2f} GB/s")
        if nccl_gbps:
            bound = nbytes / (nccl_gbps * 1e9)
            lines.append(f"  - NCCL bound at {nccl_gbps} GB/s: {bound:.3f} s; measured / bound "
                         f"{sep['sync_s'] / bound:.2f}x (goal: at most 2x)")  # fmt: skip
        else:
            lines.append("  - NCCL bound: not computed (no --nccl-gbps given)")
    per_step = runs.get("separate_async", [])
    if per_step:
        lines += ["", "separate_async per step (K3: against the current weights; per-version K3: each token against "
                  "the actor at its own version, tokens checked / not):", "",
                  "| step | staleness mean | staleness worst | K3 | per-version K3 | tokens | sync s |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for i, m in enumerate(per_step, 1):
            tokens = f"{_fmt(m.get(BEHAVIOR + 'tokens_checked'))} / {_fmt(m.get(BEHAVIOR + 'tokens_unchecked'))}"
            lines.append(f"| {i} | {_fmt(m.get('training/off_policy/trajectory_staleness/mean'))} | "
                         f"{_fmt(m.get(STALE))} | {_fmt(m.get('rollout_corr/k3_kl'), '{:.3g}')} | "
                         f"{_fmt(m.get(BEHAVIOR + 'k3'), '{:.3g}')} | {tokens} | "
                         f"{_fmt(m.get('timing_s/update_weights'), '{:.3f}')} |")  # fmt: skip
    ok = all(f["steps"] and f["exact"] for f in s.values())
    if versions:
        sep_ok = bool(sep) and sep["versions_exact"]
        lines += ["", f"- separate_async per-version check at every step: {'pass' if sep_ok else '**fail**'}"]
        ok = ok and sep_ok
    return "\n".join(lines) + "\n", ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sync", type=Path, help="verl's metrics JSONL of the MODE=sync run")
    p.add_argument("separate", type=Path, help="verl's metrics JSONL of the MODE=separate_async run")
    p.add_argument("--params", type=int, required=True, help="the model's parameter count")
    p.add_argument("--wire-bytes", type=int, default=4, help="bytes a parameter on the wire (4: the actor's fp32)")
    p.add_argument("--nccl-gbps", type=float, default=None, help="measured NCCL broadcast bandwidth, GB/s")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--header", action="append", default=[], help="a line above the table (repeatable)")
    p.add_argument(
        "--versions",
        action="store_true",
        help="require separate_async's per-version check (actor/vexact/behavior/*) at every step",
    )
    args = p.parse_args(argv)
    if args.params < 1 or args.wire_bytes < 1:
        p.error(f"--params and --wire-bytes must be >= 1, got {args.params} and {args.wire_bytes}")
    runs = {"sync": read_steps(args.sync), "separate_async": read_steps(args.separate)}
    text, ok = render(runs, args.params, args.wire_bytes, args.nccl_gbps, args.header, args.versions)
    args.out.write_text(text)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
