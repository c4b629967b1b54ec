"""Rollouts from any engine as :class:`Rollout` rows: the readers of each layout (vexact, vLLM, verl), the row
checks, and JSONL output."""

from __future__ import annotations

import json
import math
import pickle
from dataclasses import dataclass
from pathlib import Path

import torch

LAYOUTS = ("auto", "vexact", "vllm", "verl")
VLLM_LOGPROBS_MODES = ("processed", "raw")
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
            f"{r.row}: temperature {t!r} (must be a finite number > 0): greedy rows have no temperature-0 logprobs; "
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
