"""The docs site builds with every warning an error: ``mkdocs build --strict`` (what ``nox -s docs`` runs), the API
reference included (mkdocstrings reads the packages' docstrings)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_docs_build_strict_without_warnings(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs requirements (requirements/docs.txt) are not installed")
    pytest.importorskip("mkdocstrings", reason="the docs requirements (requirements/docs.txt) are not installed")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path)]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log
    warnings = [line for line in log.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert not warnings, "\n".join(warnings)
    api = tmp_path / "api" / "engine" / "index.html"
    assert "vexact_engine.LLM" in api.read_text(), "the API reference has no entry for vexact_engine.LLM"
