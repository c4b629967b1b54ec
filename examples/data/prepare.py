"""Write a public RL dataset in verl's parquet layout: ``prepare.py NAME --out DIR [--from FILE] [--split SPLIT]``.

NAME is one of the datasets below. Without ``--from`` the dataset is loaded by its hub name with ``datasets`` (needs
internet) and every split it has is written; with ``--from`` a local file in the dataset's own schema (``.json``,
``.jsonl`` or ``.parquet``, the columns the hub copy has) becomes one split (``--split``, default the dataset's first).
Output: ``DIR/NAME/<split>.parquet``, one row per problem with verl's columns: ``data_source`` (the string
``verl.utils.reward_score.default_compute_score`` routes to verl's own scorer for that dataset), ``prompt`` (one user
message in chat form, with the answer format that scorer reads), ``ability``, ``reward_model`` (``style: rule`` and
``ground_truth``) and ``extra_info`` (split, index, the problem and its answer).

| NAME      | hub name                          | splits      | data_source                          | verl scorer     |
| --------- | --------------------------------- | ----------- | ------------------------------------ | --------------- |
| gsm8k     | openai/gsm8k (config main)        | train, test | openai/gsm8k                         | gsm8k (####)    |
| math      | DigitalLearningGmbH/MATH-lighteval| train, test | DigitalLearningGmbH/MATH-lighteval   | math_reward     |
| dapo_math | BytedTsinghua-SIA/DAPO-Math-17k   | train       | math_dapo                            | math_dapo       |
| aime24    | Maxwell-Jia/AIME_2024             | test        | aime24                               | math_dapo       |
| aime25    | math-ai/aime25                    | test        | aime25                               | math_dapo       |

DAPO-Math-17k is already in verl's layout; its hub copy repeats each problem many times, and the copy written here
keeps each prompt once. The AIME sets are validation sets (their only split is written as ``test``).

``examples/data/samples/NAME.jsonl`` holds 16 problems of our own in each source schema, so that this script and the
recipes (examples/recipes/) run offline: ``python examples/data/prepare.py gsm8k --out data --from
examples/data/samples/gsm8k.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

GSM8K_FORMAT = "Think step by step, then give the final answer as a number on the last line after '#### '."
MATH_FORMAT = "Think step by step and put the final answer in \\boxed{}."
ANSWER_FORMAT = "Think step by step. The last line of your response must read 'Answer: X', where X is the final answer."


@dataclass(frozen=True)
class Source:
    hub: str
    config: str | None
    splits: dict[str, str]  # the split written -> the hub's split
    columns: tuple[str, ...]  # the source schema's columns this script reads (matched case-insensitively)
    data_source: str


SOURCES = {
    "gsm8k": Source("openai/gsm8k", "main", {"train": "train", "test": "test"}, ("question", "answer"), "openai/gsm8k"),
    "math": Source(
        "DigitalLearningGmbH/MATH-lighteval",
        None,
        {"train": "train", "test": "test"},
        ("problem", "solution"),
        "DigitalLearningGmbH/MATH-lighteval",
    ),
    "dapo_math": Source(
        "BytedTsinghua-SIA/DAPO-Math-17k", None, {"train": "train"}, ("prompt", "reward_model"), "math_dapo"
    ),
    "aime24": Source("Maxwell-Jia/AIME_2024", None, {"test": "train"}, ("problem", "answer"), "aime24"),
    "aime25": Source("math-ai/aime25", None, {"test": "test"}, ("problem", "answer"), "aime25"),
}


def gsm8k_row(r: dict) -> tuple[str, str]:
    """(prompt text, ground truth): the number after GSM8K's final ``####``, as verl's gsm8k scorer compares it."""
    if "####" not in r["answer"]:
        raise ValueError(f"gsm8k answer has no '#### <number>' line: {r['answer']!r}")
    truth = r["answer"].rsplit("####", 1)[1].strip().replace(",", "")
    return f"{r['question']} {GSM8K_FORMAT}", truth


def math_row(r: dict) -> tuple[str, str]:
    """The last ``\\boxed{}`` of the reference solution, taken out as verl's math scorer takes out the response's."""
    from verl.utils.reward_score.math_reward import last_boxed_only_string, remove_boxed

    boxed = last_boxed_only_string(r["solution"])
    if boxed is None:
        raise ValueError(f"MATH solution has no \\boxed{{}} answer: {r['solution'][-200:]!r}")
    return f"{r['problem']} {MATH_FORMAT}", remove_boxed(boxed)


def aime_row(r: dict) -> tuple[str, str]:
    return f"{ANSWER_FORMAT}\n\n{r['problem']}", str(r["answer"]).strip()


ROWS = {"gsm8k": gsm8k_row, "math": math_row, "aime24": aime_row, "aime25": aime_row}


def to_verl(name: str, df: pd.DataFrame, split: str, origin: str) -> pd.DataFrame:
    """The source rows ``df`` (``origin`` names where they came from, for errors) in verl's layout."""
    src = SOURCES[name]
    df = df.rename(columns={c: c.lower() for c in df.columns if isinstance(c, str)})
    missing = [c for c in src.columns if c not in df.columns]
    if missing:
        raise ValueError(
            f"{origin} has columns {list(df.columns)}; {name} needs {list(src.columns)} (missing {missing})"
        )
    rows = []
    if name == "dapo_math":
        df = df.drop_duplicates(subset="prompt", keep="first", ignore_index=True) if len(df) else df
    for i, r in enumerate(df.to_dict("records")):
        if name == "dapo_math":
            prompt, truth = _dapo_prompt(r, origin, i), str(r["reward_model"]["ground_truth"])
            question = prompt[0]["content"]
        else:
            question, truth = ROWS[name](r)
            prompt = [{"role": "user", "content": question}]
        rows.append(
            {
                "data_source": src.data_source,
                "prompt": prompt,
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": truth},
                "extra_info": {"split": split, "index": i, "question": question, "answer": truth},
            }
        )
    if not rows:
        raise ValueError(f"{origin} has no rows")
    return pd.DataFrame(rows)


