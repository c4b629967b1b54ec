"""The results writers of scripts/checks/resume_gpu.sh and scripts/checks/recipes_gpu.sh on small made-up runs: each
passes equal runs with zero K3 KL and fails a perturbed one (a metric, a tensor, a K3 KL, a missing step, an exit
status). The scripts themselves run verl jobs (minutes); their CPU mode is VERL_PLATFORM=cpu."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _load(path: str):
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _metrics(step: int, **change) -> dict:
    m = {"critic/score/mean": 0.1 * step, "response_length/mean": 12.0, "rollout_corr/k3_kl": 0.0,
         "training/rollout_probs_diff_max": 0.0, "actor/grad_norm": 0.5 + step,
         "timing_s/step": 1.0 + step}  # fmt: skip
    return {**m, **change}


def _write(path: Path, steps: dict[int, dict]) -> Path:
    path.write_text("".join(json.dumps({"step": s, "data": m}) + "\n" for s, m in steps.items()))
    return path


def test_resume_results_passes_equal_runs_and_fails_a_perturbed_one(tmp_path):
    writer = _load("examples/verl_grpo/resume_results.py")
    a = _write(tmp_path / "a.jsonl", {s: _metrics(s) for s in (1, 2, 3, 4)})
    b = _write(tmp_path / "b.jsonl", {s: _metrics(s, **{"timing_s/step": 9.0}) for s in (1, 2)})  # timings may differ
    c = _write(tmp_path / "c.jsonl", {s: _metrics(s) for s in (3, 4)})
    for run in ("a", "c"):
        (tmp_path / run / "actor").mkdir(parents=True)
        torch.save({"w": torch.arange(4.0)}, tmp_path / run / "actor/model.pt")
    ckpts = [tmp_path / "c", tmp_path / "a"]
    out = tmp_path / "resume.md"
    assert writer.main([str(a), str(b), str(c), "--stop", "2", "--steps", "4", "--checkpoints", *map(str, ckpts),
                        "--out", str(out), "--header", "# title"]) == 0  # fmt: skip
    text = out.read_text()
    assert text.startswith("# title\n") and "Result: PASS" in text and "| actor/model.pt | equal |" in text

    torch.save({"w": torch.arange(4.0) + 1e-3}, tmp_path / "c/actor/model.pt")
    lines, ok = writer.report(a, b, c, 2, 4, ckpts)
    assert not ok and any("actor/model.pt" in line and "differ" in line for line in lines)
    torch.save({"w": torch.arange(4.0)}, tmp_path / "c/actor/model.pt")
    _write(c, {3: _metrics(3), 4: _metrics(4, **{"critic/score/mean": 0.41})})
    lines, ok = writer.report(a, b, c, 2, 4, ckpts)
    assert not ok and any(line.startswith("| 4 |") and "critic/score/mean" in line for line in lines)
    _write(c, {3: _metrics(3, **{"rollout_corr/k3_kl": 1e-9}), 4: _metrics(4)})
    assert not writer.report(a, b, c, 2, 4, ckpts)[1]
    _write(c, {3: _metrics(3)})  # the resumed run stopped early
    assert not writer.report(a, b, c, 2, 4, ckpts)[1]
    assert not writer.report(a, b, tmp_path / "missing.jsonl", 2, 4, ckpts)[1]


def test_resume_results_fails_a_run_without_gradients(tmp_path):
    """A collapsed policy (zero gradient norm from some step on) compares trivially: more than 2 such steps fail."""
    writer = _load("examples/verl_grpo/resume_results.py")
    zero = {"actor/grad_norm": 0.0}
    metrics = {s: _metrics(s, **(zero if s in (3, 5) else {})) for s in range(1, 7)}  # two steps: an untrained policy
    a = _write(tmp_path / "a.jsonl", metrics)
    b = _write(tmp_path / "b.jsonl", {s: metrics[s] for s in (1, 2, 3)})
    c = _write(tmp_path / "c.jsonl", {s: metrics[s] for s in (4, 5, 6)})
    lines, ok = writer.report(a, b, c, 3, 6, None)
    assert ok and any("zero gradient norm: 2 of 6 [3, 5]" in line for line in lines), lines
    metrics[6] = _metrics(6, **zero)  # a third
    _write(a, metrics)
    _write(c, {s: metrics[s] for s in (4, 5, 6)})
    lines, ok = writer.report(a, b, c, 3, 6, None)
    assert not ok and any("zero gradient norm: 3 of 6 [3, 5, 6]" in line for line in lines), lines
    assert writer.report(a, b, c, 3, 6, None, max_zero_grad=3)[1]
    out = str(tmp_path / "r.md")
    assert writer.main([str(a), str(b), str(c), "--stop", "3", "--steps", "6", "--out", out]) == 1


def test_smoke_results_marks_each_failure(tmp_path):
    writer = _load("examples/recipes/smoke_results.py")
    good = _write(tmp_path / "good.jsonl", {0: {"val-core/x": 0.0}, 1: _metrics(1), 2: _metrics(2)})
    kl = _write(tmp_path / "kl.jsonl", {1: _metrics(1), 2: _metrics(2, **{"rollout_corr/k3_kl": 2e-7})})
    short = _write(tmp_path / "short.jsonl", {1: _metrics(1)})
    base = dict(shape="qwen3-1.7b", layers=2, steps=2, rc=0, wall_s=60, env="SMOKE=1")
    runs = [dict(base, name="good", metrics=str(good)), dict(base, name="kl", metrics=str(kl)),
            dict(base, name="short", metrics=str(short)), dict(base, name="crashed", rc=1, metrics=str(good)),
            dict(base, name="none", rc=124, metrics=str(tmp_path / "missing.jsonl"))]  # fmt: skip
    rows = {r["name"]: writer.row(r) for r in runs}
    assert rows["good"][1] and rows["good"][0].endswith("| pass |") and "| 0.0, 0.0 |" in rows["good"][0]
    assert "| 2/2 |" in rows["good"][0] and "| 2.0, 3.0 |" in rows["good"][0]  # step times
    assert not rows["kl"][1] and "2e-07" in rows["kl"][0] and "not 0.0" in rows["kl"][0]
    assert not rows["short"][1] and "1/2 steps" in rows["short"][0]
    assert not rows["crashed"][1] and "exit 1" in rows["crashed"][0]
    assert not rows["none"][1] and "0/2 steps" in rows["none"][0]
    late = writer.row(dict(base, name="late", metrics=str(good), skipped="time budget: 850 of 900 s spent"))
    assert not late[1] and "**not run** (time budget: 850 of 900 s spent)" in late[0]
    runs_file = tmp_path / "runs.jsonl"
    runs_file.write_text(json.dumps(runs[0]) + "\n")
    out = tmp_path / "recipes.md"
    assert writer.main([str(runs_file), "--out", str(out), "--header", "- GPU: cpu"]) == 0
    assert "1/1 recipes pass" in out.read_text()
    runs_file.write_text("".join(json.dumps(r) + "\n" for r in runs))
    assert writer.main([str(runs_file), "--out", str(out)]) == 1
    assert "1/5 recipes pass" in out.read_text()


def test_async_results_compares_the_modes_and_fails_an_inexact_on_policy_step(tmp_path):
    writer = _load("examples/recipes/async_results.py")

    def step(s: int, stale: int, k3: float, seconds: float) -> dict:
        return _metrics(s, **{"rollout_corr/k3_kl": k3, "perf/total_num_tokens": 1000, "perf/time_per_step": seconds,
                              "timing_s/update_weights": 0.5, "training/off_policy/trajectory_staleness/mean": stale,
                              "training/off_policy/trajectory_staleness_worst/max": stale})  # fmt: skip

    sync = _write(tmp_path / "sync.jsonl", {s: step(s, 0, 0.0, 4.0) for s in (1, 2, 3)})
    sep = _write(tmp_path / "sep.jsonl", {1: step(1, 0, 0.0, 4.0), 2: step(2, 1, 2e-5, 2.0), 3: step(3, 1, 3e-5, 2.0)})
    out = tmp_path / "async.md"
    args = [str(sync), str(sep), "--params", "1000000000", "--nccl-gbps", "100", "--out", str(out), "--header", "# t"]
    assert writer.main(args) == 0
    text = out.read_text()
    assert "separate_async / sync training tokens/s: 2.00x" in text  # steps after the first: 500 against 250
    assert "4.000 GB a sync" in text and "NCCL bound at 100.0 GB/s: 0.040 s; measured / bound 12.50x" in text
    assert "exactly 0.0 (1)" in text and "2e-05, 3e-05" in text
    assert writer.main([*args, "--versions"]) == 1  # no per-version check logged: the versions did not reach the actor
    assert "per-version check at every step: **fail**" in out.read_text()
    checked = {
        "actor/vexact/behavior/k3": 0.0,
        "actor/vexact/behavior/tokens_differ": 0.0,
        "actor/vexact/behavior/tokens_checked": 200.0,
        "actor/vexact/behavior/tokens_unchecked": 0.0,
    }
    versioned = {1: step(1, 0, 0.0, 4.0), 2: step(2, 1, 2e-5, 2.0), 3: step(3, 1, 3e-5, 2.0)}
    for m in versioned.values():
        m.update(checked)
    _write(sep, versioned)
    assert writer.main([*args, "--versions"]) == 0
    text = out.read_text()
    assert "per-version check at every step: pass" in text and "| 2 | 1 | 1 | 2e-05 | 0 | 200 / 0 |" in text
    versioned[3]["actor/vexact/behavior/tokens_unchecked"] = 5.0  # tokens labelled with a version not held
    _write(sep, versioned)
    assert writer.main([*args, "--versions"]) == 1
    _write(sep, {1: step(1, 0, 1e-9, 4.0), 2: step(2, 1, 2e-5, 2.0)})  # an on-policy step that is not exact
    assert writer.main(args) == 1 and "**not exact**" in out.read_text()
