"""``vexact tim``: rescoring our engine's rollouts (exactly 0 on the invariant backend, --expect-exact fails on a
perturbed input), bad rows, and per-op-family attribution (each family's fast kernel alone moves the logprobs)."""

from __future__ import annotations

import json

import pytest
import torch

import vexact_kernels as vk
from vexact.cli import main
from vexact.tim import attribute, default_families
from vexact_engine import LLM, SamplingParams
from vexact_models import default_checkpoint, load_config
from vexact_trainer import rollouts_from_outputs, rollouts_to_jsonl


@pytest.fixture(scope="module")
def invariant_rollouts(tmp_path_factory):
    llm = LLM(default_checkpoint(), max_num_seqs=4, max_num_batched_tokens=64)
    outs = llm.generate([[17, 42, 7, i] for i in range(4)], SamplingParams(temperature=0.9, max_tokens=8, seed=1))
    path = tmp_path_factory.mktemp("tim") / "invariant.jsonl"
    rollouts_to_jsonl(rollouts_from_outputs(outs, 0.9), path)
    return path


def test_invariant_rollouts_rescore_exactly_and_a_perturbed_one_fails_expect_exact(invariant_rollouts, tmp_path):
    assert main(["tim", "rescore", str(invariant_rollouts), "--out", str(tmp_path / "a"), "--expect-exact"]) == 0
    s = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert s["exact"] and s["tokens"] == 32 and s["k3_kl"] == 0.0 and s["greedy"]["available"]
    rows = [json.loads(line) for line in invariant_rollouts.read_text().splitlines()]
    lp = torch.tensor(rows[2]["logprobs"][5], dtype=torch.float32)
    rows[2]["logprobs"][5] = float(torch.nextafter(lp, torch.tensor(0.0)))  # one fp32 ulp
    bad = tmp_path / "perturbed.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "b"
    assert main(["tim", "rescore", str(bad), "--out", str(out), "--expect-exact", "--no-top1"]) == 1
    s = json.loads((out / "summary.json").read_text())
    assert s["tokens_differ"] == 1 and s["worst_sequences"][0]["row"] == "perturbed.jsonl:3"
    assert s["by_position"][2]["tokens_differ"] == 1  # position 5 is in [4, 16)
    assert (out / "report.html").read_text().count("data:image/png;base64,") == 4


