"""EngineConfig.draw_in_graph: a padded decode step whose rows all take the fused draw draws from the static buffers
(a second CUDA graph on CUDA, eagerly from the same buffers on CPU). The tokens and logprobs are those of the engine
without it, bitwise, whatever the padding; steps with a greedy, top-k or top-p row, or a mismatch injection, sample
as without it."""

from __future__ import annotations

import pytest
import torch

import vexact_engine.cuda_graphs as cuda_graphs
import vexact_engine.sampler as sampler
from vexact_engine import LLM, EngineConfig, SamplingParams
from vexact_engine.sampler import draws_whole, token_seeds
from vexact_engine.scheduler import ScheduledSeq
from vexact_engine.sequence import Sequence
from vexact_models import default_checkpoint, random_model, tiny_qwen3_config

KW = dict(max_num_seqs=7, max_num_batched_tokens=32, block_size=4, num_kv_blocks=128)
OFF = dict(draw_in_graph=False)  # the reference engines, whatever $VEXACT_DRAW_IN_GRAPH says


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_qwen3_config(), seed=34)


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]  # fmt: skip


def _plain(n: int) -> list[SamplingParams]:
    # rows that all take the fused draw: temperatures > 0, no top-k / top-p; sequences end at different steps, so
    # the decode batch shrinks through the padded sizes
    return [SamplingParams(temperature=[1.0, 0.7, 1.3][i % 3], max_tokens=10 - i % 5, seed=i, ignore_eos=True)
            for i in range(n)]  # fmt: skip


def _equal(outs, ref):
    assert len(outs) == len(ref)
    for a, b in zip(outs, ref, strict=True):
        assert a.ok and a.token_ids == b.token_ids and torch.equal(a.logprobs, b.logprobs), a.request_id


def test_draw_in_graph_setting_is_checked(monkeypatch):
    monkeypatch.delenv("VEXACT_DRAW_IN_GRAPH", raising=False)
    assert EngineConfig().draw_in_graph is None  # decided with async_decode, by the engine
    assert EngineConfig().resolved(on_cuda=False).draw_in_graph is False
    assert EngineConfig(async_decode=False).draw_in_graph is False
    assert EngineConfig(draw_in_graph=True).draw_in_graph is True
    monkeypatch.setenv("VEXACT_DRAW_IN_GRAPH", "1")
    assert EngineConfig().draw_in_graph is True
    assert EngineConfig(draw_in_graph=False).draw_in_graph is False  # an explicit value wins
    monkeypatch.setenv("VEXACT_DRAW_IN_GRAPH", "0")
    assert EngineConfig().draw_in_graph is False
    monkeypatch.setenv("VEXACT_DRAW_IN_GRAPH", "yes")
    with pytest.raises(ValueError, match=r"\$VEXACT_DRAW_IN_GRAPH must be 1 or 0 \(or unset\), got 'yes'"):
        EngineConfig()
    with pytest.raises(TypeError, match="draw_in_graph must be True, False or None, got 1"):
        EngineConfig(draw_in_graph=1)


