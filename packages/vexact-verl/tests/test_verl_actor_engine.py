"""``actor.strategy=vexact``: verl's own engine, built by verl's registry, scores == the vexact trainer, bitwise.

What is real here: verl 0.9.1's ``EngineRegistry``, ``HFModelConfig`` / ``FSDPEngineConfig`` / ``FSDPOptimizerConfig``,
the engine's ``initialize`` (FSDP2 wrapping through verl's helpers, optimizer, LR scheduler), verl's data path
(``left_right_2_no_padding``, ``infer_batch`` -> ``forward_backward_batch`` -> micro-batches -> ``forward_step``,
``no_padding_2_padding``) and ``get_per_tensor_param``. What is replaced: verl's *platform* (verl 0.9.1 has no CPU
platform and falls back to CUDA): a CPU platform is put in verl's platform singleton (the slot ``set_platform`` fills)
and ``torch.cpu`` lends verl's checkpoint a ``set_rng_state``, both by monkeypatch for a test's duration; the process
group is gloo, world size 1. Every test also has a ``cuda`` variant (marked ``gpu``, skipped without a
GPU) that runs the same path on verl's real CUDA platform (NCCL; the ref's FSDP2 CPU-offload policy is active there).
Not exercised here: verl's Ray trainer workers (``TrainingWorker``) and a PPO step driven by verl's trainer.
Scoring, the per-tensor export and the HF export also run on the tiny Qwen3-MoE checkpoint (``family`` ``qwen3_moe``),
the tiny Llama (``llama``: ``actor.strategy=vexact`` accepts a family other than Qwen3; its head is tied) and the tiny
DeepSeek-V3 (``deepseek_v3``).
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("verl", reason="verl is not installed: pip install 'vexact-verl[verl]'")

from tensordict import TensorDict  # noqa: E402
from verl.trainer.config import CheckpointConfig  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import FSDPOptimizerConfig, HFModelConfig  # noqa: E402
from verl.workers.engine.base import EngineRegistry  # noqa: E402
from verl.workers.utils.padding import no_padding_2_padding  # noqa: E402
from verl_batches import packed_batch  # noqa: E402

from vexact_models import (  # noqa: E402
    checkpoint_pieces,
    default_checkpoint,
    expected_tensors,
    iter_checkpoint,
    load_model,
)
from vexact_trainer import Actor, init_distributed  # noqa: E402
from vexact_verl.actor_engine import VexactEngineWithLMHead, VexactFSDPEngineConfig  # noqa: E402
from vexact_verl.engine_builder import build_actor_engine  # noqa: E402
from vexact_verl.registration import is_engine_registered  # noqa: E402
from vexact_verl.tim import ATTR_KEYS, AttributionConfig  # noqa: E402

PROMPTS = [[257, 72, 101], [257, 49, 43, 49, 61, 50], [257, 10], [257, 120, 61]]
RESPONSES = [[50, 51, 52, 256], [33], [97, 98, 99, 100, 101], [55, 56]]
TEMPS = [0.5, 1.0, 1.3, 0.8]


@pytest.fixture
def device(verl_device):
    return verl_device


FAMILIES = ["qwen3", "qwen3_moe", "llama", "deepseek_v3"]  # default_checkpoint families (Llama: tied head)


def verl_batch(temperature) -> TensorDict:
    """The batch verl's trainer hands ``compute_log_prob``: left-padded prompts, right-padded responses."""
    return packed_batch(PROMPTS, RESPONSES, temperature)


def verl_log_probs(engine, temperature):
    data = verl_batch(temperature)
    with engine.eval_mode():
        out = engine.infer_batch(data, loss_function=None)
    lp = no_padding_2_padding(out["model_output"]["log_probs"], data)
    ent = no_padding_2_padding(out["model_output"]["entropy"], data)
    return lp.cpu(), ent.cpu()


def trainer_log_probs(temperature, device, family: str = "qwen3"):
    temps = temperature.tolist() if isinstance(temperature, torch.Tensor) else temperature
    model = load_model(default_checkpoint(family), device=device)
    return Actor(model).compute_log_probs(PROMPTS, RESPONSES, temps, with_entropy=True)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("forward_only", [False, True], ids=["actor", "ref"])
