"""TIM diagnostics: converters (files written by the real library where installed), metrics against hand-computed
values, bad input naming the row, the HTML report."""

from __future__ import annotations

import base64
import json
import math
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

from vexact_trainer import (
    BadRolloutError,
    Rescored,
    Rollout,
    k3_kl,
    load_rollouts,
    rollouts_to_jsonl,
    tim_metrics,
    tim_token_metrics,
)
from vexact_trainer.tim import compare, write_report

DATA = Path(__file__).parent / "data"


def _rollouts():
    return [
        Rollout([1, 2], [3, 4, 5], torch.tensor([-1.0, -0.5, -2.0]), 0.7, "r0"),
        Rollout([6], [7], torch.tensor([-0.25]), 1.0, "r1"),
    ]


def test_metrics_match_hand_computed_values():
    eng = [torch.tensor([-1.0, -0.5, -2.0]), torch.tensor([-0.25])]
    tr = [torch.tensor([-1.0, -0.75, -1.5]), torch.tensor([-0.25])]
    s = tim_metrics(eng, tr)
    d = [0.0, -0.25, 0.5, 0.0]  # trainer - engine
    assert s["tokens"] == 4 and s["tokens_differ"] == 2 and s["fraction_differ"] == 0.5
    assert s["sequences_differ"] == 1 and not s["exact"]
    assert s["abs_delta"]["max"] == 0.5 and s["abs_delta"]["mean"] == pytest.approx(0.1875)
    assert s["k1_kl"] == pytest.approx(-sum(d) / 4)
    assert s["k3_kl"] == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 4)
    assert s["chi2"] == pytest.approx(sum((math.exp(x) - 1) ** 2 for x in d) / 4)
    assert s["log_ppl_engine"] == pytest.approx(3.75 / 4) and s["log_ppl_trainer"] == pytest.approx(3.5 / 4)
    assert s["log_ppl_diff"] == pytest.approx(s["log_ppl_trainer"] - s["log_ppl_engine"])
    assert s["log_ppl_diff_seq_mean"] == pytest.approx((-0.25 / 3 + 0.0) / 2)
    pos = {r["bucket"]: r for r in s["by_position"]}
    assert pos["[0, 1)"]["tokens"] == 2 and pos["[0, 1)"]["tokens_differ"] == 0
    assert pos["[1, 4)"]["tokens"] == 2 and pos["[1, 4)"]["tokens_differ"] == 2
    prob = {r["bucket"]: r["tokens"] for r in s["by_probability"]}  # exp(-2)=0.135, exp(-1)=0.37, 0.61, 0.78
    assert prob["[0.1, 0.5)"] == 2 and prob["[0.5, 0.9)"] == 2 and sum(prob.values()) == 4
    assert [w["row"] for w in s["worst_sequences"]] == ["sequence 0", "sequence 1"]
    assert s["worst_sequences"][0]["max_abs_delta"] == 0.5


def test_identical_logprobs_are_exact_zero_and_one_ulp_is_not():
    x = [torch.tensor([-1.0, -3.0])]
    s = tim_metrics(x, [x[0].clone()])
    assert s["exact"] and s["k3_kl"] == 0.0 and s["k1_kl"] == 0.0 and s["chi2"] == 0.0
    y = [torch.nextafter(x[0], torch.zeros(2))]  # one fp32 ulp towards 0
    s = tim_metrics(x, y)
    assert not s["exact"] and s["tokens_differ"] == 2


def test_per_sequence_statistics_equal_a_mask_per_sequence_bitwise():
    # each sequence's statistics read its slice of the concatenation: the same values, to the bit, as selecting its
    # tokens with a mask over all of them; uneven lengths and an empty sequence included
    g = torch.Generator().manual_seed(0)
    lens = [1000, 0, 3, 257, 1, 64, 999]
    eng = [-5 * torch.rand(n, generator=g) for n in lens]
    tr = [
        x + 1e-3 * torch.randn(n, generator=g) * (torch.rand(n, generator=g) < 0.3)
        for n, x in zip(lens, eng, strict=True)
    ]
    s = tim_metrics(eng, tr, worst=len(lens))
    a = torch.cat(eng).double()
    b = torch.cat(tr).double()
    seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    d = b - a
    rows = {r["index"]: r for r in s["worst_sequences"]}
    for i, n in enumerate(lens):
        sel = seq == i
        assert rows[i]["tokens"] == n and rows[i]["tokens_differ"] == int((a != b)[sel].sum())
        if n:
            assert rows[i]["max_abs_delta"] == float(d.abs()[sel].max())
            assert rows[i]["mean_abs_delta"] == float(d.abs()[sel].mean())
            assert rows[i]["k3_kl"] == float(k3_kl(d)[sel].mean())
            assert rows[i]["log_ppl_diff"] == float((a - b)[sel].mean())
    seq_means = [(a - b)[seq == i].mean() for i, n in enumerate(lens) if n]
    assert s["log_ppl_diff_seq_mean"] == float(torch.stack(seq_means).mean())
    assert s["sequences_differ"] == sum(bool((a != b)[seq == i].any()) for i in range(len(lens)))


