"""Where verl's gen phase goes, per arm and step: verl's ``timing_s/gen`` beside what the rollout engine reports.

    python examples/verify/gen_profile.py examples/verify/results/h200-dense-4k-{vllm,vexact}.jsonl [--out FILE.md]

Each run is verl's file-logger JSONL of the verify pair (``runs.py`` reads it and its meta); the engine's account
is read from the files run_pair.sh writes beside it:

- vexact and fast arms: ``<stem>.phases.jsonl``, one line per replica and generation phase
  (``vexact_verl.server.GenPhase``). verl sets the engine's ``global_steps`` before it generates, so the phase with
  ``global_steps`` g generated step g + 1's batch (phase 0 also holds the server's start-up before its first request);
  lines without ``global_steps`` are matched to the run's steps in order, per replica. Per step: the phase's wall
  time and its wait for the first request, the time inside ``engine.step`` (its share of verl's gen, and of the
  phase's first request to last answer as the server records it), engine steps, tokens per second inside the engine,
  and where recorded the most sequences running at once, the KV cache's capacity in tokens and the preemptions.
- vllm arm: ``<stem>.log``, the arm's console. With ``GEN_STATS=1`` run_pair.sh lets vLLM log its stats lines there
  (logger ``vllm.v1.metrics.loggers``, every ~10 s: ``Avg generation throughput: ... tokens/s, Running: N reqs,
  Waiting: N reqs, GPU KV cache usage: P%``; Ray prefixes and colour codes are ignored, each field is read on its
  own) and its start-up lines ``GPU KV cache size: N tokens`` and ``Maximum concurrency for L tokens per request:
  Cx``. A stats line belongs to the step whose verl console line (``step:N - ...``) follows it. Per step: the stats
  lines, the mean and peak running requests, the peak waiting, the mean generation throughput over the lines with
  requests running and the peak KV cache usage; a last row covers the whole log. Without stats lines the table says
  so and names GEN_STATS=1.

Both tables carry verl's gen tokens/s (``response_length/mean`` x ``train_batch_size`` x ``rollout_n`` of the meta's
config over ``timing_s/gen``), the figure the engine's own throughput is set against. A run that cannot be read
(missing, empty, not verl's records) exits 2 naming the file; a missing ``.phases.jsonl`` or ``.log`` is said in the
arm's section. The Markdown is printed, and written to ``--out`` as well.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runs import RESPONSE_LEN, Run, RunError, fmt_float, jsonl_records, read_run, write_report  # noqa: E402

GEN = "timing_s/gen"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
STATS_FIELDS = {  # one regex per field of vLLM's stats line: a line lacking one still gives the others
    "prompt_tps": re.compile(r"Avg prompt throughput: ([\d.]+) tokens/s"),
    "gen_tps": re.compile(r"Avg generation throughput: ([\d.]+) tokens/s"),
    "running": re.compile(r"Running: (\d+) reqs"),
    "waiting": re.compile(r"Waiting: (\d+) reqs"),
    "kv_usage": re.compile(r"KV cache usage: ([\d.]+)%"),
}
KV_SIZE = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
CONCURRENCY = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")
VERL_STEP = re.compile(r"(?:^|[\s)])step:(\d+) - ")  # verl's console logger: step:N - key:value - ...


@dataclass
class VllmLog:
    """vLLM's stats lines of one log, by the verl step they precede (None: after the last step line, or a log without
    step lines), and its start-up lines."""

    stats: dict[int | None, list[dict[str, float]]] = field(default_factory=dict)
    kv_cache_tokens: list[int] = field(default_factory=list)
    concurrency: list[tuple[int, float]] = field(default_factory=list)  # (tokens per request, concurrency)
    has_step_lines: bool = False

    def all_stats(self) -> list[dict[str, float]]:
        return [s for group in self.stats.values() for s in group]


def parse_vllm_log(text: str) -> VllmLog:
    out, pending = VllmLog(), []
    for raw in text.splitlines():
        line = ANSI.sub("", raw)
        if m := VERL_STEP.search(line):
            out.has_step_lines = True
            out.stats.setdefault(int(m.group(1)), []).extend(pending)
            pending = []
            continue
        if m := KV_SIZE.search(line):
            out.kv_cache_tokens.append(int(m.group(1).replace(",", "")))
        if m := CONCURRENCY.search(line):
            out.concurrency.append((int(m.group(1).replace(",", "")), float(m.group(2))))
        found = {k: float(m.group(1)) for k, rx in STATS_FIELDS.items() if (m := rx.search(line))}
        if found:
            pending.append(found)
    if pending:
        out.stats.setdefault(None, []).extend(pending)
    return out


def summarize_stats(lines: list[dict[str, float]]) -> dict[str, float | None]:
    """Mean and peak running requests, peak waiting, mean generation throughput over the lines with requests
    running, peak KV cache usage (%)."""

    def values(key: str, where=lambda s: True) -> list[float]:
        return [s[key] for s in lines if key in s and where(s)]

    running = values("running")
    busy = values("gen_tps", lambda s: s.get("running", 0) > 0)
    waiting, kv = values("waiting"), values("kv_usage")
    return {
        "lines": len(lines),
        "running_mean": sum(running) / len(running) if running else None,
        "running_peak": max(running) if running else None,
        "waiting_peak": max(waiting) if waiting else None,
        "gen_tps_mean": sum(busy) / len(busy) if busy else None,
        "kv_usage_peak": max(kv) if kv else None,
    }


def read_phases(path: Path) -> list[dict]:
    phases = []
    for n, rec in jsonl_records(path):
        missing = [k for k in ("wall_s", "engine_s", "tokens") if not isinstance(rec, dict) or k not in rec]
        if missing:
            raise RunError(f"{path}:{n}: a GenPhase line lacks {missing}")
        phases.append(rec)
    return phases


def phases_by_step(phases: list[dict], steps: list[int]) -> dict[int, list[dict]]:
    """step -> its phases (one a replica): ``global_steps`` g is step g + 1; without it, the n-th phase of a replica is
    the run's n-th step."""
    out: dict[int, list[dict]] = {}
    seen: dict[int, int] = {}
    for p in phases:
        replica = int(p.get("replica", 0))
        if "global_steps" in p:
            step = int(p["global_steps"]) + 1
        else:
            i = seen.get(replica, 0)
            seen[replica] = i + 1
            step = steps[i] if i < len(steps) else steps[-1] + 1 + i - len(steps)
        out.setdefault(step, []).append(p)
    return out


