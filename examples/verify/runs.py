"""Reading verl GRPO runs for ``compare.py`` and ``benchmarks/rl_step.py``: verl's file-logger JSONL and its meta.

A run is ``<gpu>-<model>-<arm>.jsonl`` (arm in ``vllm``, ``vexact``, ``fast``; e.g. ``h100-qwen3-1.7b-vllm.jsonl``):
one line per step, ``{"step": N, "data": {"rollout_corr/k3_kl": ..., "timing_s/gen": ..., ...}}``. Beside it the run
script writes ``<same stem>.meta.json`` with the keys in ``META_KEYS``: ``config`` is a flat dict of the settings
every arm must share (the pair and model shape first, then batch, lengths, ``ignore_eos``, steps, lr, data, and the
token budgets and micro-batches both arms are tuned with), ``stack`` says what ran
(rollout, actor engine, attention, MoE implementation, versions), ``peak_gpu_mem_mib`` is an int or null.
Runs without a meta file (the older ``*-invariant.jsonl`` / ``*-fast.jsonl`` pairs) still load; their configs are
not checked.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

ARMS = ("vllm", "vexact", "fast")
# the invariant-vs-fast pairs name the rollout backend (invariant kernels), with the invariant actor in both runs
LEGACY_ARMS = ("invariant",)
DEFAULT_ARM = "vllm"
META_KEYS = ("arm", "model", "gpu", "date", "commit", "command", "config", "stack", "peak_gpu_mem_mib")

K3 = "rollout_corr/k3_kl"
PROBS_DIFF_MEAN = "training/rollout_probs_diff_mean"
PROBS_DIFF_MAX = "training/rollout_probs_diff_max"
REWARD = "critic/score/mean"
GRAD_NORM = "actor/grad_norm"
ENTROPY = "actor/entropy"
RESPONSE_LEN = "response_length/mean"
PHASES = ("gen", "old_log_prob", "update_actor", "update_weights", "step")


class RunError(ValueError):
    """A run that cannot be read, or runs that cannot be compared; the message names the file and the values."""


@dataclass
class Run:
    path: Path
    arm: str
    steps: list[int]  # ascending step numbers
    data: dict[int, dict[str, float]]  # step -> verl's metrics of that step
    meta: dict | None  # the parsed .meta.json, or None where the run has none

    @property
    def name(self) -> str:
        return self.path.name

    def series(self, key: str) -> list[float]:
        """The metric at every step (NaN where a step did not log it)."""
        return [float(self.data[s].get(key, math.nan)) for s in self.steps]

    def mean_after(self, key: str, warmup: int) -> float | None:
        """Mean of ``key`` over the steps after the first ``warmup``; None unless every one of them logged it."""
        vals = [self.data[s].get(key) for s in self.steps[warmup:]]
        if not vals or any(v is None for v in vals):
            return None
        return sum(float(v) for v in vals) / len(vals)

    def phase_means(self, warmup: int) -> dict[str, float | None]:
        """verl's ``timing_s/<phase>`` per phase of ``PHASES``, as the mean over the steps after warm-up."""
        return {p: self.mean_after(f"timing_s/{p}", warmup) for p in PHASES}

    def only(self, steps: list[int]) -> Run:
        """This run cut to ``steps`` (each one it logged)."""
        data = {s: self.data[s] for s in steps}
        return Run(path=self.path, arm=self.arm, steps=list(steps), data=data, meta=self.meta)


def meta_path(path: Path) -> Path:
    return path.with_name(path.name.removesuffix(".jsonl") + ".meta.json")


def arm_from_name(path: Path) -> str:
    """The arm is the file name's last ``-`` field: ``h100-qwen3-1.7b-vllm.jsonl`` -> ``vllm``."""
    arm = path.name.removesuffix(".jsonl").rsplit("-", 1)[-1]
    if arm not in ARMS + LEGACY_ARMS:
        raise RunError(
            f"{path}: cannot tell the arm from the file name (last '-' field is {arm!r}); "
            f"name runs <gpu>-<model>-<arm>.jsonl with arm in {', '.join(ARMS + LEGACY_ARMS)}"
        )
    return arm


def jsonl_records(path: Path):
    """``(line number, record)`` of each non-blank line of a JSONL file; a line that is not JSON raises
    :class:`RunError` naming ``path:line``."""
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as e:
            raise RunError(f"{path}:{n}: not JSON ({e.msg})") from None


def write_report(text: str, out: Path | None) -> None:
    """Print a report, and write it to ``out`` as well where given (its folder made)."""
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(f"wrote {out}")


