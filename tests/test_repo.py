"""Repository-level checks: the README's commands, CI, package metadata, the demo."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "vexact-kernels": "vexact_kernels",
    "vexact-models": "vexact_models",
    "vexact-engine": "vexact_engine",
    "vexact-trainer": "vexact_trainer",
    "vexact-verl": "vexact_verl",
}


def readme_commands() -> list[str]:
    block = re.search(r"<!-- commands -->\s*```(?:bash|sh)?\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block, "README.md must have a fenced code block after <!-- commands -->"
    return [ln.strip() for ln in block.group(1).splitlines() if ln.strip() and not ln.strip().startswith("#")]


def test_readme_has_exactly_two_commands_and_ci_runs_the_second():
    cmds = readme_commands()
    assert len(cmds) == 2, cmds
    assert "demo" in cmds[0]
    ci = (ROOT / ".ci/run").read_text()
    assert cmds[1] in ci, f".ci/run must run the README's test command: {cmds[1]!r}"
    assert "set -euo pipefail" in ci


@pytest.mark.parametrize("dist", sorted(PACKAGES))
def test_package_metadata(dist):
    meta = tomllib.loads((ROOT / "packages" / dist / "pyproject.toml").read_text())
    mod = importlib.import_module(PACKAGES[dist])
    assert meta["project"]["name"] == dist
    assert re.fullmatch(r"\d+\.\d+\.\d+", mod.__version__)
    assert mod.__version__ == "0.1.0" or mod.__version__ > "0.1.0"
    assert (ROOT / "packages" / dist / "README.md").is_file()
    assert (ROOT / "packages" / dist / "tests").is_dir()
    for dep in meta["project"]["dependencies"]:
        name = re.split(r"[<>=!~ \[]", dep, maxsplit=1)[0]
        if name.startswith("vexact-"):
            assert ">=" in dep and "<" in dep, f"{dist}: internal dependency {dep!r} needs a version range"
        if name == "torch":
            assert dep.replace(" ", "") == "torch>=2.11,<2.14", f"{dist}: torch range {dep!r}"


def test_demo_runs_and_reports_zero_mismatch_for_invariant():
    out = subprocess.run(
        [sys.executable, "-m", "vexact", "demo", "--prompts", "6", "--max-tokens", "6", "--dtypes", "float32"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    inv = next(ln for ln in out.stdout.splitlines() if ln.startswith("invariant"))
    fields = inv.split()
    assert fields[3] == "0" and fields[5] == "0.0", inv
    fast = next(ln for ln in out.stdout.splitlines() if ln.startswith("fast")).split()
    assert int(fast[3]) > 0, fast  # README: in fp32 too the fast backend differs (reduction order, not bf16 alone)
    assert "engine == trainer bitwise" in out.stdout
