"""The verify pair's arms compose into verl's own config on a CPU machine: every override run_pair.sh passes exists
in verl 0.9.1's Hydra config (a typo fails here, not after the GPU machine has started), the arms differ only in
the stack (rollout, actor engine, attention, MoE kernels) and share every setting the comparison needs."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("verl")
hydra = pytest.importorskip("hydra")


def _arms(shape: str, tmp_path: Path) -> dict[str, list[str]]:
    """``shape``: smoke's SHAPE, or a named pair (examples/verify/shapes.py)."""
    pair = {"PAIR": shape} if shape in ("dense-1k", "dense-4k", "dense8b-1k", "moe-1k") else {"SHAPE": shape}
    env = {**os.environ, "DRY_RUN": "1", "TAG": "cpu", **pair}
    out = subprocess.run(
        ["bash", "examples/verify/run_pair.sh", str(tmp_path), "vllm", "vexact", "fast"],
        cwd=ROOT, env=env, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    arms = {}
    for line in out.splitlines():
        words = [w for w in line.split("\0") if w]
        arms[words[0]] = words[1:]
    return arms


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from verl.trainer import main_ppo

    config_dir = str(Path(main_ppo.__file__).parent / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=[o for o in overrides if not o.startswith("hydra.")])


@pytest.mark.parametrize("shape", ["qwen3-1.7b", "qwen3-30b-a3b", "dense-4k", "dense8b-1k", "moe-1k"])
def test_arms_compose_in_verl_config(shape, tmp_path):
    arms = _arms(shape, tmp_path)
    assert set(arms) == {"vllm", "vexact", "fast"}
    assert arms["vllm"][:3] == ["python3", "-m", "verl.trainer.main_ppo"]  # verl's own entry point, as users run it
    cfgs = {arm: _compose(cmd[3:]) for arm, cmd in arms.items()}
    assert cfgs["vllm"].actor_rollout_ref.rollout.name == "vllm"
    assert cfgs["vexact"].actor_rollout_ref.rollout.name == "vexact"
    assert cfgs["vexact"].actor_rollout_ref.actor.strategy == "vexact"
    assert cfgs["fast"].actor_rollout_ref.rollout.engine_kwargs.vexact.backend == "fast"
    if shape in ("qwen3-30b-a3b", "moe-1k"):  # verl's MoE actor: VeOmni with its grouped-GEMM MoE
        assert cfgs["vllm"].model_engine == "veomni"
        assert cfgs["vllm"].actor_rollout_ref.actor.veomni.moe_implementation == "fused_triton"
        assert cfgs["vllm"].actor_rollout_ref.actor.veomni.mixed_precision is False  # one GPU: no FSDP autocast
    for key in ("data", "algorithm", "trainer"):
        for arm in ("vexact", "fast"):
            a, b = dict(cfgs["vllm"][key]), dict(cfgs[arm][key])
            for name in ("experiment_name", "default_local_dir"):
                a.pop(name, None), b.pop(name, None)
            assert a == b, f"{key} differs between vllm and {arm}"
    for arm in ("vexact", "fast"):
        for key in ("n", "ignore_eos", "calculate_log_probs", "temperature", "top_p", "gpu_memory_utilization",
                    "max_num_seqs", "max_num_batched_tokens", "log_prob_use_dynamic_bsz",
                    "log_prob_max_token_len_per_gpu", "log_prob_micro_batch_size_per_gpu"):  # fmt: skip
            assert cfgs["vllm"].actor_rollout_ref.rollout[key] == cfgs[arm].actor_rollout_ref.rollout[key], key
        for key in (
            "use_dynamic_bsz",
            "ppo_max_token_len_per_gpu",
            "ppo_micro_batch_size_per_gpu",
            "ppo_mini_batch_size",
        ):
            assert cfgs["vllm"].actor_rollout_ref.actor[key] == cfgs[arm].actor_rollout_ref.actor[key], key
        for key in ("use_remove_padding", "enable_gradient_checkpointing"):
            assert cfgs["vllm"].actor_rollout_ref.model[key] == cfgs[arm].actor_rollout_ref.model[key], key
        assert cfgs["vllm"].actor_rollout_ref.actor.optim.lr == cfgs[arm].actor_rollout_ref.actor.optim.lr
    assert cfgs["vllm"].actor_rollout_ref.rollout.ignore_eos is True  # equal work for the step timing
    if shape in ("dense-4k", "dense8b-1k", "moe-1k"):  # tuned as verl's examples tune a run
        assert cfgs["vllm"].actor_rollout_ref.actor.use_dynamic_bsz is True
        assert cfgs["vllm"].actor_rollout_ref.rollout.log_prob_use_dynamic_bsz is True
        assert cfgs["vllm"].data.train_batch_size * cfgs["vllm"].actor_rollout_ref.rollout.n == 512


def test_bad_arm_and_shape_are_named(tmp_path):
    env = {**os.environ, "DRY_RUN": "1", "TAG": "cpu"}
    r = subprocess.run(["bash", "examples/verify/run_pair.sh", str(tmp_path), "sglang"], cwd=ROOT, env=env,
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 2 and "unknown arm 'sglang'" in r.stderr
    r = subprocess.run(["bash", "examples/verify/run_pair.sh", str(tmp_path)], cwd=ROOT,
                       env={**env, "SHAPE": "llama-8b"}, capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 2 and "llama-8b" in r.stderr
    r = subprocess.run(["bash", "examples/verify/run_pair.sh", str(tmp_path)], cwd=ROOT,
                       env={**env, "PAIR": "dense-2k"}, capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 2 and "dense-2k" in r.stderr
