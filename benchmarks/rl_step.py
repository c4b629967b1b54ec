"""The RL step time of each stack, from verl's own ``timing_s/*`` of the verify runs: vexact against verl's default.

    python benchmarks/rl_step.py examples/verify/results/h100-qwen3-1.7b-{vllm,vexact}.jsonl \\
        examples/verify/results/h100-qwen3-30b-a3b-{vllm,vexact}.jsonl --warmup 2 \\
        --out benchmarks/results/rl-step-h100.md

Reads the runs of ``examples/verify`` (verl's file-logger JSONL, ``<gpu>-<model>-<arm>.jsonl``, each with its
``.meta.json``; ``examples/verify/runs.py`` reads both), groups them by the meta's ``model`` and writes one Markdown
file: the runs' date, GPU, commit and commands, then per model a table of the phases (gen, old_log_prob,
update_actor, update_weights, step) as the mean over the steps after ``--warmup``, per stack, with the ratio
vexact / default (the ``vllm`` arm); rollout tokens/s (response tokens of the steps after warm-up, from
``response_length/mean`` x ``train_batch_size`` x ``rollout_n`` of the meta's config, over their ``timing_s/gen``);
each stack's peak GPU memory (meta). Runs of one model must share their config (the first differing setting is named)
and all runs one GPU. Where one arm logged fewer steps than another (a run stopped early) the model's table covers the
steps every arm logged, and says how many each has; ``--warmup`` (default 1: step 1 holds each stack's warm-up) is
cut to leave at least one of them, with a note. The table is printed as well.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "verify"))
from runs import (  # noqa: E402
    ARMS,
    DEFAULT_ARM,
    PHASES,
    RESPONSE_LEN,
    Run,
    RunError,
    check_comparable,
    common,
    fmt_float,
    meta_path,
    read_run,
    write_report,
)

EXACT_ARM = "vexact"


def tokens_per_s(run: Run, warmup: int) -> tuple[float | None, str]:
    """Rollout response tokens per second of ``timing_s/gen`` over the steps after warm-up, and why not if n/a."""
    cfg = run.meta["config"]
    missing = [k for k in ("train_batch_size", "rollout_n") if k not in cfg]
    if missing:
        return None, f"config lacks {missing}"
    try:
        per_step = int(cfg["train_batch_size"]) * int(cfg["rollout_n"])
    except (TypeError, ValueError):
        return None, f"train_batch_size {cfg['train_batch_size']!r}, rollout_n {cfg['rollout_n']!r}: not integers"
    length, gen = run.mean_after(RESPONSE_LEN, warmup), run.mean_after("timing_s/gen", warmup)
    if length is None or not gen:
        return None, f"{RESPONSE_LEN} or timing_s/gen not logged"
    return length * per_step / gen, ""


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.3f}" if a is not None and b else "n/a"


def stack_line(stack: dict) -> str:
    def one(v):
        return "(" + ", ".join(f"{k} {x}" for k, x in v.items()) + ")" if isinstance(v, dict) else str(v)

    return ", ".join(f"{k}={one(v)}" for k, v in stack.items())


def equal_work(runs: list[Run], warmup: int) -> str:
    cfg = runs[0].meta["config"]
    lengths = ", ".join(f"{r.arm} {fmt_float(r.mean_after(RESPONSE_LEN, warmup), '.1f')}" for r in runs)
    measured = f"measured `{RESPONSE_LEN}` after warm-up: {lengths}"
    max_len = cfg.get("max_response_length")
    if str(cfg.get("ignore_eos")).lower() == "true":  # a JSON true, or "true" / "True" from a shell script
        text = (
            f"Equal work: `ignore_eos=True` in the shared config, so every response runs to "
            f"`max_response_length={max_len}` tokens; {measured}."
        )
        off = [r.arm for r in runs if max_len is None or r.mean_after(RESPONSE_LEN, warmup) != float(max_len)]
        # verl's response_length/mean of an ignore_eos run is max_response_length exactly
        if off:
            text += f" **The lengths of {', '.join(off)} differ from max_response_length: the work is not equal.**"
        return text
    return (
        f"**Equal work is not ensured**: the shared config has `ignore_eos={cfg.get('ignore_eos')!r}`, so response "
        f"lengths follow sampling (up to `max_response_length={max_len}`); {measured}. Compare tokens/s, not "
        "step times."
    )


def model_section(model: str, runs: list[Run], warmup: int, notes: list[str]) -> list[str]:
    """One model's table over ``runs`` (cut to the steps all of them logged), with ``notes`` on steps and warm-up."""
    runs = sorted(runs, key=lambda r: ARMS.index(r.arm) if r.arm in ARMS else len(ARMS))
    by_arm = {r.arm: r for r in runs}
    base, exact = by_arm.get(DEFAULT_ARM), by_arm.get(EXACT_ARM)
    steps = runs[0].steps
    lines = [f"## {model}", ""]
    lines += [f"- `{r.arm}`: {stack_line(r.meta['stack'])}" for r in runs]
    lines += ["", equal_work(runs, warmup), ""]
    lines += [f"**Note**: {n[0].upper()}{n[1:]}." for n in notes] + ([""] if notes else [])
    lines.append(
        f"Mean over steps {steps[warmup]}..{steps[-1]} ({len(steps) - warmup} steps after {warmup} warm-up) of verl's "
        "`timing_s/<phase>`, seconds; `step` is the whole RL step."
    )
    lines.append("")
    ratio_head = f"{EXACT_ARM} / {DEFAULT_ARM}"
    lines.append("| | " + " | ".join(f"`{r.arm}`" for r in runs) + f" | {ratio_head} |")
    lines.append("| --- |" + " ---: |" * (len(runs) + 1))
    means = {r.arm: r.phase_means(warmup) for r in runs}
    for p in PHASES:
        cells = [fmt_float(means[r.arm][p], ".3f") for r in runs]
        rat = ratio(means[EXACT_ARM][p], means[DEFAULT_ARM][p]) if base and exact else "n/a"
        name = "step (total)" if p == "step" else p
        lines.append(f"| {name} (s) | " + " | ".join(cells) + f" | {rat} |")
    tps = {r.arm: tokens_per_s(r, warmup) for r in runs}
    cells = [fmt_float(v, ".0f") if v is not None else f"n/a ({why})" for v, why in tps.values()]
    rat = ratio(tps[EXACT_ARM][0], tps[DEFAULT_ARM][0]) if base and exact else "n/a"
    lines.append("| rollout tokens/s | " + " | ".join(cells) + f" | {rat} |")
    mem = {r.arm: r.meta["peak_gpu_mem_mib"] for r in runs}
    cells = [str(v) if v is not None else "n/a (not recorded)" for v in mem.values()]
    rat = ratio(mem.get(EXACT_ARM), mem.get(DEFAULT_ARM)) if base and exact else "n/a"
    lines.append("| peak GPU memory (MiB) | " + " | ".join(cells) + f" | {rat} |")
    if not (base and exact):
        lines += ["", f"No ratio: the runs of {model} lack the `{DEFAULT_ARM}` or the `{EXACT_ARM}` arm."]
    lines.append("")
    return lines


