"""The recipes' CPU-side parts: the local dataset is scored by verl's own rule; the random model has a chat template
(compare.py's tests: tests/test_verify_tools.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="verl is not installed: pip install 'vexact-verl[verl]'")
pd = pytest.importorskip("pandas")

ROOT = Path(__file__).resolve().parents[3]


def test_dataset_is_verl_parquet_scored_by_verls_gsm8k_rule(tmp_path):
    from verl.utils.reward_score import default_compute_score

    subprocess.run([sys.executable, str(ROOT / "examples/verl_grpo/make_dataset.py"), "--out", str(tmp_path),
                    "--train", "16", "--test", "4"], check=True)  # fmt: skip
    train = pd.read_parquet(tmp_path / "train.parquet")
    assert len(train) == 16 and len(pd.read_parquet(tmp_path / "test.parquet")) == 4
    for row in train.itertuples():
        truth = row.reward_model["ground_truth"]
        a, op, b = row.extra_info["question"].split("?")[0].removeprefix("What is ").split()
        assert int(truth) == (int(a) + int(b) if op == "+" else int(a) * int(b))
        assert default_compute_score(row.data_source, f"so #### {truth}", truth) == 1.0
        assert default_compute_score(row.data_source, f"#### {int(truth) + 1}", truth) == 0.0


def test_shaped_rewards_exact_answer_then_digit_credit():
    import importlib.util

    spec = importlib.util.spec_from_file_location("shaped_reward", ROOT / "examples/verl_grpo/reward.py")
    reward = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reward)
    for fn in (reward.compute_score, reward.compute_score_half_digits):
        assert fn("openai/gsm8k", "so #### 42", "42") == 1.0
        assert fn("openai/gsm8k", "", "42") == 0.0
        assert fn("openai/gsm8k", "abcd", "42") == 0.0
    # share of digits: highest at all digits for one, at half digits for the other (the resume check's)
    assert reward.compute_score("gsm8k", "1234", "42") == pytest.approx(0.2)
    assert reward.compute_score("gsm8k", "12ab", "42") == pytest.approx(0.1)
    assert reward.compute_score_half_digits("gsm8k", "1234", "42") == 0.0
    assert reward.compute_score_half_digits("gsm8k", "12ab", "42") == pytest.approx(0.2)
    assert reward.compute_score_half_digits("gsm8k", "1abc", "42") == pytest.approx(0.1)


@pytest.mark.parametrize(
    "extra", [[], ["--family", "deepseek_v3", "--experts", "8", "--top-k", "2"]], ids=["qwen3", "deepseek_v3"]
)
def test_random_model_checkpoint_has_a_chat_template_verl_can_use(tmp_path, extra):
    from transformers import AutoTokenizer

    from vexact_models import load_model

    out = tmp_path / "m"
    subprocess.run([sys.executable, str(ROOT / "examples/verl_grpo/make_model.py"), "--out", str(out), "--hidden",
                    "64", "--layers", "1", *extra], check=True)  # fmt: skip
    tok = AutoTokenizer.from_pretrained(str(out))
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    cfg = load_model(out).config
    assert cfg.num_hidden_layers == 1 and cfg.model_type == ("deepseek_v3" if extra else "qwen3")
    # DeepSeek's own special tokens and layout: verl's token builder for model_type deepseek_v3 requires its EOS
    # (the first H100 run of the DeepSeek verl pair stopped there: "Tokenizer does not define required token")
    assert tok.decode(ids).endswith("<\uff5cAssistant\uff5c>" if extra else "<|im_start|>assistant\n")
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

    create_continuous_token_builder(tok, hf_model_type=cfg.model_type)
    if extra:
        assert tok.eos_token == "<\uff5cend\u2581of\u2581sentence\uff5c>" and tok.eos_token_id < cfg.vocab_size


def test_make_model_shapes_take_the_published_widths():
    """``make_model.py --shape``: each real model's widths (its config.json) at the depth asked for, with the byte
    vocabulary and a context of 1024, or with ``--vocab real`` the model's own vocabulary and Qwen3's special-token
    ids (config only: writing the weights takes seconds to minutes)."""
    import argparse
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_model", ROOT / "examples/verl_grpo/make_model.py")
    make_model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_model)
    want = {
        "qwen3-1.7b": dict(model_type="qwen3", hidden_size=2048, num_attention_heads=16, num_key_value_heads=8),
        "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                         num_key_value_heads=8, tie_word_embeddings=False),
        "qwen3-30b-a3b": dict(model_type="qwen3_moe", num_experts=128, num_experts_per_tok=8,
                              moe_intermediate_size=768),
        "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                             num_key_value_heads=8, rope_theta=500_000.0, tie_word_embeddings=False),
        "r1-distill-qwen-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960,
                                     num_attention_heads=12, num_key_value_heads=2, rope_theta=10_000.0,
                                     tie_word_embeddings=False),
        "moonlight-16b-a3b": dict(model_type="deepseek_v3", hidden_size=2048, n_routed_experts=64,
                                  num_experts_per_tok=6, n_shared_experts=2, kv_lora_rank=512, first_k_dense_replace=1,
                                  moe_intermediate_size=1408),
        "gpt-oss-20b": dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_local_experts=32,
                            num_experts_per_tok=4, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                            sliding_window=128, tie_word_embeddings=False),
    }  # fmt: skip
    assert set(want) == set(make_model.SHAPES)
    for shape, fields in want.items():
        args = argparse.Namespace(shape=shape, layers=2, layers_given=True, family="qwen3", experts=0, top_k=4,
                                  vocab="byte", context=1024)  # fmt: skip
        cfg = make_model._shaped(args)
        got = {k: getattr(cfg, k) for k in fields}
        assert got == fields, shape
        assert (cfg.num_hidden_layers, cfg.vocab_size, cfg.max_position_embeddings) == (2, 272, 1024), shape
    for shape in ("qwen3-1.7b", "qwen3-8b", "qwen3-30b-a3b"):
        args = argparse.Namespace(shape=shape, layers=2, layers_given=True, family="qwen3", experts=0, top_k=4,
                                  vocab="real", context=5120)  # fmt: skip
        cfg = make_model._shaped(args)
        got = (cfg.vocab_size, cfg.max_position_embeddings, cfg.bos_token_id, cfg.eos_token_id)
        assert got == (151936, 5120, 151643, 151645), shape