def verl_tokens_per_s(run: Run, step: int) -> float | None:
    """Response tokens of the step over its ``timing_s/gen`` (the meta's batch; None without a meta)."""
    cfg = (run.meta or {}).get("config", {})
    gen, length = run.data[step].get(GEN), run.data[step].get(RESPONSE_LEN)
    try:
        per_step = int(cfg["train_batch_size"]) * int(cfg["rollout_n"])
    except (KeyError, TypeError, ValueError):
        return None
    return length * per_step / gen if gen and length is not None else None


def table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head), *("| " + " | ".join(r) + " |" for r in rows)]


def sidecar(run: Run, suffix: str) -> Path:
    return run.path.with_name(run.path.name.removesuffix(".jsonl") + suffix)


def fmt_int(v: float | None) -> str:
    return "n/a" if v is None else f"{int(v):,}"


def vexact_section(run: Run) -> list[str]:
    path = sidecar(run, ".phases.jsonl")
    if not path.is_file():
        return [f"No `{path.name}` beside the run: run_pair.sh writes it for the vexact and fast arms "
                "(vexact_verl.server GenPhase)."]  # fmt: skip
    by_step = phases_by_step(read_phases(path), run.steps)
    many = any(len(v) > 1 or int(v[0].get("replica", 0)) != 0 for v in by_step.values())
    head = ["step", *(["replica"] if many else []), "verl gen (s)", "verl tokens/s", "phase (s)",
            "to first request (s)", "engine.step (s)", "engine / verl gen", "engine share (first request to last "
            "answer)", "engine steps", "engine tokens/s", "peak running", "KV tokens", "preemptions"]  # fmt: skip
    rows = []
    for step in run.steps:
        gen = run.data[step].get(GEN)
        verl = [fmt_float(gen, ".2f"), fmt_float(verl_tokens_per_s(run, step), ",.0f")]
        for p in sorted(by_step.get(step, []), key=lambda p: int(p.get("replica", 0))) or [None]:
            if p is None:
                rows.append([str(step), *(["n/a"] if many else []), *verl, *["n/a"] * 10])
                continue
            engine = float(p["engine_s"])
            rows.append([
                str(step), *([str(p.get("replica", 0))] if many else []), *verl, fmt_float(p["wall_s"], ".2f"),
                fmt_float(p.get("to_first_request_s"), ".2f"), fmt_float(engine, ".2f"),
                fmt_float(engine / gen if gen else None, ".1%"), fmt_float(p.get("engine_share"), ".1%"),
                fmt_int(p.get("steps")), fmt_float(p["tokens"] / engine if engine else None, ",.0f"),
                fmt_int(p.get("peak_running")), fmt_int(p.get("kv_tokens")), fmt_int(p.get("preemptions")),
            ])  # fmt: skip
    lines = [f"From `{path.name}`: the phase with `global_steps` g generated step g + 1.", "", *table(head, rows)]
    over = [str(s) for s in run.steps for p in by_step.get(s, []) if run.data[s].get(GEN) and
            float(p["engine_s"]) > run.data[s][GEN]]  # fmt: skip
    if over:
        lines += ["", f"Engine / verl gen above 100% (step {', '.join(dict.fromkeys(over))}): the engine stepped for "
                  "longer than verl's gen timer ran, so the phase's work began before that timer started."]  # fmt: skip
    extra = sorted(s for s in by_step if s not in run.data)
    if extra:
        lines += ["", f"Phases of steps the run did not log: {', '.join(map(str, extra))}."]
    if not any("peak_running" in p for ps in by_step.values() for p in ps):
        lines += ["", "Peak running, KV tokens and preemptions: not in this file (its GenPhase lines lack them)."]
    return lines


