"""examples/verify/gen_profile.py on a synthetic vLLM log and GenPhase file, on the committed dense pairs, and
run_pair.sh's GEN_STATS=1 (the vllm arm's stats setting, in its command and its meta)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "verify"))
import gen_profile  # noqa: E402

ESC = "\x1b"
RAY = f"{ESC}[36m(vLLMHttpServer pid=4242){ESC}[0m "


def stats(prompt: float, gen: float, running: int, waiting: int, kv: float) -> str:
    return (f"{RAY}INFO 11-28 20:41:46 [loggers.py:123] Engine 000: Avg prompt throughput: {prompt} tokens/s, "
            f"Avg generation throughput: {gen} tokens/s, Running: {running} reqs, Waiting: {waiting} reqs, "
            f"GPU KV cache usage: {ESC}[1m{kv}%{ESC}[0m, Prefix cache hit rate: 12.5%")  # fmt: skip


LOG = "\n".join([
    "== h100-qwen3-1.7b-vllm: actor attention sdpa (why); PYTHONPATH in front: (none)",
    f"{RAY}INFO 11-28 20:40:01 [kv_cache_utils.py:1087] GPU KV cache size: 436,512 tokens",
    f"{RAY}INFO 11-28 20:40:01 [kv_cache_utils.py:1091] Maximum concurrency for 4,224 tokens per request: 103.34x",
    stats(123.4, 12345.6, 256, 0, 87.3),
    stats(0.0, 10000.0, 128, 2, 90.5),
    stats(0.0, 0.0, 0, 0, 0.0),  # asleep while the actor trains: not in the throughput mean
    f"{ESC}[36m(TaskRunner pid=77){ESC}[0m step:1 - timing_s/gen:2.0 - critic/score/mean:0.01",
    "(vLLMHttpServer pid=4242) Running: 64 reqs, Waiting: 0 reqs",  # fields alone still count
    stats(10.0, 20000.0, 512, 0, 99.0),
    "step:2 - timing_s/gen:2.5",
    "an unrelated line: Running out of patience",
    stats(0.0, 5.0, 0, 0, 1.0),  # after the last step line: the whole-log row only
])  # fmt: skip


def test_vllm_log_stats_lines_parsed_per_step_through_ray_prefixes_and_colours():
    log = gen_profile.parse_vllm_log(LOG)
    assert log.kv_cache_tokens == [436512] and log.concurrency == [(4224, 103.34)] and log.has_step_lines
    assert sorted(log.stats, key=str) == [1, 2, None]
    assert log.stats[1][0] == {"prompt_tps": 123.4, "gen_tps": 12345.6, "running": 256, "waiting": 0, "kv_usage": 87.3}
    assert log.stats[2][0] == {"running": 64, "waiting": 0}
    s1 = gen_profile.summarize_stats(log.stats[1])
    assert s1 == {"lines": 3, "running_mean": (256 + 128 + 0) / 3, "running_peak": 256, "waiting_peak": 2,
                  "gen_tps_mean": (12345.6 + 10000.0) / 2, "kv_usage_peak": 90.5}  # fmt: skip
    s2 = gen_profile.summarize_stats(log.stats[2])
    assert s2 == {"lines": 2, "running_mean": (64 + 512) / 2, "running_peak": 512, "waiting_peak": 0,
                  "gen_tps_mean": 20000.0, "kv_usage_peak": 99.0}  # fmt: skip
    whole = gen_profile.summarize_stats(log.all_stats())
    assert whole["lines"] == 6 and whole["gen_tps_mean"] == (12345.6 + 10000.0 + 20000.0) / 3


def write_run(d: Path, arm: str, gens: list[float], meta: bool = True) -> Path:
    path = d / f"h100-qwen3-1.7b-{arm}.jsonl"
    path.write_text("".join(json.dumps({"step": i + 1, "data": {"timing_s/gen": g, "response_length/mean": 64.0}})
                            + "\n" for i, g in enumerate(gens)))  # fmt: skip
    if meta:
        m = {"arm": arm, "model": "qwen3-1.7b", "gpu": "h100", "date": "2026-11-27", "commit": "abc1234",
             "command": "c", "config": {"train_batch_size": 8, "rollout_n": 4}, "stack": {},
             "peak_gpu_mem_mib": None}  # fmt: skip
        path.with_name(path.name.removesuffix(".jsonl") + ".meta.json").write_text(json.dumps(m))
    return path


def rows(md: str, section: str) -> dict[str, list[str]]:
    part = md.split(f"## `{section}`")[1].split("\n## ")[0]
    cells = [[c.strip() for c in r.strip().strip("|").split("|")] for r in part.splitlines() if r.startswith("|")]
    return {c[0]: c[1:] for c in cells if c[0] not in ("---",)}


def test_report_tables_both_arms_and_writes_markdown(tmp_path, capsys):
    vllm = write_run(tmp_path, "vllm", [2.0, 2.5])
    (tmp_path / "h100-qwen3-1.7b-vllm.log").write_text(LOG)
    vexact = write_run(tmp_path, "vexact", [4.0, 3.0])
    phase = {"replica": 0, "wall_s": 3.5, "to_first_request_s": 0.5, "first_to_last_answer_s": 2.5,
             "after_last_answer_s": 0.5, "engine_s": 2.0, "engine_share": 0.8, "requests": 32, "steps": 64,
             "tokens": 2048}  # fmt: skip
    lines = [{**phase, "global_steps": 1, "engine_s": 2.5, "peak_running": 32, "kv_tokens": 4096, "preemptions": 3},
             {**phase, "global_steps": 0}]  # written out of order: matched by global_steps  # fmt: skip
    (tmp_path / "h100-qwen3-1.7b-vexact.phases.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "gen.md"
    assert gen_profile.main([str(vllm), str(vexact), "--out", str(out)]) == 0
    md = out.read_text()
    assert md in capsys.readouterr().out
    assert "- Date: 2026-11-27" in md and "- GPU: h100" in md and "- Commit: abc1234" in md
    v = rows(md, "vllm")
    # 64 tokens x 8 x 4 = 2048 response tokens a step
    assert v["1"] == ["2.00", "1,024", "3", f"{384 / 3:.1f}", "256", "2", f"{22345.6 / 2:,.0f}", "90.5%"]
    assert v["2"] == ["2.50", f"{2048 / 2.5:,.0f}", "2", "288.0", "512", "0", "20,000", "99.0%"]
    assert v["whole log"][2] == "6"
    assert "KV cache: 436,512 tokens; maximum concurrency 103.34x at 4,224 tokens per request." in md
    x = rows(md, "vexact")
    assert x["1"] == ["4.00", "512", "3.50", "0.50", "2.00", "50.0%", "80.0%", "64", "1,024", "n/a", "n/a", "n/a"]
    assert x["2"] == ["3.00", f"{2048 / 3:,.0f}", "3.50", "0.50", "2.50", f"{2.5 / 3:.1%}", "80.0%", "64", "819",
                      "32", "4,096", "3"]  # fmt: skip
    assert "above 100%" not in md


def test_no_stats_lines_names_gen_stats_and_a_missing_run_is_named(tmp_path, capsys):
    vllm = write_run(tmp_path, "vllm", [2.0], meta=False)
    assert gen_profile.main([str(vllm)]) == 0
    out = capsys.readouterr().out
    assert "No `h100-qwen3-1.7b-vllm.log` beside the run" in out and "GEN_STATS=1" in out
    (tmp_path / "h100-qwen3-1.7b-vllm.log").write_text("== arm\nstep:1 - timing_s/gen:2.0\nINFO Running out\n")
    assert gen_profile.main([str(vllm)]) == 0
    out = capsys.readouterr().out
    assert "`h100-qwen3-1.7b-vllm.log` has no vLLM stats lines: run the arm with GEN_STATS=1" in out
    assert rows(out, "vllm")["1"] == ["2.00", "n/a"]  # no meta: no batch for verl's tokens/s
    vexact = write_run(tmp_path, "vexact", [2.0])
    assert gen_profile.main([str(vexact)]) == 0
    assert "No `h100-qwen3-1.7b-vexact.phases.jsonl` beside the run" in capsys.readouterr().out
    assert gen_profile.main([str(vllm), str(tmp_path / "h100-qwen3-1.7b-fast.jsonl")]) == 2
    assert "h100-qwen3-1.7b-fast.jsonl: no such file" in capsys.readouterr().err
    (tmp_path / "h100-qwen3-1.7b-vexact.phases.jsonl").write_text('{"wall_s": 1.0}\n')
    assert gen_profile.main([str(vexact)]) == 2
    assert "h100-qwen3-1.7b-vexact.phases.jsonl:1: a GenPhase line lacks ['engine_s', 'tokens']" in \
        capsys.readouterr().err  # fmt: skip


@pytest.mark.parametrize("pair", ["dense-4k", "dense-1k"])
def test_runs_as_a_script_on_the_committed_pairs(pair, tmp_path):
    res = ROOT / "examples/verify/results"
    out = tmp_path / "gen.md"
    r = subprocess.run([sys.executable, str(ROOT / "examples/verify/gen_profile.py"),
                        *(str(res / f"h200-{pair}-{arm}.jsonl") for arm in ("vllm", "vexact")), "--out", str(out)],
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    md = out.read_text()
    assert f"No `h200-{pair}-vllm.log` beside the run: no vLLM stats; run the arm with GEN_STATS=1" in md
    vexact = rows(md, "vexact")
    steps = [json.loads(ln)["step"] for ln in (res / f"h200-{pair}-vexact.jsonl").read_text().splitlines()]
    phases = [json.loads(ln) for ln in (res / f"h200-{pair}-vexact.phases.jsonl").read_text().splitlines()]
    assert [s for s in vexact if s.isdigit()] == [str(s) for s in steps]
    for p in phases:  # global_steps g: step g + 1
        assert vexact[str(p["global_steps"] + 1)][4] == f"{p['engine_s']:.2f}"


def _dry_run(tmp_path: Path, **env: str) -> dict[str, list[str]]:
    out = subprocess.run(
        ["bash", "examples/verify/run_pair.sh", str(tmp_path), "vllm", "vexact", "fast"],
        cwd=ROOT, env={**os.environ, "DRY_RUN": "1", "TAG": "cpu", **env}, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return {words[0]: words[1:] for words in ([w for w in ln.split("\0") if w] for ln in out.stdout.splitlines())}


@pytest.mark.parametrize("pair", ["smoke", "dense-4k", "moe-1k"])
def test_gen_stats_sets_vllm_log_stats_on_the_vllm_arm_only(tmp_path, pair):
    word = "actor_rollout_ref.rollout.disable_log_stats=False"
    on = _dry_run(tmp_path, PAIR=pair, GEN_STATS="1")
    assert word in on["vllm"]
    assert not [w for w in on["vexact"] + on["fast"] if "disable_log_stats" in w]
    off = _dry_run(tmp_path, PAIR=pair)
    assert not [w for arm in off.values() for w in arm if "disable_log_stats" in w]
    assert [w for w in on["vllm"] if w != word] == off["vllm"]  # nothing else changes


def test_gen_stats_note_names_the_logging_level_and_bad_values_are_refused(tmp_path):
    r = subprocess.run(["bash", "examples/verify/run_pair.sh", str(tmp_path), "vllm", "vexact"], cwd=ROOT,
                       env={**os.environ, "DRY_RUN": "1", "TAG": "cpu", "GEN_STATS": "1"}, capture_output=True,
                       text=True, check=True)  # fmt: skip
    notes = dict(ln.split(":", 1) for ln in r.stderr.splitlines() if ln.startswith("== "))
    assert notes["== cpu-qwen3-1.7b-vllm"].endswith("; environment: VLLM_LOGGING_LEVEL=INFO")
    assert "VLLM_LOGGING_LEVEL" not in notes["== cpu-qwen3-1.7b-vexact"]
    env = {**os.environ, "DRY_RUN": "1", "GEN_STATS": "yes"}
    r = subprocess.run(["bash", "examples/verify/run_pair.sh", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                       text=True)  # fmt: skip
    assert r.returncode == 2 and "GEN_STATS must be 0 or 1, got 'yes'" in r.stderr


def test_gen_stats_setting_is_listed_among_those_that_differ_from_verl_defaults(tmp_path):
    pytest.importorskip("verl")
    pytest.importorskip("omegaconf")
    import write_meta

    cmd = _dry_run(tmp_path, GEN_STATS="1")["vllm"]
    effective, differs = write_meta.settings(" ".join(cmd))
    assert differs is not None, "verl's reference config not found"
    assert differs["actor_rollout_ref.rollout.disable_log_stats"] == {"value": False, "verl_default": True}
    _, differs = write_meta.settings(" ".join(_dry_run(tmp_path)["vllm"]))
    assert "actor_rollout_ref.rollout.disable_log_stats" not in differs
