"""Training-inference mismatch (TIM) diagnostics: rescore any engine's rollouts with the invariant trainer.

Three steps, each usable alone:

1. :func:`load_rollouts` reads rollouts in one of :data:`LAYOUTS` into :class:`Rollout` rows (prompt ids, response
   ids, the engine's per-token logprobs and the temperature they were computed at), checking every row (lengths,
   token ids inside the vocabulary, finite logprobs, a temperature) with an error naming the row.
2. :func:`rescore` computes the trainer's logprobs of the same tokens (:meth:`Actor.compute_log_probs`, batched by
   token count, with a progress bar) and, optionally, the trainer's top-1 token at each position.
3. :func:`tim_metrics` compares the two: per-token |delta logprob|, fraction of tokens that differ, KL estimates (k1 and
   K3), chi-square, log-perplexity difference, by position and engine-probability bucket, worst sequences first, and
   greedy flips. :func:`write_report` writes ``summary.json``, PNG plots and one self-contained ``report.html``.

Conventions: ``a`` is the engine's (rollout) logprob of a sampled token, ``b`` the trainer's, ``d = b - a``;
the tokens were drawn from the engine, so ``mean(a - b)`` (k1) and ``mean(exp(d) - 1 - d)`` (K3) estimate
KL(engine || trainer) and ``mean((exp(d) - 1)^2)`` estimates the chi-square divergence chi^2(trainer || engine).
Two logprobs "differ" when their fp32 values are not bitwise equal.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import pickle
from dataclasses import dataclass, field
from pathlib import Path

import torch

import vexact_kernels as vk

from .actor import Actor
from .batch import pack

LAYOUTS = ("auto", "vexact", "vllm", "verl")
VLLM_LOGPROBS_MODES = ("processed", "raw")
POSITION_EDGES = (0, 1, 4, 16, 64, 256, 1024, 4096)
PROB_EDGES = (0.0, 1e-4, 1e-3, 1e-2, 0.1, 0.5, 0.9, 0.99, 1.0)
VERL_TEXT_DUMP = (
    "verl's trainer.rollout_data_dir dump holds decoded text, scores and the step only (no token ids, no rollout "
    "logprobs), so it cannot be rescored exactly; save the batch with verl's DataProto.save_to_disk(path) after "
    "generation (it holds prompts, responses, attention_mask and rollout_log_probs) and pass that file"
)


class BadRolloutError(ValueError):
    """A rollout row that cannot be rescored; the message names the row."""


@dataclass
class Rollout:
    """One sampled sequence as an engine reported it.

    ``temperature``: the temperature the engine's logprobs were computed at (the trainer rescores at it).
    ``engine_top1``: per token, whether the engine ranked the sampled token first (vLLM's ``Logprob.rank == 1``);
    ``None`` when the layout does not say.
    """

    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: torch.Tensor
    temperature: float
    row: str = ""
    engine_top1: list[bool] | None = None


# ---- readers and converters


def _records(path: Path) -> list[tuple[str, object]]:
    """``(row name, record)`` for every row of a JSONL / JSON list / parquet file, or a verl DataProto pickle."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ImportError("reading parquet needs pyarrow (pip install pyarrow)") from e
        return [(f"{path.name}:{i}", r) for i, r in enumerate(pq.read_table(path).to_pylist())]
    if suffix in (".pkl", ".pickle", ".pt", ".dataproto"):
        with path.open("rb") as f:
            # a DataProto pickle, as verl's DataProto.save_to_disk writes it; only open files you trust
            return [(path.name, pickle.load(f))]
    text = path.read_text()
    if suffix == ".json":
        data = json.loads(text)
        data = data if isinstance(data, list) else [data]
        return [(f"{path.name}:{i}", r) for i, r in enumerate(data)]
    out = []
    for i, line in enumerate(text.splitlines()):
        if line.strip():
            try:
                out.append((f"{path.name}:{i + 1}", json.loads(line)))
            except json.JSONDecodeError as e:
                out.append((f"{path.name}:{i + 1}", BadRolloutError(f"{path.name}:{i + 1}: not JSON ({e.msg})")))
    return out


def _layout_of(rec: object) -> str:
    if type(rec).__name__ == "DataProto":
        return "verl"
    if isinstance(rec, dict):
        if "outputs" in rec:
            return "vllm"
        if "token_ids" in rec and "logprobs" in rec:
            return "vexact"
        if {"input", "output", "step"} <= rec.keys():
            return "verl"
    keys = sorted(rec.keys()) if isinstance(rec, dict) else type(rec).__name__
    raise BadRolloutError(f"cannot tell the layout of a row with {keys}; pass layout= one of {LAYOUTS[1:]}")


def _temperature(row: str, *values) -> float:
    for v in values:
        if v is not None:
            return v
    raise BadRolloutError(f"{row}: no temperature (the row has none; pass temperature=, --temperature on the CLI)")


def from_vexact(rec: dict, row: str, temperature: float | None = None) -> list[Rollout]:
    """Our engine: a :class:`vexact_engine.RequestOutput` as a dict (``prompt_token_ids``, ``token_ids``,
    ``logprobs`` one float per token, ``temperature``; :func:`rollouts_to_jsonl` writes it)."""
    lp = rec.get("logprobs")
    if lp is None or "prompt_token_ids" not in rec:
        raise BadRolloutError(f"{row}: a vexact row needs prompt_token_ids, token_ids and logprobs")
    temp = _temperature(row, rec.get("temperature"), temperature)
    return [Rollout(list(rec["prompt_token_ids"]), list(rec["token_ids"]), _fp32(lp, row), temp, row)]


def from_vllm(rec: dict, row: str, temperature: float | None = None, logprobs_mode: str = "processed") -> list[Rollout]:
    """vLLM's offline API: a ``RequestOutput`` as a dict, one rollout per entry of ``outputs`` (``n > 1``).

    ``prompt_token_ids``; each output's ``token_ids`` and ``logprobs``: one entry per generated token, either a
    ``{token_id: Logprob}`` dict (``SamplingParams(logprobs=k)``: the sampled token and the top k, keys as strings,
    each ``{"logprob", "rank", "decoded_token"}``) or a plain float. The temperature comes from the row's
    ``temperature`` or ``sampling_params.temperature``, else ``temperature``. ``logprobs_mode``: ``processed`` (vLLM's
    ``logprobs_mode="processed_logprobs"``, as verl runs it: after temperature) or ``raw`` (vLLM's default
    ``raw_logprobs``: before temperature, so they are rescored at temperature 1).
    """
    if logprobs_mode not in VLLM_LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {VLLM_LOGPROBS_MODES}, got {logprobs_mode!r}")
    if "prompt_token_ids" not in rec or not isinstance(rec.get("outputs"), list):
        raise BadRolloutError(f"{row}: a vLLM row needs prompt_token_ids and a list of outputs")
    sp = rec.get("sampling_params") or {}
    temp = (
        1.0 if logprobs_mode == "raw" else _temperature(row, rec.get("temperature"), sp.get("temperature"), temperature)
    )
    out = []
    for j, o in enumerate(rec["outputs"]):
        name = f"{row}/outputs[{j}]" if len(rec["outputs"]) > 1 else row
        ids, entries = list(o.get("token_ids") or []), o.get("logprobs")
        if entries is None:
            raise BadRolloutError(f"{name}: no logprobs (generate with SamplingParams(logprobs=0) or more)")
        if len(entries) != len(ids):
            raise BadRolloutError(f"{name}: {len(ids)} token_ids but {len(entries)} logprobs")
        values, ranks = [], []
        for k, (tok, e) in enumerate(zip(ids, entries, strict=True)):
            if isinstance(e, dict):
                hit = e.get(str(tok), e.get(tok))
                if hit is None:
                    raise BadRolloutError(f"{name}: token {k} (id {tok}) is not in its logprobs entry")
                values.append(hit["logprob"] if isinstance(hit, dict) else hit)
                ranks.append(hit.get("rank") if isinstance(hit, dict) else None)
            else:
                values.append(e)
                ranks.append(None)
        top1 = [r == 1 for r in ranks] if ranks and None not in ranks else None
        out.append(Rollout(list(rec["prompt_token_ids"]), ids, _fp32(values, name), temp, name, top1))
    return out


def from_verl(rec: object, row: str, temperature: float | None = None) -> list[Rollout]:
    """verl: a ``DataProto`` (``DataProto.save_to_disk``) after generation: ``prompts [B, P]`` (left-padded),
    ``responses [B, R]`` (right-padded), ``attention_mask [B, P + R]`` (or ``response_mask [B, R]``) and
    ``rollout_log_probs [B, R]``; the temperature from ``meta_info["temperature"]`` (verl's trainer sets it), else
    ``temperature``. verl's ``rollout_data_dir`` JSONL (text only) is refused with the reason."""
    if isinstance(rec, dict):
        raise BadRolloutError(f"{row}: {VERL_TEXT_DUMP}")
    batch = rec.batch
    missing = [k for k in ("prompts", "responses", "attention_mask", "rollout_log_probs") if k not in batch.keys()]
    if missing:
        raise BadRolloutError(f"{row}: the DataProto has no {missing} (keys: {sorted(batch.keys())})")
    prompts, responses, attn = batch["prompts"], batch["responses"], batch["attention_mask"]
    p_len = prompts.shape[1]
    resp_mask = batch["response_mask"] if "response_mask" in batch.keys() else attn[:, p_len:]
    temp = _temperature(row, rec.meta_info.get("temperature"), temperature)
    out = []
    for i in range(prompts.shape[0]):
        n = int(resp_mask[i].sum())
        out.append(
            Rollout(
                prompts[i][attn[i, :p_len].bool()].tolist(),
                responses[i, :n].tolist(),
                batch["rollout_log_probs"][i, :n].float(),
                float(temp),
                f"{row}[{i}]",
            )
        )
    return out


def _fp32(values, row: str) -> torch.Tensor:
    try:
        return torch.as_tensor(values, dtype=torch.float32).reshape(-1)
    except (TypeError, ValueError, RuntimeError) as e:
        raise BadRolloutError(f"{row}: logprobs are not a list of numbers ({e})") from None


def check_rollout(r: Rollout, vocab_size: int | None = None) -> None:
    """Raise :class:`BadRolloutError` naming the row when ``r`` cannot be rescored."""
    if not r.prompt_token_ids:
        raise BadRolloutError(f"{r.row}: the prompt is empty")
    if not r.token_ids:
        raise BadRolloutError(f"{r.row}: the response is empty")
    if len(r.logprobs) != len(r.token_ids):
        raise BadRolloutError(f"{r.row}: {len(r.token_ids)} response tokens but {len(r.logprobs)} logprobs")
    bad = torch.nonzero(~torch.isfinite(r.logprobs))
    if len(bad):
        k = int(bad[0])
        raise BadRolloutError(f"{r.row}: logprob of token {k} is {float(r.logprobs[k])} (must be finite)")
    for name, ids in (("prompt", r.prompt_token_ids), ("response", r.token_ids)):
        for k, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
                raise BadRolloutError(f"{r.row}: {name} token {k} is {t!r}, outside the vocabulary [0, {vocab_size})")
    t = r.temperature
    if t == 0 and not isinstance(t, bool):
        raise BadRolloutError(
            f"{r.row}: temperature 0 (must be a finite number > 0): greedy rows have no temperature-0 logprobs; "
            "the vexact engine reports greedy tokens' logprobs at temperature 1, so record 1.0 for them"
        )
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
        raise BadRolloutError(f"{r.row}: temperature {t!r} (must be a finite number > 0)")


def load_rollouts(
    path: str | Path,
    layout: str = "auto",
    temperature: float | None = None,
    vocab_size: int | None = None,
    skip_bad: bool = False,
    vllm_logprobs_mode: str = "processed",
) -> tuple[list[Rollout], list[str]]:
    """Rollouts of the file at ``path`` (``.jsonl``, ``.json``, ``.parquet``, or a verl DataProto pickle ``.pkl``).

    Returns ``(rollouts, errors)``; without ``skip_bad`` the first bad row raises :class:`BadRolloutError`, with it
    the bad rows are left out and their errors returned. ``temperature`` fills in rows that carry none.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no rollout file at {path}")
    rollouts, errors = [], []
    for row, rec in _records(path):
        try:
            if isinstance(rec, Exception):
                raise rec
            kind = _layout_of(rec) if layout == "auto" else layout
            if kind == "vllm":
                got = from_vllm(rec, row, temperature, vllm_logprobs_mode)
            elif kind == "verl":
                got = from_verl(rec, row, temperature)
            else:
                got = from_vexact(rec, row, temperature)
            for r in got:
                check_rollout(r, vocab_size)
            rollouts += got
        except BadRolloutError as e:
            if not skip_bad:
                raise
            errors.append(str(e))
    return rollouts, errors


def rollouts_from_outputs(outputs, temperature: float | list[float]) -> list[Rollout]:
    """Rollouts from our engine's :class:`vexact_engine.RequestOutput` objects (in memory)."""
    temps = temperature if isinstance(temperature, list) else [temperature] * len(outputs)
    return [
        Rollout(list(o.prompt_token_ids), list(o.token_ids), o.logprobs.float().cpu(), float(t), f"output {i}")
        for i, (o, t) in enumerate(zip(outputs, temps, strict=True))
    ]


def rollouts_to_jsonl(rollouts: list[Rollout], path: str | Path) -> None:
    """Write rollouts in the ``vexact`` layout (fp32 logprobs survive JSON exactly: a float64 holds every fp32)."""
    with Path(path).open("w") as f:
        for r in rollouts:
            rec = {
                "prompt_token_ids": r.prompt_token_ids,
                "token_ids": r.token_ids,
                "logprobs": r.logprobs.tolist(),
                "temperature": r.temperature,
            }
            f.write(json.dumps(rec) + "\n")


# ---- rescoring


@dataclass
class Rescored:
    """The trainer's view of the rollouts: ``logprobs`` (fp32, one tensor per rollout) and, when asked for,
    ``top1`` (the trainer's argmax token at each response position, int64)."""

    logprobs: list[torch.Tensor]
    top1: list[torch.Tensor] | None = None


def _batches(rollouts: list[Rollout], max_tokens: int) -> list[list[int]]:
    out, cur, n = [], [], 0
    for i, r in enumerate(rollouts):
        size = len(r.prompt_token_ids) + len(r.token_ids)
        if cur and n + size > max_tokens:
            out.append(cur)
            cur, n = [], 0
        cur.append(i)
        n += size
    return out + ([cur] if cur else [])


@torch.no_grad()
def _trainer_top1(actor: Actor, prompts, responses) -> list[torch.Tensor]:
    model = actor.model
    cfg = model.config
    batch = pack(prompts, responses, cfg.vocab_size, cfg.max_position_embeddings)
    batch = batch.to(next(model.parameters()).device)
    with vk.use_backend(actor.config.backend):
        hidden = model(batch.input_ids, batch.positions, batch.meta)
        top = torch.cat([model.logits(hidden[s : s + 1024]).argmax(-1) for s in range(0, len(hidden), 1024)])
    out, start = [], 0
    for plen, n in zip(batch.prompt_lens, batch.seq_lens, strict=True):
        out.append(top[start + plen - 1 : start + n - 1].cpu())
        start += n
    return out


def rescore(
    actor: Actor | torch.nn.Module,
    rollouts: list[Rollout],
    max_batch_tokens: int = 16384,
    with_top1: bool = True,
    progress: bool = True,
) -> Rescored:
    """The trainer's logprobs of every rollout's tokens (:meth:`Actor.compute_log_probs`, at each rollout's
    temperature), in batches of at most ``max_batch_tokens`` prompt + response tokens (a longer rollout gets a batch
    of its own); ``with_top1`` also records the trainer's top-1 token at each position (a second forward)."""
    from tqdm.auto import tqdm

    if not isinstance(actor, Actor):
        actor = Actor(actor)
    logprobs: list[torch.Tensor] = [torch.empty(0)] * len(rollouts)
    top1: list[torch.Tensor] | None = [torch.empty(0)] * len(rollouts) if with_top1 else None
    bar = tqdm(total=len(rollouts), desc="rescoring", unit="seq", disable=not progress)
    for idx in _batches(rollouts, max_batch_tokens):
        prompts = [rollouts[i].prompt_token_ids for i in idx]
        responses = [rollouts[i].token_ids for i in idx]
        temps = [float(rollouts[i].temperature) for i in idx]
        scored = actor.compute_log_probs(prompts, responses, temps)
        tops = _trainer_top1(actor, prompts, responses) if with_top1 else None
        for j, i in enumerate(idx):
            logprobs[i] = scored.logprobs[j].float().cpu()
            if top1 is not None:
                top1[i] = tops[j]
        bar.update(len(idx))
    bar.close()
    return Rescored(logprobs, top1)


# ---- metrics


def _bucket_rows(key: torch.Tensor, bounds: list[tuple[float, float, bool]], a, b, differ) -> list[dict]:
    """Statistics per bucket ``[lo, hi)`` (``[lo, hi]`` where ``closed``) of ``key``."""
    rows = []
    for lo, hi, closed in bounds:
        sel = (key >= lo) & ((key <= hi) if closed else (key < hi))
        n = int(sel.sum())
        d = (b - a)[sel]
        rows.append(
            {
                "bucket": f"[{lo:g}, {hi:g}{']' if closed else ')'}",
                "tokens": n,
                "tokens_differ": int(differ[sel].sum()),
                "fraction_differ": float(differ[sel].double().mean()) if n else 0.0,
                "mean_abs_delta": float(d.abs().mean()) if n else 0.0,
                "k3_kl": float((torch.expm1(d) - d).mean()) if n else 0.0,
            }
        )
    return rows


POSITION_BUCKETS = [(lo, hi, False) for lo, hi in zip(POSITION_EDGES, POSITION_EDGES[1:] + (math.inf,), strict=True)]
PROB_BUCKETS = [(lo, hi, hi == 1.0) for lo, hi in zip(PROB_EDGES, PROB_EDGES[1:], strict=False)]


def tim_metrics(
    engine_logprobs: list[torch.Tensor],
    trainer_logprobs: list[torch.Tensor],
    engine_top1: list[list[bool] | None] | None = None,
    trainer_top1: list[torch.Tensor] | None = None,
    token_ids: list[list[int]] | None = None,
    rows: list[str] | None = None,
    worst: int = 20,
) -> dict:
    """The mismatch between the engine's and the trainer's logprobs of the same sampled tokens (one tensor per
    sequence each); see the module docstring for the conventions. All statistics are float64 over fp32 inputs.

    Greedy flips need the trainer's top-1 (``trainer_top1``) and the sampled ``token_ids``: a token is a flip where
    the engine ranked the sampled token first (``engine_top1``, vLLM's rank) and the trainer's top-1 is another token,
    or where the engine did not and the trainer's top-1 is the sampled token. Without ``engine_top1`` only
    ``trainer_top1_is_sampled`` (the fraction of sampled tokens that are the trainer's top-1) is reported.
    """
    if len(engine_logprobs) != len(trainer_logprobs):
        raise ValueError(f"{len(engine_logprobs)} engine sequences but {len(trainer_logprobs)} trainer sequences")
    if not engine_logprobs:
        raise ValueError("no sequences to compare")
    rows = rows or [f"sequence {i}" for i in range(len(engine_logprobs))]
    for i, (x, y) in enumerate(zip(engine_logprobs, trainer_logprobs, strict=True)):
        if x.shape != y.shape:
            raise ValueError(f"{rows[i]}: engine has {tuple(x.shape)} logprobs, trainer {tuple(y.shape)}")
    a32 = torch.cat([x.float().cpu().reshape(-1) for x in engine_logprobs])
    b32 = torch.cat([y.float().cpu().reshape(-1) for y in trainer_logprobs])
    differ = a32 != b32
    a, b = a32.double(), b32.double()
    d = b - a
    absd = d.abs()
    k3 = torch.expm1(d) - d
    lens = [len(x.reshape(-1)) for x in engine_logprobs]
    seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    pos = torch.cat([torch.arange(n) for n in lens]).double()
    n = len(a)
    q = torch.tensor([0.5, 0.9, 0.99, 0.999], dtype=torch.float64)
    quant = torch.quantile(absd, q) if n else torch.zeros(4, dtype=torch.float64)
    summary = {
        "sequences": len(lens),
        "tokens": n,
        "tokens_differ": int(differ.sum()),
        "fraction_differ": float(differ.double().mean()) if n else 0.0,
        "sequences_differ": int(sum(bool(differ[seq == s].any()) for s in range(len(lens)))),
        "exact": not bool(differ.any()),
        "abs_delta": {
            "mean": float(absd.mean()) if n else 0.0,
            "max": float(absd.max()) if n else 0.0,
            **{f"p{p}": float(v) for p, v in zip(("50", "90", "99", "99.9"), quant.tolist(), strict=True)},
        },
        "kl_k1": float((a - b).mean()) if n else 0.0,
        "kl_k3": float(k3.mean()) if n else 0.0,
        "chi2": float(torch.expm1(d).square().mean()) if n else 0.0,
        "log_ppl_engine": float((-a).mean()) if n else 0.0,
        "log_ppl_trainer": float((-b).mean()) if n else 0.0,
        "log_ppl_diff": float((a - b).mean()) if n else 0.0,
        "log_ppl_diff_seq_mean": float(
            torch.stack([(a - b)[seq == s].mean() for s in range(len(lens)) if lens[s]]).mean()
        )
        if n
        else 0.0,
        "by_position": _bucket_rows(pos, POSITION_BUCKETS, a, b, differ),
        "by_probability": _bucket_rows(a.exp(), PROB_BUCKETS, a, b, differ),
    }
    per_seq = []
    for s in range(len(lens)):
        sel = seq == s
        per_seq.append(
            {
                "index": s,
                "row": rows[s],
                "tokens": lens[s],
                "tokens_differ": int(differ[sel].sum()),
                "max_abs_delta": float(absd[sel].max()) if lens[s] else 0.0,
                "mean_abs_delta": float(absd[sel].mean()) if lens[s] else 0.0,
                "k3_kl": float(k3[sel].mean()) if lens[s] else 0.0,
                "log_ppl_diff": float((a - b)[sel].mean()) if lens[s] else 0.0,
            }
        )
    per_seq.sort(key=lambda r: (-r["max_abs_delta"], -r["k3_kl"], r["index"]))
    summary["worst_sequences"] = per_seq[:worst]
    summary["greedy"] = _greedy(engine_top1, trainer_top1, token_ids, rows)
    return summary


def _greedy(engine_top1, trainer_top1, token_ids, rows) -> dict:
    if trainer_top1 is None or token_ids is None:
        return {"available": False, "reason": "the trainer's top-1 was not computed"}
    is_top = [t.cpu() == torch.as_tensor(ids, dtype=t.dtype) for t, ids in zip(trainer_top1, token_ids, strict=True)]
    n = sum(len(x) for x in is_top)
    out = {
        "available": True,
        "trainer_top1_is_sampled": float(sum(int(x.sum()) for x in is_top) / n) if n else 0.0,
    }
    known = engine_top1 is not None and all(e is not None for e in engine_top1)
    if not known:
        out["flips"] = None
        out["reason"] = "the layout does not say which sampled tokens were the engine's top-1 (vLLM's rank does)"
        return out
    flips = []
    for s, (eng, tr) in enumerate(zip(engine_top1, is_top, strict=True)):
        for k, (e, t) in enumerate(zip(eng, tr.tolist(), strict=True)):
            if bool(e) != bool(t):
                flips.append({"row": rows[s], "position": k, "engine_top1": bool(e), "trainer_top1": bool(t)})
    out.update({"flips": len(flips), "flip_rate": len(flips) / n if n else 0.0, "flip_tokens": flips[:50]})
    return out


def compare(rollouts: list[Rollout], rescored: Rescored, worst: int = 20) -> dict:
    """:func:`tim_metrics` of rollouts and their rescoring."""
    return tim_metrics(
        [r.logprobs for r in rollouts],
        rescored.logprobs,
        [r.engine_top1 for r in rollouts],
        rescored.top1,
        [r.token_ids for r in rollouts],
        [r.row for r in rollouts],
        worst,
    )


# ---- report


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
