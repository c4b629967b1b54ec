"""Command lines: every option of `vexact` and the examples' scripts has help text and shows its default; a bad value
prints one line naming it and what is allowed, and exits 2 (no traceback)."""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vexact.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal of --device cuda without CUDA")


def _load(rel: str):
    name = Path(rel).stem
    spec = importlib.util.spec_from_file_location(name, ROOT / rel)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def _parsers(ap: argparse.ArgumentParser, name: str):
    yield name, ap
    for action in ap._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def _all_parsers():
    yield from _parsers(build_parser(), "vexact")
    yield "grpo.py", _load("examples/getting_started/grpo.py").parser()
    yield "sweep.py", _load("examples/tim_study/sweep.py").parser()
    yield "fit_policy.py", _load("examples/tim_study/fit_policy.py").parser()
    yield "report.py", _load("examples/tim_study/report.py").parser()


def test_every_option_has_help_and_shows_its_default():
    seen = 0
    for name, ap in _all_parsers():
        assert ap.formatter_class is argparse.ArgumentDefaultsHelpFormatter, name
        options = 0
        for action in ap._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            assert action.help, f"{name} {action.option_strings or action.dest}: no help text"
            options += bool(action.option_strings)
        assert ap.format_help().count("(default:") >= options, name
        seen += options
    assert seen >= 13 + 11 + 5 + 11  # grpo.py, tim rescore, demo, tim attribute (and sweep.py's)


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def _one_line_exit_2(out: subprocess.CompletedProcess, *words: str) -> None:
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    for w in words:
        assert w in lines[0], (w, lines[0])


def test_bad_dtypes_and_a_missing_file_exit_2_in_one_line():
    _one_line_exit_2(_run("-m", "vexact", "demo", "--dtypes", "bf16,float32"), "'bf16'", "bfloat16", "float32")
    _one_line_exit_2(_run("-m", "vexact", "tim", "rescore", "no/such.jsonl"), "no/such.jsonl", "no such file")


@NO_CUDA
def test_device_cuda_without_cuda_exits_2_in_one_line():
    _one_line_exit_2(_run("examples/getting_started/grpo.py", "--device", "cuda"), "--device cuda", "use cpu")


@pytest.mark.parametrize(
    "argv, words",
    [
        (["demo", "--model", "no/such/dir"], ["'no/such/dir'", "config.json"]),
        (["tim", "rescore", "README.md", "--dtype", "fp8"], ["'fp8'", "bfloat16"]),
        (["tim", "rescore", "README.md", "--device", "tpu"], ["'tpu'", "cpu, cuda"]),
        (["tim", "attribute", "--ops", "linear,convolution"], ["'convolution'", "attention"]),
        (["tim", "attribute", "--temperature", "0"], ["--temperature 0", "> 0"]),
        (["tim", "attribute", "--prompts", "0"], ["--prompts 0", ">= 1"]),
        (["demo", "--max-tokens", "-3"], ["--max-tokens -3", ">= 1"]),
    ],
)
def test_vexact_refuses_a_bad_value_naming_it(argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("vexact: error: "), err
    for w in words:
        assert w in err, (w, err)


@NO_CUDA
def test_vexact_device_cuda_without_cuda(capsys):
    assert main(["tim", "attribute", "--device", "cuda"]) == 2
    assert "--device cuda: this machine has no CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize(
    "script, argv, words",
    [
        ("examples/getting_started/grpo.py", ["--rollout-backend", "fastest"], ["'fastest'", "invariant", "fast"]),
        ("examples/getting_started/grpo.py", ["--task", "mul"], ["'mul'", "add_mod10"]),
        ("examples/getting_started/grpo.py", ["--model", "no/dir"], ["'no/dir'", "tiny"]),
        ("examples/tim_study/sweep.py", ["--corrections", "none,clip"], ["--corrections 'clip'", "tis"]),
        ("examples/tim_study/sweep.py", ["--model-size", "huge"], ["--model-size 'huge'", "small"]),
        ("examples/tim_study/sweep.py", ["--magnitudes", "0,a"], ["'0,a'", "numbers"]),
        ("examples/tim_study/plot.py", ["no/such.jsonl"], ["'no/such.jsonl'", "no such file"]),
        ("examples/tim_study/sweep.py", ["--arms", "exact,warp"], ["--arms 'warp'", "k3:<kl>"]),
        ("examples/tim_study/sweep.py", ["--arms", "noise:-1"], ["'noise:-1'", "> 0"]),
        (
            "examples/tim_study/sweep.py",
            ["--arms", "k3:1e-4", "--calibration", "no/cal.json"],
            ["'no/cal.json'", "--calibrate"],
        ),
        ("examples/tim_study/sweep.py", ["--shard", "3/2"], ["--shard '3/2'", "0 <= I < N"]),
        ("examples/tim_study/sweep.py", ["--from-fitted", "no/dir"], ["--from-fitted 'no/dir'", "fit.json"]),
        ("examples/tim_study/fit_policy.py", ["--preset", "huge"], ["--preset 'huge'", "small"]),
        ("examples/tim_study/fit_policy.py", ["--steps", "0"], ["--steps 0", ">= 1"]),
        ("examples/tim_study/fit_policy.py", ["--target", "1.5"], ["--target 1.5", "(0, 1)"]),
        ("examples/tim_study/report.py", ["no/such.jsonl"], ["'no/such.jsonl'", "no such file"]),
        ("examples/tim_study/report.py", ["README.md", "--out", "x.md"], ["--out 'x.md'", "prefix"]),
        ("examples/getting_started/plot.py", ["no/such.jsonl"], ["'no/such.jsonl'", "no such file"]),
    ],
)
def test_examples_refuse_a_bad_value_naming_it(script, argv, words, capsys):
    assert _load(script).main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and ": error: " in err, err
    for w in words:
        assert w in err, (w, err)


def test_rescore_summary_never_prints_greedy_flips_none():
    from vexact.tim import _greedy_line

    no_rank = {"available": True, "trainer_top1_is_sampled": 0.5, "flips": None, "reason": "no engine rank"}
    assert (
        _greedy_line(no_rank)
        == "greedy flips: not available (no engine rank); trainer top-1 is the sampled token: 0.5000"
    )
    assert "not computed" in _greedy_line({"available": False, "reason": "the trainer's top-1 was not computed"})
    counted = {"available": True, "trainer_top1_is_sampled": 1.0, "flips": 2, "flip_rate": 0.25}
    assert _greedy_line(counted).startswith("greedy flips: 2 (25.0000% of tokens)")
