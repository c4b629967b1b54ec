"""``model_engine=veomni`` with the invariant actor: verl's VeOmni configs select the vexact engine (``vexact_veomni``).

Real here: verl 0.9.1's Hydra tree with ``model_engine=veomni``, its ``VeOmniEngineConfig`` / ``VeOmniOptimizerConfig``,
``EngineRegistry``, the engine's ``initialize`` (FSDP2, VeOmni's optimizer and LR scheduler, VeOmni's parallel state),
verl's data path, and the vexact rollout engine (``vexact_engine.LLM``) whose logprobs the actor must reproduce. As in
``test_verl_actor_engine.py``, verl's platform is a CPU platform on a gloo world-size-1 group. The engine tests need
veomni (``pip install --no-deps -r requirements/veomni.txt``) and are skipped, visibly, without it; the config mapping
and the refusals need only verl.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytest.importorskip("verl", reason="verl is not installed: pip install 'vexact-verl[verl]'")

from verl.trainer.config import CheckpointConfig  # noqa: E402
from verl.workers.config import HFModelConfig, VeOmniOptimizerConfig  # noqa: E402
from verl.workers.engine.base import EngineRegistry  # noqa: E402
from verl_batches import packed_batch  # noqa: E402

from vexact_engine import LLM, EngineConfig, SamplingParams  # noqa: E402
from vexact_models import default_checkpoint  # noqa: E402
from vexact_verl.veomni_engine import (  # noqa: E402
    VEOMNI_BACKEND,
    VexactVeOmniEngineConfig,
    VexactVeOmniEngineWithLMHead,
    fsdp_config_from_veomni,
)

needs_veomni = pytest.mark.skipif(
    importlib.util.find_spec("veomni") is None,
    reason="veomni is not installed: pip install --no-deps -r requirements/veomni.txt",
)
TARGET = "vexact_verl.veomni_engine.VexactVeOmniEngineConfig"


def make_engine(family: str = "qwen3", **veomni_kw):
    model_config = HFModelConfig(path=str(default_checkpoint(family)), enable_gradient_checkpointing=True)
    model_config.model_type = "language_model"  # what verl's TrainingWorker sets before EngineRegistry.new
    engine_config = VexactVeOmniEngineConfig(mixed_precision=True, **veomni_kw)  # verl's veomni.yaml: true
    engine = EngineRegistry.new(
        model_type="language_model",
        backend=engine_config.strategy,
        model_config=model_config,
        engine_config=engine_config,
        optimizer_config=VeOmniOptimizerConfig(lr=1e-3, total_training_steps=10),
        checkpoint_config=CheckpointConfig(),
    )
    engine.initialize()
    return engine


def rollout(family: str, device: str):
    """Prompts, sampled responses, their rollout logprobs and temperatures from the vexact engine (invariant)."""
    prompts = [[257, 72, 101], [257, 49, 43, 49, 61, 50], [257, 10], [257, 120, 61]]
    temps = [0.7, 1.0, 1.3, 0.9]  # 0.7 and 1.3 are not bf16-representable: the temperature must stay fp32
    llm = LLM(
        str(default_checkpoint(family)), config=EngineConfig(max_model_len=64, seed=3, device=device, num_kv_blocks=64)
    )
    params = [SamplingParams(temperature=t, max_tokens=6, seed=i, ignore_eos=True) for i, t in enumerate(temps)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return prompts, [o.token_ids for o in outs], [o.logprobs for o in outs], temps


@pytest.fixture
def device(verl_device):
    return verl_device


def actor_log_probs(engine, prompts, responses, temps) -> list[torch.Tensor]:
    from verl.workers.utils.padding import no_padding_2_padding

    data = packed_batch(prompts, responses, torch.tensor(temps, dtype=torch.float32), calculate_entropy=False)
    with engine.eval_mode():
        out = engine.infer_batch(data, loss_function=None)
    lp = no_padding_2_padding(out["model_output"]["log_probs"], data).cpu()
    return [lp[i, : len(r)] for i, r in enumerate(responses)]


@needs_veomni
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_veomni_actor_log_probs_equal_the_rollout(device, family):
    prompts, responses, rollout_lp, temps = rollout(family, device)
    engine = make_engine(family)
    assert isinstance(engine, VexactVeOmniEngineWithLMHead)
    assert type(engine.optimizer).__module__.startswith("torch.optim")  # VeOmni's builder returns torch's AdamW
    actor_lp = actor_log_probs(engine, prompts, responses, temps)
    rollout_lp = [r.cpu() for r in rollout_lp]
    for i, (a, r) in enumerate(zip(actor_lp, rollout_lp, strict=True)):
        assert torch.equal(a, r.to(a.dtype)), (i, a, r)
    engine.kernel_backend = "fast"  # the mismatch baseline must be seen failing the same check
    fast = actor_log_probs(engine, prompts, responses, temps)
    assert not all(torch.equal(a, r.to(a.dtype)) for a, r in zip(fast, rollout_lp, strict=True))


@needs_veomni
def test_veomni_parallel_state_is_set_as_verls_veomni_engine_sets_it(device):
    from veomni.distributed import parallel_state

    make_engine()
    ps = parallel_state.get_parallel_state()
    assert (ps.dp_size, ps.ulysses_size, ps.ep_size) == (1, 1, 1)


def test_hydra_model_engine_veomni_selects_the_vexact_engine_for_actor_and_ref(device, actor_ref_configs):
    def configs(*extra):
        return actor_ref_configs("model_engine=veomni", *extra)

    actor, ref = configs(
        f"actor_rollout_ref.actor.veomni._target_={TARGET}", f"actor_rollout_ref.ref.veomni._target_={TARGET}"
    )
    assert actor.strategy == "veomni"  # verl's own checks on actor.strategy (router replay, ...) are unchanged
    assert actor.engine.strategy == ref.engine.strategy == VEOMNI_BACKEND
    assert ref.engine.forward_only and not actor.engine.forward_only
    assert EngineRegistry.get_engine_cls("language_model", actor.engine.strategy) is VexactVeOmniEngineWithLMHead
    # the trap this replaces: actor.strategy=vexact does not reach a VeOmni engine config (verl does not copy it
    # there as it does for FSDP), so verl would build its own VeOmni engine
    actor, _ = configs("actor_rollout_ref.actor.strategy=vexact")
    assert (actor.strategy, actor.engine.strategy) == ("vexact", "veomni")
    # the vexact engine's own settings: the config's vexact section, carried into the FSDP config the engine runs on
    actor, _ = configs(
        f"actor_rollout_ref.actor.veomni._target_={TARGET}",
        "+actor_rollout_ref.actor.veomni.vexact.tim_attribute_every=10",
        "actor_rollout_ref.actor.veomni.mixed_precision=true",
    )
    assert actor.engine.vexact == {"tim_attribute_every": 10}
    assert fsdp_config_from_veomni(actor.engine).vexact == {"tim_attribute_every": 10}


def test_veomni_plan_maps_onto_the_fsdp_engine():
    cfg = VexactVeOmniEngineConfig(
        mixed_precision=True, fsdp_size=4, param_offload=True, optimizer_offload=True, enable_fsdp_offload=True,
        forward_prefetch=True, seed=7, use_dynamic_bsz=True, max_token_len_per_gpu=4096,
    )  # fmt: skip
    fsdp = fsdp_config_from_veomni(cfg)
    assert fsdp.strategy == VEOMNI_BACKEND
    assert (fsdp.fsdp_size, fsdp.param_offload, fsdp.optimizer_offload, fsdp.offload_policy) == (4, True, True, True)
    assert (fsdp.forward_prefetch, fsdp.seed, fsdp.use_dynamic_bsz, fsdp.max_token_len_per_gpu) == (True, 7, True, 4096)
    assert fsdp.reshard_after_forward and fsdp.ulysses_sequence_parallel_size == 1 and fsdp.mixed_precision is None
    # VeOmni's attention / MoE kernel choice for its own model is read by nothing: the vexact model runs vexact's
    assert fsdp_config_from_veomni(VexactVeOmniEngineConfig(mixed_precision=True, attn_implementation="sdpa"))


@pytest.mark.parametrize(
    "field,value",
    [
        ("ulysses_parallel_size", 2),
        ("expert_parallel_size", 2),
        ("mixed_precision", False),
        ("rms_norm_implementation", "triton"),
        ("enable_async_activation_offload", True),
        ("pad_to_length", True),
    ],
)
def test_veomni_settings_that_change_the_numerics_are_refused_by_name(field, value):
    kw = {"mixed_precision": True, field: value}
    with pytest.raises(NotImplementedError, match=field):
        fsdp_config_from_veomni(VexactVeOmniEngineConfig(**kw))


def test_the_veomni_backend_refuses_an_fsdp_config(device):
    from verl.workers.config import FSDPEngineConfig

    model_config = HFModelConfig(path=str(default_checkpoint()))
    model_config.model_type = "language_model"
    with pytest.raises(TypeError, match="VeOmniEngineConfig"):
        VexactVeOmniEngineWithLMHead(
            model_config, FSDPEngineConfig(), VeOmniOptimizerConfig(lr=1e-3), CheckpointConfig()
        )
