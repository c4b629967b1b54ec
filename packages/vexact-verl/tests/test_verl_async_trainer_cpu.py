"""verl's asynchronous trainers end to end on CPU with the vexact rollout and actor: ``trainer.v1.trainer_mode`` =
``separate_async`` (a standalone rollout replica on its own "GPU" slot, ``actor_rollout_ref.hybrid_engine=False``,
weights through verl's ``CheckpointEngineManager`` with backend ``gloo``) and ``colocate_async`` (the hybrid
replica, aborted, put to sleep and woken with new weights around each training step). Both with partial rollouts
through verl's ``FullyAsyncLLMServerClient`` and verl's own ``ReplayBuffer``; ``examples/verl_grpo/run_grpo.sh`` with
``VERL_PLATFORM=cpu``, two steps on the tiny model.

verl's ``rollout_corr/*`` compare the rollout's logprobs with the actor's *current* weights. A step whose batch came
entirely from those weights (verl's ``training/off_policy/trajectory_staleness`` 0, computed from the versions the
vexact server stamps on each reply) must log K3, KL and the largest |p_rollout - p_actor| as exactly 0.0; a stale step
logs K3 > 0, which is then staleness alone. Each separate-placement step logs the gloo engine's sync
(``vexact/weight_sync/bytes``).

With :class:`vexact_verl.agent_loop.VersionedAgentLoopManager` each response reaches the actor with the policy version
of every token, and with ``vexact.keep_previous_version=true`` the actor holds the weights of the current and the
previous version: every step logs ``actor/vexact/behavior/k3`` (each token against the actor's logprob at its own
version) as exactly 0.0 with no token differing and none left unchecked, stale steps included, and the staleness of
its tokens (``actor/vexact/staleness/*``) as verl's trajectory staleness shows it. In ``separate_async`` the version
travels as with verl's ``nccl`` backend: the ``gloo`` engine moves bytes only, the actor learns its version from
verl's ``update_weights(global_steps=v)`` and the rollout server from verl's ``CheckpointEngineWorker``.

The same check fails when the versions are wrong (``version_faults.py``): with the rollout server told no version after
the initial one (as if the version did not travel with the checkpoint engine's weights), tokens of retrained weights
carry version 0 and a later step finds tokens it cannot check at their labelled version; with the server told one
version too many, a later step rescores tokens at the wrong weights and logs K3 > 0 with tokens that differ.
"""

from __future__ import annotations

import json
import os
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
FAULT_STEPS = 3  # a step's batch holds the previous version's tokens: the first retrained version is checked at 3

MODES = {
    "separate_async": (
        "+ray_kwargs.ray_init.num_gpus=2",
        # train_batch_size = parameter_sync_step * mini-batch; 2: the second mini-batch's old_log_prob is scored on the
        # weights restored from the host (DetachActorWorker.restore_model_from_cpu with the vexact engine)
        "trainer.v1.separate_async.parameter_sync_step=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.hybrid_engine=False",
        "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=1",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=gloo",
        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=16",
    ),
    "colocate_async": ("+ray_kwargs.ray_init.num_gpus=1", "actor_rollout_ref.actor.ppo_mini_batch_size=4"),
}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, subprocess_env):
    d = tmp_path_factory.mktemp("verl_async")
    py = sys.executable
    subprocess.run([py, str(ROOT / "examples/verl_grpo/make_model.py"), "--out", str(d / "model"), "--hidden", "64",
                    "--layers", "2"], check=True, env=subprocess_env())  # fmt: skip
    subprocess.run([py, str(ROOT / "examples/verl_grpo/make_dataset.py"), "--out", str(d / "data"), "--train", "32",
                    "--test", "8"], check=True, env=subprocess_env())  # fmt: skip
    return d


