"""examples/tim_study on CPU in a few steps: the fitted policy, the K3 calibration, the sweep's cells (arm x
correction x seed), resume, the report and its collapse definition."""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"tim_study_{name}", ROOT / "examples" / "tim_study" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sweep_runs_every_cell_per_seed_and_magnitude_zero_is_exact(tmp_path):
    out = tmp_path / "sweep.jsonl"
    args = ["--steps", "2", "--magnitudes", "0,0.1", "--corrections", "none", "--seeds", "0,1", "--out", str(out)]
    threads = torch.get_num_threads()
    try:
        _load("sweep").main(args)  # sets one CPU thread for its runs
    finally:
        torch.set_num_threads(threads)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted({(r["logit_noise_std"], r["seed"]) for r in rows}) == [(0.0, 0), (0.0, 1), (0.1, 0), (0.1, 1)]
    assert len(rows) == 8
    assert all(r["k3_kl"] == 0.0 for r in rows if r["logit_noise_std"] == 0.0)
    assert all(r["k3_kl"] > 0.0 for r in rows if r["logit_noise_std"] == 0.1)
    png = _load("plot").plot(str(out))
    assert png.is_file() and png.stat().st_size > 10_000


def _quiet_threads(fn, *args):
    threads = torch.get_num_threads()
    try:
        return fn(*args)  # the scripts set one CPU thread for their runs
    finally:
        torch.set_num_threads(threads)


SMALL = ["--prompts-per-step", "2", "--group-size", "4"]


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """A tiny policy fitted for 60 steps (evaluated at 0, 30 and 60) and its K3 calibration, for the tests below."""
    tmp = tmp_path_factory.mktemp("tim_study")
    fit = ["--preset", "tiny", "--steps", "60", "--eval-every", "30", "--batch-size", "32", "--lr", "3e-3"]
    assert _quiet_threads(_load("fit_policy").main, [*fit, "--out", str(tmp / "policy"), "--quiet"]) == 0
    cal = [
        "--from-fitted",
        str(tmp / "policy"),
        "--calibrate",
        "--calibrate-stds",
        "0.01,0.1",
        "--calibrate-prompts",
        "4",
    ]
    assert _quiet_threads(_load("sweep").main, [*cal, "--calibration", str(tmp / "cal.json")]) == 0
    return tmp


def test_fit_policy_learns_and_writes_a_checkpoint_the_engine_and_trainer_load(fitted):
    record = json.loads((fitted / "policy" / "fit.json").read_text())
    assert [h["step"] for h in record["history"]] == [0, 30, 60]
    # 60 steps of cross-entropy on the worked solutions raise their probability by orders of magnitude, and the
    # engine, synced with the trainer's weights, samples right answers
    assert record["history"][-1]["p_solution"] > 1e6 * record["history"][0]["p_solution"] > 0
    assert record["history"][0]["reward"] == 0.0 < record["history"][-1]["reward"] == record["reward"]
    assert record["task"] == "chain" and record["parameters"] > 50_000 and not record["reached_target"]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (fitted / "policy").iterdir()}


def test_calibration_k3_grows_as_the_noise_std_squared(fitted):
    cal = json.loads((fitted / "cal.json").read_text())
    k3 = [p["k3_kl"] for p in cal["points"]]
    assert 0 < k3[0] < k3[1]
    assert 1.5 < cal["fit"]["p"] < 2.5  # K3 ~ std^2 / 2 per token for small noise
    std = cal["chosen"]["0.00015"]
    assert 0.01 < std < 0.1 and math.isclose(cal["fit"]["a"] * std ** cal["fit"]["p"], 1.5e-4, rel_tol=1e-6)
    assert cal["fast"]["k3_kl"] > 0  # the fast kernels' rollouts differ from the trainer's on CPU as well


