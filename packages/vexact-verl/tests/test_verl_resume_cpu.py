"""The same verl GRPO job twice, and stopped and resumed, bitwise: verl's own trainer on CPU (``VERL_PLATFORM=cpu``,
the tiny random Qwen3, examples/verl_grpo/run_grpo.sh with the vexact rollout and actor), 4 steps, a checkpoint
every 2.

Three jobs, one test (pytest-xdist hands tests to workers one by one; one test keeps the jobs in one process):

- A: 4 steps uninterrupted;
- B: the same job stopped after step 2 (``total_training_steps=2``; the LR is constant, so the schedule does not
  depend on the total);
- C: B's directory resumed with verl's ``trainer.resume_mode=auto`` (from B's step-2 checkpoint) up to step 4.

Rerun: B's steps 1-2 equal A's in every logged number except wall-clock timings, throughput and memory, and B's
step-2 checkpoint (model, optimizer, LR scheduler and RNG states, dataloader position) equals A's, tensor by tensor
(``torch.equal``). Resume: C's steps 3-4 equal A's the same way, and so does C's final checkpoint. What this covers:
the dataloader position (verl's ``data.pt``), sampling seeds from (step, dataset index, session_id) through
``vexact_single_turn_agent``, the batch in dataloader order (``OrderedReplayBuffer``), optimizer and RNG states,
the engine's weights after the resume (verl syncs them from the restored actor before step 3: step 3's rollout
logprobs equal the actor's, ``rollout_corr/k3_kl == 0``) and a cold prefix cache (C's engine starts empty).

The dataloader runs as run_grpo.sh sets it (``data.dataloader_num_workers=0``; the test sets no worker count of its
own): with worker processes, each job saves a base seed drawn from its own randomly seeded torch RNG in ``data.pt``,
and the checkpoint comparisons fail on it.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="verl is not installed: pip install 'vexact-verl[verl]'")
pytest.importorskip("ray", reason="ray is not installed: pip install 'vexact-verl[verl]'")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
NAME = "grpo"


def run_job(tmp: Path, run_dir: Path, log: str, steps: int, subprocess_env, *overrides: str) -> dict[int, dict]:
    """One job of run_grpo.sh; its per-step metrics (verl's file logger, written to ``run_dir/log``)."""
    env = subprocess_env(VERL_PLATFORM="cpu", MODEL=str(tmp / "model"), DATA=str(tmp / "data"), STEPS=str(steps),
                         LR="1e-4", RUN_DIR=str(run_dir), NAME=NAME,
                         VERL_FILE_LOGGER_PATH=str(run_dir / log))  # fmt: skip
    env.pop("RAY_ADDRESS", None)  # a cluster of its own
    cmd = ["bash", str(ROOT / "examples/verl_grpo/run_grpo.sh"),
           "+ray_kwargs.ray_init.num_gpus=1", "+ray_kwargs.ray_init.num_cpus=16",
           "+ray_kwargs.ray_init.include_dashboard=False",
           "data.train_batch_size=4", "data.max_response_length=16", "actor_rollout_ref.rollout.n=2",
           "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
           "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
           "actor_rollout_ref.actor.strategy=vexact", "reward.num_workers=1",
           "actor_rollout_ref.rollout.agent.num_workers=1",
           "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
           f"reward.custom_reward_function.path={ROOT / 'examples/verl_grpo/reward.py'}", "trainer.save_freq=2",
           *overrides]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise AssertionError(f"verl job in {run_dir} failed, rc {proc.returncode}:\n{proc.stdout[-6000:]}\n"
                             f"{proc.stderr[-6000:]}")  # fmt: skip
    return compare_runs().read_metrics(run_dir / log)


def compare_runs():
    """examples/verl_grpo/compare_runs.py, the comparison the GPU runs use."""
    spec = importlib.util.spec_from_file_location("compare_runs", ROOT / "examples/verl_grpo/compare_runs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_same_metrics(got: dict[int, dict], want: dict[int, dict], steps: list[int], what: str) -> None:
    assert sorted(got) == steps, (what, sorted(got))
    for step, diffs in compare_runs().metric_diffs(got, want, steps).items():
        assert not diffs, f"{what}, step {step}: {len(diffs)} metrics differ, e.g. {diffs[:5]}"


def assert_same_checkpoint(got_dir: Path, want_dir: Path, what: str) -> None:
    cmp = compare_runs()
    got, want = cmp.load_checkpoint(got_dir), cmp.load_checkpoint(want_dir)
    assert sorted(got) == sorted(want) and len(got) >= 4, (what, sorted(got), sorted(want))
    diffs = [d for name in got for d in cmp.state_diffs(got[name], want[name], name)]
    assert not diffs, f"{what}: {len(diffs)} differences, e.g. {diffs[:5]}"


def test_verl_grpo_rerun_and_resume_are_bitwise(tmp_path, subprocess_env):
    py = sys.executable
    subprocess.run([py, str(ROOT / "examples/verl_grpo/make_model.py"), "--out", str(tmp_path / "model"), "--hidden",
                    "64", "--layers", "2"], check=True, env=subprocess_env())  # fmt: skip
    subprocess.run([py, str(ROOT / "examples/verl_grpo/make_dataset.py"), "--out", str(tmp_path / "data"), "--train",
                    "64", "--test", "8"], check=True, env=subprocess_env())  # fmt: skip
    a = run_job(tmp_path, tmp_path / "a", "a.jsonl", 4, subprocess_env)
    # not vacuous: real updates on other samples each step, and the rollout exact
    assert all(a[s]["actor/grad_norm"] > 0 and a[s]["rollout_corr/k3_kl"] == 0.0 for s in a), a
    assert len({a[s]["rollout_corr/training_log_ppl"] for s in a}) == 4, a
    b = run_job(tmp_path, tmp_path / "b", "b.jsonl", 2, subprocess_env)
    assert_same_metrics(b, a, [1, 2], "rerun (B vs A)")
    ckpt = f"checkpoints/{NAME}/global_step_{{}}"
    # data.pt included: with the dataloader settings of run_grpo.sh, not the test's own
    assert_same_checkpoint(tmp_path / "b" / ckpt.format(2), tmp_path / "a" / ckpt.format(2), "rerun, step 2")

    c = run_job(tmp_path, tmp_path / "b", "c.jsonl", 4, subprocess_env, "trainer.resume_mode=auto")
    assert c[3]["rollout_corr/k3_kl"] == 0.0 and c[3]["training/rollout_probs_diff_max"] == 0.0
    assert_same_metrics(c, a, [3, 4], "resumed from step 2 (C vs A)")
    assert_same_checkpoint(tmp_path / "b" / ckpt.format(4), tmp_path / "a" / ckpt.format(4), "resumed, step 4")
