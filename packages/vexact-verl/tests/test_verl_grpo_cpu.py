"""verl's own GRPO trainer, end to end on CPU: ``python -m vexact_verl.main_ppo`` with ``rollout.name=vexact`` and
``actor.strategy=vexact`` (examples/verl_grpo/run_grpo.sh), two steps, on verl's platform slot filled by
:mod:`vexact_verl.cpu_platform` (``VERL_PLATFORM=cpu``; Ray's GPU slot declared with ``ray_init.num_gpus=1``).

What runs is all of verl's path: Hydra config, Ray TaskRunner, the TransferQueue, the hybrid actor/rollout worker
(FSDP2 engine built by ``EngineRegistry``), the agent loop driving the vexact server, the reward loop (custom reward),
GRPO advantages, the actor update, verl's weight sync into the rollout, and verl's rollout-correction metrics.

The invariant run must log K3 KL, KL and verl's largest |p_rollout - p_actor| as exactly 0.0 at both steps, with a
nonzero gradient (the second step's rollout runs on weights verl synced after a real update), and at step 2 (only) the
per-op attribution's ``actor/tim_attr/*`` (the actor engine config's ``vexact.tim_attribute_every=2``), which leaves
the steps exact. The fast
rollout backend against the same actor must not: that is the check seen failing, on the same metrics.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="verl is not installed: pip install 'vexact-verl[verl]'")
pytest.importorskip("ray", reason="ray is not installed: pip install 'vexact-verl[verl]'")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
STEPS = 2


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, subprocess_env):
    d = tmp_path_factory.mktemp("verl_grpo")
    py = sys.executable
    subprocess.run([py, str(ROOT / "examples/verl_grpo/make_model.py"), "--out", str(d / "model"), "--hidden", "64",
                    "--layers", "2"], check=True, env=subprocess_env())  # fmt: skip
    subprocess.run([py, str(ROOT / "examples/verl_grpo/make_dataset.py"), "--out", str(d / "data"), "--train", "64",
                    "--test", "8"], check=True, env=subprocess_env())  # fmt: skip
    return d


def run_grpo(inputs: Path, backend: str, subprocess_env, *overrides: str) -> list[dict]:
    out = inputs / f"run-{backend}"
    env = subprocess_env(VERL_PLATFORM="cpu", MODEL=str(inputs / "model"), DATA=str(inputs / "data"), BACKEND=backend,
               STEPS=str(STEPS), LR="1e-4", RUN_DIR=str(out), NAME=f"cpu-{backend}")  # fmt: skip
    env.pop("RAY_ADDRESS", None)  # a cluster of its own
    cmd = ["bash", str(ROOT / "examples/verl_grpo/run_grpo.sh"),
           "+ray_kwargs.ray_init.num_gpus=1", "+ray_kwargs.ray_init.num_cpus=16",
           "+ray_kwargs.ray_init.include_dashboard=False",
           # 4 prompts x 2 samples of up to 16 tokens: the checks need a real update and tokens to compare, not
           # volume (run_grpo.sh's 4 samples of up to 64 tokens on 8 prompts: ~10 s more per step on 2 cores)
           "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "data.max_response_length=16",
           "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
           "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8", "actor_rollout_ref.actor.strategy=vexact",
           "reward.num_workers=1", "actor_rollout_ref.rollout.agent.num_workers=1",
           "transfer_queue.backend.SimpleStorage.num_data_storage_units=1", "data.dataloader_num_workers=0",
           f"reward.custom_reward_function.path={ROOT / 'examples/verl_grpo/reward.py'}", *overrides]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise AssertionError(
            f"verl run ({backend}) failed, rc {proc.returncode}:\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
        )
    records = [json.loads(line) for line in (out / f"cpu-{backend}.jsonl").read_text().splitlines() if line.strip()]
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    return [r["data"] for r in sorted(records, key=lambda r: r["step"])]


def test_verl_grpo_on_cpu_invariant_is_exact_and_fast_is_not(inputs, subprocess_env):
    # with the per-op attribution on at step 2 (and the step still exact: it does not touch the step's numerics)
    attr = (
        "actor_rollout_ref.actor.fsdp_config._target_=vexact_verl.actor_engine.VexactFSDPEngineConfig",
        "+actor_rollout_ref.actor.fsdp_config.vexact.tim_attribute_every=2",
        "+actor_rollout_ref.actor.fsdp_config.vexact.tim_attribute_samples=3",
    )
    inv = run_grpo(inputs, "invariant", subprocess_env, *attr)
    assert len(inv) == STEPS
    assert not [k for k in inv[0] if "tim_attr/" in k]
    assert inv[1]["actor/tim_attr/all/abs_delta_mean"] > 0 and inv[1]["actor/tim_attr/all/fraction_differ"] > 0
    assert {k.split("/")[2] for k in inv[1] if k.startswith("actor/tim_attr/")} >= {"linear", "attention", "rotary"}
    for step, m in enumerate(inv, 1):
        assert m["rollout_corr/k3_kl"] == 0.0, (step, m["rollout_corr/k3_kl"])
        assert m["rollout_corr/kl"] == 0.0, (step, m["rollout_corr/kl"])
        assert m["training/rollout_probs_diff_max"] == 0.0, (step, m["training/rollout_probs_diff_max"])
        assert m["actor/grad_norm"] > 0.0, step  # a real update, so step 2 samples from synced new weights
        assert "timing_s/update_weights" in m
    fast = run_grpo(inputs, "fast", subprocess_env)
    assert len(fast) == STEPS
    assert all(m["rollout_corr/k3_kl"] > 0.0 for m in fast), [m["rollout_corr/k3_kl"] for m in fast]
    assert all(m["training/rollout_probs_diff_max"] > 0.0 for m in fast)
