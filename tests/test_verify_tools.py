"""examples/verify/compare.py and benchmarks/rl_step.py on small synthetic verl runs (JSONL + meta.json)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "verify"))
sys.path.insert(0, str(ROOT / "benchmarks"))
import compare  # noqa: E402
import rl_step  # noqa: E402

CONFIG = {"model_shape": "qwen3 h1024 l8", "seed": 0, "lr": 3e-6, "steps": 4, "train_batch_size": 8, "rollout_n": 4,
          "max_prompt_length": 128, "max_response_length": 64, "ignore_eos": True}  # fmt: skip
# arm -> per-phase seconds of every step after the first; the first step is slow (warm-up)
PHASE_S = {
    "vllm": {"gen": 2.0, "old_log_prob": 1.0, "update_actor": 3.0, "update_weights": 0.5, "step": 8.0},
    "vexact": {"gen": 2.5, "old_log_prob": 1.0, "update_actor": 3.3, "update_weights": 0.25, "step": 9.0},
    "fast": {"gen": 1.5, "old_log_prob": 1.0, "update_actor": 3.3, "update_weights": 0.25, "step": 7.0},
}
PHASE_S["invariant"] = PHASE_S["vexact"]


def write_run(
    d: Path, arm: str, k3: list[float], pdiff: list[float] | None = None, model: str = "qwen3-1.7b",
    meta: bool = True, gpu: str = "h100", resp_len: float = 64.0, **config,
) -> Path:  # fmt: skip
    pdiff = [v * 10 for v in k3] if pdiff is None else pdiff
    path = d / f"{gpu}-{model}-{arm}.jsonl"
    with path.open("w") as f:
        for i, (k, p) in enumerate(zip(k3, pdiff, strict=True)):
            timing = {f"timing_s/{ph}": s * (10 if i == 0 else 1) + (0.5 * i if ph == "gen" else 0.0)
                      for ph, s in PHASE_S[arm].items()}  # fmt: skip
            data = {"rollout_corr/k3_kl": k, "training/rollout_probs_diff_max": p,
                    "training/rollout_probs_diff_mean": p / 20, "critic/score/mean": 0.01 * (i + 1),
                    "actor/grad_norm": 1.0 + i, "actor/entropy": 5.0 - i, "response_length/mean": resp_len,
                    **timing}  # fmt: skip
            f.write(json.dumps({"step": i + 1, "data": data}) + "\n")
    if meta:
        m = {"arm": arm, "model": model, "gpu": gpu, "date": "2026-11-27", "commit": "abc1234",
             "command": f"bash examples/verify/run_pair.sh {arm}", "config": {**CONFIG, **config},
             "stack": {"rollout": arm, "actor": "fsdp", "attention": "sdpa", "versions": {"verl": "0.9.1"}},
             "peak_gpu_mem_mib": {"vllm": 40000, "vexact": 30000}.get(arm)}  # fmt: skip
        path.with_name(path.name.removesuffix(".jsonl") + ".meta.json").write_text(json.dumps(m))
    return path


EXACT = [0.0, 0.0, 0.0, 0.0]
MISMATCH = [7e-5, 8e-5, 7.5e-5, 9e-5]


def test_compare_refuses_runs_of_different_configs_naming_the_key_and_both_values(tmp_path, capsys):
    a = write_run(tmp_path, "vllm", MISMATCH)
    b = write_run(tmp_path, "vexact", EXACT, lr=1e-5)
    assert compare.main([str(a), str(b)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "'lr'" in err and "3e-06" in err and "1e-05" in err, err


def test_compare_tables_the_steps_all_arms_logged_when_one_stopped_early(tmp_path, capsys):
    a = write_run(tmp_path, "vllm", MISMATCH)
    b = write_run(tmp_path, "vexact", EXACT[:3])  # stopped after step 3, same config (the same planned steps)
    assert compare.main([str(a), str(b), "--expect-exact", "vexact"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("runs (vllm 4 steps (1..4), vexact 3 steps (1..3)): "), out
    assert "note: the arms logged different steps (vllm 4 steps (1..4), vexact 3 steps (1..3)): the tables cover the " \
        "3 steps (1..3) all logged" in out, out  # fmt: skip
    table = out.split("probs_diff_max vexact")[1].split("\n\n")[0].strip().splitlines()
    assert [row.split()[0] for row in table] == ["1", "2", "3"]
    # steady state: steps 2..3 (default warm-up 1); gen of vexact 2.5 + 0.5, 2.5 + 1.0; of vllm 2.0 + 0.5, 2.0 + 1.0
    assert "timing_s/*: mean s over steps 2..3 (after 1 warm-up)" in out
    line = next(x for x in out.splitlines() if x.startswith("vexact") and "x)" in x)
    assert line.split()[1:3] == ["3.250", f"({3.25 / 2.75:.2f}x)"], line
    assert "expect-exact vexact" in out and "expect-exact: PASS" in out
    # one step in common: the means include step 1's warm-up, and say so
    c = write_run(tmp_path, "vexact", EXACT[:1])
    assert compare.main([str(a), str(c)]) == 0
    out = capsys.readouterr().out
    assert "--warmup 1 leaves none of the 1 step (1) in common: the means cover 1 step (1), step 1's warm-up " \
        "included" in out, out  # fmt: skip
    assert "timing_s/*: mean s over steps 1..1 (after 0 warm-up)" in out


def test_compare_still_refuses_a_short_run_of_other_settings_naming_the_first(tmp_path, capsys):
    a = write_run(tmp_path, "vllm", MISMATCH)
    b = write_run(tmp_path, "vexact", EXACT[:2], max_response_length=128, lr=1e-5)  # lr comes first in CONFIG
    assert compare.main([str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert "config differs at 'lr': 3e-06 in h100-qwen3-1.7b-vllm.meta.json, 1e-05 in" in err, err
    c = write_run(tmp_path, "vexact", EXACT[:2], steps=2)  # launched for 2 steps, not stopped early: a setting
    assert compare.main([str(a), str(c)]) == 2
    assert "config differs at 'steps': 4 in" in capsys.readouterr().err


def test_compare_names_a_missing_or_empty_run(tmp_path, capsys):
    a = write_run(tmp_path, "vllm", MISMATCH)
    assert compare.main([str(a), str(tmp_path / "h100-qwen3-1.7b-vexact.jsonl")]) == 2
    assert "h100-qwen3-1.7b-vexact.jsonl: no such file" in capsys.readouterr().err
    (tmp_path / "h100-qwen3-1.7b-vexact.jsonl").write_text("\n")
    assert compare.main([str(a), str(tmp_path / "h100-qwen3-1.7b-vexact.jsonl")]) == 2
    assert "no records" in capsys.readouterr().err


def test_compare_without_meta_checks_step_counts_only_and_says_so(tmp_path, capsys):
    a = write_run(tmp_path, "fast", MISMATCH, model="1gpu-lr3e-6", meta=False)
    b = write_run(tmp_path, "invariant", EXACT, model="1gpu-lr3e-6", meta=False, lr=1.0)
    assert compare.main([str(b), str(a), "--expect-exact", "invariant"]) == 0
    assert "configs not checked" in capsys.readouterr().out
    c = write_run(tmp_path, "vexact", EXACT[:2], model="1gpu-lr3e-6", meta=False)
    assert compare.main([str(a), str(c)]) == 0  # the 2 steps both logged
    assert "vexact 2 steps (1..2)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("vexact", "vllm", "fast", "want"),
    [
        (EXACT, MISMATCH, MISMATCH, 0),
        ([0.0, 0.0, 1e-12, 0.0], MISMATCH, MISMATCH, 1),  # the exact arm off at one step
        (EXACT, [7e-5, 0.0, 7e-5, 7e-5], MISMATCH, 1),  # another arm exactly 0 at one step
        (EXACT, MISMATCH, [7e-5, 7e-5, 7e-5, 0.0], 1),  # the third arm exactly 0 at one step
    ],
    ids=["pass", "exact-arm-off", "vllm-zero", "fast-zero"],
)
def test_compare_expect_exact(tmp_path, capsys, vexact, vllm, fast, want):
    runs = [write_run(tmp_path, "vllm", vllm), write_run(tmp_path, "vexact", vexact), write_run(tmp_path, "fast", fast)]
    png = tmp_path / "pair.png"
    assert compare.main([*map(str, runs), "--expect-exact", "vexact", "--plot", str(png)]) == want
    out = capsys.readouterr().out
    assert f"expect-exact: {'PASS' if want == 0 else 'FAIL'}" in out
    assert png.stat().st_size > 10_000  # six panels, each arm drawn


def test_compare_expect_exact_checks_probs_diff_max_too(tmp_path, capsys):
    a = write_run(tmp_path, "vllm", MISMATCH)
    b = write_run(tmp_path, "vexact", EXACT, pdiff=[0.0, 0.0, 0.0, 2e-7])
    assert compare.main([str(a), str(b), "--expect-exact", "vexact"]) == 1
    assert "fails at step 4: 2e-07" in capsys.readouterr().out
    assert compare.main([str(a), str(b), "--expect-exact", "fast"]) == 2  # no such arm
    assert "no such arm" in capsys.readouterr().err


def test_compare_timing_means_after_warmup_and_ratio_to_vllm(tmp_path, capsys):
    a = write_run(tmp_path, "vllm", MISMATCH)
    b = write_run(tmp_path, "vexact", EXACT)
    assert compare.main([str(a), str(b), "--warmup", "2"]) == 0
    out = capsys.readouterr().out
    # gen of vexact at steps 3, 4: 2.5 + 1.0, 2.5 + 1.5 -> 3.75; of vllm 2.0 + 1.0, 2.0 + 1.5 -> 3.25
    line = next(x for x in out.splitlines() if x.startswith("vexact") and "x)" in x)
    assert line.split()[1:3] == ["3.750", f"({3.75 / 3.25:.2f}x)"], line
    assert compare.main([str(a), str(b), "--warmup", "4"]) == 0  # no step left after 4: the last one
    assert "the means cover 1 step (4), after 3 warm-up steps" in capsys.readouterr().out
    assert compare.main([str(a), str(b), "--warmup", "-1"]) == 2
    assert "--warmup -1: allowed 0 or more" in capsys.readouterr().err


@pytest.mark.parametrize(
    "stem,arms,exact",
    [("h200x2-2gpu-lr3e-6", ("invariant", "fast"), "invariant"), ("h100-qwen3-1.7b", ("vllm", "vexact"), "vexact"),
     ("h100-qwen3-30b-a3b", ("vllm", "vexact"), "vexact"), ("h200-qwen3-1.7b", ("vllm", "vexact"), "vexact"),
     ("h200-dense-1k", ("vllm", "vexact"), "vexact"), ("h200-dense-4k", ("vllm", "vexact"), "vexact"),
     ("h200-moe-1k", ("vllm", "vexact"), "vexact")],
)  # fmt: skip
def test_compare_runs_as_a_script_on_the_committed_pairs(tmp_path, stem, arms, exact):
    res = ROOT / "examples/verify/results"
    pair = [str(res / f"{stem}-{arm}.jsonl") for arm in arms]
    cmd = [sys.executable, str(ROOT / "examples/verify/compare.py"), *pair, "--expect-exact", exact, "--plot",
           str(tmp_path / "p.png")]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "expect-exact: PASS" in r.stdout and (tmp_path / "p.png").is_file()


def test_rl_step_table_means_ratios_tokens_and_memory(tmp_path, capsys):
    runs = [write_run(tmp_path, arm, k) for arm, k in (("vexact", EXACT), ("vllm", MISMATCH))]
    runs += [write_run(tmp_path, arm, k, model="qwen3-30b-a3b") for arm, k in (("vllm", MISMATCH), ("vexact", EXACT))]
    out = tmp_path / "rl-step-h100.md"
    assert rl_step.main([*map(str, runs), "--warmup", "2", "--out", str(out)]) == 0
    md = out.read_text()
    assert md in capsys.readouterr().out
    head = md.splitlines()[:6]
    assert "Date: 2026-11-27" in head[2] and "GPU: h100" in head[3] and "Commit: abc1234" in head[4]
    assert f"`python benchmarks/rl_step.py {runs[0]}" in head[5] and "--out" in head[5]
    assert "run_pair.sh vllm" in md
    for model in ("qwen3-1.7b", "qwen3-30b-a3b"):
        section = md.split(f"## {model}\n")[1].split("\n## ")[0]
        cells = [[c.strip() for c in r.strip().strip("|").split("|")] for r in section.splitlines() if r[:1] == "|"]
        rows = {c[0]: c[1:] for c in cells}
        assert rows[""] == ["`vllm`", "`vexact`", "vexact / vllm"]  # default stack first
        assert rows["gen (s)"] == ["3.250", "3.750", f"{3.75 / 3.25:.3f}"]
        assert rows["update_weights (s)"] == ["0.500", "0.250", "0.500"]
        assert rows["step (total) (s)"] == ["8.000", "9.000", "1.125"]
        # 64 tokens x 8 prompts x 4 samples per step, over the mean gen time after warm-up
        assert rows["rollout tokens/s"] == [f"{2048 / 3.25:.0f}", f"{2048 / 3.75:.0f}", f"{3.25 / 3.75:.3f}"]
        assert rows["peak GPU memory (MiB)"] == ["40000", "30000", "0.750"]
        assert "`ignore_eos=True`" in section and "max_response_length=64" in section
        assert "not equal" not in section


def test_rl_step_refuses_different_configs_and_missing_meta_and_says_when_work_is_not_equal(tmp_path, capsys):
    a = write_run(tmp_path, "vllm", MISMATCH)
    b = write_run(tmp_path, "vexact", EXACT, train_batch_size=16)
    assert rl_step.main([str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert "'train_batch_size'" in err and "8 in" in err and "16 in" in err, err
    c = write_run(tmp_path, "vexact", EXACT, meta=False, model="m")
    assert rl_step.main([str(a), str(c)]) == 2
    assert "no h100-m-vexact.meta.json" in capsys.readouterr().err
    d = write_run(tmp_path, "vexact", EXACT, gpu="h200")
    assert rl_step.main([str(a), str(d)]) == 2
    assert "different GPUs" in capsys.readouterr().err
    a = write_run(tmp_path, "vllm", MISMATCH, ignore_eos=False)
    b = write_run(tmp_path, "vexact", EXACT, ignore_eos=False)
    assert rl_step.main([str(a), str(b)]) == 0
    assert "Equal work is not ensured" in capsys.readouterr().out


def test_rl_step_tables_the_steps_all_arms_logged_when_one_stopped_early(tmp_path, capsys):
    runs = [write_run(tmp_path, "vllm", MISMATCH[:2]), write_run(tmp_path, "vexact", EXACT)]
    assert rl_step.main([*map(str, runs)]) == 0
    md = capsys.readouterr().out
    assert "**Note**: The arms logged different steps (vllm 2 steps (1..2), vexact 4 steps (1..4)): the tables " \
        "cover the 2 steps (1..2) all logged." in md, md  # fmt: skip
    assert "Mean over steps 2..2 (1 steps after 1 warm-up)" in md
    rows = {c[0]: c[1:] for c in ([x.strip() for x in r.strip().strip("|").split("|")] for r in md.splitlines()
                                  if r.startswith("|"))}  # fmt: skip
    assert rows["gen (s)"] == ["2.500", "3.000", f"{3.0 / 2.5:.3f}"]  # step 2 alone: 2.0 + 0.5, 2.5 + 0.5
    a = write_run(tmp_path, "vexact", EXACT, rollout_n=8)  # a different setting is still refused
    assert rl_step.main([str(runs[0]), str(a)]) == 2
    assert "config differs at 'rollout_n': 4 in" in capsys.readouterr().err


def test_rl_step_flags_responses_shorter_than_max_under_ignore_eos(tmp_path, capsys):
    a = write_run(tmp_path, "vllm", MISMATCH, ignore_eos="true")
    b = write_run(tmp_path, "vexact", EXACT, resp_len=50.0, ignore_eos="true")
    assert rl_step.main([str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "`ignore_eos=True`" in out and "vllm 64.0, vexact 50.0" in out
    assert "The lengths of vexact differ from max_response_length: the work is not equal." in out


def test_a_run_name_without_an_arm_is_refused_naming_the_allowed_arms(tmp_path, capsys):
    a = write_run(tmp_path, "vllm", MISMATCH)
    b = tmp_path / "verify-invariant-1gpu-lr3e-6.jsonl"
    b.write_text(a.read_text())
    assert compare.main([str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert "last '-' field is '6'" in err and "vllm, vexact, fast" in err, err


def test_headline_draws_one_row_per_model(tmp_path, capsys):
    import headline

    runs = [write_run(tmp_path, arm, k3, model=m) for m in ("qwen3-1.7b", "qwen3-30b-a3b")
            for arm, k3 in (("vllm", MISMATCH), ("vexact", EXACT))]  # fmt: skip
    out = tmp_path / "pair.png"
    assert headline.main([str(p) for p in runs] + ["--out", str(out)]) == 0
    groups = headline.group([headline.read_run(p) for p in runs])
    assert [[r.arm for r in g] for g in groups] == [["vllm", "vexact"], ["vllm", "vexact"]]
    assert [g[0].meta["model"] for g in groups] == ["qwen3-1.7b", "qwen3-30b-a3b"]
    assert out.stat().st_size > 10_000


def test_headline_refuses_a_model_with_one_arm_or_runs_of_different_configs(tmp_path, capsys):
    import headline

    a = write_run(tmp_path, "vllm", MISMATCH)
    b = write_run(tmp_path, "vexact", EXACT, model="qwen3-30b-a3b")
    assert headline.main([str(a), str(b), "--out", str(tmp_path / "x.png")]) == 2
    assert "'qwen3-1.7b' has one run" in capsys.readouterr().err
    c = write_run(tmp_path, "vexact", EXACT, lr=1e-5)
    assert headline.main([str(a), str(c), "--out", str(tmp_path / "x.png")]) == 2
    assert "lr" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize(
    "gpu, models",
    [("h100", ("qwen3-1.7b", "qwen3-30b-a3b")), ("h200", ("dense-1k", "dense-4k", "moe-1k", "moe-4k", "qwen3-1.7b"))],
    ids=["h100", "h200"],
)
def test_committed_rl_step_table_is_what_the_committed_runs_give(tmp_path, gpu, models):
    committed = ROOT / f"benchmarks/results/rl-step-{gpu}.md"
    cmd_line = next(ln for ln in committed.read_text().splitlines() if ln.startswith("- Command (this file): "))
    args = cmd_line.split("`")[1].split()[2:]  # after `python benchmarks/rl_step.py`
    out = tmp_path / "rl-step.md"
    args[args.index("--out") + 1] = str(out)
    res = ROOT / "examples/verify/results"
    assert [a for a in args if a.endswith(".jsonl")] == [
        f"examples/verify/results/{gpu}-{m}-{arm}.jsonl" for m in models for arm in ("vllm", "vexact")
    ]
    assert res.is_dir()
    assert rl_step.main([str(ROOT / a) if a.endswith(".jsonl") else a for a in args]) == 0

    def tables(text: str) -> list[str]:
        return [ln for ln in text.splitlines() if ln.startswith("|")]

    assert tables(out.read_text()) == tables(committed.read_text())
    assert len(tables(committed.read_text())) == len(models) * 9