def read_run(path: Path | str) -> Run:
    """One run: its JSONL records (merged per step, as verl may log a step in several records) and its meta."""
    path = Path(path)
    if not path.is_file():
        raise RunError(f"{path}: no such file")
    data: dict[int, dict[str, float]] = {}
    for n, rec in jsonl_records(path):
        if not isinstance(rec, dict) or "step" not in rec or "data" not in rec:
            got = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
            raise RunError(f"{path}:{n}: expected verl file-logger records with 'step' and 'data', got {got}")
        data.setdefault(int(rec["step"]), {}).update(rec["data"])
    if not data:
        raise RunError(f"{path}: no records (an empty log: did the run fail before its first step?)")
    arm = arm_from_name(path)
    meta = None
    mp = meta_path(path)
    if mp.is_file():
        try:
            meta = json.loads(mp.read_text())
        except json.JSONDecodeError as e:
            raise RunError(f"{mp}: not JSON ({e.msg})") from None
        if not isinstance(meta, dict):
            raise RunError(f"{mp}: expected a JSON object with the keys {list(META_KEYS)}")
        missing = [k for k in META_KEYS if k not in meta]
        if missing:
            raise RunError(f"{mp}: lacks the keys {missing}; a meta file has {list(META_KEYS)}")
        if not isinstance(meta["config"], dict):
            raise RunError(f"{mp}: 'config' is {type(meta['config']).__name__}, expected a flat dict")
        if meta["arm"] != arm:
            raise RunError(f"{mp}: arm {meta['arm']!r} in the meta, {arm!r} in the file name {path.name}")
    return Run(path=path, arm=arm, steps=sorted(data), data=data, meta=meta)


def check_comparable(runs: list[Run]) -> list[str]:
    """Raise RunError unless the runs have distinct arms, share their config (where metas exist: the first differing
    setting is named, in the meta's order, shape first) and have a step in common. Returns notes on what was not
    checked. Runs may log different steps (one stopped early): ``common`` cuts them to the steps all of them have."""
    first = runs[0]
    for r in runs[1:]:
        if r.arm == first.arm:
            raise RunError(f"two runs of arm {r.arm!r}: {first.name} and {r.name}")
    without = [r.name for r in runs if r.meta is None]
    for r in runs[1:] if not without else []:
        key = first_difference(first.meta["config"], r.meta["config"])
        if key is not None:
            a, b = first.meta["config"], r.meta["config"]
            va = repr(a[key]) if key in a else "(absent)"
            vb = repr(b[key]) if key in b else "(absent)"
            raise RunError(
                f"config differs at {key!r}: {va} in {meta_path(first.path).name}, {vb} in {meta_path(r.path).name}"
            )
    if not common_steps(runs):
        logged = ", ".join(f"{r.name} {span(r.steps)}" for r in runs)
        raise RunError(f"no step in common: {logged}")
    if without:
        return [f"configs not checked: no meta.json beside {', '.join(without)} (steps in common checked)"]
    return []


def common_steps(runs: list[Run]) -> list[int]:
    """The steps every run logged, ascending."""
    return sorted(set.intersection(*(set(r.steps) for r in runs)))


def span(steps: list[int]) -> str:
    """``4 steps (1..4)``, ``1 step (1)``, ``3 steps (1, 2, 4)``."""
    n = len(steps)
    if steps == list(range(steps[0], steps[-1] + 1)):
        where = f"{steps[0]}" if n == 1 else f"{steps[0]}..{steps[-1]}"
    else:
        where = ", ".join(map(str, steps))
    return f"{n} step{'s' if n != 1 else ''} ({where})"


def common(runs: list[Run], warmup: int) -> tuple[list[Run], int, list[str]]:
    """The runs cut to the steps all of them logged (an arm stopped early keeps the others to its steps), the warm-up
    to leave out of means over them (``warmup``, or one step fewer than they have where that leaves none: then the
    means include warm-up, and a note says so) and notes saying how many steps each arm logged where they differ."""
    if warmup < 0:
        raise RunError(f"--warmup {warmup}: allowed 0 or more")
    steps = common_steps(runs)
    notes = []
    if any(r.steps != steps for r in runs):
        logged = ", ".join(f"{r.arm} {span(r.steps)}" for r in runs)
        notes.append(f"the arms logged different steps ({logged}): the tables cover the {span(steps)} all logged")
    used = min(warmup, len(steps) - 1)
    if used < warmup:
        after = f"step {steps[0]}'s warm-up included" if used == 0 else f"after {used} warm-up steps"
        notes.append(f"--warmup {warmup} leaves none of the {span(steps)} in common: the means cover "
                     f"{span(steps[used:])}, {after}")  # fmt: skip
    return [r.only(steps) for r in runs], used, notes


def first_difference(a: dict, b: dict) -> str | None:
    """The first key, in ``a``'s order and then ``b``'s, whose value differs between the configs (or that one lacks)."""
    for key in [*a, *(k for k in b if k not in a)]:
        if key not in a or key not in b or a[key] != b[key]:
            return key
    return None


def fmt_float(v: float | None, spec: str = ".3g") -> str:
    return "n/a" if v is None or math.isnan(v) else format(v, spec)
