"""benchmarks/admission_step.py on the CPU: the tiny engine at its batch limit admits a prompt every fourth step; the
report names both kinds of step and the launches, and the admitting steps did run split (decode rows padded, the
prompt apart) or, with --joint, in one launch."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*flags: str) -> str:
    env = dict(os.environ)
    src = [str(p) for p in sorted((ROOT / "packages").glob("*/src"))]
    env["PYTHONPATH"] = os.pathsep.join([*src, str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "benchmarks/admission_step.py", "--shape", "tiny", "--steps", "8", *flags]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True, timeout=300).stdout


@pytest.mark.parametrize("joint", [False, True], ids=["split", "joint"])
def test_admission_step_reports_both_kinds(joint):
    out = _run(*(["--joint"] if joint else []))
    assert re.search(r"^decode: \d+ steps, mean [\d.]+ ms", out, re.M), out
    assert re.search(r"^admits: 2 steps, mean [\d.]+ ms", out, re.M), out
    assert re.search(r"^launch, admits: 2 launches", out, re.M), out
    split = int(re.search(r"split steps (\d+)", out).group(1))
    assert (split == 0) if joint else (split >= 2), out
