"""The results file of ``benchmarks/throughput.py --results-md PATH`` (``throughput-rl-<gpu>.md``): date, GPU, commit
and the exact command, then per model and batch limit a table of every mode (output tok/s, ratio to vLLM default
and to vLLM batch-invariant, roofline fraction, decode-only step ms) and, with ``--profile-steps``, where VeXact's
decode step goes. Plain data in, markdown out: no torch, no engine."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from profiling import BUCKETS

REFERENCES = ("vllm", "vllm-bi")  # the modes each row is divided by


def _ratio(row, ref) -> str:
    if isinstance(row, Mapping) and isinstance(ref, Mapping) and ref.get("tok_s"):
        return f"{row['tok_s'] / ref['tok_s']:.2f}"
    return "-"


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def results_table(rows: Mapping[str, Mapping | str], names: Mapping[str, str]) -> list[str]:
    """One batch limit's table: a row per mode, in ``rows``' order; a row that is a string (``"not installed"``, a
    failure) shows it in place of the numbers."""
    refs = [rows.get(m) for m in REFERENCES]
    lines = [
        "| engine | output tok/s | / vLLM default | / vLLM batch-invariant | roofline fraction | decode-only step ms "
        "| wall s | preemptions |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, row in rows.items():
        name = names.get(mode, mode)
        if not isinstance(row, Mapping):
            lines.append(f"| {name} | {row} | - | - | - | - | - | - |")
            continue
        ratios = " | ".join("-" if row.get("baseline") else _ratio(row, ref) for ref in refs)
        lines.append(
            f"| {name} | {row['tok_s']:.0f} | {ratios} | {_num(row.get('roofline'), '.2f')} | "
            f"{_num(row.get('decode_ms'), '.2f')} | {_num(row.get('wall'), '.1f')} | {row.get('preemptions', '-')} |"
        )
    return lines


def profile_table(profiles: Mapping[str, Mapping | str], names: Mapping[str, str]) -> list[str]:
    """Where each profiled mode's decode step goes: ms per step by kernel kind and the host gap, each with its share
    of the step's wall time, then the mode's costliest kernels."""
    lines = [
        "| engine | batch | context | step ms | kernel ms | " + " | ".join(BUCKETS) + " | host gap |",
        "| --- " * (6 + len(BUCKETS)) + "|",
    ]
    tops = []
    for mode, p in profiles.items():
        name = names.get(mode, mode)
        if not isinstance(p, Mapping):
            lines.append(f"| {name} | {p} |" + " - |" * (4 + len(BUCKETS)))
            continue
        step = p["step_ms"]

        def cell(ms: float, step: float = step) -> str:
            return f"{ms:.2f} ({ms / step:.0%})" if step > 0 else f"{ms:.2f}"

        buckets = " | ".join(cell(p["buckets"].get(b, 0.0)) for b in BUCKETS)
        lines.append(
            f"| {name} | {p['batch']} | {p['context']} | {step:.2f} | {p['kernel_ms']:.2f} | {buckets} | "
            f"{cell(p['host_gap_ms'])} |"
        )
        if p.get("top_kernels"):
            kernels = "; ".join(f"`{k[:60]}` {ms:.2f} ({bucket})" for k, ms, bucket in p["top_kernels"])
            tops.append(f"- {name}, costliest kernels (ms per step): {kernels}")
    return lines + ([""] + tops if tops else [])


def results_markdown(meta: Mapping, sections: Sequence[Mapping]) -> str:
    """The whole results file.

    ``meta``: ``date``, ``gpu``, ``commit``, ``command`` (strings), optional ``workload`` (a sentence), ``notes``
    (lines), ``mode_names`` (mode -> name in the tables). ``sections``: one per model, each ``model`` (heading),
    ``rows`` ({batch limit: {mode: row}}, a row being ``tok_s``, ``roofline``, ``decode_ms``, ``wall``,
    ``preemptions`` or a string saying why there are no numbers) and optional ``profiles`` ({batch limit: {mode:
    profile}}, a profile being ``batch``, ``context``, ``steps``, ``step_ms``, ``kernel_ms``, ``host_gap_ms``,
    ``buckets`` ({bucket: ms}) and ``top_kernels`` ([(name, ms, bucket)]) as ``throughput.decode_kernels`` gives
    them, or a string)."""
    names = meta.get("mode_names", {})
    lines = [
        f"# {meta.get('title', 'Engine throughput against vLLM')} ({meta['gpu']})",
        "",
        f"- Date: {meta['date']}",
        f"- GPU: {meta['gpu']}",
        f"- Commit: {meta['commit']}",
        f"- Command: `{meta['command']}`",
        *(f"- {note}" for note in meta.get("notes", ())),
        "",
    ]
    if meta.get("workload"):
        lines += [meta["workload"], ""]
    lines += [
        "Ratios divide a row's output tok/s by vLLM default's and by vLLM batch-invariant's in the same run. Roofline "
        "fraction: least bytes the run must read / copy bandwidth / wall time (benchmarks/peers.py). Decode-only step: "
        "VeXact's mean wall time of the steps without prompt tokens, host work included.",
        "",
    ]
    for sec in sections:
        for limit, rows in sec["rows"].items():
            lines += [f"## {sec['model']}, batch limit {limit}", "", *results_table(rows, names), ""]
            profiles = sec.get("profiles", {}).get(limit)
            if profiles:
                steps = "/".join(sorted({str(p["steps"]) for p in profiles.values() if isinstance(p, Mapping)}))
                lines += [
                    f"Where VeXact's decode step goes, at the batch and context below: the mean wall time of "
                    f"{steps or '-'} decode steps on the timed run's engine right after its run, then kernel time by "
                    "kind over as many steps of a new engine under torch.profiler (CUDA graph replays included) once "
                    "every timed run of the model is done, in ms per step (share of the step's wall time); host gap = "
                    "step wall time - kernel time (the GPU waiting on the host).",
                    "",
                    *profile_table(profiles, names),
                    "",
                ]
    return "\n".join(lines)
