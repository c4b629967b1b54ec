"""The trainer on the tiny Qwen3-MoE (CPU, gloo world size 1): FSDP == the unsharded bf16 model with the experts
sharded in their layer, per-expert weight export, the router's load-balancing loss (transformers' definition, off by
default, per sequence so no micro-batch split changes it) and the router outputs the actor returns for analysis."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

import vexact_trainer.trainer as trainer_module
from vexact_models import (
    RouterOutput,
    expected_tensors,
    load_balancing_loss,
    random_model,
    record_router,
    tiny_qwen3_config,
    tiny_qwen3_moe_config,
)
from vexact_trainer import (
    Actor,
    RolloutBatch,
    Trainer,
    TrainerConfig,
    grpo_advantages,
    hf_name,
    init_distributed,
    iter_weight_buckets,
    iter_weights,
    pack,
    parallelize,
    sequence_load_balancing_loss,
)

VOCAB = 272
E, K = 8, 2  # the tiny MoE: 8 experts, top-2; layers 0 and 2 sparse, layer 1 dense


@pytest.fixture(scope="module")
def mesh():
    return init_distributed("cpu")


def _models(seed: int = 3):
    """(fp32 master, bf16 twin) of the tiny MoE with the same values."""
    cfg = tiny_qwen3_moe_config(max_position_embeddings=96)
    return random_model(dataclasses.replace(cfg, torch_dtype="float32"), seed), random_model(cfg, seed)


def _data(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (int(torch.randint(1, 10, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]  # fmt: skip
    responses = [torch.randint(0, VOCAB, (int(torch.randint(1, 8, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(n)]  # fmt: skip
    return prompts, responses


def _batch(n: int = 6, seed: int = 0) -> RolloutBatch:
    prompts, responses = _data(n, seed)
    return RolloutBatch(prompts, responses, grpo_advantages(torch.arange(n, dtype=torch.float32) % 3, group_size=2))


def _router(model, prompts, responses) -> tuple[list[RouterOutput], list[int]]:
    batch = pack(prompts, responses, VOCAB, 96)
    with torch.no_grad(), record_router() as router:
        Actor(model).forward_packed(batch)
    return router, batch.seq_lens


def test_load_balancing_loss_is_transformers(mesh):
    _, twin = _models()
    prompts, responses = _data(5, seed=1)
    router, seq_lens = _router(twin, prompts, responses)
    assert len(router) == 2 and all(r.logits.dtype == torch.float32 for r in router)  # the dense layer records none
    ours = load_balancing_loss(router, E, K)
    theirs = load_balancing_loss_func(tuple(r.logits for r in router), E, K)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    # per sequence: transformers' loss over that sequence's rows alone
    per_seq = sequence_load_balancing_loss(router, seq_lens, E, K)
    start = 0
    for s, n in enumerate(seq_lens):
        alone = load_balancing_loss_func(tuple(r.logits[start : start + n] for r in router), E, K)
        torch.testing.assert_close(per_seq[s], alone, rtol=1e-6, atol=1e-6)
        start += n
    with pytest.raises(ValueError, match="sequence lengths sum to 3 but the router saw"):
        sequence_load_balancing_loss(router, [1, 2], E, K)


def _step_grads(trainer: Trainer, batch: RolloutBatch):
    """Run one step, keeping the full gradients it applied (the step clears them)."""
    grads = {}
    clip = trainer._clip_grad_norm

    def keep_then_clip():
        grads.update({n: p.grad.full_tensor().clone() for n, p in trainer.model.named_parameters()})
        return clip()

    trainer._clip_grad_norm = keep_then_clip
    return trainer.train_step(batch), grads


def test_aux_loss_reaches_the_router_and_is_split_independent(mesh):
    batch = _batch(6, seed=4)
    runs = {}
    for coef, budget, ac in ((0.0, None, False), (0.5, None, False), (0.5, 12, False), (0.5, None, True)):
        master, _ = _models()
        cfg = TrainerConfig(lr=1e-3, max_grad_norm=None, router_aux_loss_coef=coef, micro_batch_tokens=budget,
                            activation_checkpointing=ac)  # fmt: skip
        trainer = Trainer(master, cfg, mesh=mesh)
        runs[coef, budget, ac] = (*_step_grads(trainer, batch), trainer.last_micro_batches[0])
    (m0, g0, _), (m1, g1, _), (m2, g2, n2) = runs[0.0, None, False], runs[0.5, None, False], runs[0.5, 12, False]
    # activation checkpointing's recomputation (outside the recording) changes no bit of the loss or the gradient
    m_ac, g_ac, _ = runs[0.5, None, True]
    g_ac = {hf_name(n): g for n, g in g_ac.items()}
    assert m_ac.router_aux_loss == m1.router_aux_loss and g_ac.keys() == g1.keys()
    assert all(torch.equal(g_ac[n], g) for n, g in g1.items())
    assert m0.router_aux_loss == 0.0 and m1.router_aux_loss > 0 and m1.loss == m0.loss  # the policy loss alone
    # the aux loss moves every router and what feeds the last router (layer 0's experts), nothing after it
    routers = ("model.layers.0.mlp.gate.weight", "model.layers.2.mlp.gate.weight")
    for name in (*routers, "model.layers.0.mlp.experts.down_proj"):
        assert not torch.equal(g0[name], g1[name]), name
    for name in ("lm_head.weight", "model.norm.weight", "model.layers.2.mlp.experts.down_proj"):
        assert torch.equal(g0[name], g1[name]), name
    # its value: the token-weighted mean over sequences of transformers' loss on each sequence (bf16 forward)
    _, twin = _models()
    router, seq_lens = _router(twin, batch.prompts, batch.responses)
    want, start = 0.0, 0
    for n in seq_lens:
        alone = [RouterOutput(r.logits[start : start + n], r.topk_ids[start : start + n]) for r in router]
        want += float(load_balancing_loss(alone, E, K)) * n / sum(seq_lens)
        start += n
    assert math.isclose(m1.router_aux_loss, want, rel_tol=1e-5)
    # micro-batches (and, by the same sum, ranks) change neither the value nor, beyond rounding, the gradient
    assert m2.tokens == m1.tokens and n2 > 1
    assert math.isclose(m2.router_aux_loss, m1.router_aux_loss, rel_tol=1e-6)
    for name in routers:
        # the backward runs in bf16, so a gradient summed over micro-batches differs from one pass by rounding
        # (about 0.2% here, where the aux loss itself moves these gradients by about 50%)
        assert float((g2[name] - g1[name]).norm()) < 1e-2 * float(g1[name].norm()), name


def test_aux_loss_is_off_by_default_and_never_records(mesh, monkeypatch):
    assert TrainerConfig().router_aux_loss_coef == 0.0

    def refuse():
        raise AssertionError("the router was recorded with router_aux_loss_coef=0")

    monkeypatch.setattr(trainer_module, "record_router", refuse)
    master, _ = _models()
    m = Trainer(master, TrainerConfig(lr=1e-3), mesh=mesh).train_step(_batch(4, seed=2))
    assert m.skipped is None and m.router_aux_loss == 0.0 and m.as_dict()["router_aux_loss"] == 0.0


def test_aux_loss_config_and_dense_model_refused(mesh):
    for bad in (-0.1, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="router_aux_loss_coef must be a finite number >= 0"):
            TrainerConfig(router_aux_loss_coef=bad)
    dense = random_model(dataclasses.replace(tiny_qwen3_config(), torch_dtype="float32"), 0)
    with pytest.raises(ValueError, match=r"router_aux_loss_coef=0.01 needs an MoE model; Qwen3Config has no experts"):
        Trainer(dense, TrainerConfig(router_aux_loss_coef=0.01), mesh=mesh)
    with pytest.raises(ValueError, match="with_router=True needs an MoE model; Qwen3Config has no experts"):
        Actor(dense).compute_log_probs([[1]], [[2]], with_router=True)
    # an MoE config whose layers are all dense: nothing to record, said at the first step
    all_dense = tiny_qwen3_moe_config(mlp_only_layers=(0, 1, 2), torch_dtype="float32")
    trainer = Trainer(random_model(all_dense, 0), TrainerConfig(router_aux_loss_coef=0.01), mesh=mesh)
    with pytest.raises(ValueError, match="recorded no router output"):
        trainer.train_step(_batch(2))


def test_fsdp_moe_forward_gradients_and_router_equal_the_unsharded_bf16_model(mesh):
    master, twin = _models()
    trainer = Trainer(master, TrainerConfig(lr=1e-2), mesh=mesh)  # experts sharded with their decoder layer
    prompts, responses = _data(5, seed=5)
    ours = trainer.compute_log_probs(prompts, responses, with_entropy=True, with_router=True)
    ref = Actor(twin).compute_log_probs(prompts, responses, with_entropy=True, with_router=True)
    assert all(map(torch.equal, ours.logprobs, ref.logprobs)) and all(map(torch.equal, ours.entropy, ref.entropy))
    assert all(map(torch.equal, ours.router, ref.router))
    plain = Actor(twin).compute_log_probs(prompts, responses)
    assert plain.router is None and all(map(torch.equal, plain.logprobs, ref.logprobs))  # recording changes nothing
    # per sequence [sparse layers, prompt + response, k]: each sequence scored alone routes the same
    lens = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
    assert [tuple(r.shape) for r in ref.router] == [(2, n, K) for n in lens]
    for i in range(len(prompts)):
        (alone,) = Actor(twin).compute_log_probs([prompts[i]], [responses[i]], with_router=True).router
        assert torch.equal(alone, ref.router[i]) and alone.dtype == torch.int64
    # gradients: bf16 gradients reduced in fp32 == the bf16 model's own, upcast
    other, twin2 = _models(seed=4)
    parallelize(other.requires_grad_(True), mesh)
    batch = pack(prompts, responses, VOCAB, 96)
    for model in (other, twin2.requires_grad_(True)):
        lp, _ = Actor(model).forward_packed(batch, 0.8)
        lp.sum().backward()
    twin_grads = {n: p.grad for n, p in twin2.named_parameters()}
    for name, p in other.named_parameters():
        assert torch.equal(p.grad.full_tensor(), twin_grads[name].float()), name
    assert twin_grads["model.layers.0.mlp.gate.weight"].abs().sum() > 0


def test_moe_weight_export_is_per_expert_and_loads_into_the_twin(mesh):
    master, twin = _models()
    trainer = Trainer(master, TrainerConfig(lr=1e-2, router_aux_loss_coef=0.01), mesh=mesh)
    trainer.train_step(_batch(4, seed=6))
    buckets = list(iter_weight_buckets(trainer.model, bucket_bytes=20_000))
    names = [n for b in buckets for n, _ in b]
    assert names == list(expected_tensors(twin)) and len(buckets) > 3
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in names and "model.layers.1.mlp.up_proj.weight" in names
    assert not any(n.endswith(("gate_up_proj", "experts.down_proj")) for n in names)
    from vexact_models import load_weights

    load_weights(twin, (x for b in buckets for x in b))
    prompts, responses = _data(4, seed=7)
    ours = trainer.compute_log_probs(prompts, responses).logprobs
    assert all(map(torch.equal, ours, Actor(twin).compute_log_probs(prompts, responses).logprobs))


def test_stacked_export_sends_each_expert_tensor_whole_and_loads_the_same_weights(mesh):
    """``iter_weights(stacked=True)`` (verl's state-dict shape): one tensor per stacked parameter, names the engine
    loads, values equal to the per-expert export's."""
    master, twin = _models()
    trainer = Trainer(master, TrainerConfig(lr=1e-2), mesh=mesh)
    per_expert = dict(iter_weights(trainer.model))
    stacked = dict(iter_weights(trainer.model, stacked=True))
    assert "model.layers.0.mlp.experts.gate_up_proj" in stacked and len(stacked) < len(per_expert)
    assert stacked["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == E
    assert not any(".experts.7." in n for n in stacked)
    from vexact_models import load_weights

    load_weights(twin, stacked.items())
    assert all(torch.equal(t, per_expert[n]) for n, t in expected_tensors(twin).items())
