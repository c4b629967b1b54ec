"""verl's RolloutConfig -> engine settings, sampling-dict translation, and the layouts the backend refuses."""

from __future__ import annotations

import pytest

pytest.importorskip("verl", reason="verl is not installed: pip install 'vexact-verl[verl]'")

from verl.workers.config import RolloutConfig  # noqa: E402

from vexact_models import default_checkpoint  # noqa: E402
from vexact_verl.rollout import ServerAdapter, _check_layout  # noqa: E402
from vexact_verl.server import ServerSettings, engine_kwargs_from_verl, to_engine_params  # noqa: E402


def rollout(**kw):
    base = dict(name="vexact", tensor_model_parallel_size=1, prompt_length=16, response_length=8, max_num_seqs=4)
    return RolloutConfig(**dict(base, **kw))


def test_engine_kwargs_follow_verl_and_engine_kwargs_vexact():
    kw = engine_kwargs_from_verl(rollout(seed=5, engine_kwargs={"vexact": {"backend": "fast", "block_size": 8}}), 2)
    assert kw["max_model_len"] == 24 and kw["max_num_seqs"] == 4 and kw["seed"] == 7
    assert kw["backend"] == "fast" and kw["block_size"] == 8 and kw["dtype"] == "bfloat16"
    assert "device" not in kw  # decided by the server process, which owns the GPU
    assert kw["enable_prefix_caching"] is True  # verl's rollout.enable_prefix_caching (default True) is honoured
    assert engine_kwargs_from_verl(rollout(enable_prefix_caching=False))["enable_prefix_caching"] is False
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['blocksize'\]"):
        engine_kwargs_from_verl(rollout(engine_kwargs={"vexact": {"blocksize": 8}}))


def test_layouts_that_would_change_reductions_are_refused():
    with pytest.raises(ValueError, match="tensor_model_parallel_size=2"):
        _check_layout(rollout(tensor_model_parallel_size=2))
    # pipeline parallelism keeps each row's reduction order: allowed, given a fixed KV cache shared by the stages
    with pytest.raises(ValueError, match="pipeline_model_parallel_size=2.*num_kv_blocks"):
        _check_layout(rollout(pipeline_model_parallel_size=2))
    _check_layout(rollout(pipeline_model_parallel_size=2, engine_kwargs={"vexact": {"num_kv_blocks": 64}}))
    with pytest.raises(ValueError, match="tensor_model_parallel_size=2"):
        ServerAdapter(rollout(tensor_model_parallel_size=2), None)


def test_expert_parallel_size_is_checked_against_the_model():
    """``rollout.expert_parallel_size`` (with ``data_parallel_size`` equal to it, as verl requires) must divide the
    routed experts (both numbers named); a size that does is taken (the replica runs ExpertParallelLLM over its
    GPUs), but not together with pipeline stages."""
    from types import SimpleNamespace

    moe = SimpleNamespace(local_path=str(default_checkpoint("qwen3_moe")))  # 8 routed experts, read from config.json
    hf = SimpleNamespace(num_experts=8)  # or from a loaded HF config
    dense = SimpleNamespace(local_path=str(default_checkpoint("qwen3")))
    _check_layout(rollout(expert_parallel_size=1), moe)
    with pytest.raises(ValueError, match=r"expert_parallel_size=3 does not divide the model's 8 routed experts"):
        _check_layout(rollout(expert_parallel_size=3, data_parallel_size=3), moe)
    with pytest.raises(ValueError, match=r"expert_parallel_size=16 does not divide the model's 8 routed experts"):
        _check_layout(rollout(expert_parallel_size=16, data_parallel_size=16), SimpleNamespace(hf_config=hf))
    with pytest.raises(ValueError, match="no routed experts"):
        _check_layout(rollout(expert_parallel_size=2, data_parallel_size=2), dense)
    with pytest.raises(ValueError, match="positive integer"):
        _check_layout(rollout(expert_parallel_size=0), moe)
    _check_layout(rollout(expert_parallel_size=2, data_parallel_size=2), moe)
    _check_layout(rollout(expert_parallel_size=8, data_parallel_size=8), moe)
    both = dict(expert_parallel_size=2, data_parallel_size=2, pipeline_model_parallel_size=2)
    with pytest.raises(ValueError, match="expert_parallel_size=2 with pipeline_model_parallel_size=2"):
        _check_layout(rollout(**both, engine_kwargs={"vexact": {"num_kv_blocks": 64}}), moe)
    with pytest.raises(ValueError, match="a vexact replica runs one of the two"):
        ServerSettings(model_path="x", max_model_len=8, prompt_length=4, response_length=4,
                       pipeline_parallel_size=2, expert_parallel_size=2)  # fmt: skip


def test_sampling_dict_translation():
    s = ServerSettings(model_path="x", max_model_len=24, prompt_length=16, response_length=8)
    p, lp = to_engine_params({"temperature": 0.5, "top_k": None, "logprobs": True}, prompt_len=20, settings=s)
    assert (p.temperature, p.top_k, p.max_tokens, lp) == (0.5, -1, 4, True)  # capped by the room left
    p, lp = to_engine_params({"max_new_tokens": 3, "stop_token_ids": [9]}, prompt_len=2, settings=s)
    assert (p.max_tokens, p.stop_token_ids, lp) == (3, [9], False)
    with pytest.raises(ValueError, match="prompt has 24 tokens"):
        to_engine_params({}, prompt_len=24, settings=s)
    with pytest.raises(ValueError, match=r"\['presence_penalty'\]"):
        to_engine_params({"presence_penalty": 0.5}, prompt_len=2, settings=s)


def test_engine_and_trainer_must_run_the_same_attention_impl(monkeypatch):
    """triton and fa4 differ in the last bits: a rollout engine on one and a trainer on the other is refused at the
    first weight sync, naming both, instead of a silent mismatch on every token."""
    import asyncio

    import torch

    import vexact_kernels as vk

    class Remote:
        def __init__(self, value):
            self.value = value

        def remote(self):
            async def get():
                return self.value

            return get()

    class Server:
        attention_impl = Remote("fa4")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(vk, "get_attention_impl", lambda: "triton")
    adapter = ServerAdapter(rollout(), None)
    with pytest.raises(RuntimeError, match=r"engine runs attention with 'fa4' and this trainer worker with 'triton'"):
        asyncio.run(adapter._check_attention_impl(Server()))
    monkeypatch.setattr(vk, "get_attention_impl", lambda: "fa4")
    asyncio.run(adapter._check_attention_impl(Server()))
    assert adapter._attention_checked


def test_checkpoint_engine_backends_other_than_naive_nccl_gloo_are_refused():
    from verl.workers.config import CheckpointEngineConfig

    for ok in ("naive", "nccl", "gloo"):
        _check_layout(rollout(checkpoint_engine=CheckpointEngineConfig(backend=ok)))
    with pytest.raises(ValueError, match=r"checkpoint_engine.backend='mooncake'.*\['naive', 'nccl', 'gloo'\]"):
        ServerAdapter(rollout(checkpoint_engine=CheckpointEngineConfig(backend="mooncake")), None)