def test_sweep_arms_from_the_fitted_policy_resume_and_report(fitted, tmp_path, capsys):
    out = tmp_path / "study.jsonl"
    args = ["--from-fitted", str(fitted / "policy"), "--calibration", str(fitted / "cal.json"), *SMALL, "--lr", "1e-4"]
    args += ["--arms", "exact,k3:1.5e-4,fast", "--corrections", "tis", "--steps", "2", "--out", str(out)]
    assert _quiet_threads(_load("sweep").main, args) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    cells = {(r["arm"], r["rollout_correction"], r["rollout_backend"]) for r in rows}
    assert cells == {("exact", "none", "invariant"), ("k3:1.5e-4", "tis", "invariant"), ("fast", "tis", "fast")}
    assert len(rows) == 6 and all(r["task"] == "chain" for r in rows)
    chosen = json.loads((fitted / "cal.json").read_text())["chosen"]["0.00015"]
    by_arm = {a: [r for r in rows if r["arm"] == a] for a in ("exact", "k3:1.5e-4", "fast")}
    assert all(r["k3_kl"] == 0.0 for r in by_arm["exact"])
    assert all(r["k3_kl"] > 0.0 and r["logit_noise_std"] == round(chosen, 6) for r in by_arm["k3:1.5e-4"])
    assert all(r["k3_kl"] > 0.0 and r["logit_noise_std"] == 0.0 for r in by_arm["fast"])
    # a kill mid-write: the last line is cut; --resume reruns that cell alone, and it comes out the same
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:-1]) + lines[-1][:20])
    capsys.readouterr()
    assert _quiet_threads(_load("sweep").main, [*args, "--resume"]) == 0
    assert capsys.readouterr().out.count(f"complete in {out}, skipped") == 2
    again = [json.loads(line) for line in out.read_text().splitlines()]
    strip = lambda rs: [{k: v for k, v in r.items() if k != "seconds"} for r in rs]  # noqa: E731
    assert strip(again) == strip(rows)
    assert len((tmp_path / "study.meta.jsonl").read_text().splitlines()) == 2  # one line per invocation
    other = ["--arms", "k3:1.5e-4", "--calibration", str(fitted / "cal.json"), "--out", str(tmp_path / "x.jsonl")]
    assert _load("sweep").main(other) == 2  # that calibration is of the fitted policy, not of the default model
    assert "calibrates" in capsys.readouterr().err
    md = _load("report").report([out], tmp_path / "report")
    table = [line for line in md.read_text().splitlines() if line.startswith("| ")]
    assert len(table) == 1 + 3 and table[1].startswith("| exact | any (bitwise the same run) | 0 | 1 | 2 |")
    assert (tmp_path / "report.png").stat().st_size > 10_000


