"""The recipes of examples/recipes/, each run through its own script for 2 steps on CPU (``SMOKE=1``,
``VERL_PLATFORM=cpu``) on its family's committed tiny checkpoint and the committed sample data, and their refusals.

Each run is verl's whole trainer (Ray, the vexact rollout, the invariant actor, the recipe's algorithm, reward
manager and validation); it must log ``rollout_corr/k3_kl`` and ``training/rollout_probs_diff_max`` exactly 0.0 at
both steps with a nonzero gradient, and the validation's mean@k under the validation set's data_source at the last
step. The tiny random models never answer a problem, so every verl score would be equal, every advantage zero and
DAPO's dynamic sampling would drop every group: the runs score with examples/verl_grpo/reward.py (verl's GSM8K rule
plus a small credit for digits), passed as a Hydra override like the CPU settings; verl's scorers on these data are
tested in tests/test_data_prepare.py.

Cost on 2 cores: one run takes about 70 s (Qwen3-1.7B GRPO, cores otherwise idle) to 3 minutes (MoE recipes, cores
shared), ten runs in all; so the default suite runs one recipe (Qwen3-1.7B GRPO on GSM8K) and the rest
run with ``VEXACT_RECIPE_SMOKE=all`` (skipped otherwise, with that reason).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "examples/recipes"
ALL = os.environ.get("VEXACT_RECIPE_SMOKE") == "all"
only_with_all = pytest.mark.skipif(not ALL, reason="a 1-3 minute CPU verl run: VEXACT_RECIPE_SMOKE=all runs it")

# recipe -> (tiny checkpoint family, extra environment, the validation key logged at the last step)
RUNS = {
    "qwen3_1.7b_grpo_gsm8k": ("qwen3", {}, "val-core/openai/gsm8k/acc/mean@1"),
    # the recipe's own PP=2: one rollout replica of 2 pipeline stages, the actor FSDP over 2 ranks (gloo)
    "qwen3_30b_a3b_dapo_math": ("qwen3_moe", {"GPUS_PER_NODE": "2"}, "val-aux/aime24/overlong_reward/mean@2"),
    "qwen3_30b_a3b_reinforce_pp_dapo_math": ("qwen3_moe", {"PP": "1"}, "val-core/aime24/acc/mean@2"),
    # the recipe's own EP=2: one rollout replica over 2 ranks (ExpertParallelLLM, gloo), 4 of the 8 experts each
    "qwen3_30b_a3b_ep": ("qwen3_moe", {"GPUS_PER_NODE": "2"}, "val-core/openai/gsm8k/acc/mean@1"),
    "moonlight_16b_a3b-grpo": ("deepseek_v3", {"ALGO": "grpo"}, "val-core/openai/gsm8k/acc/mean@1"),
    "moonlight_16b_a3b-reinforce_pp": ("deepseek_v3", {"ALGO": "reinforce_pp"}, "val-core/aime24/acc/mean@2"),
    "r1_distill_qwen_1.5b_verify_pair_math": ("qwen2", {"ARMS": "vexact"}, "val-core/aime25/acc/mean@2"),
    "llama_3.1_8b_grpo_gsm8k": ("llama", {}, "val-core/openai/gsm8k/acc/mean@1"),
    # the tiny gpt-oss: a window of 24 keys that the prompts outrun, sinks, a biased top-4 MoE
    "gpt_oss_20b_grpo": ("gpt_oss", {}, "val-core/openai/gsm8k/acc/mean@1"),
    # verl's separate_async trainer: the trainer's slot and the rollout's (gloo checkpoint engine on CPU); no validation
    "qwen3_1.7b_separate_async": ("qwen3", {"ROLLOUT_GPUS": "1"}, None),
}
DEFAULT_SUITE = {"qwen3_1.7b_grpo_gsm8k"}
CPU_OVERRIDES = [
    "+ray_kwargs.ray_init.num_cpus=16",
    "+ray_kwargs.ray_init.include_dashboard=False", "reward.num_workers=1",
    "actor_rollout_ref.rollout.agent.num_workers=1", "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    "data.dataloader_num_workers=0", f"reward.custom_reward_function.path={ROOT / 'examples/verl_grpo/reward.py'}",
]  # fmt: skip


def _env(**extra: str) -> dict[str, str]:
    """This interpreter first on PATH (the scripts call ``python3``), the monorepo's sources on PYTHONPATH."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    srcs = [str(p) for p in sorted((ROOT / "packages").glob("*/src"))]
    env["PYTHONPATH"] = os.pathsep.join([*srcs, str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("RAY_ADDRESS", None)  # a cluster of its own
    env.update(extra)
    return env


def _recipe(name: str) -> Path:
    return RECIPES / f"{name.split('-')[0]}.sh"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """The committed samples through examples/data/prepare.py (in this process: a child per dataset costs ~3 s)."""
    spec = importlib.util.spec_from_file_location("examples_data_prepare", ROOT / "examples/data/prepare.py")
    prepare = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = prepare  # its dataclass looks its module up there
    spec.loader.exec_module(prepare)
    out = tmp_path_factory.mktemp("recipe_data")
    for name in ("gsm8k", "math", "dapo_math", "aime24", "aime25"):
        prepare.prepare(name, out, ROOT / f"examples/data/samples/{name}.jsonl")
    prepare.prepare("gsm8k", out, ROOT / "examples/data/samples/gsm8k.jsonl", split="test")
    return out


def tiny_model(family: str, out: Path) -> Path:
    """The family's committed tiny checkpoint with a chat template (verl's dataset formats prompts with it); for
    deepseek_v3 also DeepSeek's special tokens, which verl's token builder for that model_type requires. Where the
    embeddings are tied (tiny-llama) the weights are drawn again with embeddings of std 1/sqrt(hidden), as
    examples/verl_grpo/make_model.py draws them: N(0, 1) tied embeddings give a one-hot policy (entropy ~1e-12, every
    logprob 0, every response alike), on which a zero K3 KL would prove nothing."""
    from vexact_models import default_checkpoint, load_model, random_model, save_checkpoint

    spec = importlib.util.spec_from_file_location("examples_make_model", ROOT / "examples/verl_grpo/make_model.py")
    make_model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_model)
    shutil.copytree(default_checkpoint(family), out)
    cfg = load_model(out).config
    if cfg.tie_word_embeddings:
        save_checkpoint(random_model(cfg, 0, embed_std=cfg.hidden_size**-0.5), out)
    if family == "deepseek_v3":
        make_model._deepseek_tokenizer(out, cfg)
    tok_cfg = out / "tokenizer_config.json"
    meta = json.loads(tok_cfg.read_text())
    meta["chat_template"] = make_model.DEEPSEEK_CHAT_TEMPLATE if family == "deepseek_v3" else make_model.CHAT_TEMPLATE
    tok_cfg.write_text(json.dumps(meta, indent=2) + "\n")
    return out


def _runs():
    for name in RUNS:
        marks = [pytest.mark.slow] + ([] if name in DEFAULT_SUITE else [only_with_all])
        yield pytest.param(name, id=name, marks=marks)


@pytest.mark.parametrize("name", _runs())
def test_recipe_runs_two_steps_on_cpu_with_zero_k3_kl(name, data_dir, tmp_path):
    family, extra, val_key = RUNS[name]
    model = tiny_model(family, tmp_path / "model")
    run_dir = tmp_path / "run"
    env = _env(VERL_PLATFORM="cpu", SMOKE="1", MODEL_DIR=str(model), DATA_DIR=str(data_dir), RUN_DIR=str(run_dir),
               NNODES="1", **{"GPUS_PER_NODE": "1", **extra})  # fmt: skip
    slots = int(env["GPUS_PER_NODE"]) + int(env.get("ROLLOUT_GPUS", 0))
    gpus = f"+ray_kwargs.ray_init.num_gpus={slots}"  # Ray's GPU slots, declared (VERL_PLATFORM=cpu)
    proc = subprocess.run(["bash", str(_recipe(name)), gpus, *CPU_OVERRIDES], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=1200)  # fmt: skip
    assert proc.returncode == 0, f"{name}: rc {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    (metrics,) = [p for p in run_dir.glob("*.jsonl")]
    records = sorted((json.loads(line) for line in metrics.read_text().splitlines() if line.strip()),
                     key=lambda r: r["step"])  # fmt: skip
    steps = [r["data"] for r in records if r["step"] > 0]
    assert len(steps) == 2, [r["step"] for r in records]
    for step, m in enumerate(steps, 1):
        # an asynchronous trainer's step may train on tokens of older weights: verl's rollout_corr compares them with
        # the current ones, so only a step of staleness 0 is held to exactly 0.0 (the rest is staleness, which
        # packages/vexact-verl/tests/test_verl_async_cpu.py rescores at each token's version: exactly 0.0)
        if m.get("training/off_policy/trajectory_staleness_worst/max", 0) == 0:
            assert m["rollout_corr/k3_kl"] == 0.0, (name, step, m["rollout_corr/k3_kl"])
            assert m["training/rollout_probs_diff_max"] == 0.0, (name, step, m["training/rollout_probs_diff_max"])
        assert m["actor/grad_norm"] > 0.0, (name, step)  # a real update: step 2 samples from synced new weights
        assert m["actor/entropy"] > 0.1, (name, step)  # a policy that samples, whose logprobs are not all 0
    assert steps[0].get("training/off_policy/trajectory_staleness_worst/max", 0) == 0, name
    if val_key is not None:
        assert val_key in steps[-1], (name, sorted(k for k in steps[-1] if k.startswith("val")))


def _refusal(recipe: str, tmp_path: Path, **env: str) -> str:
    base = dict(MODEL_DIR=str(tmp_path / "model"), DATA_DIR=str(tmp_path / "data"), VERL_PLATFORM="cpu")
    base.update(env)
    proc = subprocess.run(["bash", str(RECIPES / f"{recipe}.sh")], env=_env(**base), capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    return proc.stderr


def test_recipes_refuse_bad_input_naming_the_value(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model/config.json").write_text("{}")
    (tmp_path / "data/gsm8k").mkdir(parents=True)
    (tmp_path / "data/gsm8k/train.parquet").write_bytes(b"")
    r = "qwen3_1.7b_grpo_gsm8k"
    assert "MODEL_DIR=/nonexistent/m is not a directory" in _refusal(r, tmp_path, MODEL_DIR="/nonexistent/m")
    assert "DATA_DIR=/nonexistent/d is not a directory" in _refusal(r, tmp_path, DATA_DIR="/nonexistent/d")
    err = _refusal(r, tmp_path)
    assert f"DATA_DIR={tmp_path / 'data'} has no gsm8k/test.parquet" in err and "prepare.py gsm8k" in err
    assert "GPUS_PER_NODE must be a positive integer, got 'two'" in _refusal(r, tmp_path, GPUS_PER_NODE="two")
    assert "SMOKE must be 0 or 1, got 'yes'" in _refusal(r, tmp_path, SMOKE="yes")
    oss = "gpt_oss_20b_grpo"
    assert "MODEL_DIR=/nonexistent/m is not a directory" in _refusal(oss, tmp_path, MODEL_DIR="/nonexistent/m")
    assert f"DATA_DIR={tmp_path / 'data'} has no gsm8k/test.parquet" in _refusal(oss, tmp_path)
    assert "NNODES must be a positive integer, got '0'" in _refusal(oss, tmp_path, NNODES="0")
    dapo = "qwen3_30b_a3b_dapo_math"
    for f in ("dapo_math/train.parquet", "aime24/test.parquet"):
        (tmp_path / "data" / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "data" / f).write_bytes(b"")
    assert "PP=3 must be a positive integer that divides GPUS_PER_NODE=8" in _refusal(dapo, tmp_path, PP="3")
    assert "ALGO must be grpo or reinforce_pp, got 'ppo'" in _refusal("moonlight_16b_a3b", tmp_path, ALGO="ppo")
    pair = "r1_distill_qwen_1.5b_verify_pair_math"
    for f in ("math/train.parquet", "aime25/test.parquet"):
        (tmp_path / "data" / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "data" / f).write_bytes(b"")
    assert "ARMS: unknown arm 'sglang' (vllm, vexact)" in _refusal(pair, tmp_path, ARMS="vexact sglang")
    (tmp_path / "data/gsm8k/test.parquet").write_bytes(b"")
    assert "EP=3 must be a positive integer that divides GPUS_PER_NODE=8" in _refusal("qwen3_30b_a3b_ep", tmp_path,
                                                                                        EP="3")  # fmt: skip
    sep = "qwen3_1.7b_separate_async"
    assert "MODE must be separate_async, colocate_async or sync, got 'ppo'" in _refusal(sep, tmp_path, MODE="ppo")
    assert "ROLLOUT_GPUS must be a positive integer, got '0'" in _refusal(sep, tmp_path, ROLLOUT_GPUS="0")
    if importlib.util.find_spec("vllm") is None:
        assert "ARMS includes vllm but vLLM is not importable" in _refusal(pair, tmp_path)


def test_recipes_refuse_more_gpus_than_visible(tmp_path):
    import torch

    (tmp_path / "model").mkdir()
    (tmp_path / "model/config.json").write_text("{}")
    (tmp_path / "data").mkdir()
    visible = torch.cuda.device_count()
    err = _refusal("qwen3_1.7b_grpo_gsm8k", tmp_path, VERL_PLATFORM="", GPUS_PER_NODE=str(visible + 1))
    assert f"GPUS_PER_NODE={visible + 1} but this node sees {visible} GPU(s)" in err


def test_every_recipe_is_tested():
    scripts = {p.stem for p in RECIPES.glob("*.sh")} - {"common"}
    assert scripts == {_recipe(n).stem for n in RUNS}, scripts
