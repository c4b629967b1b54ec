"""``summary.json``, PNG plots and one self-contained ``report.html`` from a comparison."""

from __future__ import annotations

import base64
import html
import io
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .rescore import Rescored
from .rollouts import Rollout


@dataclass
class Report:
    summary: dict
    files: dict[str, Path] = field(default_factory=dict)


def _plots(summary: dict, a: torch.Tensor, b: torch.Tensor) -> dict[str, bytes]:
    """PNG bytes of each plot; empty (with a note in the summary) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        summary["plots"] = "matplotlib is not installed: pip install matplotlib for the PNG plots"
        return {}
    d = (b.double() - a.double()).abs()
    pngs = {}

    def save(name, fig):
        buf = io.BytesIO()
        fig.tight_layout()
        fig.savefig(buf, format="png", dpi=90)
        plt.close(fig)
        pngs[name] = buf.getvalue()

    fig, ax = plt.subplots(figsize=(6, 3.5))
    nz = d[d > 0]
    if len(nz):
        ax.hist(nz.log10().numpy(), bins=50, color="tab:red")
    ax.set_xlabel("log10 |delta logprob| (tokens that differ)")
    ax.set_ylabel("tokens")
    ax.set_title(
        f"{summary['tokens_differ']} of {summary['tokens']} tokens differ; {summary['tokens'] - len(nz)} equal"
    )
    save("abs_delta_hist", fig)
    for key, title in (("by_position", "response position"), ("by_probability", "engine token probability")):
        rows = summary[key]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.bar(range(len(rows)), [r["fraction_differ"] for r in rows], color="tab:blue")
        ax.set_xticks(range(len(rows)), [r["bucket"] for r in rows], rotation=45, fontsize=7)
        ax.set_ylabel("fraction of tokens that differ")
        ax.set_xlabel(title)
        ax2 = ax.twinx()
        ax2.plot(range(len(rows)), [r["mean_abs_delta"] for r in rows], "o-", color="tab:red")
        ax2.set_ylabel("mean |delta logprob|", color="tab:red")
        save(key, fig)
    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    ax.scatter(a.numpy(), b.numpy(), s=3, alpha=0.5)
    lo = float(min(a.min(), b.min())) if len(a) else -1.0
    ax.plot([lo, 0], [lo, 0], "k--", lw=0.8)
    ax.set_xlabel("engine logprob")
    ax.set_ylabel("trainer logprob")
    save("engine_vs_trainer", fig)
    return pngs


def _table(rows: list[dict]) -> str:
    if not rows:
        return "<p>none</p>"
    cols = list(rows[0].keys())
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join(
        "<tr>"
        + "".join(f"<td>{html.escape(f'{r[c]:.4g}' if isinstance(r[c], float) else str(r[c]))}</td>" for c in cols)
        + "</tr>"
        for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def write_report(
    summary: dict, out_dir: str | Path, rollouts: list[Rollout], rescored: Rescored, title: str = ""
) -> Report:
    """``summary.json``, one PNG per plot and ``report.html`` (the PNGs embedded as base64) under ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    a = torch.cat([r.logprobs.float() for r in rollouts])
    b = torch.cat([x.float() for x in rescored.logprobs])
    pngs = _plots(summary, a, b)
    files = {}
    for name, data in pngs.items():
        files[name] = out / f"{name}.png"
        files[name].write_bytes(data)
    files["summary"] = out / "summary.json"
    files["summary"].write_text(json.dumps(summary, indent=2) + "\n")
    scalars = [{k: v for k, v in summary.items() if not isinstance(v, (dict, list))}]
    imgs = "".join(
        f'<figure><img alt="{n}" src="data:image/png;base64,{base64.b64encode(d).decode()}"/><figcaption>{n}'
        "</figcaption></figure>"
        for n, d in pngs.items()
    )
    greedy = summary.get("greedy", {})
    page = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>TIM report {html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse;font-size:12px}}
td,th{{border:1px solid #ccc;padding:2px 6px}} figure{{display:inline-block;margin:4px}}</style></head>
<body><h1>Training-inference mismatch {html.escape(title)}</h1>
<p>Engine logprobs vs the trainer's on the same sampled tokens. K3 and k1 estimate KL(engine || trainer).</p>
<h2>Summary</h2>{_table(scalars)}
<h2>|delta logprob|</h2>{_table([summary["abs_delta"]])}
<h2>Greedy flips</h2>{_table([{k: v for k, v in greedy.items() if k != "flip_tokens"}])}
<h2>Plots</h2>{imgs or "<p>" + html.escape(str(summary.get("plots", ""))) + "</p>"}
<h2>By response position</h2>{_table(summary["by_position"])}
<h2>By engine token probability</h2>{_table(summary["by_probability"])}
<h2>Worst sequences</h2>{_table(summary["worst_sequences"])}
</body></html>
"""
    files["html"] = out / "report.html"
    files["html"].write_text(page)
    return Report(summary, files)