@pytest.mark.parametrize("temperature", [0.7, torch.tensor(TEMPS)], ids=["scalar", "per_sample"])
def test_verl_engine_logprobs_equal_trainer(device, temperature, forward_only, family):
    assert is_engine_registered()
    engine = build_actor_engine(forward_only=forward_only, family=family)
    assert type(engine) is VexactEngineWithLMHead
    lp, ent = verl_log_probs(engine, temperature)
    want = trainer_log_probs(temperature, device, family)
    for i, r in enumerate(RESPONSES):
        assert torch.equal(lp[i, : len(r)], want.logprobs[i].cpu()), f"sequence {i}"
        assert torch.equal(ent[i, : len(r)], want.entropy[i].cpu()), f"sequence {i}"


def test_fast_kernels_fail_the_same_check(device):
    engine = build_actor_engine(forward_only=True)
    engine.kernel_backend = "fast"
    lp, _ = verl_log_probs(engine, 1.0)
    want = trainer_log_probs(1.0, device)
    assert not all(torch.equal(lp[i, : len(r)], want.logprobs[i].cpu()) for i, r in enumerate(RESPONSES))


@pytest.mark.parametrize("family", FAMILIES)
def test_weight_export_keeps_hf_names(device, family):
    """verl's per-tensor export carries the checkpoint's names: the module's HF names, and for an MoE layer the
    stacked experts (``mlp.experts.gate_up_proj [E, 2I, H]``, transformers' layout) split one tensor per expert and
    projection by verl's own ``unfuse_moe_params``, as the rollout's ``update_weights`` receives them."""
    engine = build_actor_engine(forward_only=False, family=family)
    params, peft = engine.get_per_tensor_param()
    got = dict(params)
    want = dict(iter_checkpoint(default_checkpoint(family)))
    if engine.module.config.tie_word_embeddings:  # sent under both names, as verl sends an HF model's state dict
        assert torch.equal(got.pop("lm_head.weight"), got["model.embed_tokens.weight"])
    assert peft is None and sorted(got) == sorted(want)
    for name, t in want.items():
        assert torch.equal(got[name].to(t.dtype).cpu(), t), name  # fp32 master of a bf16 checkpoint: exact
    stacked = [n for n, _ in engine.module.named_parameters() if n.endswith("experts.gate_up_proj")]
    assert bool(stacked) == (family in ("qwen3_moe", "deepseek_v3"))


def test_refusals_name_the_setting(device):
    with pytest.raises(NotImplementedError, match="ulysses_sequence_parallel_size"):
        build_actor_engine(forward_only=True, ulysses_sequence_parallel_size=2)
    with pytest.raises(ValueError, match="param_dtype=torch.float16"):
        build_actor_engine(forward_only=True, mixed_precision={"param_dtype": "fp16"})


def test_build_actor_engine_refuses_by_name():
    with pytest.raises(ValueError, match=r"strategy 'fsdp' is not built here; allowed: \['vexact', 'fsdp2'\]"):
        build_actor_engine("fsdp")
    with pytest.raises(ValueError, match="a checkpoint path or a family, not both"):
        build_actor_engine(path=default_checkpoint(), family="qwen3")


def _response_rows(seq_lens: list[int]) -> torch.Tensor:
    """Packed rows that predict a response token (position j predicts token j+1), in packed order."""
    rows, start = [], 0
    for p, n in zip(map(len, PROMPTS), seq_lens, strict=True):
        rows.extend(range(start + p - 1, start + n - 1))
        start += n
    return torch.tensor(rows)


