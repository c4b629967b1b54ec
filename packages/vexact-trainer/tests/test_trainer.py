"""The FSDP2 trainer on CPU (gloo, world size 1 in-process): bf16 forward == the unsharded bf16 model, exact weight
export, checkpoints, and bad input that fails loudly or skips the step, never a silent wrong update.

World size 2 runs in contracts/test_fsdp.py (torchrun subprocess).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.distributed.tensor import DTensor

import vexact_kernels as vk
from vexact_models import default_checkpoint, load_model, random_model, tiny_qwen3_config
from vexact_trainer import (
    Actor,
    ActorConfig,
    RolloutBatch,
    Trainer,
    TrainerConfig,
    grpo_advantages,
    hf_name,
    init_distributed,
    iter_weight_buckets,
    pack,
    parallelize,
    save_hf_checkpoint,
)

VOCAB = 272


@pytest.fixture(scope="module")
def mesh():
    return init_distributed("cpu")


def _models(seed: int = 3, **overrides):
    """(fp32 master, bf16 twin) with the same values: FSDP's bf16 cast of the master is the twin."""
    cfg = tiny_qwen3_config(max_position_embeddings=96, **overrides)
    return random_model(dataclasses.replace(cfg, torch_dtype="float32"), seed), random_model(cfg, seed)