def test_token_metrics_are_tim_metrics_token_keys_bitwise():
    # verl's per-step tim/* read the token-level keys alone (vexact_verl.tim): the same values, to the bit, as the
    # whole summary's, on the concatenation of the sequences; equal inputs give exactly 0
    g = torch.Generator().manual_seed(1)
    lens = [1000, 0, 3, 257, 1, 64, 999]
    eng = [-5 * torch.rand(n, generator=g) for n in lens]
    tr = [x + 1e-3 * torch.randn(len(x), generator=g) * (torch.rand(len(x), generator=g) < 0.3) for x in eng]
    for engine, trainer in ((eng, tr), (eng, eng)):
        full = tim_metrics(engine, trainer, worst=0)
        tok = tim_token_metrics(torch.cat(engine), torch.cat(trainer))
        assert list(tok) == [k for k in full if k in tok] and list(tok["abs_delta"]) == ["mean", "max"]
        pairs = [(tok[k], full[k]) for k in tok if k != "abs_delta"]
        pairs += [(tok["abs_delta"][k], full["abs_delta"][k]) for k in ("mean", "max")]
        assert all(v == w and type(v) is type(w) for v, w in pairs)
    assert tim_token_metrics(torch.cat(eng), torch.cat(eng))["k3_kl"] == 0.0
    with pytest.raises(ValueError, match="engine has"):
        tim_token_metrics(torch.zeros(2), torch.zeros(3))


def test_greedy_flips_from_engine_rank_and_trainer_top1():
    eng = [torch.tensor([-0.1, -2.0, -0.2])]
    s = tim_metrics(
        eng, eng, engine_top1=[[True, False, True]], trainer_top1=[torch.tensor([5, 6, 9])], token_ids=[[5, 6, 7]]
    )
    g = s["greedy"]  # token 1: engine not top-1, trainer's top-1 is it (flip); token 2: engine top-1, trainer 9 (flip)
    assert g["flips"] == 2 and g["trainer_top1_is_sampled"] == pytest.approx(2 / 3)
    assert [f["position"] for f in g["flip_tokens"]] == [1, 2]
    g = tim_metrics(eng, eng, None, [torch.tensor([5, 6, 9])], [[5, 6, 7]])["greedy"]
    assert g["flips"] is None and "rank" in g["reason"]


def test_vexact_jsonl_round_trip_is_bit_exact(tmp_path):
    ro = _rollouts()
    ro[0].logprobs = torch.tensor([-1.0000001, -0.3333333, -2.7182817])
    rollouts_to_jsonl(ro, tmp_path / "r.jsonl")
    back, errors = load_rollouts(tmp_path / "r.jsonl", vocab_size=16)
    assert not errors and len(back) == 2
    assert all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(ro, back, strict=True))
    assert back[0].temperature == 0.7 and back[1].token_ids == [7] and back[0].row == "r.jsonl:1"


def test_vllm_sample_converts():
    ro, errors = load_rollouts(DATA / "vllm_sample.jsonl", vocab_size=272)
    assert not errors and len(ro) == 6  # 3 requests, n=2 outputs each
    assert ro[1].row == "vllm_sample.jsonl:1/outputs[1]" and ro[0].temperature == 0.8
    first = json.loads((DATA / "vllm_sample.jsonl").read_text().splitlines()[0])["outputs"][0]
    tok = first["token_ids"][0]
    assert ro[0].logprobs[0] == torch.tensor(first["logprobs"][0][str(tok)]["logprob"], dtype=torch.float32)
    assert ro[0].engine_top1 == [
        e[str(t)]["rank"] == 1 for e, t in zip(first["logprobs"], first["token_ids"], strict=True)
    ]
    raw, _ = load_rollouts(DATA / "vllm_sample.jsonl", vllm_logprobs_mode="raw")
    assert raw[0].temperature == 1.0  # vLLM's default raw_logprobs come before the temperature


