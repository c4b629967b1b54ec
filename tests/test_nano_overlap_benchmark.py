"""benchmarks/nano_overlap.py on the CPU: the tiny model's decode step as one forward, two half forwards and the
two-stream forms (run one after the other on CPU) give every row the bits of the one forward."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_form_gives_the_full_forwards_rows():
    env = dict(os.environ)
    src = [str(p) for p in sorted((ROOT / "packages").glob("*/src"))]
    env["PYTHONPATH"] = os.pathsep.join([*src, str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "benchmarks/nano_overlap.py", "--shape", "tiny", "--batch", "7", "--context", "40",
           "--delays-us", "100"]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True, timeout=300).stdout
    lines = [ln for ln in out.splitlines() if "rows equal full's" in ln]
    assert [ln.split(":")[0] for ln in lines] == ["halves", "streams", "streams+100"], out
    assert all(ln.endswith("True") for ln in lines), out