def _data(n: int, seed: int, max_prompt: int = 10, max_resp: int = 8):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (int(torch.randint(1, max_prompt, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]  # fmt: skip
    responses = [torch.randint(0, VOCAB, (int(torch.randint(1, max_resp, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(n)]  # fmt: skip
    return prompts, responses


def _batch(n: int = 4, seed: int = 0, **kw) -> RolloutBatch:
    prompts, responses = _data(n, seed)
    adv = grpo_advantages(torch.arange(n, dtype=torch.float32) % 3, group_size=2)
    return RolloutBatch(prompts, responses, adv, **kw)


def _full(model) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [False, True])
def test_fsdp_forward_and_gradients_equal_the_unsharded_bf16_model(mesh, tied):
    master, twin = _models(tie_word_embeddings=tied)
    parallelize(master.requires_grad_(True), mesh)
    prompts, responses = _data(5, seed=1)
    ours = Actor(master).compute_log_probs(prompts, responses, [0.7, 1.0, 1.3, 1.0, 0.9], with_entropy=True)
    ref = Actor(twin).compute_log_probs(prompts, responses, [0.7, 1.0, 1.3, 1.0, 0.9], with_entropy=True)
    assert all(map(torch.equal, ours.logprobs, ref.logprobs)) and all(map(torch.equal, ours.entropy, ref.entropy))
    # backward: bf16 gradients reduced in fp32 == the bf16 model's own gradients, upcast
    batch = pack(prompts, responses, VOCAB, 96)
    for model in (master, twin.requires_grad_(True)):
        lp, ent = Actor(model).forward_packed(batch, 0.8, with_entropy=True)
        (lp.sum() + 0.1 * ent.sum()).backward()
    twin_grads = {n: p.grad for n, p in twin.named_parameters()}
    for name, p in master.named_parameters():
        assert p.grad.dtype == torch.float32
        assert torch.equal(p.grad.full_tensor(), twin_grads[name].float()), name
    assert ("lm_head.weight" in twin_grads) != tied  # tied: one parameter, named as the embedding


@pytest.mark.parametrize("backend", ["invariant", "fast"])
def test_activation_checkpointing_changes_no_bit(mesh, backend):
    # the Actor sets the backend around the forward only: backward (and the checkpoint's recomputation in it) runs
    # outside that block, so the recomputation must take the forward's kernels (recompute_on_forward_kernels); on
    # the fast backend without it torch's checkpoint refused the invariant kernels' recomputed tensors
    grads = []
    for ac in (False, True):
        master, _ = _models()
        parallelize(master.requires_grad_(True), mesh, activation_checkpointing=ac)
        lp, _ = Actor(master, ActorConfig(backend=backend)).forward_packed(pack(*_data(4, 2), VOCAB, 96))
        lp.sum().backward()
        grads.append({hf_name(n): p.grad.full_tensor() for n, p in master.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    assert all(torch.equal(grads[0][k], grads[1][k]) for k in grads[0])


def test_checkpoint_recomputation_takes_the_forward_kernels():
    # the recomputation context alone: a forward on "fast", backward on the default backend
    from vexact_trainer import parallel

    seen = []
    ctx = {}
    with vk.use_backend("fast"):
        _, ctx["recompute"] = parallel.recompute_on_forward_kernels()
    with ctx["recompute"]:
        seen.append(vk.get_backend("linear"))
    assert seen == ["fast"] and vk.get_backend("linear") == "invariant"


def test_parallelize_refuses_bf16_master(mesh):
    _, twin = _models()
    with pytest.raises(ValueError, match=r"fp32 master parameters; model.embed_tokens.weight is torch.bfloat16"):
        parallelize(twin, mesh)


def test_weight_export_is_the_bf16_forward_weights_by_hf_name_in_bounded_buckets(mesh):
    master, twin = _models()
    trainer = Trainer(master, TrainerConfig(lr=1e-2, activation_checkpointing=True), mesh=mesh)
    trainer.train_step(_batch())
    buckets = list(iter_weight_buckets(trainer.model, bucket_bytes=40_000))
    names = [n for b in buckets for n, _ in b]
    assert names == [n for n, _ in twin.named_parameters()]  # HF names, wrapper prefixes stripped
    largest = max(t.numel() * 2 for b in buckets for _, t in b)
    assert len(buckets) > 3 and all(sum(t.numel() * 2 for _, t in b) <= max(40_000, largest) for b in buckets)
    full = {n.replace("_checkpoint_wrapped_module.", ""): t for n, t in _full(trainer.model).items()}
    for name, t in (x for b in buckets for x in b):
        assert t.dtype == torch.bfloat16 and torch.equal(t, full[name].to(torch.bfloat16))
    # the exported weights are what the FSDP forward computes with: load them into the twin and compare logprobs
    twin.load_state_dict(dict(x for b in buckets for x in b))
    prompts, responses = _data(4, seed=7)
    ours = trainer.compute_log_probs(prompts, responses).logprobs
    assert all(map(torch.equal, ours, Actor(twin).compute_log_probs(prompts, responses).logprobs))
    with pytest.raises(ValueError, match="bucket_bytes must be a positive integer, got 0"):
        next(iter_weight_buckets(trainer.model, bucket_bytes=0))


def test_deepseek_bias_stays_an_fp32_buffer_through_fsdp_export_and_save(mesh, tmp_path):
    """FSDP's mixed precision casts parameters only: DeepSeek's fp32 ``e_score_correction_bias`` buffer stays fp32,
    unsharded and untouched by a step, and the export and the HF checkpoint carry it in fp32, bit for bit."""
    from vexact_models import expected_tensors

    path = default_checkpoint("deepseek_v3")
    master = load_model(path, dtype="float32")
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    bias = master.model.layers[1].mlp.gate.e_score_correction_bias.clone()
    trainer = Trainer(master, TrainerConfig(lr=1e-2, activation_checkpointing=True), mesh=mesh)
    trainer.train_step(_batch())
    held = dict(trainer.model.named_buffers())
    held = {hf_name(n): b for n, b in held.items()}[name]
    assert not isinstance(held, DTensor) and held.dtype == torch.float32 and torch.equal(held, bias)
    sent = dict(p for b in iter_weight_buckets(trainer.model) for p in b)
    assert sent.keys() == expected_tensors(load_model(path)).keys()
    assert sent[name].dtype == torch.float32 and torch.equal(sent[name], bias)
    assert all(t.dtype == torch.bfloat16 for n, t in sent.items() if not n.endswith("e_score_correction_bias"))
    save_hf_checkpoint(trainer.model, tmp_path / "hf")
    back = load_model(tmp_path / "hf").model.layers[1].mlp.gate.e_score_correction_bias
    assert back.dtype == torch.float32 and torch.equal(back, bias)


def test_train_step_metrics_and_update(mesh):
    master, _ = _models()
    trainer = Trainer(master, TrainerConfig(lr=1e-2, rollout_correction="tis"), mesh=mesh)
    before = _full(trainer.model)
    b = _batch(6, seed=4)
    old = trainer.compute_log_probs(b.prompts, b.responses).logprobs
    m = trainer.train_step(dataclasses.replace(b, rollout_logprobs=old))
    assert m.skipped is None and m.step == 1 and m.tokens == sum(len(r) for r in b.responses)
    assert m.k3_kl == 0.0 and m.mismatch_fraction == 0.0 and m.max_abs_delta == 0.0  # rollout == trainer
    assert m.clip_fraction == 0.0 and m.approx_kl == 0.0 and m.kept_fraction == 1.0  # on-policy: ratio 1
    assert math.isfinite(m.grad_norm) and m.grad_norm > 0 and 0 < m.entropy < math.log(VOCAB)
    after = _full(trainer.model)
    assert all(not torch.equal(before[k], after[k]) for k in ("lm_head.weight", "model.layers.0.mlp.up_proj.weight"))
    # shifted rollout logprobs: nonzero K3, mismatches counted, TIS weights applied
    shifted = [lp - 0.05 for lp in old]
    m2 = trainer.train_step(dataclasses.replace(b, rollout_logprobs=shifted))
    assert m2.k3_kl > 0 and m2.mismatch_fraction == 1.0 and m2.max_abs_delta > 0.04


def test_micro_batches_give_the_same_update_up_to_rounding(mesh):
    results = []
    for budget in (None, 12):
        master, _ = _models()
        trainer = Trainer(master, TrainerConfig(lr=1e-3, micro_batch_tokens=budget), mesh=mesh)
        m = trainer.train_step(_batch(6, seed=5))
        results.append((m, _full(trainer.model)))
    (m1, w1), (m2, w2) = results
    assert m1.tokens == m2.tokens and math.isclose(m1.grad_norm, m2.grad_norm, rel_tol=1e-4)
    # A different summation order of the gradient: a tolerance, not bits. Adam's first step is about lr * sign(g),
    # so a gradient within rounding of 0 may move its weight the other way: few such, none beyond 2 lr.
    diff = torch.cat([(w1[k] - w2[k]).abs().flatten() for k in w1])
    assert float(diff.max()) <= 2.1e-3 and float((diff > 1e-6).double().mean()) < 0.01


def test_reinforce_and_per_token_advantages(mesh):
    master, _ = _models()
    trainer = Trainer(master, TrainerConfig(lr=1e-3, policy_loss="reinforce"), mesh=mesh)
    b = _batch(4, seed=6)
    per_token = [torch.full((len(r),), float(a)) for r, a in zip(b.responses, b.advantages, strict=True)]
    m = trainer.train_step(dataclasses.replace(b, advantages=per_token, loss_masks=[[1] * len(r) for r in b.responses]))
    assert m.skipped is None and math.isfinite(m.loss)


def test_checkpoint_roundtrip_resumes_bitwise(mesh, tmp_path):
    master, _ = _models()
    trainer = Trainer(master, TrainerConfig(lr=1e-2), mesh=mesh)
    trainer.train_step(_batch(seed=1))
    trainer.save_checkpoint(tmp_path / "ckpt")
    trainer.train_step(_batch(seed=2))
    expected = _full(trainer.model)
    fresh, _ = _models(seed=99)  # different weights: everything must come from the checkpoint
    resumed = Trainer(fresh, TrainerConfig(lr=1e-2), mesh=mesh)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.step == 1
    resumed.train_step(_batch(seed=2))  # same step again: needs the restored Adam moments to match bitwise
    got = _full(resumed.model)
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    # HF export: an engine-loadable bf16 checkpoint of exactly the exported weights
    save_hf_checkpoint(resumed.model, tmp_path / "hf")
    loaded = load_model(tmp_path / "hf")
    assert all(torch.equal(p, got[n].to(torch.bfloat16)) for n, p in loaded.named_parameters())
    with pytest.raises(FileNotFoundError, match="no checkpoint directory"):
        resumed.load_checkpoint(tmp_path / "missing")


def test_nan_loss_skips_the_step_and_changes_nothing(mesh, caplog):
    master, _ = _models()
    trainer = Trainer(master, TrainerConfig(lr=1e-2), mesh=mesh)
    trainer.train_step(_batch(seed=1))  # Adam state exists
    before = _full(trainer.model)
    p0 = next(iter(trainer.model.parameters()))
    state = {k: v.full_tensor().clone() for k, v in trainer.optimizer.state[p0].items() if isinstance(v, DTensor)}
    b = _batch(seed=2)
    adv = b.advantages.clone()
    adv[1] = float("nan")
    with caplog.at_level("WARNING", logger="vexact_trainer"):
        m = trainer.train_step(dataclasses.replace(b, advantages=adv))
    assert m.skipped is not None and "non-finite loss" in m.skipped and "step skipped" in caplog.text
    # a forward without its backward leaves no gathered bf16 tensor registered as a parameter (nor does scoring)
    assert all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in trainer.model.parameters())
    trainer.compute_log_probs(b.prompts, b.responses)
    assert all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in trainer.model.parameters())
    assert all(torch.equal(before[k], v) for k, v in _full(trainer.model).items())
    assert state and all(torch.equal(state[k], trainer.optimizer.state[p0][k].full_tensor()) for k in state)
    assert trainer.train_step(b).skipped is None  # and training goes on


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(prompts=[], responses=[], advantages=[]), "empty batch: no sequences to train on"),
        (dict(responses=[[1]] * 3), "4 prompts but 3 responses"),
        (dict(advantages=[0.0, 1.0]), "2 advantages for 4 sequences"),
        (dict(prompts=[[5] * 95] + [[1]] * 3), "sequence 0 has 1[0-9][0-9] tokens; the model's max length is 96"),
        (dict(responses=[[VOCAB]] * 4), rf"sequence 0: token id {VOCAB} is outside the vocabulary \[0, {VOCAB}\)"),
        (dict(prompts=[[-1]] * 4), r"token id -1 is outside the vocabulary"),
        (dict(loss_masks=[[1]] * 4), r"sequence \d: loss mask has shape \(1,\) for \d response tokens"),
        (dict(loss_masks="twos"), r"loss mask values must be 0 or 1, got \[2.0\]"),
        (dict(rollout_logprobs=[torch.zeros(1)] * 4), r"rollout_logprobs has shape \(1,\) for \d response tokens"),
        (dict(temperature=0.0), "temperature must be a finite number > 0, got 0.0"),
        (dict(temperature=float("nan")), "temperature must be a finite number > 0, got nan"),
        (dict(temperature=[1.0, 1.0, float("inf"), 1.0]), r"temperature\[2\] must be a finite number > 0, got inf"),
        (dict(responses=[[]] * 4), "no response tokens to train on"),
    ],
)
def test_bad_input_raises_before_any_update(mesh, change, message):
    master, _ = _models()
    trainer = Trainer(master, TrainerConfig(lr=1e-2), mesh=mesh)
    b = _batch()
    if change.get("loss_masks") == "twos":
        change = dict(loss_masks=[[2] * len(r) for r in b.responses])
    before = _full(trainer.model)
    with pytest.raises(ValueError, match=message):
        trainer.train_step(dataclasses.replace(b, **change))
    assert all(torch.equal(before[k], v) for k, v in _full(trainer.model).items())


def test_correction_needs_rollout_logprobs_and_config_is_validated(mesh):
    master, _ = _models()
    trainer = Trainer(master, TrainerConfig(rollout_correction="mis"), mesh=mesh)
    with pytest.raises(ValueError, match="rollout_correction='mis' needs rollout_logprobs"):
        trainer.train_step(_batch())
    for kw, msg in [
        (dict(policy_loss="dpo"), "policy_loss must be one of"),
        (dict(rollout_correction="clip"), "rollout_correction must be one of"),
        (dict(rollout_correction_threshold=1.0), "rollout_correction_threshold must be > 1, got 1.0"),
        (dict(lr=float("nan")), "lr must be a finite number >= 0"),
        (dict(max_grad_norm=0), "max_grad_norm must be > 0 or None, got 0"),
        (dict(micro_batch_tokens=0), "micro_batch_tokens must be >= 1 or None, got 0"),
        (dict(backend="foo"), "backend must be one of"),
    ]:
        with pytest.raises(ValueError, match=msg):
            TrainerConfig(**kw)


def test_trainer_from_checkpoint_path_matches_the_committed_model(mesh):
    trainer = Trainer(default_checkpoint(), mesh=mesh)
    prompts, responses = _data(3, seed=8)
    ref = Actor(load_model(default_checkpoint())).compute_log_probs(prompts, responses).logprobs
    assert all(map(torch.equal, trainer.compute_log_probs(prompts, responses).logprobs, ref))