def run_async(inputs: Path, mode: str, subprocess_env, steps: int = STEPS, fault: str | None = None) -> list[dict]:
    """``steps`` steps of verl's ``mode`` trainer; ``fault``: one of ``version_faults.py``, in every process."""
    name = f"{mode}-{fault}" if fault else mode
    out = inputs / f"run-{name}"
    env = subprocess_env(VERL_PLATFORM="cpu", MODEL=str(inputs / "model"), DATA=str(inputs / "data"),
                         BACKEND="invariant", STEPS=str(steps), LR="1e-4", RUN_DIR=str(out), NAME=mode,
                         # verl 0.9.1, hybrid_engine=False: logger.info(..., flush=True) is a TypeError at INFO
                         VERL_LOGGING_LEVEL="WARN")  # fmt: skip
    env.pop("RAY_ADDRESS", None)  # a cluster of its own
    if fault:
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env["PYTHONPATH"]])
        env["VERL_USE_EXTERNAL_MODULES"] = "version_faults"
        env["VEXACT_VERSION_FAULT"] = fault
    cmd = ["bash", str(ROOT / "examples/verl_grpo/run_grpo.sh"), *MODES[mode],
           "+ray_kwargs.ray_init.num_cpus=16", "+ray_kwargs.ray_init.include_dashboard=False",
           f"trainer.v1.trainer_mode={mode}",
           "trainer.v1.sampler.custom_sampler.path=null", "trainer.v1.sampler.custom_sampler.name=null",
           "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
           "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4", "actor_rollout_ref.actor.strategy=vexact",
           "reward.num_workers=1", "actor_rollout_ref.rollout.agent.num_workers=1",
           "+actor_rollout_ref.rollout.agent.agent_loop_manager_class="
           "vexact_verl.agent_loop.VersionedAgentLoopManager",
           "actor_rollout_ref.actor.fsdp_config._target_=vexact_verl.actor_engine.VexactFSDPEngineConfig",
           "+actor_rollout_ref.actor.fsdp_config.vexact.keep_previous_version=true",
           "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
           f"reward.custom_reward_function.path={ROOT / 'examples/verl_grpo/reward.py'}"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        tail = f"{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
        raise AssertionError(f"verl run ({mode}) failed, rc {proc.returncode}:\n{tail}")
    records = [json.loads(line) for line in (out / f"{mode}.jsonl").read_text().splitlines() if line.strip()]
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    return [r["data"] for r in sorted(records, key=lambda r: r["step"])]


# colocate_async costs another 1-2 minutes on 2 cores: run with VEXACT_ASYNC_E2E=all (as tests/test_recipes.py's
# VEXACT_RECIPE_SMOKE=all)
ALL = os.environ.get("VEXACT_ASYNC_E2E") == "all"
only_with_all = pytest.mark.skipif(not ALL, reason="a 1-2 minute CPU verl run: VEXACT_ASYNC_E2E=all runs it")


SHOWN = ("rollout_corr/k3_kl", "training/off_policy/trajectory_staleness/mean", "actor/vexact/behavior/k3",
         "actor/vexact/behavior/tokens_differ", "actor/vexact/staleness/max", "actor/vexact/staleness/min",
         "actor/vexact/behavior/tokens_checked", "actor/vexact/behavior/tokens_unchecked")  # fmt: skip


def version_check_failures(m: dict) -> list[str]:
    """What a step's ``actor/vexact/behavior/*`` say is wrong: every token must be checked at its own version (the
    actor's current or previous one) and equal there, bit for bit."""
    k3, differ = m.get("actor/vexact/behavior/k3"), m.get("actor/vexact/behavior/tokens_differ")
    checked, unchecked = m.get("actor/vexact/behavior/tokens_checked"), m.get("actor/vexact/behavior/tokens_unchecked")
    failures = []
    if k3 != 0.0:
        failures.append(f"k3 {k3}")
    if differ != 0:
        failures.append(f"{differ} tokens differ")
    if not checked or unchecked != 0:
        failures.append(f"{checked} tokens checked, {unchecked} not")
    return failures


@pytest.mark.parametrize("mode", ["separate_async", pytest.param("colocate_async", marks=only_with_all)])
def test_verl_async_trainer_on_cpu_is_exact_where_on_policy(inputs, subprocess_env, mode):
    steps = run_async(inputs, mode, subprocess_env)
    assert len(steps) == STEPS
    on_policy = 0
    for step, m in enumerate(steps, 1):
        assert m["actor/grad_norm"] > 0.0, step  # a real update: the next versions differ
        assert "timing_s/update_weights" in m, step
        if mode == "separate_async":
            assert m["vexact/weight_sync/bytes"] > 0, step  # the gloo checkpoint engine carried this step's sync
        stale = m["training/off_policy/trajectory_staleness_worst/max"]
        print(mode, step, {k: m.get(k) for k in SHOWN})
        # every token checked at its own version (the current or the previous one, held on the host): exact
        assert not version_check_failures(m), (step, version_check_failures(m))
        # verl's is over the step's batch; the actor's, per old_log_prob call (two in a separate_async step), averaged
        assert 0 <= m["actor/vexact/staleness/max"] <= stale and (m["actor/vexact/staleness/max"] > 0) == (stale > 0)
        if stale == 0:  # every token from the actor's current weights
            on_policy += 1
            assert m["rollout_corr/k3_kl"] == 0.0, (step, m["rollout_corr/k3_kl"])
            assert m["rollout_corr/kl"] == 0.0, (step, m["rollout_corr/kl"])
            assert m["training/rollout_probs_diff_max"] == 0.0, (step, m["training/rollout_probs_diff_max"])
        else:  # measured against newer weights: staleness, not mismatch
            assert m["rollout_corr/k3_kl"] > 0.0, (step, stale)
    assert on_policy >= 1  # the first step trains on the warm-up batch of the initial weights
    # Whether a later step is stale depends on timing (it was in every run seen); the check of stale tokens at their
    # own version is held without timing by test_verl_actor_engine.py's
    # test_old_log_prob_checks_each_token_at_its_version


# each fault is a 3-step verl run (about 100 s on 2 cores); "ahead" shows the check failing on the bits (K3 > 0, tokens
# that differ), "untold" on the versions' bookkeeping (tokens it cannot check) and runs with VEXACT_ASYNC_E2E=all
@pytest.mark.parametrize("fault", [pytest.param("untold", marks=only_with_all), "ahead"])
def test_separate_async_check_fails_when_the_rollout_is_told_a_wrong_version(inputs, subprocess_env, fault):
    """The rollout server told a wrong version from the first retrained weights on (``version_faults.py``): the first
    step's tokens (the initial weights, version 0, told right) pass the actor's check, and a later step fails it."""
    try:
        steps = run_async(inputs, "separate_async", subprocess_env, steps=FAULT_STEPS, fault=fault)
    except AssertionError as e:  # "ahead" labels a token the trainer has not made yet where a batch holds one
        assert fault == "ahead" and "is ahead of the trainer's" in str(e), e
        return
    assert len(steps) == FAULT_STEPS
    failures = {}
    for step, m in enumerate(steps, 1):
        assert m["actor/grad_norm"] > 0.0, step
        print(fault, step, {k: m.get(k) for k in SHOWN})
        failures[step] = version_check_failures(m)
    assert not failures[1], failures
    assert any(failures[s] for s in range(2, FAULT_STEPS + 1)), failures
    if fault == "ahead":  # tokens rescored at the wrong weights: they differ, and K3 says so
        assert any(m.get("actor/vexact/behavior/k3", 0.0) > 0.0 for m in steps[1:]), failures
