"""verl's own GRPO trainer, end to end on CPU: ``python -m vexact_verl.main_ppo`` with ``rollout.name=vexact`` and
``actor.strategy=vexact`` (examples/verl_grpo/run_grpo.sh), on verl's platform slot filled by
:mod:`vexact_verl.cpu_platform` (``VERL_PLATFORM=cpu``; Ray's GPU slot declared with ``ray_init.num_gpus=1``), on the
tiny random Qwen3.

What runs is all of verl's path: Hydra config, Ray TaskRunner, the TransferQueue, the hybrid actor/rollout worker
(FSDP2 engine built by ``EngineRegistry``), the agent loop driving the vexact server, the reward loop (custom reward),
GRPO advantages, the actor update, verl's weight sync into the rollout, verl's rollout-correction metrics and its
checkpoints.

Three jobs, each a verl job of its own (Ray, the TaskRunner, the workers: about a minute of start-up on 2 cores), so
the tests share them (module fixtures; ``xdist_group`` keeps them in one pytest-xdist worker):

- A: 4 steps uninterrupted, a checkpoint every 2, the per-op attribution every 2 (the actor engine config's
  ``vexact.tim_attribute_every=2``);
- C: a fresh directory holding only A's step-2 checkpoint, resumed with verl's ``trainer.resume_mode=auto`` up to
  step 4 (a job stopped after step 2 writes the same checkpoint: the LR is constant and the seeds depend on the step,
  not on the run);
- the fast rollout backend against the same actor, 1 step.

Exact: A must log K3 KL, KL and verl's largest |p_rollout - p_actor| as exactly 0.0 at every step, with a nonzero
gradient (each later step's rollout runs on weights verl synced after a real update), and ``actor/tim_attr/*`` at
steps 2 and 4 only, which leaves the steps exact. The fast backend's job must not: that is the check seen failing, on
the same metrics.

Resume, which is a rerun in another process: C's steps 3-4 equal A's in every logged number except wall-clock
timings, throughput and memory, and C's step-4 checkpoint (model, optimizer, LR scheduler and RNG states, dataloader
position) equals A's, tensor by tensor (``torch.equal``). What this covers: the dataloader position (verl's
``data.pt``), sampling seeds from (step, dataset index, session_id) through ``vexact_single_turn_agent``, the batch in
dataloader order (``OrderedReplayBuffer``), optimizer and RNG states, the engine's weights after the resume (verl
syncs them from the restored actor before step 3: step 3's rollout logprobs equal the actor's,
``rollout_corr/k3_kl == 0``) and a cold prefix cache (C's engine starts empty). A rerun from step 1 is the same
check at steps 1-2 (``scripts/checks/resume_gpu.sh`` runs it on GPUs, and ``tests/test_getting_started.py`` without
verl).

The dataloader runs as run_grpo.sh sets it (``data.dataloader_num_workers=0``; the jobs set no worker count of their
own): with worker processes, each job saves a base seed drawn from its own randomly seeded torch RNG in ``data.pt``,
and the checkpoint comparisons fail on it.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="verl is not installed: pip install 'vexact-verl[verl]'")
pytest.importorskip("ray", reason="ray is not installed: pip install 'vexact-verl[verl]'")

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("verl_grpo_cpu")]

ROOT = Path(__file__).resolve().parents[3]
NAME = "grpo"
STEPS = 4
CKPT = f"checkpoints/{NAME}/global_step_{{}}"
# the attribution every 2 steps in every job: its metrics are compared like the rest. The engine counts the steps its
# process ran, so a job resumed at an even step attributes at the same global steps as the uninterrupted one.
ATTRIBUTION = (
    "actor_rollout_ref.actor.fsdp_config._target_=vexact_verl.actor_engine.VexactFSDPEngineConfig",
    "+actor_rollout_ref.actor.fsdp_config.vexact.tim_attribute_every=2",
    "+actor_rollout_ref.actor.fsdp_config.vexact.tim_attribute_samples=3",
)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, subprocess_env):
    d = tmp_path_factory.mktemp("verl_grpo")
    py = sys.executable
    subprocess.run([py, str(ROOT / "examples/verl_grpo/make_model.py"), "--out", str(d / "model"), "--hidden", "64",
                    "--layers", "2"], check=True, env=subprocess_env())  # fmt: skip
    subprocess.run([py, str(ROOT / "examples/verl_grpo/make_dataset.py"), "--out", str(d / "data"), "--train", "64",
                    "--test", "8"], check=True, env=subprocess_env())  # fmt: skip
    return d


def run_job(inputs: Path, run_dir: Path, log: str, steps: int, subprocess_env, *overrides: str,
            backend: str = "invariant") -> dict[int, dict]:  # fmt: skip
    """One job of run_grpo.sh; its per-step metrics (verl's file logger, written to ``run_dir/log``)."""
    env = subprocess_env(VERL_PLATFORM="cpu", MODEL=str(inputs / "model"), DATA=str(inputs / "data"), BACKEND=backend,
                         STEPS=str(steps), LR="1e-4", RUN_DIR=str(run_dir), NAME=NAME,
                         VERL_FILE_LOGGER_PATH=str(run_dir / log))  # fmt: skip
    env.pop("RAY_ADDRESS", None)  # a cluster of its own
    cmd = ["bash", str(ROOT / "examples/verl_grpo/run_grpo.sh"),
           "+ray_kwargs.ray_init.num_gpus=1", "+ray_kwargs.ray_init.num_cpus=16",
           "+ray_kwargs.ray_init.include_dashboard=False",
           # 4 prompts x 2 samples of up to 16 tokens: the checks need a real update and tokens to compare, not
           # volume (run_grpo.sh's 4 samples of up to 64 tokens on 8 prompts: ~10 s more per step on 2 cores)
           "data.train_batch_size=4", "data.max_response_length=16", "actor_rollout_ref.rollout.n=2",
           "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
           "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
           "actor_rollout_ref.actor.strategy=vexact", "reward.num_workers=1",
           "actor_rollout_ref.rollout.agent.num_workers=1",
           "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
           f"reward.custom_reward_function.path={ROOT / 'examples/verl_grpo/reward.py'}", *overrides]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise AssertionError(f"verl job in {run_dir} failed, rc {proc.returncode}:\n{proc.stdout[-6000:]}\n"
                             f"{proc.stderr[-6000:]}")  # fmt: skip
    return compare_runs().read_metrics(run_dir / log)


@pytest.fixture(scope="module")
def job_a(inputs, subprocess_env) -> tuple[Path, dict[int, dict]]:
    """A: the uninterrupted job, its directory and metrics."""
    run_dir = inputs / "a"
    return run_dir, run_job(inputs, run_dir, "a.jsonl", STEPS, subprocess_env, "trainer.save_freq=2", *ATTRIBUTION)


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


def test_verl_grpo_on_cpu_invariant_is_exact(job_a):
    _, a = job_a
    assert sorted(a) == list(range(1, STEPS + 1)), sorted(a)
    # the per-op attribution at steps 2 and 4 only, and the steps exact all the same
    for step in (1, 3):
        assert not [k for k in a[step] if "tim_attr/" in k], step
    for step in (2, 4):
        m = a[step]
        assert m["actor/tim_attr/all/abs_delta_mean"] > 0 and m["actor/tim_attr/all/fraction_differ"] > 0, step
        assert {k.split("/")[2] for k in m if k.startswith("actor/tim_attr/")} >= {"linear", "attention", "rotary"}
    for step, m in a.items():
        assert m["rollout_corr/k3_kl"] == 0.0, (step, m["rollout_corr/k3_kl"])
        assert m["rollout_corr/kl"] == 0.0, (step, m["rollout_corr/kl"])
        assert m["training/rollout_probs_diff_max"] == 0.0, (step, m["training/rollout_probs_diff_max"])
        assert m["actor/grad_norm"] > 0.0, step  # a real update, so the next step samples from synced new weights
        assert "timing_s/update_weights" in m
    # not vacuous for the rerun and the resume: other samples each step
    assert len({m["rollout_corr/training_log_ppl"] for m in a.values()}) == STEPS, a


def test_verl_grpo_on_cpu_fast_is_not_exact(inputs, subprocess_env):
    fast = run_job(inputs, inputs / "fast", "fast.jsonl", 1, subprocess_env, backend="fast")
    assert sorted(fast) == [1], sorted(fast)
    assert all(m["rollout_corr/k3_kl"] > 0.0 for m in fast.values()), [m["rollout_corr/k3_kl"] for m in fast.values()]
    assert all(m["training/rollout_probs_diff_max"] > 0.0 for m in fast.values())


def test_verl_grpo_resume_is_bitwise(job_a, inputs, subprocess_env):
    a_dir, a = job_a
    c_dir = inputs / "c"
    from verl.utils.checkpoint.checkpoint_manager import get_checkpoint_tracker_filename

    # A's step-2 checkpoint alone, as a job stopped after step 2 leaves it: resume_mode=auto reads verl's tracker file
    shutil.copytree(a_dir / CKPT.format(2), c_dir / CKPT.format(2))
    Path(get_checkpoint_tracker_filename(str((c_dir / CKPT.format(2)).parent))).write_text("2")
    c = run_job(inputs, c_dir, "c.jsonl", STEPS, subprocess_env, "trainer.save_freq=2", *ATTRIBUTION,
                "trainer.resume_mode=auto")  # fmt: skip
    assert sorted(c) == [3, 4], sorted(c)  # resumed, not started over
    assert c[3]["rollout_corr/k3_kl"] == 0.0 and c[3]["training/rollout_probs_diff_max"] == 0.0
    assert_same_metrics(c, a, [3, 4], "resumed from step 2 (C vs A)")
    # data.pt included: with the dataloader settings of run_grpo.sh, not the test's own
    assert_same_checkpoint(c_dir / CKPT.format(4), a_dir / CKPT.format(4), "resumed, step 4")