def _dapo_prompt(r: dict, origin: str, i: int) -> list[dict]:
    prompt = list(r["prompt"])
    if not prompt or not all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in prompt):
        raise ValueError(f"{origin} row {i}: 'prompt' must be a list of {{role, content}} messages, got {prompt!r}")
    if not isinstance(r["reward_model"], dict) or "ground_truth" not in r["reward_model"]:
        raise ValueError(f"{origin} row {i}: 'reward_model' must hold 'ground_truth', got {r['reward_model']!r}")
    return [{"role": m["role"], "content": m["content"]} for m in prompt]


def read_local(path: Path) -> pd.DataFrame:
    if not path.is_file():
        raise FileNotFoundError(f"--from {path}: no such file")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return pd.read_parquet(path)
    if suffix == ".jsonl":
        return pd.read_json(path, lines=True, dtype=False)
    if suffix == ".json":
        return pd.DataFrame(json.loads(path.read_text()))
    raise ValueError(f"--from {path}: unknown file type {suffix!r}; use .json, .jsonl or .parquet")


def read_hub(name: str, hub_split: str) -> pd.DataFrame:
    import datasets

    src = SOURCES[name]
    try:
        return datasets.load_dataset(src.hub, src.config, split=hub_split).to_pandas()
    except Exception as e:  # no internet, no such dataset: say which, and the offline way
        raise RuntimeError(
            f"could not load {src.hub} (split {hub_split}) with datasets: {type(e).__name__}: {e}. "
            f"Without internet, pass a local copy: --from FILE (json, jsonl or parquet, columns {list(src.columns)})"
        ) from e


def prepare(name: str, out: Path, local: Path | None = None, split: str | None = None) -> list[Path]:
    """Write ``out/name/<split>.parquet`` for each split (the one ``split`` given, or all the dataset has)."""
    if name not in SOURCES:
        raise ValueError(f"unknown dataset {name!r}; choose from {sorted(SOURCES)}")
    src = SOURCES[name]
    if split is not None and split not in src.splits:
        raise ValueError(f"{name} has no split {split!r}; it has {list(src.splits)}")
    splits = [split] if split else ([next(iter(src.splits))] if local else list(src.splits))
    written = []
    for s in splits:
        if local is not None:
            df = to_verl(name, read_local(local), s, str(local))
        else:
            df = to_verl(name, read_hub(name, src.splits[s]), s, f"{src.hub}[{src.splits[s]}]")
        path = out / name / f"{s}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        df.to_parquet(path)
        print(f"wrote {len(df)} rows to {path} (data_source {src.data_source})")
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", help=f"the dataset: {', '.join(SOURCES)}")
    ap.add_argument("--out", type=Path, required=True, help="data root: writes OUT/NAME/<split>.parquet")
    ap.add_argument("--from", dest="local", type=Path, help="a local file in the source schema (no hub access)")
    ap.add_argument("--split", help="the split to write (with --from: the split the file becomes)")
    args = ap.parse_args(argv)
    try:
        prepare(args.name, args.out, args.local, args.split)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"prepare.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
