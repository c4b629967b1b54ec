"""Each package installs alone, with the command its README documents, and its README snippet runs there.

Per package: a fresh venv without the system's site packages gets exactly the closure of what the install command's
packages declare (their dependencies and the extras the command names, resolved in this environment's metadata; the
vexact packages themselves excluded), as links in one folder on a .pth. torch is in that closure, so nothing is
downloaded (no CUDA torch, no network): pip runs the README's command with `--no-index` and builds the local
packages with this environment's hatchling (`--no-build-isolation`). An import the pyprojects do not declare is not
in the venv, so the snippet fails (seen with numpy removed from vexact-kernels' dependencies: the kernels' and the
engine's snippets stop in the CPU sampler, "Numpy is not available"). About 45 s for the five on 2 idle cores.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["vexact-kernels", "vexact-models", "vexact-engine", "vexact-trainer", "vexact-verl"]
PIP_INSTALL = "python -m pip install "


def readme_blocks(dist: str) -> tuple[str, str]:
    """The install command (the bash block after ``<!-- install -->``) and the snippet (the python block after
    ``<!-- snippet -->``) of a package's README."""
    text = (ROOT / "packages" / dist / "README.md").read_text()
    install = re.search(r"<!-- install -->\s*```bash\n(.*?)```", text, re.S)
    snippet = re.search(r"<!-- snippet -->\s*```python\n(.*?)```", text, re.S)
    assert install and snippet, f"{dist}/README.md needs a bash block after <!-- install --> and a python block after"
    lines = [ln.split("  #")[0].strip() for ln in install.group(1).splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(PIP_INSTALL), f"{dist}: one `{PIP_INSTALL}...` line: {lines}"
    return lines[0], snippet.group(1)


def local_requirements(args: list[str]) -> list[str]:
    """What the local packages named in ``args`` (``packages/x`` or ``'packages/x[extra]'``) declare, with the
    extras asked for."""
    reqs = []
    for arg in args:
        path, _, extras = arg.partition("[")
        project = tomllib.loads((ROOT / path / "pyproject.toml").read_text())["project"]
        reqs += project.get("dependencies", [])
        for extra in filter(None, extras.rstrip("]").split(",")):
            reqs += project["optional-dependencies"][extra]
    return reqs


def closure(reqs: list[str]) -> list[md.Distribution]:
    """The installed distributions that ``reqs`` need here, transitively (markers and extras evaluated)."""
    seen: dict[str, md.Distribution] = {}
    stack = [Requirement(r) for r in reqs]
    extras_seen: set[tuple[str, str]] = set()
    while stack:
        req = stack.pop()
        name = canonicalize_name(req.name)
        if name.startswith("vexact"):
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        new_extras = {e for e in req.extras if (name, e) not in extras_seen}
        if name in seen and not new_extras:
            continue
        extras_seen |= {(name, e) for e in req.extras}
        dist = seen.setdefault(name, md.distribution(req.name))
        for r in dist.requires or []:
            rr = Requirement(r)
            envs = [{"extra": e} for e in [""] + sorted(new_extras)]
            if rr.marker is None or any(rr.marker.evaluate(e) for e in envs):
                stack.append(Requirement(str(rr).split(";")[0]))
    return list(seen.values())


def provide(dists: list[md.Distribution], folder: Path) -> None:
    """Link every top-level file or folder of each distribution (its code and its .dist-info) into ``folder``."""
    folder.mkdir()
    for dist in dists:
        base = Path(dist.locate_file(""))
        assert dist.files, f"{dist.metadata['Name']} lists no files (no RECORD): cannot provide it"
        for top in {f.parts[0] for f in dist.files if f.parts[0] not in ("..", "__pycache__")}:
            link = folder / top
            if not link.exists() and (base / top).exists():
                link.symlink_to(base / top)


@pytest.mark.slow
@pytest.mark.parametrize("dist", PACKAGES)
def test_package_installs_alone_and_its_readme_snippet_runs(dist, tmp_path):
    command, snippet = readme_blocks(dist)
    args = shlex.split(command[len(PIP_INSTALL) :])
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    try:
        build = closure(["hatchling"])
    except md.PackageNotFoundError:
        pytest.fail("hatchling builds the packages here: python -m pip install -r requirements/test.txt")
    provide(closure(local_requirements(args)) + build, tmp_path / "provided")
    (site / "provided.pth").write_text(str(tmp_path / "provided") + "\n")
    # the venv sees only itself and the provided folder: no PYTHONPATH, no user site, no pip configuration
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_", "VIRTUAL_ENV"))}
    env.update(PIP_CONFIG_FILE=os.devnull, PYTHONNOUSERSITE="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index", "--no-build-isolation"]
    out = subprocess.run(pip + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{command}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    installed = sorted(p.name for p in site.iterdir() if not p.name.startswith(("_", "provided.pth")))
    assert all(n.startswith("vexact") for n in installed), f"pip installed more than the local packages: {installed}"
    run = subprocess.run(
        [python, "-c", snippet], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )  # fmt: skip
    assert run.returncode == 0, f"{dist}/README.md snippet failed:\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"


def test_closure_follows_markers_and_extras():
    names = {canonicalize_name(d.metadata["Name"]) for d in closure(["torch>=2.11", "vexact-kernels"])}
    assert "torch" in names and "sympy" in names and not any(n.startswith("vexact") for n in names)
