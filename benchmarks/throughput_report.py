"""The results file of ``benchmarks/throughput.py --results-md PATH`` (``throughput-rl-<gpu>.md``): date, GPU, commit
and the exact command, then per model and batch limit a table of every mode (output tok/s, ratio to vLLM default
and to vLLM batch-invariant, roofline fraction, decode-only step ms) and, with ``--profile-steps``, where VeXact's
and vLLM's decode step goes. Plain data in, markdown out: no torch, no engine."""

from __future__ import annotations

import re
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
            f"| {name} | {tok_s_cell(row)} | {ratios} | {_num(row.get('roofline'), '.2f')} | "
            f"{_num(row.get('decode_ms'), '.2f')} | {_num(row.get('wall'), '.1f')} | {row.get('preemptions', '-')} |"
        )
    return lines


def tok_s_cell(row: Mapping) -> str:
    """A run's tok/s for a table: with ``--rounds``, the median round's and the rounds' range (``tok_s_range``)."""
    spread = row.get("tok_s_range")
    return f"{row['tok_s']:.0f}" + (f" ({spread[0]:.0f}-{spread[1]:.0f})" if spread else "")


def kernel_label(name: str, width: int = 60) -> str:
    """A kernel's name for the costliest-kernels line, cut to ``width``: a demangled CUDA name without its return
    type, anonymous namespaces, CUTLASS's and FA3's launch wrappers, template arguments and parameters
    (``void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<...> > >(...)`` ->
    ``flash::FlashAttnFwdSm90``); a Triton kernel's name as it is."""
    label = name.removeprefix("void ").replace("(anonymous namespace)::", "")
    for wrapper in ("cutlass::device_kernel<", "flash::enable_sm90_or_later<"):
        label = label.removeprefix(wrapper)
    return re.split(r"[<(]", label, maxsplit=1)[0].strip()[:width]


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
            kernels = "; ".join(f"`{kernel_label(k)}` {ms:.2f} ({bucket})" for k, ms, bucket in p["top_kernels"])
            tops.append(f"- {name}, costliest kernels (ms per step): {kernels}")
    return lines + ([""] + tops if tops else [])


def _peer_profile_note(profiles: Mapping[str, Mapping | str], names: Mapping[str, str]) -> list[str]:
    """The sentence on the vLLM rows of a profile table, where it has any (``benchmarks/peers.py``)."""
    peers = [m for m in REFERENCES if m in profiles]
    if not peers:
        return []
    sched = {m: profiles[m].get("async_scheduling") for m in peers if isinstance(profiles[m], Mapping)}
    said = "; ".join(f"{names.get(m, m)}: {'on' if on else 'off' if on is False else 'not known'}"
                     for m, on in sched.items())  # fmt: skip
    return [
        "",
        "vLLM's rows: a vLLM engine of its own after the timed runs, its engine core in the profiling process "
        "(VLLM_ENABLE_V1_MULTIPROCESSING=0), at the same batch, context and prompts; the wall time of the steps, then "
        "as many under torch.profiler. Its output processing runs between steps there, where the timed run's engine "
        "overlaps it with the step in another process. vLLM's lm_head is a cuBLAS GEMM (GEMM column); VeXact's runs "
        "inside its logprobs kernel (sampler/logprobs column)." + (f" Async scheduling: {said}." if said else ""),
    ]


def results_markdown(meta: Mapping, sections: Sequence[Mapping]) -> str:
    """The whole results file.

    ``meta``: ``date``, ``gpu``, ``commit``, ``command`` (strings), optional ``workload`` (a sentence), ``notes``
    (lines), ``mode_names`` (mode -> name in the tables). ``sections``: one per model, each ``model`` (heading),
    ``rows`` ({batch limit: {mode: row}}, a row being ``tok_s`` (optional ``tok_s_range``: the least and most over
    ``--rounds``), ``roofline``, ``decode_ms``, ``wall``, ``preemptions`` or a string saying why there are no
    numbers) and optional ``profiles`` ({batch limit: {mode: profile}}, a profile being ``batch``, ``context``,
    ``steps``, ``step_ms``, ``kernel_ms``, ``host_gap_ms``, ``buckets`` ({bucket: ms}) and ``top_kernels`` ([(name,
    ms, bucket)]) as ``throughput.decode_kernels`` and ``peers.decode_profile`` give them, or a string; a vLLM one
    may add ``async_scheduling``)."""
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
                    *_peer_profile_note(profiles, names),
                    "",
                    *profile_table(profiles, names),
                    "",
                ]
    return "\n".join(lines)
