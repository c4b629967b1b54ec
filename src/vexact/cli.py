"""``vexact`` command line."""

from __future__ import annotations

import argparse
import sys
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


def build_parser() -> argparse.ArgumentParser:
    ap = parser(description="VeXact: zero training-inference mismatch for LLM RL")
    sub = ap.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="roll out with the engine, rescore with the trainer, report the mismatch",
        description="Per model dtype, the engine samples rollouts and the trainer rescores them, once on the "
        "invariant kernels and once on the fast ones; a table shows the mismatch of each.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    demo.add_argument("--model", default=None, help="HF checkpoint dir; unset: the bundled tiny Qwen3")
    demo.add_argument("--prompts", type=int, default=64, help="number of rollouts per run")
    demo.add_argument("--max-tokens", type=int, default=48, help="tokens generated per rollout")
    demo.add_argument("--dtypes", default="bfloat16,float32", help=f"comma-separated model dtypes, of {DTYPES}")
    demo.add_argument("--seed", type=int, default=0, help="the prompts' and the sampling's seed")
    from .tim import add_parser as add_tim

    add_tim(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "demo":
            model, dtypes = check_model(args.model), check_dtypes(args.dtypes)
            check_positive(args, "prompts", "max_tokens")
            from .demo import run_demo

            return run_demo(model, args.prompts, args.max_tokens, dtypes, args.seed)
        from .tim import main as tim_main

        return tim_main(args)
    except UsageError as e:
        print(f"vexact: error: {e}", file=sys.stderr)
        return 2