@pytest.mark.parametrize("family", FAMILIES)
def test_training_gradients_equal_trainer(device, family):
    """One verl training micro-batch (gradient checkpointing on, as verl's default) == the vexact trainer's FSDP2
    gradients for the same loss, bitwise (seen failing with ``kernel_backend="fast"``); the MoE's router and stacked
    experts included."""
    from vexact_trainer import pack, parallelize

    seq_lens = [len(p) + len(r) for p, r in zip(PROMPTS, RESPONSES, strict=True)]
    rows = _response_rows(seq_lens).to(device)

    def loss_fn(model_output, data, dp_group=None):
        loss = -model_output["log_probs"].values()[rows].sum()
        return loss, {}

    engine = build_actor_engine(forward_only=False, family=family)
    data = verl_batch(1.0)
    tu.assign_non_tensor(data, micro_batch_size_per_gpu=len(PROMPTS))  # one micro-batch: no accumulation order
    with engine.train_mode(zero_grad_on_exit=False):
        engine.optimizer_zero_grad()
        engine.forward_backward_batch(data, loss_fn, forward_only=False)
    # DeepSeek's e_score_correction_bias only steers the expert choice: it gets no gradient, in either trainer
    got = {n: p.grad.full_tensor() for n, p in engine.module.named_parameters() if p.grad is not None}

    model = load_model(default_checkpoint(family), dtype="float32").requires_grad_(True)
    model = parallelize(model, init_distributed(device))
    cfg = model.config
    batch = pack(PROMPTS, RESPONSES, cfg.vocab_size, cfg.max_position_embeddings)
    lp, _ = Actor(model).forward_packed(batch, 1.0)
    (-lp[rows].sum()).backward()
    want = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    assert sorted(got) == sorted(want)
    assert all(n.endswith("e_score_correction_bias") for n, _ in model.named_parameters() if n not in want)
    assert all(torch.equal(got[n], want[n]) for n in want), [n for n in want if not torch.equal(got[n], want[n])]
    assert any(want[n].abs().sum() > 0 for n in want)


def _sum_loss(model_output, data, dp_group=None):
    lp = model_output["log_probs"]
    keep = torch.ones_like(lp.values(), dtype=torch.bool)
    keep[lp.offsets()[1:] - 1] = False  # each sequence's last row is scored against the next sequence
    return -lp.values()[keep].sum(), {}


def test_train_batch_steps_the_optimizer(device):
    """verl's ``train_batch`` (zero grad, micro-batches, FSDP2 grad clipping, AdamW step) moves the weights that the
    per-tensor export then carries."""
    engine = build_actor_engine(forward_only=False)
    before = {n: t.clone() for n, t in engine.get_per_tensor_param()[0]}
    with engine.train_mode():
        out = engine.train_batch(verl_batch(1.0), _sum_loss)
    after = dict(engine.get_per_tensor_param()[0])
    assert 0 < out["metrics"]["grad_norm"] < float("inf")
    assert all(not torch.equal(before[n], after[n]) for n in before), "every tensor takes an AdamW step"


def test_old_log_prob_time_is_logged_by_the_next_step(device):
    """verl's old_log_prob (``infer_batch``) is timed on the engine's side, the whole call and its forwards, and the
    next training step logs the sums once: what of verl's ``timing_s/old_log_prob`` is ours."""
    engine = build_actor_engine(forward_only=False)
    with engine.eval_mode():
        engine.infer_batch(verl_batch(1.0), loss_function=None)
        engine.infer_batch(verl_batch(1.0), loss_function=None)
    with engine.train_mode():
        first = engine.train_batch(verl_batch(1.0), _sum_loss)["metrics"]
        second = engine.train_batch(verl_batch(1.0), _sum_loss)["metrics"]
    (whole,), (forward,), (micro,) = (first[k] for k in TIMING_KEYS)
    assert 0 < forward <= whole and micro >= 2  # two calls, one micro-batch or more each
    assert not [k for k in TIMING_KEYS if k in second]  # logged once, by the step after the old_log_prob


TIMING_KEYS = ("vexact/perf/infer_batch_s", "vexact/perf/infer_forward_s", "vexact/perf/infer_micro_batches")


