"""Shared by the verl tests: verl's own trainer config with the vexact rollout on the tiny model, and where verl's
actor engine runs (``verl_device``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(Path(__file__).parent))  # verl_batches.py, shared by the engine tests (importlib mode)


@pytest.fixture(scope="session")
def subprocess_env():
    """``env(**extra)``: this process's environment for a child that must run this interpreter (first on PATH, for
    scripts that call ``python3``) and import the monorepo's packages whether or not they are installed."""

    def env(**extra: str) -> dict[str, str]:
        out = dict(os.environ)
        out["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{out.get('PATH', '')}"
        srcs = [str(p) for p in sorted((ROOT / "packages").glob("*/src"))]
        out["PYTHONPATH"] = os.pathsep.join([*srcs, str(ROOT), *filter(None, [out.get("PYTHONPATH")])])
        out.update(extra)
        return out

    return env


@pytest.fixture(scope="module")
def compose_rollout_config():
    """``compose(*extra, family="qwen3")``: verl's ``ppo_trainer`` config, as ``python -m vexact_verl.main_ppo
    <overrides>`` builds it, with the vexact rollout on the tiny checkpoint of ``family`` (``qwen3``, ``qwen3_moe``,
    ``llama``, ...; small lengths and KV cache) plus ``extra`` overrides."""

    def compose(*extra: str, family: str = "qwen3"):
        import verl
        from hydra import compose as hydra_compose
        from hydra import initialize_config_dir

        from vexact_models import default_checkpoint

        overrides = [
            "actor_rollout_ref.rollout.name=vexact",
            f"actor_rollout_ref.model.path={default_checkpoint(family)}",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
            "actor_rollout_ref.rollout.prompt_length=16",
            "actor_rollout_ref.rollout.response_length=8",
            "actor_rollout_ref.rollout.max_num_seqs=8",
            "actor_rollout_ref.rollout.max_num_batched_tokens=64",
            "actor_rollout_ref.rollout.calculate_log_probs=True",
            "+actor_rollout_ref.rollout.engine_kwargs.vexact.num_kv_blocks=64",
            "+actor_rollout_ref.rollout.engine_kwargs.vexact.block_size=4",
            *extra,
        ]
        config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            return hydra_compose("ppo_trainer", overrides=overrides)

    return compose


@pytest.fixture(scope="module")
def actor_ref_configs():
    """``configs(*overrides)``: the actor's and the ref's config dataclasses that verl builds from its
    ``ppo_trainer`` tree with these Hydra overrides (tiny checkpoint, micro-batches of 2), the ref's section rewritten
    as ``ActorRolloutRefWorker.init_model`` does before its engine is made."""

    def configs(*extra: str):
        import verl
        from hydra import compose, initialize_config_dir
        from omegaconf import open_dict
        from verl.utils.config import omega_conf_to_dataclass

        from vexact_models import default_checkpoint

        overrides = [
            f"actor_rollout_ref.model.path={default_checkpoint()}",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.rollout.n=1",
            *extra,
        ]
        config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            cfg = compose("ppo_trainer", overrides=overrides)
        ref_node = cfg.actor_rollout_ref.ref
        with open_dict(ref_node):
            ref_node.ppo_mini_batch_size = cfg.actor_rollout_ref.actor.ppo_mini_batch_size
            ref_node.ppo_micro_batch_size = ref_node.pop("log_prob_micro_batch_size", None)
            ref_node.ppo_micro_batch_size_per_gpu = ref_node.pop("log_prob_micro_batch_size_per_gpu", None)
            ref_node.use_dynamic_bsz = ref_node.pop("log_prob_use_dynamic_bsz", False)
            ref_node.ppo_max_token_len_per_gpu = ref_node.pop("log_prob_max_token_len_per_gpu", None)
        return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor), omega_conf_to_dataclass(ref_node)

    return configs


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def verl_device(request, monkeypatch):
    """Where verl's actor engine runs: ``cpu`` (a CPU platform set for the test, verl 0.9.1 has none) or ``cuda``
    (verl's own platform); a world-size-1 process group, the vexact engines registered."""
    import torch
    from verl.plugin.platform import platform_manager

    from vexact_trainer import init_distributed
    from vexact_verl.cpu_platform import CPUPlatform
    from vexact_verl.registration import register_engine

    if request.param == "cpu":
        monkeypatch.setattr(platform_manager, "_current_platform", CPUPlatform())
        # verl's checkpoint restores the "device" RNG through the platform's module: on CPU that is torch's own
        monkeypatch.setattr(torch.cpu, "set_rng_state", torch.set_rng_state, raising=False)
    init_distributed(request.param)  # world size 1: gloo on CPU (NCCL as well where a GPU is present)
    register_engine()
    return request.param
