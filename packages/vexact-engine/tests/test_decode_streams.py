"""EngineConfig.decode_streams = 2: a padded decode step of at least DECODE_STREAMS_MIN_ROWS rows runs as two forwards
of half its rows (on two CUDA streams inside the graph; on CPU one after the other). The same tokens and logprobs as
one forward, for every request; not in a PipelineLLM."""

from __future__ import annotations

import pytest
import torch

import vexact_engine.cuda_graphs as cuda_graphs
from vexact_engine import LLM, EngineConfig, SamplingParams
from vexact_models import random_model, tiny_qwen3_config


def test_decode_streams_is_one_or_two():
    assert EngineConfig().decode_streams == 1
    for bad in (0, 3, True, "2"):
        with pytest.raises(ValueError, match=r"EngineConfig.decode_streams must be 1 or 2"):
            EngineConfig(decode_streams=bad)


def _workload(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 256, (int(k),), generator=g).tolist() for k in torch.randint(2, 30, (n,), generator=g)]
    params = [SamplingParams(temperature=[1.0, 0.7, 0.0][i % 3], max_tokens=3 + i % 7, seed=i, ignore_eos=i % 2 == 0)
              for i in range(n)]  # fmt: skip
    return prompts, params


def test_halves_give_one_forwards_bits(monkeypatch):
    """On CPU with padded decode steps (explicit graph sizes): halves at 4 rows and up against one forward."""
    model = random_model(tiny_qwen3_config(), seed=11)
    prompts, params = _workload(13, seed=11)
    kw = dict(num_kv_blocks=256, max_num_seqs=13, max_num_batched_tokens=64, cuda_graph_batch_sizes=(2, 8, 13))
    ref = LLM(model=model, **kw).generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(cuda_graphs, "DECODE_STREAMS_MIN_ROWS", 4)
    rows = []
    real = type(model).forward

    def counting(self, ids, *rest, **kw):
        rows.append(ids.shape[0])
        return real(self, ids, *rest, **kw)

    monkeypatch.setattr(type(model), "forward", counting)
    llm = LLM(model=model, decode_streams=2, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.undo()
    assert llm.runner.num_padded_steps > 0
    assert 4 in rows and {6, 7} <= set(rows), rows  # the halves of the 8- and 13-row steps
    assert 8 not in rows and 13 not in rows, rows  # no padded step of 4 rows or more ran whole
    for a, b in zip(outs, ref, strict=True):
        assert a.token_ids == b.token_ids and torch.equal(a.logprobs, b.logprobs), a.request_id


@pytest.mark.gpu
def test_gpu_two_stream_decode_gives_one_streams_bits_and_the_trainers():
    """On CUDA: 256 requests through the 256-row decode graph captured as two half forwards on two streams (one step
    ahead, the draw in the graph): tokens and logprobs equal one stream's and the trainer's, bitwise."""
    from vexact_trainer import Actor

    cfg = tiny_qwen3_config(hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=4,
                            head_dim=64, num_hidden_layers=3)  # fmt: skip
    model = random_model(cfg, seed=3, device="cuda", embed_std=0.05)
    prompts, params = _workload(256, seed=3)
    for p in params:
        p.temperature = 1.0  # every row takes the fused draw in the graph
    kw = dict(device="cuda", max_num_seqs=256, max_num_batched_tokens=2048, num_kv_blocks=2048,
              cuda_graph_batch_sizes=(64, 256))  # fmt: skip
    llm = LLM(model=model, decode_streams=2, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    ref = LLM(model=model, **kw).generate(prompts, params, use_tqdm=False)
    assert llm.runner.graph_error is None and llm.runner._half_stream is not None
    for a, b in zip(outs, ref, strict=True):
        assert a.token_ids == b.token_ids and torch.equal(a.logprobs, b.logprobs), a.request_id
    scored = Actor(model).compute_log_probs(prompts, [o.token_ids for o in outs], 1.0)
    for o, lp in zip(outs, scored.logprobs, strict=True):
        assert torch.equal(o.logprobs, lp.cpu()), o.request_id