def test_bad_row_exits_2_naming_it_and_skip_bad_reports_the_rest(invariant_rollouts, tmp_path, capsys):
    rows = [json.loads(line) for line in invariant_rollouts.read_text().splitlines()]
    rows[1]["token_ids"] = rows[1]["token_ids"][:-1]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["tim", "rescore", str(bad), "--out", str(tmp_path / "x"), "--no-top1"]) == 2
    assert "bad.jsonl:2: 7 response tokens but 8 logprobs" in capsys.readouterr().err
    out = tmp_path / "y"
    assert main(["tim", "rescore", str(bad), "--out", str(out), "--no-top1", "--skip-bad", "--expect-exact"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["sequences"] == 3 and s["input"]["skipped_rows"] == ["bad.jsonl:2: 7 response tokens but 8 logprobs"]


def test_each_op_family_alone_moves_the_logprobs_and_all_invariant_is_exact():
    # On CPU, fp32 shows every family but rotary (the same fp32 arithmetic on both backends); rotary's fast kernel is
    # transformers' bf16 arithmetic, seen in bf16 (where MKL's bf16 GEMM rounds like the invariant one).
    dense = [f for f in vk.OPS if f not in ("moe", "rotary")]
    rows = {r["family"]: r for r in attribute(default_checkpoint(), dense, "trainer", 4, 100, 12, dtype="float32")}
    assert rows["none"]["tokens_differ"] == 0 and rows["none"]["k3_kl"] == 0.0
    for f in dense + ["all"]:
        assert rows[f]["tokens_differ"] > 0, f
    assert sum(rows[f]["share_of_k3"] for f in dense) == pytest.approx(1.0)
    rows = {r["family"]: r for r in attribute(default_checkpoint(), ["rotary"], "trainer", 2, 16, 8)}
    assert rows["none"]["tokens_differ"] == 0 and rows["rotary"]["tokens_differ"] > 0
    moe = {r["family"]: r for r in attribute(default_checkpoint("qwen3_moe"), ["moe"], "trainer", 2, 8, 8)}
    assert moe["none"]["tokens_differ"] == 0 and moe["moe"]["tokens_differ"] > 0


def test_engine_mode_attribution_regenerates_with_each_backend():
    rows = {r["family"]: r for r in attribute(default_checkpoint(), ["attention"], "engine", 4, 8, 8)}
    assert rows["none"]["tokens_differ"] == 0 and rows["none"]["k3_kl"] == 0.0
    assert rows["attention"]["tokens_differ"] > 0 and rows["all"]["tokens_differ"] > 0


def test_injected_logit_noise_grows_from_exactly_zero():
    from vexact_trainer import Actor, compare, rescore

    k3 = []
    for kw in ({}, {"logit_noise_std": 0.01}, {"logit_noise_std": 0.3}, {"lm_head_dtype": "bfloat16"}):
        llm = LLM(default_checkpoint(), max_num_seqs=4, max_num_batched_tokens=64, **kw)
        outs = llm.generate([[3, 4, i] for i in range(4)], SamplingParams(temperature=1.0, max_tokens=8, seed=2))
        ro = rollouts_from_outputs(outs, 1.0)
        k3.append(compare(ro, rescore(Actor(llm.model), ro, with_top1=False, progress=False))["k3_kl"])
    assert k3[0] == 0.0 and 0.0 < k3[1] < k3[2] and k3[3] > 0.0
    with pytest.raises(ValueError, match="logit_noise_std must be a finite number >= 0, got -1"):
        LLM(default_checkpoint(), logit_noise_std=-1)
    with pytest.raises(ValueError, match="lm_head_dtype must be one of"):
        LLM(default_checkpoint(), lm_head_dtype="int8")


def test_mismatch_injection_is_an_object_apart_from_the_serving_config():
    from vexact_engine import EngineConfig, MismatchInjection

    prompts, params = [[3, 4, i] for i in range(4)], SamplingParams(temperature=1.0, max_tokens=8, seed=2)
    by_keyword = LLM(default_checkpoint(), max_num_seqs=4, max_num_batched_tokens=64, logit_noise_std=0.3)
    by_object = LLM(default_checkpoint(), max_num_seqs=4, max_num_batched_tokens=64,
                    mismatch=MismatchInjection(logit_noise_std=0.3))  # fmt: skip
    a, b = by_keyword.generate(prompts, params, use_tqdm=False), by_object.generate(prompts, params, use_tqdm=False)
    assert all(x.token_ids == y.token_ids and torch.equal(x.logprobs, y.logprobs) for x, y in zip(a, b, strict=True))
    assert by_object.mismatch == MismatchInjection(logit_noise_std=0.3)
    assert LLM(default_checkpoint(), mismatch=MismatchInjection()).mismatch is None  # all off: the serving path
    with pytest.raises(TypeError, match="not both"):
        LLM(default_checkpoint(), mismatch=MismatchInjection(), logit_noise_std=0.1)
    with pytest.raises(TypeError):
        EngineConfig(logit_noise_std=0.1)  # serving settings only


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_moe", "deepseek_v3"])
def test_attribute_default_families_follow_the_model(family):
    """Without --ops, every op family the model runs: moe only for the families with routed experts (a dense config
    has no expert count at all, which once crashed the default)."""
    fams = default_families(load_config(default_checkpoint(family)))
    assert ("moe" in fams) == (family in ("qwen3_moe", "deepseek_v3"))
    assert set(fams) - {"moe"} == set(vk.OPS) - {"moe"}