def test_checkpoint_round_trip(device, tmp_path):
    """verl's checkpoint save/load: a fresh engine that loads it continues training exactly as the saved one."""
    a = build_actor_engine(forward_only=False)
    with a.train_mode():
        a.train_batch(verl_batch(1.0), _sum_loss)
    a.save_checkpoint(str(tmp_path), global_step=1)
    assert (tmp_path / "huggingface" / "config.json").is_file()
    assert a.module.config is not None and not hasattr(a.module, "can_generate")  # the model's own config is back
    b = build_actor_engine(forward_only=False)
    b.load_checkpoint(str(tmp_path))
    for engine in (a, b):
        with engine.train_mode():
            engine.train_batch(verl_batch(1.0), _sum_loss)  # a second step needs the optimizer state too
    got, want = dict(b.get_per_tensor_param()[0]), dict(a.get_per_tensor_param()[0])
    assert all(torch.equal(got[n], want[n]) for n in want)


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_model_checkpoint_holds_the_trained_weights(device, tmp_path, family):
    """``hf_model`` in ``save_contents``: verl's HF export of the trained actor loads back, by vexact-models and by
    transformers (``Qwen3MoeForCausalLM`` for the MoE), with exactly the engine's weights."""
    from transformers import AutoModelForCausalLM

    contents = ["model", "optimizer", "extra", "hf_model"]
    engine = build_actor_engine(
        checkpoint_config=CheckpointConfig(save_contents=contents, load_contents=contents), family=family
    )
    with engine.train_mode():
        engine.train_batch(verl_batch(1.0), _sum_loss)
    engine.save_checkpoint(str(tmp_path), global_step=1)
    trained = {n: t.detach().cpu() for n, t in engine.get_per_tensor_param()[0]}  # checkpoint names
    hf_dir = tmp_path / "huggingface"
    saved = dict(iter_checkpoint(hf_dir))
    assert set(saved) <= set(trained) and len(saved) >= len(trained) - 1  # a tied lm_head may be dropped
    for name, t in saved.items():
        assert torch.equal(t.to(trained[name].dtype), trained[name]), name
    # both models hold an MoE layer's experts stacked: compare their per-expert views under the checkpoint names
    ours = expected_tensors(load_model(hf_dir, dtype=torch.float32), remove_duplicate=False)  # tied: both names
    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    names = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "llama": "LlamaForCausalLM",
             "deepseek_v3": "DeepseekV3ForCausalLM"}  # fmt: skip
    assert type(hf_model).__name__ == names[family]
    # state_dict: both names of a tied weight, and DeepSeek's e_score_correction_bias (a buffer in transformers)
    hf = {piece: t for n, p in hf_model.state_dict().items() for piece, t in checkpoint_pieces(n, p)}
    for name, t in trained.items():
        assert torch.equal(ours[name].detach(), t.float()), name
        assert torch.equal(hf[name].detach(), t.float()), name


def test_one_hydra_setting_switches_actor_and_ref(device, actor_ref_configs):
    """verl's own config tree: ``actor_rollout_ref.actor.strategy=vexact`` reaches both engines' ``strategy``."""
    actor, ref = actor_ref_configs("actor_rollout_ref.actor.strategy=vexact")
    assert actor.engine.strategy == ref.engine.strategy == "vexact"
    assert EngineRegistry.get_engine_cls("language_model", actor.engine.strategy) is VexactEngineWithLMHead


def test_vexact_settings_are_hydra_keys_of_the_actor_engine_config(device, actor_ref_configs):
    """The vexact actor engine's own settings (the TIM attribution) are keys of verl's config tree, under the engine
    config's ``vexact`` section, and reach the engine."""
    actor, _ = actor_ref_configs(
        "actor_rollout_ref.actor.strategy=vexact",
        "actor_rollout_ref.actor.fsdp_config._target_=vexact_verl.actor_engine.VexactFSDPEngineConfig",
        "+actor_rollout_ref.actor.fsdp_config.vexact.tim_attribute_every=10",
        "+actor_rollout_ref.actor.fsdp_config.vexact.tim_attribute_ops=[linear,attention]",
    )
    assert isinstance(actor.engine, VexactFSDPEngineConfig) and actor.engine.strategy == "vexact"
    assert AttributionConfig.from_settings(actor.engine.vexact) == AttributionConfig(10, 4, ("linear", "attention"))
    engine = build_actor_engine(forward_only=False, vexact={"tim_attribute_every": 10})
    assert engine.tim_attribution == AttributionConfig(every=10)
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['tim_every'\]; allowed: .*'keep_previous_version'"):
        build_actor_engine(forward_only=False, vexact={"tim_every": 10})