def report(runs: list[Run], warmup: int, command: str) -> str:
    gpus = {r.meta["gpu"] for r in runs}
    if len(gpus) > 1:
        a = runs[0]
        b = next(r for r in runs if r.meta["gpu"] != a.meta["gpu"])
        raise RunError(
            f"runs of different GPUs: {a.meta['gpu']!r} in {meta_path(a.path).name}, {b.meta['gpu']!r} in "
            f"{meta_path(b.path).name}; one results file holds one GPU"
        )
    groups: dict[str, list[Run]] = {}
    for r in runs:
        groups.setdefault(r.meta["model"], []).append(r)
    cut = {}
    for model, group in groups.items():
        check_comparable(group)
        cut[model] = common(group, warmup)  # the steps every arm of the model logged

    def unique(key: str) -> str:
        return ", ".join(dict.fromkeys(str(r.meta[key]) for r in runs))

    lines = [
        "# RL step time: vexact against verl's default stack",
        "",
        f"- Date: {unique('date')}",
        f"- GPU: {unique('gpu')}",
        f"- Commit: {unique('commit')}",
        f"- Command (this file): `{command}`",
        "- Commands (the runs):",
    ]
    lines += [f"  - `{r.name}`: `{r.meta['command']}`" for r in runs]
    lines += [
        "",
        f"Phases are verl's own `timing_s/*` per step; ratio `{EXACT_ARM} / {DEFAULT_ARM}` is the vexact stack's time "
        f"over verl's default stack's (`{DEFAULT_ARM}` arm: vLLM rollout, verl's actor). Rollout tokens/s: the mean "
        "response tokens per step (`response_length/mean` x `train_batch_size` x `rollout_n`) over the mean "
        "`timing_s/gen`.",
        "",
    ]
    for model in groups:
        lines += model_section(model, *cut[model])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", type=Path, nargs="+", help="<gpu>-<model>-<arm>.jsonl runs, each with its .meta.json")
    ap.add_argument("--warmup", type=int, default=1, help="steps left out of the means (default 1: the warm-up)")
    ap.add_argument("--out", type=Path, default=None, metavar="PATH", help="write the Markdown here as well")
    args = ap.parse_args(argv)
    try:
        if args.warmup < 0:
            raise RunError(f"--warmup {args.warmup}: allowed 0 or more")
        runs = [read_run(p) for p in args.runs]
        for r in runs:
            if r.meta is None:
                raise RunError(
                    f"{r.path}: no {meta_path(r.path).name} beside it; rl_step.py reads the model, config, stack "
                    "and peak memory from it"
                )
        text = report(runs, args.warmup, shlex.join(["python", "benchmarks/rl_step.py", *argv]))
    except RunError as e:
        print(f"rl_step.py: {e}", file=sys.stderr)
        return 2
    write_report(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