def test_the_fused_draw_of_a_row_is_the_same_in_a_padded_batch(model):
    """What the padded path relies on: a row's token and logprob from ``model.sample`` do not depend on the rows
    after it (pad rows of seed 0, temperature 1)."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(8, model.config.hidden_size, generator=g).to(torch.bfloat16)
    temps = torch.tensor([1.0, 0.7, 1.3, 0.9, 1.0], dtype=torch.float32)
    seeds = torch.from_numpy(token_seeds([1, 2, 3, 4, 5], [0, 7, 3, 11, 2]))
    tokens, logprobs = model.sample(hidden[:5], temps, seeds)
    pad_t = torch.cat([temps, torch.ones(3)])
    pad_s = torch.cat([seeds, torch.zeros(3, dtype=torch.int64)])
    padded_tokens, padded_logprobs = model.sample(hidden, pad_t, pad_s)
    assert torch.equal(padded_tokens[:5], tokens) and torch.equal(padded_logprobs[:5], logprobs)
    for r in range(5):
        one_t, one_lp = model.sample(hidden[r : r + 1], temps[r : r + 1], seeds[r : r + 1])
        assert torch.equal(one_t, tokens[r : r + 1]) and torch.equal(one_lp, logprobs[r : r + 1])


@pytest.mark.parametrize("sizes", [[1, 2, 4, 8], [3, 7], [8]], ids=["pow2", "odd", "one-size"])
def test_draw_from_static_buffers_equals_the_eager_draw(model, sizes):
    prompts, params = _prompts(7, seed=1), _plain(7)
    ref = LLM(model=model, cuda_graph_batch_sizes=sizes, **OFF, **KW).generate(prompts, params, use_tqdm=False)
    eager = LLM(model=model, **KW).generate(prompts, params, use_tqdm=False)
    llm = LLM(model=model, cuda_graph_batch_sizes=sizes, draw_in_graph=True, **KW)
    outs = llm.generate(prompts, params, use_tqdm=False)
    runner = llm.runner
    assert runner.draw_in_graph and runner.num_graph_draws > 0
    # every padded decode step draws from the static buffers here (a prefill step of one token may run padded too)
    assert runner.num_graph_draws <= runner.num_padded_steps
    _equal(outs, ref)
    _equal(outs, eager)


def test_steps_with_a_greedy_or_filtered_row_sample_eagerly(model):
    """A greedy row that outlives the others keeps every decode step on the eager draw; a mixed workload (top-k,
    top-p and greedy rows among plain ones) draws from the buffers only in the steps where every row is plain."""
    prompts = _prompts(5, seed=2)
    params = _plain(4) + [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)]
    # mixed steps in one launch: split, the decode half of a step where the greedy row is still in its prompt draws
    # from the buffers (every row of that half is plain)
    sizes = dict(cuda_graph_batch_sizes=[2, 4, 8], split_mixed_steps=False)
    ref = LLM(model=model, **sizes, **OFF, **KW).generate(prompts, params, use_tqdm=False)
    llm = LLM(model=model, draw_in_graph=True, **sizes, **KW)
    _equal(llm.generate(prompts, params, use_tqdm=False), ref)
    assert llm.runner.num_graph_draws == 0 and llm.runner.num_padded_steps > 0
    prompts = _prompts(7, seed=3)
    params = _plain(7)
    params[1] = SamplingParams(top_k=5, max_tokens=4, seed=9, ignore_eos=True)
    params[3] = SamplingParams(top_p=0.8, temperature=0.8, max_tokens=3, seed=10, ignore_eos=True)
    params[5] = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    ref = LLM(model=model, **sizes, **OFF, **KW).generate(prompts, params, use_tqdm=False)
    llm = LLM(model=model, draw_in_graph=True, **sizes, **KW)
    _equal(llm.generate(prompts, params, use_tqdm=False), ref)
    assert 0 < llm.runner.num_graph_draws < llm.runner.num_padded_steps


def test_a_mismatch_injection_samples_eagerly(model):
    prompts, params = _prompts(3, seed=4), _plain(3)
    kw = dict(cuda_graph_batch_sizes=[2, 4], logit_noise_std=0.5, **KW)
    ref = LLM(model=model, **OFF, **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(model=model, draw_in_graph=True, **kw)
    _equal(llm.generate(prompts, params, use_tqdm=False), ref)
    assert llm.runner.num_graph_draws == 0 and llm.runner.num_padded_steps > 0


def test_a_wrong_draw_seed_is_caught(model, monkeypatch):
    """The equality above can fail: seeds of the next token index instead of this one change the draws."""
    prompts, params = _prompts(4, seed=5), _plain(4)
    ref = LLM(model=model, cuda_graph_batch_sizes=[4], **OFF, **KW).generate(prompts, params, use_tqdm=False)
    wrong = lambda s, i: token_seeds(s, [x + 1 for x in i])  # noqa: E731
    monkeypatch.setattr(cuda_graphs, "token_seeds", wrong)  # the draw graph's seeds
    monkeypatch.setattr(sampler, "token_seeds", wrong)  # the eager fused draw's
    llm = LLM(model=model, cuda_graph_batch_sizes=[4], draw_in_graph=True, **KW)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.runner.num_graph_draws > 0
    assert any(a.token_ids != b.token_ids for a, b in zip(outs, ref, strict=True))


def test_without_padded_decode_the_switch_does_nothing(model):
    llm = LLM(model=model, draw_in_graph=True, **KW)  # CPU without cuda_graph_batch_sizes: no padded steps
    assert not llm.runner.draw_in_graph
    llm.generate(_prompts(2, seed=6), _plain(2), use_tqdm=False)
    assert llm.runner.num_graph_draws == 0


@pytest.mark.gpu
@pytest.mark.parametrize("recapture", ["eager", "lazy"])
def test_gpu_draw_graph_equals_the_eager_draw_through_sleep(recapture):
    """On CUDA: the draw graphs (one per decode size) give the tokens and logprobs of the eager draw after the decode
    graph, at start-up and after a wake_up (lazily: the smaller sizes and their draws at their first step). The batch
    shrinks from 20 rows to 1, so steps pad 20 -> 32, 12 -> 16, 3 -> 4 and 1 -> 2: the fused kernel draws a row in
    a block of 64, 16 or 1 rows, the eager draw of the same step in another."""
    sizes = [2, 4, 16, 32]
    kw = dict(max_num_seqs=32, max_num_batched_tokens=64, block_size=4, num_kv_blocks=512, device="cuda",
              cuda_graph_batch_sizes=sizes, graph_recapture=recapture)  # fmt: skip
    prompts = _prompts(20, seed=7)
    params = [SamplingParams(temperature=[1.0, 0.7, 1.3][i % 3], max_tokens=4 + i, seed=i, ignore_eos=True)
              for i in range(20)]  # fmt: skip
    ref = LLM(default_checkpoint(), **OFF, **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(default_checkpoint(), draw_in_graph=True, **kw)
    runner = llm.runner
    assert runner.draw_in_graph and runner.graph_error is None and sorted(runner._draws) == sizes
    _equal(llm.generate(prompts, params, use_tqdm=False), ref)
    assert runner.num_graph_draws > 0
    llm.sleep(level=1)
    llm.wake_up()
    draws = runner.num_graph_draws
    _equal(llm.generate(prompts, params, use_tqdm=False), ref)
    assert runner.graph_error is None and runner.num_graph_draws > draws and sorted(runner._draws) == sizes


def test_which_steps_draw_from_the_buffers_follows_draws_whole(model):
    """The runner's inline row check takes the rows ``draws_whole`` names, and only last chunks of one token."""
    llm = LLM(model=model, cuda_graph_batch_sizes=[2, 4], draw_in_graph=True, **KW)
    vocab = model.config.vocab_size
    kinds = [dict(), dict(temperature=0.0), dict(temperature=1e-5), dict(top_k=5), dict(top_k=vocab), dict(top_k=-1),
             dict(top_p=0.99), dict(top_p=1.0, top_k=vocab - 1), dict(temperature=2.0, top_k=vocab + 3)]  # fmt: skip
    plain = Sequence("a", [1, 2], SamplingParams(), seed=0, arrival=0)
    for kw in kinds:
        p = SamplingParams(**kw)
        seq = Sequence("b", [1, 2], p, seed=1, arrival=1)
        batch = [ScheduledSeq(plain, 1, True), ScheduledSeq(seq, 1, True)]
        assert (llm.runner.graph_draw_size(batch) == 2) == draws_whole(p, vocab), kw
    assert llm.runner.graph_draw_size([ScheduledSeq(plain, 1, False)]) is None  # a chunk that does not sample
    assert llm.runner.graph_draw_size([ScheduledSeq(plain, 2, True)]) is None  # not a one-token step
    assert llm.runner.graph_draw_size([ScheduledSeq(plain, 1, True)] * 5) is None  # larger than every graph size