def test_a_veomni_engine_config_is_refused_by_name(device):
    from verl.workers.config import VeOmniEngineConfig

    model_config = HFModelConfig(path=str(default_checkpoint()))
    model_config.model_type = "language_model"
    with pytest.raises(NotImplementedError, match="VeOmniEngineConfig"):
        EngineRegistry.new(
            model_type="language_model",
            backend="vexact",
            model_config=model_config,
            engine_config=VeOmniEngineConfig(),
            optimizer_config=FSDPOptimizerConfig(lr=1e-3, total_training_steps=1),
            checkpoint_config=CheckpointConfig(),
        )


def _step(engine):
    """One verl training step (``train_batch``): its output, the training forward's logprobs, the gradients and the
    stepped weights."""
    seen = []

    def loss(model_output, data, dp_group=None):
        seen.append(model_output["log_probs"].values().detach().clone())
        return _sum_loss(model_output, data, dp_group)

    with engine.train_mode(zero_grad_on_exit=False):
        out = engine.train_batch(verl_batch(torch.tensor(TEMPS)), loss)
    grads = {n: p.grad.full_tensor() for n, p in engine.module.named_parameters() if p.grad is not None}
    return out, torch.cat(seen), grads, dict(engine.get_per_tensor_param()[0])


def test_tim_attribution_is_off_by_default_and_leaves_the_step_unchanged(device):
    """The engine config's ``vexact.tim_attribute_every=N``: every N-th step logs ``tim_attr/<family>/*`` from rescoring
    a sample of the step's sequences with one op family on ``fast`` at a time; the step itself (loss, its logprobs,
    gradient norm, the weights it writes) is bitwise the step without attribution, and all-invariant gives exactly
    zero."""
    off = build_actor_engine(forward_only=False)
    assert off.tim_attribution.every == 0
    m_off, lp_off, g_off, w_off = _step(off)
    assert not [k for k in m_off["metrics"] if k.startswith("tim_attr/")]

    on = build_actor_engine(forward_only=False, vexact={"tim_attribute_every": 1, "tim_attribute_samples": 3})
    data = verl_batch(torch.tensor(TEMPS))
    control = on.tim_attribute(data, ["invariant"])  # before the step: the same weights as the step's attribution
    m_on, lp_on, g_on, w_on = _step(on)
    assert torch.equal(lp_on, lp_off)
    assert g_off and sorted(g_on) == sorted(g_off) and all(torch.equal(g_on[n], g_off[n]) for n in g_off)
    assert m_on["loss"] == m_off["loss"] and m_on["metrics"]["grad_norm"] == m_off["metrics"]["grad_norm"]
    assert sorted(w_on) == sorted(w_off) and all(torch.equal(w_on[n], w_off[n]) for n in w_off)
    leak = build_actor_engine(forward_only=False)  # what a fast kernel left set by the attribution would do: caught
    leak.kernel_backend = "fast"
    assert not torch.equal(_step(leak)[1], lp_off)

    assert control == {f"tim_attr/invariant/{k}": 0.0 for k in ATTR_KEYS}
    attr = {k: v[0] for k, v in m_on["metrics"].items() if k.startswith("tim_attr/")}
    families = ["linear", "attention", "rms_norm", "rotary", "activation", "logprobs", "all"]  # no MoE in qwen3
    assert sorted(attr) == sorted(f"tim_attr/{f}/{k}" for f in families for k in ATTR_KEYS)
    assert all(v >= 0 and math.isfinite(v) for v in attr.values())
    # the engine computes in bf16 (FSDP mixed precision); on CPU, where MKL's bf16 GEMM rounds like the invariant
    # one, linear / attention / rms_norm agree and these three families move (fp32 moves the others: test_tim_cli)
    moved = ["rotary", "activation", "logprobs", "all"] if device == "cpu" else ["all"]
    for f in moved:
        assert attr[f"tim_attr/{f}/abs_delta_mean"] > 0 and attr[f"tim_attr/{f}/fraction_differ"] > 0, f