def test_parquet_holds_the_same_rows(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    rows = [json.loads(line) for line in (DATA / "vllm_sample.jsonl").read_text().splitlines()]

    def plain(o):
        return [e[str(t)]["logprob"] for e, t in zip(o["logprobs"], o["token_ids"], strict=True)]

    flat = [
        {
            "prompt_token_ids": r["prompt_token_ids"],
            "temperature": 0.8,
            "outputs": [{"token_ids": o["token_ids"], "logprobs": plain(o)} for o in r["outputs"]],
        }
        for r in rows
    ]
    pq.write_table(pa.Table.from_pylist(flat), tmp_path / "r.parquet")
    a, _ = load_rollouts(tmp_path / "r.parquet")
    b, _ = load_rollouts(DATA / "vllm_sample.jsonl")
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert all(torch.equal(x.logprobs, y.logprobs) for x, y in zip(a, b, strict=True))
    assert a[0].engine_top1 is None  # plain floats carry no rank


def test_verl_dataproto_written_by_verl(tmp_path):
    protocol = pytest.importorskip("verl.protocol")
    prompts = torch.tensor([[0, 0, 11, 12], [21, 22, 23, 24]])  # left-padded
    responses = torch.tensor([[31, 32, 0], [41, 42, 43]])  # right-padded
    attn = torch.tensor([[0, 0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]])
    lp = torch.tensor([[-0.5, -1.5, 0.0], [-0.1, -0.2, -0.3]])
    data = protocol.DataProto.from_dict(
        {"prompts": prompts, "responses": responses, "attention_mask": attn, "rollout_log_probs": lp},
        meta_info={"temperature": 0.9},
    )
    data.save_to_disk(tmp_path / "batch.pkl")
    ro, _ = load_rollouts(tmp_path / "batch.pkl", vocab_size=64)
    assert [r.prompt_token_ids for r in ro] == [[11, 12], [21, 22, 23, 24]]
    assert [r.token_ids for r in ro] == [[31, 32], [41, 42, 43]]
    assert torch.equal(ro[0].logprobs, torch.tensor([-0.5, -1.5])) and ro[1].temperature == pytest.approx(0.9)
    assert ro[1].row == "batch.pkl[1]"


def test_verl_text_dump_is_refused_with_the_reason(tmp_path):
    (tmp_path / "3.jsonl").write_text(json.dumps({"input": "1+1=", "output": "2", "gts": "2", "score": 1.0, "step": 3}))
    with pytest.raises(BadRolloutError, match=r"3.jsonl:1: verl's trainer.rollout_data_dir dump holds decoded text"):
        load_rollouts(tmp_path / "3.jsonl")


@pytest.mark.parametrize(
    "row, match",
    [
        (
            {"prompt_token_ids": [1], "token_ids": [2, 3], "logprobs": [-1.0], "temperature": 1.0},
            "2 response tokens but 1",
        ),
        (
            {"prompt_token_ids": [1], "token_ids": [2, 99], "logprobs": [-1.0, -1.0], "temperature": 1.0},
            "outside the voc",
        ),
        ({"prompt_token_ids": [1], "token_ids": [2], "logprobs": [float("nan")], "temperature": 1.0}, "is nan"),
        ({"prompt_token_ids": [1], "token_ids": [2], "logprobs": [-1.0]}, "no temperature"),
        ({"prompt_token_ids": [1], "token_ids": [2], "logprobs": [-1.0], "temperature": 0.0}, "temperature 0.0"),
        ({"prompt_token_ids": [], "token_ids": [2], "logprobs": [-1.0], "temperature": 1.0}, "prompt is empty"),
        (
            {"prompt_token_ids": [1], "temperature": 1, "outputs": [{"token_ids": [2], "logprobs": [{"5": {}}]}]},
            "not in its",
        ),
    ],
)
def test_bad_rows_name_the_row_and_skip_bad_keeps_the_rest(tmp_path, row, match):
    good = {"prompt_token_ids": [1], "token_ids": [2], "logprobs": [-1.0], "temperature": 1.0}
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (good, row, good)) + "\n")
    with pytest.raises(BadRolloutError, match=f"r.jsonl:2: .*{match}"):
        load_rollouts(path, vocab_size=50, temperature=None)
    ro, errors = load_rollouts(path, vocab_size=50, skip_bad=True)
    assert len(ro) == 2 and [r.row for r in ro] == ["r.jsonl:1", "r.jsonl:3"]
    assert len(errors) == 1 and errors[0].startswith("r.jsonl:2: ")


def test_bad_arguments():
    with pytest.raises(ValueError, match="layout must be one of"):
        load_rollouts(DATA / "vllm_sample.jsonl", layout="sglang")
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        load_rollouts(DATA / "vllm_sample.jsonl", vllm_logprobs_mode="logits")
    with pytest.raises(FileNotFoundError):
        load_rollouts(DATA / "missing.jsonl")
    with pytest.raises(ValueError, match=r"sequence 0: engine has \(2,\) logprobs, trainer \(3,\)"):
        tim_metrics([torch.zeros(2)], [torch.zeros(3)])


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.imgs, self.tables = [], 0

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.imgs.append(dict(attrs)["src"])
        self.tables += tag == "table"


def test_report_html_parses_with_every_plot_embedded(tmp_path):
    pytest.importorskip("matplotlib")
    ro = _rollouts()
    rescored = Rescored([torch.tensor([-1.0, -0.75, -1.5]), torch.tensor([-0.25])])
    summary = compare(ro, rescored)
    rep = write_report(summary, tmp_path, ro, rescored, title="t")
    page = _Page()
    page.feed(rep.files["html"].read_text())
    assert len(page.imgs) == 4 and page.tables >= 5
    for src in page.imgs:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1]).startswith(b"\x89PNG")
    assert json.loads(rep.files["summary"].read_text())["tokens_differ"] == 2
    assert all(rep.files[n].read_bytes().startswith(b"\x89PNG") for n in ("abs_delta_hist", "by_position"))
