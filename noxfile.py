"""nox sessions: tests (CPU suite), demo, lint, docs (the site), contracts per target (cpu, h100, h200, b200), and the
GPU check steps of ``scripts/checks/gpu_checks.sh`` per GPU target.

GPU targets run offline on the device's preinstalled CUDA torch: a venv with system site packages and the
packages put on PYTHONPATH, so nothing is downloaded or built there.
"""

import site
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).parent
TARGETS = ["cpu", "h100", "h200", "b200"]
GPU_TARGETS = TARGETS[1:]
DEVICE_ENV, GPU_CHECKS = "scripts/staging/device_env.sh", "scripts/checks/gpu_checks.sh"
SRC_PATHS = [str(p) for p in sorted(ROOT.glob("packages/*/src"))] + [str(ROOT / "src"), str(ROOT)]

nox.options.sessions = ["lint", "tests"]
nox.options.default_venv_backend = "venv"


@nox.session
def tests(session):
    """The whole CPU test suite (package tests + contracts for target cpu)."""
    session.install("-r", "requirements/test.txt")
    session.run("python", "-m", "pytest", "-n", "auto", *session.posargs)


@nox.session
def demo(session):
    """Engine rollouts rescored by the trainer: the mismatch table for the invariant and fast backends."""
    session.install("-r", "requirements/cpu.txt")
    session.run("python", "-m", "vexact", "demo", *session.posargs)


@nox.session
def lint(session):
    session.install("-r", "requirements/lint.txt")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def docs(session):
    """The docs site from docs/ and mkdocs.yml, with every warning an error (broken links and anchors included)."""
    session.install("-r", "requirements/docs.txt")
    session.env["NO_MKDOCS_2_WARNING"] = "1"
    session.run("mkdocs", "build", "--strict", *session.posargs)


@nox.session(venv_params=["--system-site-packages"])
@nox.parametrize("target", TARGETS)
def contracts(session, target):
    """The contract suite for one target. GPU targets: offline, on the machine's own CUDA torch."""
    if target == "cpu":
        session.install("-r", "requirements/test.txt")
    else:
        # The device's torch may itself live in a venv, which --system-site-packages does not reach: put the
        # site-packages of the interpreter running nox behind the sources.
        host = [p for p in sys.path if p.endswith("site-packages")] + site.getsitepackages()
        session.env["PYTHONPATH"] = ":".join(SRC_PATHS + host)
        session.env["PIP_NO_INDEX"] = "1"
    session.env["VEXACT_TARGET"] = target
    session.run("python", "-m", "pytest", "contracts", "--target", target, *session.posargs)


@nox.session(venv_backend="none")
@nox.parametrize("target", GPU_TARGETS)
def gpu_checks(session, target):
    """The GPU check steps of scripts/checks/gpu_checks.sh on this machine, e.g. ``nox -s "gpu_checks(target='h100')" --
    golden contracts`` (results under $OUT), after ``source scripts/staging/device_env.sh``. Runs on the machine's own
    interpreter and packages, as the script does."""
    if not session.posargs:
        session.error(f"name the steps after --, e.g. nox -s \"gpu_checks(target='{target}')\" -- golden contracts")
    script = f'source {DEVICE_ENV} && exec bash {GPU_CHECKS} "$@"'
    session.run("bash", "-c", script, "gpu_checks", target, *session.posargs, external=True)