def test_tim_attribution_runs_every_nth_step_once_per_step(device):
    """A step is verl's ``update_actor``: ``train_batch`` per mini-batch, the last flagged ``update_lr_scheduler``;
    the attribution runs on the first mini-batch of every N-th step only."""
    engine = build_actor_engine(forward_only=False)
    engine.tim_attribution = AttributionConfig(every=2, samples=1, ops=("rotary",))
    logged = []
    for last in (False, True, False, True, True):  # steps 1 (two mini-batches), 2 (two), 3 (one)
        data = verl_batch(1.0)
        tu.assign_non_tensor(data, update_lr_scheduler=last)
        with engine.train_mode():
            out = engine.train_batch(data, _sum_loss)
        logged.append(sorted(k for k in out["metrics"] if k.startswith("tim_attr/")))
    want = sorted(f"tim_attr/{f}/{k}" for f in ("rotary", "all") for k in ATTR_KEYS)
    assert logged == [[], [], want, [], []]


def versioned_batch(behavior: list[torch.Tensor], token_versions: list[list[int]]) -> TensorDict:
    """verl's ``old_log_prob`` batch of an async trainer: the rollout's logprobs and each response's ``extra_fields``
    with its tokens' policy versions (as ``VersionedAgentLoopManager`` gets them into verl's batch)."""
    data = verl_batch(1.0)
    data["rollout_log_probs"] = torch.nested.as_nested_tensor(behavior, layout=torch.jagged)
    tu.assign_non_tensor_stack(data, "extra_fields", [{"token_global_steps": v} for v in token_versions])
    return data


def test_old_log_prob_checks_each_token_at_its_version(device):
    """verl's ``old_log_prob`` pass with per-token versions: tokens of the published version compared with the
    logprobs just computed, the previous version's rescored with its host copy (``keep_previous_version``); K3 exactly
    0.0, and a token labelled with the wrong version fails the check."""
    from vexact_verl import versions

    engine = build_actor_engine(forward_only=False, vexact={"keep_previous_version": True})
    versions.publish_version(0)
    lp0 = verl_log_probs(engine, 1.0)[0]
    v0 = [[0] * len(r) for r in RESPONSES]
    with engine.eval_mode():
        engine.infer_batch(versioned_batch([lp0[i, : len(r)] for i, r in enumerate(RESPONSES)], v0))
    (first,) = engine._version_metrics
    assert first["vexact/behavior/k3"] == 0.0 and first["vexact/staleness/max"] == 0.0, first
    with torch.no_grad():  # the next version: the actor's weights moved (as by an optimizer step)
        for p in engine.module.parameters():
            p.add_(torch.full_like(p, 1e-2))
    versions.publish_version(1)
    lp1 = verl_log_probs(engine, 1.0)[0]
    assert not torch.equal(lp0, lp1)
    mixed = [[0] * (len(r) // 2) + [1] * (len(r) - len(r) // 2) for r in RESPONSES]  # resumed across the update
    scored = {0: lp0, 1: lp1}
    behavior = [torch.stack([scored[v][i, j] for j, v in enumerate(vs)]) for i, vs in enumerate(mixed)]
    wrong = [list(v) for v in mixed]
    wrong[2][0] = 1  # a version-0 token labelled as version 1
    with engine.eval_mode():
        engine.infer_batch(versioned_batch(behavior, mixed))
        engine.infer_batch(versioned_batch(behavior, wrong))
    exact, mislabeled = engine._version_metrics[1:]
    n = sum(map(len, RESPONSES))
    assert exact["vexact/behavior/k3"] == 0.0 and exact["vexact/behavior/tokens_differ"] == 0, exact
    assert exact["vexact/behavior/tokens_checked"] == n and exact["vexact/behavior/tokens_unchecked"] == 0
    assert exact["vexact/staleness/max"] == 1.0 and exact["vexact/staleness/min"] == 0.0
    assert mislabeled["vexact/behavior/k3"] > 0.0 and mislabeled["vexact/behavior/tokens_differ"] == 1, mislabeled
    assert torch.equal(verl_log_probs(engine, 1.0)[0], lp1)  # the rescoring put version 1's weights back
    # without the host copy: only the current version's tokens are checked
    engine.keep_previous_version, engine._held_versions = False, {}
    with engine.eval_mode():
        engine.infer_batch(versioned_batch(behavior, mixed))
    current_only = engine._version_metrics[-1]
    assert current_only["vexact/behavior/k3"] == 0.0
    assert current_only["vexact/behavior/tokens_unchecked"] == sum(len(r) // 2 for r in RESPONSES)
