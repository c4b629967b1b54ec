"""Write a small verifiable arithmetic dataset as verl parquet files (no hub download).

Each row asks for a sum or product of two numbers and is scored by verl's own GSM8K rule (``data_source`` =
``openai/gsm8k``: the last ``#### <number>`` in the response must equal the answer), so no custom reward code is
needed. ``python examples/verl_grpo/make_dataset.py --out data/arith`` writes ``train.parquet`` and ``test.parquet``.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pandas as pd

INSTRUCTION = "Give only the final answer after '#### ', like '#### 42'."


def make_rows(n: int, seed: int, split: str) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        op = rng.choice(["+", "*"])
        answer = a + b if op == "+" else a * b
        question = f"What is {a} {op} {b}? {INSTRUCTION}"
        rows.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": question}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(answer)},
                "extra_info": {"split": split, "index": i, "question": question, "answer": str(answer)},
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=Path("data/arith"))
    ap.add_argument("--train", type=int, default=2048, help="training rows")
    ap.add_argument("--test", type=int, default=128, help="validation rows")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.train < 1 or args.test < 1:
        raise ValueError(f"--train and --test must be >= 1, got {args.train} and {args.test}")
    args.out.mkdir(parents=True, exist_ok=True)
    for split, n, seed in (("train", args.train, args.seed), ("test", args.test, args.seed + 1)):
        path = args.out / f"{split}.parquet"
        pd.DataFrame(make_rows(n, seed, split)).to_parquet(path)
        print(f"wrote {n} rows to {path}")


if __name__ == "__main__":
    main()
