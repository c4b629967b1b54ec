"""sleep()/wake_up(): the KV cache and the weights' storage are let go and come back; generation after waking
equals generation before, bitwise; level 2 needs update_weights and then equals a fresh engine."""

from __future__ import annotations

import pytest
import torch

from vexact_engine import LLM, SamplingParams
from vexact_models import named_weights, random_model, tiny_deepseek_v3_config, tiny_qwen3_config

# padded decode and padded steps with prompt tokens (the CUDA-graph paths, eager on CPU): their static buffers go and
# come back with the KV cache
KW = dict(max_num_seqs=4, max_num_batched_tokens=16, block_size=4, num_kv_blocks=64, cuda_graph_batch_sizes=[2, 4],
          cuda_graph_token_sizes=[8, 16])  # fmt: skip
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], list(range(30, 45))]
PARAMS = SamplingParams(temperature=0.9, max_tokens=8, seed=4, ignore_eos=True)


def _gen(llm):
    return llm.generate(PROMPTS, PARAMS, use_tqdm=False)


def _same(outs, ref):
    for a, b in zip(outs, ref, strict=True):
        assert a.token_ids == b.token_ids and torch.equal(a.logprobs, b.logprobs)


def test_sleep_level_1_frees_and_wake_restores_bitwise():
    llm = LLM(model=random_model(tiny_qwen3_config(), seed=1), **KW)
    before = _gen(llm)
    state = {n: p.clone() for n, p in llm.model.state_dict().items()}
    for _ in range(3):
        assert llm.blocks.num_cached > 0  # the prompts' full pages are cached...
        llm.sleep(level=1)
        assert llm.blocks.num_cached == 0  # ...and go with the KV cache: after waking they are recomputed
        assert llm.sleep_level == 1 and llm.runner.kv_caches is None
        assert all(p.numel() == 0 for p in llm.model.parameters())
        assert all(b.numel() == 0 for b in llm.model.buffers())
        llm.wake_up()
        assert llm.sleep_level == 0
        steps = llm.runner.num_padded_prompt_steps
        _same(_gen(llm), before)
        assert llm.runner.num_padded_prompt_steps > steps
    for n, p in llm.model.state_dict().items():
        assert torch.equal(p, state[n]), n


def test_sleep_level_2_then_update_weights_equals_a_fresh_engine():
    llm = LLM(model=random_model(tiny_qwen3_config(), seed=1), **KW)
    _gen(llm)
    llm.sleep(level=2)
    llm.wake_up()
    llm.add_request([1, 2, 3], SamplingParams(max_tokens=2), request_id="early")  # queued, runs once weights are in
    with pytest.raises(RuntimeError, match=r"weight tensor\(s\) discarded by sleep\(level=2\) are not reloaded"):
        llm.step()
    llm.abort_request("early")
    new = random_model(tiny_qwen3_config(), seed=2)
    named = [(n, p.detach().clone()) for n, p in new.named_parameters()]
    llm.update_weights(named[: len(named) // 2])  # in two buckets
    with pytest.raises(RuntimeError, match="not reloaded"):
        llm.step()
    llm.update_weights(named[len(named) // 2 :])
    fresh = LLM(model=random_model(tiny_qwen3_config(), seed=2), **KW)
    _same(_gen(llm), _gen(fresh))


def test_deepseek_fp32_bias_buffer_survives_both_levels_bitwise():
    """DeepSeek's ``e_score_correction_bias`` is an fp32 buffer: both levels keep it bit for bit, so level 2 waits
    only for the parameters; an update may still send it, in fp32."""
    llm = LLM(model=random_model(tiny_deepseek_v3_config(), seed=1), **KW)
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    before = dict(named_weights(llm.model))[name].clone()
    assert before.dtype == torch.float32 and not torch.equal(before, before.bfloat16().float())
    for level in (1, 2):
        llm.sleep(level=level)
        llm.wake_up()
        bias = dict(named_weights(llm.model))[name]
        assert bias.dtype == torch.float32 and torch.equal(bias, before)
    new = random_model(tiny_deepseek_v3_config(), seed=2)
    llm.update_weights([(n, p.detach().clone()) for n, p in new.named_parameters()])  # the parameters only
    for n, t in named_weights(new):
        if n.endswith("e_score_correction_bias"):
            t.copy_(dict(named_weights(llm.model))[n])  # the kept bias
    fresh = LLM(model=new, **KW)
    _same(_gen(llm), _gen(fresh))
    other = random_model(tiny_deepseek_v3_config(), seed=3)
    llm.update_weights([(n, t.detach().clone()) for n, t in named_weights(other)])
    assert torch.equal(dict(named_weights(llm.model))[name], dict(named_weights(other))[name])


def test_sleep_and_wake_errors():
    llm = LLM(model=random_model(tiny_qwen3_config(), seed=1), **KW)
    with pytest.raises(ValueError, match="sleep level must be 1 .* or 2 .*, got 3"):
        llm.sleep(level=3)
    llm.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match=r"sleep with 1 unfinished request\(s\)"):
        llm.sleep()
    while llm.has_unfinished_requests():
        llm.step()
    llm.wake_up()  # awake: a no-op
    llm.sleep()
    with pytest.raises(RuntimeError, match=r"already asleep \(level 1\)"):
        llm.sleep()
    with pytest.raises(RuntimeError, match="update_weights while asleep"):
        llm.update_weights([])
    llm.add_request([4, 5], SamplingParams(max_tokens=2), request_id="queued")
    with pytest.raises(RuntimeError, match=r"asleep \(level 1\): call wake_up\(\) before step\(\)"):
        llm.step()
    llm.wake_up()
    out = []
    while llm.has_unfinished_requests():
        out += llm.step()
    assert [o.request_id for o in out] == ["queued"] and len(out[0].token_ids) == 2
