"""``vexact`` command line."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="vexact", description="VeXact: zero training-inference mismatch for LLM RL")
    sub = ap.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="roll out with the engine, rescore with the trainer, report the mismatch")
    demo.add_argument("--model", default=None, help="HF checkpoint dir (default: the bundled tiny Qwen3)")
    demo.add_argument("--prompts", type=int, default=64, help="number of rollouts per run")
    demo.add_argument("--max-tokens", type=int, default=48, help="tokens generated per rollout")
    demo.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated model dtypes to run")
    demo.add_argument("--seed", type=int, default=0)
    from .tim import add_parser as add_tim

    add_tim(sub)
    args = ap.parse_args(argv)
    if args.command == "demo":
        from .demo import run_demo

        return run_demo(args.model, args.prompts, args.max_tokens, args.dtypes.split(","), args.seed)
    if args.command == "tim":
        from .tim import main as tim_main

        return tim_main(args)
    return 2