def vllm_section(run: Run) -> list[str]:
    path = sidecar(run, ".log")
    hint = ("run the arm with GEN_STATS=1 (run_pair.sh: `actor_rollout_ref.rollout.disable_log_stats=False` and "
            "VLLM_LOGGING_LEVEL=INFO) for vLLM's stats lines")  # fmt: skip
    log = parse_vllm_log(path.read_text(errors="replace")) if path.is_file() else VllmLog()
    head = ["step", "verl gen (s)", "verl tokens/s", "stats lines", "running (mean)", "running (peak)",
            "waiting (peak)", "gen tokens/s (mean, running > 0)", "KV cache usage (peak)"]  # fmt: skip

    def cells(lines: list[dict[str, float]]) -> list[str]:
        s = summarize_stats(lines)
        return [str(s["lines"]), fmt_float(s["running_mean"], ".1f"), fmt_int(s["running_peak"]),
                fmt_int(s["waiting_peak"]), fmt_float(s["gen_tps_mean"], ",.0f"),
                "n/a" if s["kv_usage_peak"] is None else f"{s['kv_usage_peak']:.1f}%"]  # fmt: skip

    stats = log.all_stats()
    if not stats:
        head = head[:3]
    rows = []
    for step in run.steps:
        row = [str(step), fmt_float(run.data[step].get(GEN), ".2f"), fmt_float(verl_tokens_per_s(run, step), ",.0f")]
        if stats:
            row += cells(log.stats.get(step, [])) if log.has_step_lines else ["n/a"] * 6
        rows.append(row)
    if stats:
        rows.append(["whole log", "", "", *cells(stats)])
    if not path.is_file():
        lines = [f"No `{path.name}` beside the run: no vLLM stats; {hint}."]
    elif not stats:
        lines = [f"`{path.name}` has no vLLM stats lines: {hint}."]
    else:
        lines = [f"From `{path.name}`: vLLM's stats lines, each with the verl step whose console line follows it."]
        if not log.has_step_lines:
            lines += ["", "The log has no verl step lines (`step:N - ...`): the stats cover the whole log."]
    lines += ["", *table(head, rows)]
    if log.kv_cache_tokens:
        sizes = ", ".join(f"{n:,}" for n in dict.fromkeys(log.kv_cache_tokens))
        conc = "; ".join(f"maximum concurrency {c:.2f}x at {t:,} tokens per request"
                         for t, c in dict.fromkeys(log.concurrency))  # fmt: skip
        lines += ["", f"KV cache: {sizes} tokens" + (f"; {conc}" if conc else "") + "."]
    return lines


def report(runs: list[Run], command: str) -> str:
    metas = [r.meta for r in runs if r.meta]

    def unique(key: str) -> str:
        return ", ".join(dict.fromkeys(str(m.get(key)) for m in metas)) or "n/a (no meta)"

    lines = [
        "# Generation phase per step: verl's timing_s/gen beside the rollout engine's account",
        "",
        f"- Date: {unique('date')}",
        f"- GPU: {unique('gpu')}",
        f"- Commit: {unique('commit')}",
        f"- Command (this file): `{command}`",
        "",
        "verl tokens/s: the step's response tokens (`response_length/mean` x `train_batch_size` x `rollout_n`) over "
        "its `timing_s/gen`.",
        "",
    ]
    for r in runs:
        lines += [f"## `{r.arm}`: `{r.name}`", ""]
        lines += vllm_section(r) if r.arm == "vllm" else vexact_section(r)
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", type=Path, nargs="+", help="<gpu>-<model>-<arm>.jsonl runs of the verify pair")
    ap.add_argument("--out", type=Path, default=None, metavar="FILE.md", help="write the Markdown here as well")
    args = ap.parse_args(argv)
    try:
        runs = [read_run(p) for p in args.runs]
        text = report(runs, shlex.join(["python", "examples/verify/gen_profile.py", *argv]))
    except RunError as e:
        print(f"gen_profile.py: {e}", file=sys.stderr)
        return 2
    write_report(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
