"""Repo-wide pytest options: ``--target`` selects which contract target (cpu, h100, h200, b200) runs."""

import os

TARGETS = ("cpu", "h100", "h200", "b200")


def pytest_addoption(parser):
    parser.addoption(
        "--target",
        default=os.environ.get("VEXACT_TARGET", "cpu"),
        choices=TARGETS,
        help="contract target (default: $VEXACT_TARGET or cpu)",
    )
