"""Argument checks shared by the `vexact` subcommands: one line naming the bad value and what is allowed."""

from __future__ import annotations

import argparse
from pathlib import Path

DTYPES = ("bfloat16", "float16", "float32")
DEVICES = ("cpu", "cuda")


class UsageError(Exception):
    """A bad argument: :func:`main` prints its message on one line and exits 2."""


def parser(prog: str = "vexact", description: str | None = None) -> argparse.ArgumentParser:
    """An argument parser whose help shows every option's default."""
    return argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )


def check_device(name: str | None) -> str:
    """``name`` (``cpu`` or ``cuda``; None: cuda when available) after checking this machine has it."""
    import torch

    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name not in DEVICES:
        raise UsageError(f"--device {name!r}: expected one of {', '.join(DEVICES)}")
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: this machine has no CUDA device (torch.cuda.is_available() is False); use cpu")
    return name


def check_dtypes(value: str) -> list[str]:
    """A comma-separated list of model dtypes, each one of :data:`DTYPES`."""
    names = [v.strip() for v in value.split(",")]
    bad = [n for n in names if n not in DTYPES]
    if bad or not names:
        raise UsageError(f"--dtypes {value!r}: {', '.join(map(repr, bad))} not allowed; expected one of {DTYPES}")
    return names


def check_model(path: str | None) -> Path | None:
    """A checkpoint directory (with a config.json), or None for the bundled tiny model."""
    if path is None:
        return None
    if not (Path(path) / "config.json").is_file():
        raise UsageError(f"--model {path!r}: not a checkpoint directory (no config.json there)")
    return Path(path)


def check_positive(args: argparse.Namespace, *names: str) -> None:
    """Each named integer option is >= 1."""
    for name in names:
        value = getattr(args, name)
        if value < 1:
            raise UsageError(f"--{name.replace('_', '-')} {value}: must be >= 1")


def check_file(path: str, what: str) -> Path:
    if not Path(path).is_file():
        raise UsageError(f"{what} {path!r}: no such file")
    return Path(path)