def test_tis_and_mis_are_bitwise_no_ops_on_the_exact_arm(fitted, tmp_path):
    """Why sweep.py runs the exact arm with correction none only."""
    out = tmp_path / "exact.jsonl"
    args = ["--from-fitted", str(fitted / "policy"), *SMALL, "--magnitudes", "0", "--corrections", "none,tis,mis"]
    assert _quiet_threads(_load("sweep").main, [*args, "--steps", "2", "--lr", "1e-3", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    runs = {c: [(r["loss"], r["grad_norm"], r["reward"]) for r in rows if r["rollout_correction"] == c] for c in
            ("none", "tis", "mis")}  # fmt: skip
    assert len(runs["none"]) == 2 and runs["none"] == runs["tis"] == runs["mis"]
    assert any(grad_norm > 0 for _, grad_norm, _ in runs["none"])  # the policy learnt something: not trivially equal


def _run(rewards, grad_norms=None):
    grad_norms = grad_norms or [1.0] * len(rewards)
    return [{"step": i, "reward": r, "grad_norm": g} for i, (r, g) in enumerate(zip(rewards, grad_norms, strict=True))]


def test_collapse_step_definition():
    collapse_step = _load("report").collapse_step
    assert collapse_step(_run([0.5] * 100)) is None
    # 10-step average at 0.5, then the reward falls to 0: the average is below 0.25 from step 55 on, for good
    assert collapse_step(_run([0.5] * 50 + [0.0] * 50)) == 55
    assert collapse_step(_run([0.5] * 50 + [0.0] * 20 + [0.5] * 30)) is None  # below half for 15 steps only
    assert collapse_step(_run([0.5] * 50, [1.0] * 30 + [11.0] + [1.0] * 19)) == 30  # grad norm > 10x the median
    assert collapse_step(_run([0.5] * 50, [1.0] * 40 + [float("nan")] + [1.0] * 9)) == 40


def test_jobs_split_the_cells_into_shards_that_the_report_merges(fitted, tmp_path):
    out = tmp_path / "study.jsonl"
    args = ["--from-fitted", str(fitted / "policy"), *SMALL, "--arms", "exact,fast", "--corrections", "none"]
    assert _load("sweep").main([*args, "--steps", "1", "--jobs", "2", "--out", str(out)]) == 0
    shards = [
        [json.loads(line)["arm"] for line in (tmp_path / f"study-{i}.jsonl").read_text().splitlines()] for i in (0, 1)
    ]
    assert shards == [["exact"], ["fast"]] and not out.exists()
    md = _load("report").report(sorted(tmp_path.glob("study-*.jsonl")), tmp_path / "merged")  # .meta.jsonl skipped
    assert [line.split(" | ")[0] for line in md.read_text().splitlines() if line.startswith("| ")][1:] == [
        "| exact",
        "| fast",
    ]


def _rows(lr: float, rewards: list[float], seed: int = 0) -> list[dict]:
    return [
        dict(r, arm="exact", lr=lr, seed=seed, rollout_correction="none", logit_noise_std=0.0, k3_kl=0.0, entropy=1.0)
        for r in _run(rewards)
    ]


def test_pick_lr_takes_the_largest_rate_that_neither_collapses_nor_stalls():
    pick_lr = _load("report").pick_lr
    learns = [0.2] * 50 + [0.4] * 50  # final - start = +0.2
    stalls = [0.2] * 100  # +0.0
    collapses = [0.2] * 30 + [0.5] * 20 + [0.0] * 50  # peaks, then below half for good
    rows = _rows(3e-5, learns) + _rows(1e-4, learns) + _rows(1e-4, learns, seed=1) + _rows(3e-4, collapses)
    lr, lines = pick_lr(rows)
    assert lr == 1e-4 and len(lines) == 3 and lines[-1].endswith("no")
    assert pick_lr(_rows(1e-4, stalls))[0] is None
    assert pick_lr(_rows(1e-4, stalls), stall=-1.0)[0] == 1e-4
    with pytest.raises(ValueError, match="exact arm"):
        pick_lr([dict(r, arm="fast") for r in _rows(1e-4, learns)])


def test_run_gpu_script_shares_cells_picks_the_lr_and_reports(fitted, tmp_path):
    """examples/tim_study/run_gpu.sh on CPU: the fitted policy and calibration kept, a probe of two rates, the pick,
    the mismatched cells at the picked rate and the report (one step per run: the control flow, not the question)."""
    import shutil
    import subprocess

    shutil.copytree(fitted / "policy", tmp_path / "policy")
    shutil.copy(fitted / "cal.json", tmp_path / "calibration.json")
    env = dict(
        os.environ, DEVICE="cpu", STEPS="1", SEEDS="0", LRS="1e-4,3e-3", ARMS="fast", CORRECTIONS="none,tis",
        PROCS="2", PICK_ARGS="--stall -1",
    )  # fmt: skip
    proc = subprocess.run(
        ["bash", str(ROOT / "examples/tim_study/run_gpu.sh"), str(tmp_path)], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "lr.txt").read_text().splitlines()[-1] == "0.003"
    cells = sorted(p.name for p in (tmp_path / "cells").glob("*.jsonl") if not p.name.endswith(".meta.jsonl"))
    assert cells == ["exact~none~0~0.0001.jsonl", "exact~none~0~0.003.jsonl", "fast~none~0~0.003.jsonl",
                     "fast~tis~0~0.003.jsonl"]  # fmt: skip
    md = (tmp_path / "study.md").read_text()
    assert "| exact |" in md and md.count("| fast |") == 2 and "lr 0.003." in md


def test_report_reads_gzip_compressed_sweeps(tmp_path):
    """The committed results are gzip-compressed JSONL: report.py and plot.py read them as they read plain files."""
    import gzip

    rows = _rows(1e-4, [0.2] * 30 + [0.4] * 30)
    for r in rows:
        r.update(model="m", task="chain", rollout_backend="invariant")
    plain = tmp_path / "s.jsonl"
    plain.write_text("".join(json.dumps(r) + "\n" for r in rows))
    packed = tmp_path / "s.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    report = _load("report")
    assert report.read_rows(packed) == report.read_rows(plain) == rows
    assert report.pick_lr(report.read_rows(packed))[0] == 1e-4
    assert _load("plot").plot(packed).is_file()
