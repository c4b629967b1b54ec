"""``vexact`` command line."""

from __future__ import annotations

import argparse
import sys

from .args import DTYPES, UsageError, check_dtypes, check_model, check_positive, parser


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
