"""Every third-party module a package imports is declared in its pyproject (dependencies or an extra).

A static scan of each package's sources; `tests/test_standalone_install.py` checks the same by installing each
package alone and running its README snippet.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata as md
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["vexact-kernels", "vexact-models", "vexact-engine", "vexact-trainer", "vexact-verl"]
SIBLINGS = {p.replace("-", "_"): p for p in PACKAGES}
# modules that are not installed here, so importlib.metadata cannot name their distribution
NOT_INSTALLED = {"flash_attn": "flash-attn-4", "veomni": "veomni"}
# imported only where the user opted in by a route pip extras cannot express, with the reason
UNDECLARED_BY_DESIGN = {
    ("vexact-verl", "veomni"): "installed with --no-deps from requirements/veomni.txt (why: the comments there)",
}


def imported_modules(src: Path) -> dict[str, list[str]]:
    """Top-level module -> the files importing it (absolute imports only; stdlib left out)."""
    found: dict[str, list[str]] = {}
    for f in sorted(src.rglob("*.py")):
        if "assets" in f.parts:
            continue
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names:
                    found.setdefault(top, []).append(str(f.relative_to(ROOT)))
    return found


def _root(dist: str) -> Path:
    return ROOT if dist == "vexact" else ROOT / "packages" / dist


def declared(dist: str) -> set[str]:
    """Canonical names of every requirement of ``dist``: dependencies and all extras."""
    project = tomllib.loads((_root(dist) / "pyproject.toml").read_text())["project"]
    reqs = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        reqs += extra
    return {canonicalize_name(Requirement(r).name) for r in reqs}


@functools.cache
def _module_dists() -> dict[str, list[str]]:
    return md.packages_distributions()


def distributions_of(module: str) -> set[str]:
    if module in SIBLINGS:
        return {SIBLINGS[module]}
    found = _module_dists().get(module)
    if found:
        return {canonicalize_name(d) for d in found}
    assert module in NOT_INSTALLED, f"{module} is not installed here: name its distribution in NOT_INSTALLED"
    return {NOT_INSTALLED[module]}


@pytest.mark.parametrize("dist", PACKAGES + ["vexact"])  # vexact: the root meta-package and its CLI (src/vexact)
def test_every_import_is_declared(dist):
    have = declared(dist) | {dist}
    missing = []
    for module, files in imported_modules(_root(dist) / "src").items():
        if (dist, module) in UNDECLARED_BY_DESIGN:
            continue
        if not distributions_of(module) & have:
            missing.append(f"{module} (imported by {files[0]}; distribution {sorted(distributions_of(module))})")
    assert not missing, f"{dist} imports what its pyproject.toml does not declare: {missing}"


def test_the_scan_sees_a_missing_declaration():
    """numpy is imported by vexact-kernels' CPU sampler: without its declaration the check above must fail."""
    imports = imported_modules(ROOT / "packages" / "vexact-kernels" / "src")
    assert "numpy" in imports
    assert not distributions_of("numpy") & (declared("vexact-kernels") - {"numpy"})
