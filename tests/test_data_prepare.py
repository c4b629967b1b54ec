"""examples/data/prepare.py: every committed sample becomes verl's parquet layout, its ``data_source`` routes to verl's
own scorer (``default_compute_score``), which gives a right answer in the prompt's format full marks and a wrong one
none; the hub path asks ``datasets`` for the right name and splits; bad input is refused naming the value."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pd = pytest.importorskip("pandas")
pytest.importorskip("verl", reason="verl is not installed: pip install 'vexact-verl[verl]'")

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "examples/data/samples"
# per dataset: (its split from a sample, the data_source, a response in the prompt's answer format)
EXPECT = {
    "gsm8k": ("train", "openai/gsm8k", "so the total is {} apples.\n#### {}"),
    "math": ("train", "DigitalLearningGmbH/MATH-lighteval", "which gives {} and so \\boxed{{{}}}"),
    "dapo_math": ("train", "math_dapo", "that is {}.\nAnswer: {}"),
    "aime24": ("test", "aime24", "that is {}.\nAnswer: {}"),
    "aime25": ("test", "aime25", "that is {}.\nAnswer: {}"),
}


def _prepare_module():
    spec = importlib.util.spec_from_file_location("examples_data_prepare", ROOT / "examples/data/prepare.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks its module up there
    spec.loader.exec_module(mod)
    return mod


prepare = _prepare_module()


def _score(row, response: str) -> float:
    from verl.utils.reward_score import default_compute_score

    s = default_compute_score(row.data_source, response, row.reward_model["ground_truth"])
    return s["score"] if isinstance(s, dict) else s


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_sample_is_verl_layout_scored_by_verls_own_rule(name, tmp_path):
    split, source, fmt = EXPECT[name]
    (path,) = prepare.prepare(name, tmp_path, SAMPLES / f"{name}.jsonl")
    assert path == tmp_path / name / f"{split}.parquet"
    df = pd.read_parquet(path)
    assert len(df) == 16
    assert list(df.columns) == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    truths = set()
    for row in df.itertuples():
        assert row.data_source == source
        (msg,) = row.prompt
        assert msg["role"] == "user" and len(msg["content"]) > 20
        truth = row.reward_model["ground_truth"]
        assert truth and row.reward_model["style"] == "rule" and row.extra_info["split"] == split
        truths.add(truth)
        assert _score(row, fmt.format("x", truth)) == 1.0, (name, truth)
        wrong = str(int(truth) + 1) if truth.lstrip("-").isdigit() else "7919"
        assert _score(row, fmt.format("x", wrong)) < 1.0, (name, truth)
    assert len(truths) > 8  # answers differ from row to row


def test_a_local_file_becomes_the_split_asked(tmp_path):
    (path,) = prepare.prepare("gsm8k", tmp_path, SAMPLES / "gsm8k.jsonl", split="test")
    assert path == tmp_path / "gsm8k/test.parquet"
    assert set(pd.read_parquet(path).extra_info.map(lambda e: e["split"])) == {"test"}


def test_parquet_and_json_read_as_jsonl(tmp_path):
    src = pd.read_json(SAMPLES / "math.jsonl", lines=True)
    src.to_parquet(tmp_path / "m.parquet")
    src.to_json(tmp_path / "m.json", orient="records")
    want = pd.read_parquet(prepare.prepare("math", tmp_path / "a", SAMPLES / "math.jsonl")[0])
    for f in ("m.parquet", "m.json"):
        got = pd.read_parquet(prepare.prepare("math", tmp_path / f"out-{f}", tmp_path / f)[0])
        assert got.reward_model.tolist() == want.reward_model.tolist()


def test_hub_path_loads_each_split_by_name(tmp_path, monkeypatch):
    import datasets

    calls = []
    hub_to_sample = {prepare.SOURCES[n].hub: SAMPLES / f"{n}.jsonl" for n in prepare.SOURCES}

    def fake_load_dataset(path, name=None, split=None):  # the hub's copy: our sample in its schema
        calls.append((path, name, split))
        return datasets.Dataset.from_pandas(pd.read_json(hub_to_sample[path], lines=True, dtype=False))

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    paths = prepare.prepare("gsm8k", tmp_path)
    assert calls == [("openai/gsm8k", "main", "train"), ("openai/gsm8k", "main", "test")]
    assert paths == [tmp_path / "gsm8k/train.parquet", tmp_path / "gsm8k/test.parquet"]
    calls.clear()
    assert prepare.prepare("aime24", tmp_path) == [tmp_path / "aime24/test.parquet"]  # its only split, "train"
    assert prepare.prepare("aime25", tmp_path) == [tmp_path / "aime25/test.parquet"]
    assert prepare.prepare("math", tmp_path, split="test") == [tmp_path / "math/test.parquet"]
    assert calls == [("Maxwell-Jia/AIME_2024", None, "train"), ("math-ai/aime25", None, "test"),
                     ("DigitalLearningGmbH/MATH-lighteval", None, "test")]  # fmt: skip


def test_dapo_math_keeps_each_prompt_once(tmp_path):
    src = pd.read_json(SAMPLES / "dapo_math.jsonl", lines=True, dtype=False)
    pd.concat([src, src, src]).to_parquet(tmp_path / "dup.parquet")
    assert len(pd.read_parquet(prepare.prepare("dapo_math", tmp_path, tmp_path / "dup.parquet")[0])) == 16


def test_bad_input_is_refused_naming_the_value(tmp_path, capsys, monkeypatch):
    import datasets

    with pytest.raises(ValueError, match="unknown dataset 'gsm9k'; choose from"):
        prepare.prepare("gsm9k", tmp_path)
    with pytest.raises(FileNotFoundError, match="nope.jsonl: no such file"):
        prepare.prepare("gsm8k", tmp_path, tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match=r"math.jsonl has columns \['problem', 'level', 'type', 'solution'\]; gsm8k "
                       r"needs \['question', 'answer'\]"):  # fmt: skip
        prepare.prepare("gsm8k", tmp_path, SAMPLES / "math.jsonl")
    with pytest.raises(ValueError, match="aime24 has no split 'train'"):
        prepare.prepare("aime24", tmp_path, SAMPLES / "aime24.jsonl", split="train")

    def offline(*a, **k):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    assert prepare.main(["gsm8k", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "could not load openai/gsm8k (split train)" in err and "--from FILE" in err
    assert prepare.main(["aime26", "--out", str(tmp_path)]) == 2
    assert "unknown dataset 'aime26'" in capsys.readouterr().err
