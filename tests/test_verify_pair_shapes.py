"""The verify pair's named shapes on CPU, without importing verl: the shape table's expansion and run_pair.sh's
commands from it, the full-vocabulary tokenizer (every id decodes and encodes back), write_meta's list of settings
that differ from verl's defaults, and compare.py refusing runs of different shapes by the first differing setting."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "verify"))
sys.path.insert(0, str(ROOT / "examples" / "verl_grpo"))
import compare  # noqa: E402
import full_vocab  # noqa: E402
import shapes  # noqa: E402
import write_meta  # noqa: E402

QWEN3_VOCAB = 151936
HAS_VERL = importlib.util.find_spec("verl") is not None  # found, not imported: importing verl takes ~20 s


def test_named_pairs_expand_to_the_shapes_users_run():
    dense = shapes.expand("dense-1k", {})
    assert (dense.shape, dense.layers, dense.vocab_size, dense.sequences) == ("qwen3-1.7b", 28, QWEN3_VOCAB, 512)
    assert (dense.max_response_length, dense.ngpus, dense.tuned, dense.stem) == (1024, 1, True, "dense-1k")
    # verl's rule: at least 2 x (prompt + response), verl's default budget where that is less; forward-only 2x
    assert (dense.ppo_max_token_len_per_gpu, dense.log_prob_max_token_len_per_gpu) == (16384, 32768)
    assert dense.context == 2048
    long = shapes.expand("dense-4k", {})
    assert (long.max_response_length, long.context, long.ppo_max_token_len_per_gpu) == (4096, 5120, 16384)
    eight = shapes.expand("dense8b-1k", {})
    assert (eight.shape, eight.layers, eight.ngpus, eight.vocab_size) == ("qwen3-8b", 36, 2, QWEN3_VOCAB)
    moe = shapes.expand("moe-1k", {"LAYERS": "6"})
    assert (moe.shape, moe.layers, moe.moe, moe.sequences) == ("qwen3-30b-a3b", 6, True, 512)
    moe_long = shapes.expand("moe-4k", {})
    assert (moe_long.layers, moe_long.moe, moe_long.max_response_length, moe_long.context) == (4, True, 4096, 5120)
    assert (moe_long.gpu_memory_utilization, moe_long.stem) == (0.25, "moe-4k")
    budget = shapes.expand("dense-4k", {"PPO_MAX_TOKENS": "20000"})
    assert (budget.ppo_max_token_len_per_gpu, budget.log_prob_max_token_len_per_gpu) == (20000, 40000)
    # smoke: today's small pair, its widths from SHAPE
    smoke = shapes.expand("smoke", {})
    assert (smoke.shape, smoke.layers, smoke.vocab, smoke.sequences, smoke.max_response_length) == (
        "qwen3-1.7b", 28, "byte", 128, 64)  # fmt: skip
    assert (smoke.tuned, smoke.stem, smoke.ppo_max_token_len_per_gpu) == (False, "qwen3-1.7b", None)
    smoke_moe = shapes.expand("smoke", {"SHAPE": "qwen3-30b-a3b"})
    assert (smoke_moe.layers, smoke_moe.gpu_memory_utilization, smoke_moe.moe) == (4, 0.25, True)


@pytest.mark.parametrize(
    "name, env, message",
    [
        ("dense-2k", {}, "PAIR must be one of smoke, dense-1k"),
        ("smoke", {"SHAPE": "llama-8b"}, "got 'llama-8b'"),
        ("dense-1k", {"SHAPE": "qwen3-8b"}, "the pair's model is qwen3-1.7b"),
        ("moe-1k", {"LAYERS": "0"}, "layers is 0; must be >= 1"),
        ("dense-1k", {"GPU_MEM": "1.5"}, "gpu_memory_utilization 1.5; allowed (0, 1)"),
        ("dense-4k", {"PPO_MAX_TOKENS": "4000"}, "ppo_max_token_len_per_gpu 4000 is below one sequence of 4224"),
        ("dense-1k", {"STEPS": "four"}, "STEPS='four': expected int"),
    ],
)
def test_bad_pairs_and_overrides_are_named(name, env, message):
    with pytest.raises(shapes.ShapeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        shapes.expand(name, env)


def _dry_run(tmp_path: Path, **env: str) -> dict[str, list[str]]:
    out = subprocess.run(
        ["bash", "examples/verify/run_pair.sh", str(tmp_path), "vllm", "vexact"],
        cwd=ROOT, env={**os.environ, "DRY_RUN": "1", "TAG": "cpu", **env}, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return {words[0]: words[1:] for words in ([w for w in ln.split("\0") if w] for ln in out.splitlines())}


def test_run_pair_passes_the_pair_and_verl_tuning_to_both_arms(tmp_path):
    arms = _dry_run(tmp_path, PAIR="dense-4k")
    for arm in ("vllm", "vexact"):
        cmd = arms[arm]
        for word in ("data.train_batch_size=64", "actor_rollout_ref.rollout.n=8", "data.max_response_length=4096",
                     "actor_rollout_ref.rollout.ignore_eos=True", "actor_rollout_ref.actor.use_dynamic_bsz=True",
                     "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384",
                     "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=32768",
                     "actor_rollout_ref.model.enable_gradient_checkpointing=True",
                     "trainer.experiment_name=cpu-dense-4k-" + arm):  # fmt: skip
            assert word in cmd, (arm, word)
        assert not [w for w in cmd if "micro_batch_size" in w or "max_num_seqs" in w], arm  # verl's defaults there
        assert any(w.endswith("/qwen3-1.7b-l28-real-c5120") for w in cmd)
    stack = {"actor_rollout_ref.rollout.name", "actor_rollout_ref.actor.strategy", "trainer.experiment_name",
             "trainer.default_local_dir", "hydra.run.dir",
             "+actor_rollout_ref.model.override_config.attn_implementation",
             "+actor_rollout_ref.rollout.engine_kwargs.vexact.backend",
             # the dense vllm arm's log-probs through verl's fused kernel: a knob of verl's actor alone
             "actor_rollout_ref.model.use_fused_kernels",
             "actor_rollout_ref.model.fused_kernel_options.impl_backend"}  # fmt: skip
    shared = [{w for w in arms[a] if "=" in w and w.split("=")[0] not in stack} for a in ("vllm", "vexact")]
    assert shared[0] == shared[1]
    smoke = _dry_run(tmp_path)["vllm"]  # today's small pair, as before
    for word in ("data.train_batch_size=32", "data.max_response_length=64", "actor_rollout_ref.rollout.n=4",
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
                 "actor_rollout_ref.rollout.max_num_seqs=256", "actor_rollout_ref.rollout.max_num_batched_tokens=4096",
                 "trainer.experiment_name=cpu-qwen3-1.7b-vllm"):  # fmt: skip
        assert word in smoke, word
    assert not [w for w in smoke if "dynamic_bsz" in w]
    r = subprocess.run(["bash", "examples/verify/run_pair.sh", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "DRY_RUN": "1", "PAIR": "dense-1k", "LAYERS": "-1"})  # fmt: skip
    assert r.returncode == 2 and "layers is -1" in r.stderr


def test_run_pair_builds_the_veomni_actor_where_veomni_takes_it(tmp_path):
    """VeOmni 0.1.12 builds the model on an accelerator without FSDP (one GPU) and on ``meta`` under FSDP2 (verl's
    default), refusing the other (torch_parallelize.build_parallelize_model / parallelize_model_fsdp2)."""
    for ngpus, where in (("1", "cuda"), ("2", None)):
        cmd = _dry_run(tmp_path, PAIR="moe-1k", NGPUS=ngpus)["vllm"]
        for role in ("actor", "ref"):
            got = [w.split("=", 1)[1] for w in cmd if w.startswith(f"actor_rollout_ref.{role}.veomni.init_device=")]
            assert got == ([where] if where else []), (ngpus, role, got)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("full-vocab")
    ids = full_vocab.write_tokenizer(path, QWEN3_VOCAB)
    assert ids == {"eos_token_id": 151645, "pad_token_id": 151643}  # Qwen3's
    return AutoTokenizer.from_pretrained(str(path))


def _verl_gsm8k():
    """verl's GSM8K rule (the reward function's exact-answer part), loaded from its file: no verl import."""
    spec = importlib.util.find_spec("verl")
    path = Path(next(iter(spec.submodule_search_locations))) / "utils" / "reward_score" / "gsm8k.py"
    module_spec = importlib.util.spec_from_file_location("verl_gsm8k_rule", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def test_full_vocab_tokenizer_decodes_every_id_and_encodes_back(tokenizer):
    assert len(tokenizer) == QWEN3_VOCAB
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    backend = tokenizer.backend_tokenizer
    assert [i for i in range(QWEN3_VOCAB) if backend.id_to_token(i) is None] == []  # vLLM's detokenizer needs each
    pieces = backend.decode_batch([[i] for i in range(QWEN3_VOCAB)], skip_special_tokens=False)
    assert [i for i, p in enumerate(pieces) if not p] == []
    # one response holding every id, in a random order, through verl's reward path: decode without the specials,
    # score the text, encode it back
    ids = list(range(QWEN3_VOCAB))
    random.Random(0).shuffle(ids)
    text = tokenizer.decode(ids, skip_special_tokens=True)
    assert isinstance(text, str) and "<|im_end|>" not in text and "<|extra_151935|>" in text and "</think>" in text
    back = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert back and max(back) < QWEN3_VOCAB
    # ids past Qwen3's 151,669 are plain added tokens: they reach the reward as text and encode to themselves
    for i in (151669, 151800, QWEN3_VOCAB - 1):
        assert tokenizer(tokenizer.decode([i]), add_special_tokens=False)["input_ids"] == [i]
    if HAS_VERL:
        gsm8k = _verl_gsm8k()
        assert gsm8k.compute_score(text, "42") in (0, 0.0, 1, 1.0)
        assert gsm8k.compute_score(tokenizer.decode(tokenizer("#### 42")["input_ids"]), "42") == 1.0
    prompt = tokenizer("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n", add_special_tokens=False)["input_ids"]
    assert prompt[0] == 151644 and 151645 in prompt and len(prompt) < 20  # BPE merges: 1-3 characters a token


@pytest.mark.skipif(not HAS_VERL, reason="write_meta reads verl's reference config; verl is not installed")
def test_write_meta_lists_every_setting_that_differs_from_verl_defaults_per_arm(tmp_path):
    arms = _dry_run(tmp_path, PAIR="dense-1k")
    differs = {arm: write_meta.settings(" ".join(cmd[3:]))[1] for arm, cmd in arms.items()}
    for arm in ("vllm", "vexact"):
        d = differs[arm]
        assert d["actor_rollout_ref.actor.use_dynamic_bsz"] == {"value": True, "verl_default": False}
        assert d["actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"] == {"value": 32768, "verl_default": 16384}
        assert d["actor_rollout_ref.rollout.gpu_memory_utilization"] == {"value": 0.4, "verl_default": 0.5}
        assert d["data.max_response_length"] == {"value": 1024, "verl_default": 512}
        # verl's own defaults, passed as its examples pass them, are not differences
        for same in ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
                     "actor_rollout_ref.model.use_remove_padding",
                     "actor_rollout_ref.model.enable_gradient_checkpointing",
                     "algorithm.use_kl_in_reward"):  # fmt: skip
            assert same not in d, (arm, same)
        assert not [k for k in d if k.startswith("hydra.")]
    assert differs["vllm"]["actor_rollout_ref.model.override_config.attn_implementation"] == {
        "value": "sdpa", "verl_default": None}  # fmt: skip
    assert differs["vexact"]["actor_rollout_ref.actor.strategy"] == {"value": "vexact", "verl_default": "fsdp"}
    moe = _dry_run(tmp_path, PAIR="moe-1k")["vllm"]
    d = write_meta.settings(" ".join(moe[3:]))[1]  # read against verl's VeOmni config
    assert d["actor_rollout_ref.actor.veomni.attn_implementation"] == {"value": "sdpa",
                                                                       "verl_default": "flash_attention_2"}  # fmt: skip
    # gpt-oss: the sinks have no SDPA path in transformers, and its eager attention mixes a packed row's sequences:
    # without FA4 the arm is refused, naming the way out; ACTOR_ATTN=eager runs it anyway
    refused = subprocess.run(
        ["bash", "examples/verify/run_pair.sh", str(tmp_path), "vllm", "vexact"], cwd=ROOT, capture_output=True,
        text=True, env={**os.environ, "DRY_RUN": "1", "TAG": "cpu", "PAIR": "gptoss-1k", "PYTHONPATH_FA4": ""},
    )  # fmt: skip
    assert refused.returncode == 2 and not refused.stdout, refused
    assert "needs FlashAttention 4" in refused.stderr and "ACTOR_ATTN=eager" in refused.stderr, refused.stderr
    assert "transformers#39997" in refused.stderr
    gptoss = _dry_run(tmp_path, PAIR="gptoss-1k", ACTOR_ATTN="eager")
    d = write_meta.settings(" ".join(gptoss["vllm"][3:]))[1]
    assert d["actor_rollout_ref.actor.veomni.attn_implementation"]["value"] == "eager"
    # VeOmni has no fused_triton kernel for gpt-oss's experts: eager
    assert d["actor_rollout_ref.actor.veomni.moe_implementation"]["value"] == "eager"
    # its eager MoE takes fp32 weights: verl's mixed_precision=true stays, fused_triton's bf16 weights are not needed
    assert "actor_rollout_ref.actor.veomni.mixed_precision" not in d
    assert write_meta.settings(" ".join(moe[3:]))[1]["actor_rollout_ref.actor.veomni.mixed_precision"]["value"] is False
    # its checkpoint holds a prompt and a whole response (128 + 1024 tokens): context 2048
    assert d["actor_rollout_ref.model.path"]["value"].endswith("gpt-oss-20b-l4-c2048")
    ours = write_meta.settings(" ".join(gptoss["vexact"][3:]))[1]
    assert ours["actor_rollout_ref.actor.strategy"]["value"] == "vexact"
    # the meta itself: the shape first in its config, the effective budgets, the differences beside the stack
    cmd = arms["vexact"]
    env = {**os.environ, "ARM": "vexact", "NAME": "cpu-dense-1k-vexact", "RESULTS": str(tmp_path), "ATTN": "triton",
           "ACTOR": "vexact FSDP actor (invariant)", "MOE": "0", "SHAPE": "qwen3-1.7b", "LAYERS": "28",
           "PAIR": "dense-1k", "VOCAB_SIZE": str(QWEN3_VOCAB), "RC": "0", "CMDLINE": " ".join(cmd),
           "COMMIT": "abc1234"}  # fmt: skip
    subprocess.run([sys.executable, "examples/verify/write_meta.py"], cwd=ROOT, env=env, check=True)
    meta = json.loads((tmp_path / "cpu-dense-1k-vexact.meta.json").read_text())
    assert meta["model"] == "dense-1k-l28"
    assert list(meta["config"])[:4] == ["shape", "layers", "vocab_size", "train_batch_size"]
    assert meta["config"]["log_prob_use_dynamic_bsz"] is True and meta["config"]["max_num_seqs"] == 256
    assert meta["config"]["ppo_micro_batch_size_per_gpu"] is None and meta["config"]["pair"] == "dense-1k"
    assert meta["differs_from_verl_defaults"] == differs["vexact"] | {
        "trainer.experiment_name": meta["differs_from_verl_defaults"]["trainer.experiment_name"]}  # fmt: skip


def _run(d: Path, arm: str, pair: str, config: dict, steps: int) -> Path:
    path = d / f"cpu-{pair}-{arm}.jsonl"
    lines = [{"step": s, "data": {"rollout_corr/k3_kl": 0.0 if arm == "vexact" else 1e-3,
                                  "training/rollout_probs_diff_max": 0.0 if arm == "vexact" else 1e-2}}
             for s in range(1, steps + 1)]  # fmt: skip
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    meta = {"arm": arm, "model": f"{pair}-l28", "gpu": "h100", "date": "2026-11-28", "commit": "abc1234",
            "command": "run_pair.sh", "config": config, "stack": {}, "peak_gpu_mem_mib": None}  # fmt: skip
    path.with_name(path.name.removesuffix(".jsonl") + ".meta.json").write_text(json.dumps(meta))
    return path


def test_compare_refuses_runs_of_different_shapes_naming_the_first_differing_setting(tmp_path, capsys):
    def config(pair: str) -> dict:
        p = shapes.expand(pair, {})
        return {"shape": p.shape, "layers": p.layers, "vocab_size": p.vocab_size,
                "train_batch_size": p.train_batch_size, "rollout_n": p.rollout_n,
                "max_prompt_length": p.max_prompt_length, "max_response_length": p.max_response_length,
                "steps": p.steps, "ppo_max_token_len_per_gpu": p.ppo_max_token_len_per_gpu, "pair": pair}  # fmt: skip

    one_k = _run(tmp_path, "vllm", "dense-1k", config("dense-1k"), 6)
    four_k = _run(tmp_path, "vexact", "dense-4k", config("dense-4k"), 4)  # steps and pair differ too, later
    assert compare.main([str(one_k), str(four_k)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("compare.py: config differs at 'max_response_length': 1024 in"), err
    assert "4096 in cpu-dense-4k-vexact.meta.json" in err
    smoke = _run(tmp_path, "vexact", "smoke", {**config("dense-1k"), "vocab_size": 272}, 6)
    assert compare.main([str(one_k), str(smoke)]) == 2
    assert "'vocab_size': 151936 in cpu-dense-1k-vllm.meta.json, 272 in" in capsys.readouterr().err
    same = _run(tmp_path, "vexact", "dense-1k", config("dense-1k"), 6)
    assert compare.main([str(one_k), str(same), "--expect-exact", "vexact", "--warmup", "0"]) == 0
    assert "expect-exact: PASS" in capsys.readouterr().out
