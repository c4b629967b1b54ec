"""Padded steps (the CUDA-graph paths, run eagerly on CPU): padding a decode step to a captured batch size, or a step
with prompt tokens to a captured token count (one pad sequence, empty sequence slots), never changes a real row's
tokens or logprobs; a load ~10x the KV capacity loses nothing and changes nothing."""

from __future__ import annotations

import pytest
import torch

from vexact_engine import LLM, EngineConfig, SamplingParams
from vexact_engine.model_runner import ModelRunner
from vexact_models import random_model, tiny_qwen3_config


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_qwen3_config(), seed=21)


def _workload(n: int, seed: int, lo: int = 3, hi: int = 20, max_tokens: int = 10):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 256, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]  # fmt: skip
    params = [
        SamplingParams(temperature=[1.0, 0.7, 0.0][i % 3], top_k=[-1, 20][i % 2], max_tokens=max_tokens - i % 4,
                       seed=i, ignore_eos=True)
        for i in range(n)
    ]  # fmt: skip
    return prompts, params


def _equal(outs, ref):
    assert len(outs) == len(ref)
    for a, b in zip(outs, ref, strict=True):
        assert a.ok and a.token_ids == b.token_ids and torch.equal(a.logprobs, b.logprobs), a.request_id


KW = dict(max_num_seqs=7, max_num_batched_tokens=32, block_size=4, num_kv_blocks=128)


def test_graph_sizes_resolution():
    assert EngineConfig(max_num_seqs=64).graph_batch_sizes(on_cuda=True) == [1, 2, 4, 8, 16, 32, 64]
    assert EngineConfig(max_num_seqs=48).graph_batch_sizes(on_cuda=True) == [1, 2, 4, 8, 16, 32, 48]
    big = EngineConfig(max_num_seqs=512, max_num_batched_tokens=1024).graph_batch_sizes(True)
    assert big == [1, 2, 4, 8, 16, 32, 64, 128, 256, 320, 384, 448, 512]  # no decode step runs eagerly
    assert EngineConfig(max_num_seqs=300).graph_batch_sizes(True)[-2:] == [256, 300]
    assert EngineConfig(max_num_seqs=256).graph_batch_sizes(True)[-2:] == [128, 256]
    assert EngineConfig(max_num_seqs=512, cuda_graph_batch_sizes=[8, 256]).graph_batch_sizes(True) == [8, 256]
    assert EngineConfig(max_num_seqs=64).graph_batch_sizes(on_cuda=False) == []
    assert EngineConfig(max_num_seqs=8, cuda_graph_batch_sizes=[4, 2]).graph_batch_sizes(on_cuda=False) == [2, 4]
    assert EngineConfig(cuda_graph_batch_sizes=[2], enforce_eager=True).graph_batch_sizes(on_cuda=True) == []


def test_graph_token_sizes_resolution():
    assert EngineConfig(max_num_batched_tokens=1000).graph_token_sizes(on_cuda=True) == [256, 512, 768, 1000]
    assert EngineConfig(max_num_seqs=16, max_num_batched_tokens=100).graph_token_sizes(on_cuda=True) == [100]
    assert EngineConfig(max_num_batched_tokens=4096).graph_token_sizes(True) == list(range(256, 4097, 256))
    assert EngineConfig(max_num_batched_tokens=8192).graph_token_sizes(True)[-5:] == [4096, 5120, 6144, 7168, 8192]
    assert EngineConfig(max_num_batched_tokens=4096).graph_token_sizes(on_cuda=False) == []
    assert EngineConfig(cuda_graph_token_sizes=[32, 16, 16]).graph_token_sizes(on_cuda=False) == [16, 32]
    assert EngineConfig(cuda_graph_token_sizes=()).graph_token_sizes(on_cuda=True) == []
    assert EngineConfig(cuda_graph_token_sizes=[16], enforce_eager=True).graph_token_sizes(on_cuda=True) == []
    with pytest.raises(ValueError, match="cuda_graph_token_sizes"):
        EngineConfig(cuda_graph_token_sizes=[0, 16])


def test_prompt_step_slots_avoid_the_token_counts_and_the_fast_kernels(model):
    """The sequence slots of a padded step with prompt tokens never equal a token count (FA4 would take such a step
    for a decode step); the fast attention kernels read the layout on the host, so they run such steps eagerly."""
    llm = LLM(model=model, max_num_seqs=15, max_num_batched_tokens=32, cuda_graph_token_sizes=[16, 17, 32])
    assert llm.runner.prompt_seqs == 18 and llm.runner.token_sizes == [16, 17, 32]
    fast = LLM(model=model, backend="fast", max_num_seqs=7, max_num_batched_tokens=32, cuda_graph_token_sizes=[32])
    assert fast.runner.token_sizes == []


TOKEN_SIZES = [8, 16, 24, 32]


@pytest.mark.parametrize(
    "kw",
    [dict(cuda_graph_token_sizes=TOKEN_SIZES), dict(cuda_graph_token_sizes=[32], cuda_graph_batch_sizes=[2, 8])],
    ids=["token-sizes", "one-token-size-and-decode"],
)
def test_padded_prompt_steps_equal_unpadded_eager_steps(model, kw):
    prompts, params = _workload(7, seed=4, hi=40)
    eager = LLM(model=model, **KW).generate(prompts, params, use_tqdm=False)
    llm = LLM(model=model, **kw, **KW)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.runner.num_padded_prompt_steps > 0
    _equal(outs, eager)


def test_padded_prompt_steps_with_a_wrong_pad_sequence_are_caught(model, monkeypatch):
    """The equality above can fail: a pad sequence that writes its K/V (slot 0 instead of -1) corrupts a page."""
    prompts, params = _workload(5, seed=5, hi=40)
    eager = LLM(model=model, **KW).generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(ModelRunner, "PAD_ROW", (0, 0, 0, 1))
    llm = LLM(model=model, cuda_graph_token_sizes=[32], **KW)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.runner.num_padded_prompt_steps > 0
    assert any(not torch.equal(a.logprobs, b.logprobs) for a, b in zip(outs, eager, strict=True))


@pytest.mark.parametrize("sizes", [[1, 2, 4, 8], [3], [8]], ids=["pow2", "odd", "one-size"])
def test_padded_decode_equals_unpadded_eager_decode(model, sizes):
    prompts, params = _workload(7, seed=1)
    eager = LLM(model=model, **KW).generate(prompts, params, use_tqdm=False)
    llm = LLM(model=model, cuda_graph_batch_sizes=sizes, **KW)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.runner.num_padded_steps > 0
    assert llm.runner.max_pages == -(-llm.max_model_len // 4)
    _equal(outs, eager)


def test_padded_decode_with_a_wrong_pad_row_is_caught(model, monkeypatch):
    """The equality above can fail: pad rows that write their K/V (slot 0 instead of -1) corrupt a real page."""
    prompts, params = _workload(5, seed=2)
    eager = LLM(model=model, **KW).generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(ModelRunner, "PAD_ROW", (0, 0, 0, 1))
    outs = LLM(model=model, cuda_graph_batch_sizes=[8], **KW).generate(prompts, params, use_tqdm=False)
    assert any(not torch.equal(a.logprobs, b.logprobs) for a, b in zip(outs, eager, strict=True))


@pytest.mark.parametrize(
    "graphs",
    [{}, dict(cuda_graph_batch_sizes=[2, 4, 8]), dict(cuda_graph_token_sizes=[12, 24])],
    ids=["eager", "padded", "padded-prompt-steps"],
)
def test_load_ten_times_the_kv_capacity_loses_nothing(model, graphs):
    """A burst whose tokens add up to ~10x the KV cache: preemption and recompute, every request finishes, and
    every logprob equals the unloaded run (a cache that holds everything), bitwise."""
    prompts, params = _workload(24, seed=3, lo=6, hi=14, max_tokens=20)
    total = sum(len(p) + sp.max_tokens for p, sp in zip(prompts, params, strict=True))
    kw = dict(max_num_seqs=8, max_num_batched_tokens=24, block_size=4)
    loaded = LLM(model=model, num_kv_blocks=total // 40, **graphs, **kw)
    capacity = loaded.blocks.num_blocks * 4
    assert 9 <= total / capacity <= 11
    outs = loaded.generate(prompts, params, use_tqdm=False)
    assert loaded.num_preemptions > 0
    unloaded = LLM(model=model, num_kv_blocks=4 * total, **kw)
    ref = unloaded.generate(prompts, params, use_tqdm=False)
    assert unloaded.num_preemptions == 0
    assert [o.finish_reason for o in outs] == ["length"] * 24
    assert [len(o.token_ids) for o in outs] == [sp.max_tokens for sp in params]
    _equal(outs, ref)
    assert loaded.blocks.num_free == loaded.blocks.num_blocks


def test_fast_backend_kv_write_without_host_sync_equals_the_plain_write():
    """The CUDA fast backend writes KV without a host sync (pad rows rewrite a kept row's slot with its own
    values); on CPU tensors the same function must give what the plain write gives."""
    import vexact_kernels as vk
    from vexact_kernels.attention import _write_kv_cache_no_sync

    g = torch.Generator().manual_seed(0)
    for slots in ([0, -1, 5, -1], [-1, -1, 7, 3], [-1, -1], [9, 2, 0]):
        k, v = torch.randn(len(slots), 2, 8, generator=g), torch.randn(len(slots), 2, 8, generator=g)
        base = torch.randn(4, 4, 2, 8, generator=g)
        want_k, want_v, got_k, got_v = base.clone(), base.clone(), base.clone(), base.clone()
        with vk.use_backend("fast"):
            vk.write_kv_cache(k, v, want_k, want_v, torch.tensor(slots))
        _write_kv_cache_no_sync(k, v, got_k, got_v, torch.tensor(slots))
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v), slots


def test_fast_backend_batched_paged_attention_matches_per_sequence_sdpa():
    """The fast backend's paged attention (decode rows batched in one masked SDPA call, prefill chunks one by one)
    agrees with per-sequence SDPA over each sequence's own keys (the engine's fast baseline stays correct)."""
    import vexact_kernels as vk
    from vexact_kernels.attention import _sdpa

    g = torch.Generator().manual_seed(0)
    hq, hkv, d, page = 8, 2, 16, 4
    kc, vc = torch.randn(64, page, hkv, d, generator=g), torch.randn(64, page, hkv, d, generator=g)
    tables = torch.randperm(64, generator=g)[:16].view(4, 4)
    for n_q, ctx in (([1, 5, 1, 2], [9, 13, 1, 16]), ([1, 1, 1, 1], [3, 16, 1, 7])):
        cu = torch.tensor([0] + n_q).cumsum(0)
        q = torch.randn(int(cu[-1]), hq, d, generator=g)
        with vk.use_backend("fast"):
            out = vk.attention_paged(q, kc, vc, tables, torch.tensor(ctx), cu)
        for b, (n, length) in enumerate(zip(n_q, ctx, strict=True)):
            pos = torch.arange(length)
            rows = tables[b, pos // page] * page + pos % page
            ref = _sdpa(q[cu[b] : cu[b + 1]], kc.view(-1, hkv, d)[rows], vc.view(-1, hkv, d)[rows], length - n, d**-0.5)
            torch.testing.assert_close(out[cu[b] : cu[b + 1]], ref, rtol=1e-5, atol=1e-5)


def test_one_token_prefill_chunks_run_padded_even_when_no_row_samples(model):
    """A budget of one token makes every prefill chunk a one-token step: it runs on the padded path, and most such
    steps have no row that samples (found on the H100 by contracts/test_engine_trainer.py)."""
    prompts, params = _workload(3, seed=9, max_tokens=4)
    kw = dict(max_num_seqs=1, max_num_batched_tokens=1, block_size=1, num_kv_blocks=64)
    ref = LLM(model=model, **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(model=model, cuda_graph_batch_sizes=[1], **kw)
    _equal(llm.generate(prompts, params, use_tqdm=False), ref)
    assert llm.runner.num_padded_steps > sum(len(p) for p in prompts)


def test_graph_recapture_setting_is_checked():
    assert EngineConfig().graph_recapture == "lazy"
    assert EngineConfig(graph_recapture="eager").graph_recapture == "eager"
    with pytest.raises(ValueError, match=r"graph_recapture must be one of \('lazy', 'eager'\), got 'sometimes'"):
        EngineConfig(graph_recapture="sometimes")


def test_lazy_recapture_takes_the_largest_shapes_now_and_each_other_at_its_first_step(model, monkeypatch):
    """The bookkeeping of ``graph_recapture="lazy"`` on CPU, where a stand-in for the CUDA capture records the shape
    and writes the static buffers as a real capture's warm-up does (pad tokens): a re-capture takes the largest token
    count and decode size, each other shape comes at the first step that runs it, once, before the step fills the
    buffers (else the step would run on the pad tokens and its tokens would differ), and the outputs stay those of
    an engine that never captures."""
    prompts, params = _workload(6, seed=7, hi=14, max_tokens=9)
    kw = dict(KW, max_num_seqs=6, cuda_graph_batch_sizes=[1, 2, 4, 6], cuda_graph_token_sizes=[8, 16, 32])
    ref = LLM(model=model, **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(model=model, **kw)
    runner = llm.runner
    captured = []

    def capture(key, static, tokens, seqs, warmups):
        runner._warm_layout(static, tokens, seqs)
        captured.append(key)

    monkeypatch.setattr(runner, "_capture", capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    runner.captures = 1  # a wake_up's re-capture, not the start-up's
    runner._capture_all(lazy=True)
    assert captured == [("prompt", 32), ("decode", 6)]
    left = {("prompt", 8), ("prompt", 16), ("decode", 1), ("decode", 2), ("decode", 4)}
    assert runner._uncaptured == left
    captured.clear()
    _equal(llm.generate(prompts, params, use_tqdm=False), ref)
    assert captured and len(captured) == len(set(captured)) and set(captured) <= left
    assert runner._uncaptured == left - set(captured) and runner.captured_at_steps == len(captured)
    assert ("decode", 1) in captured  # the workload's sequences end at different steps: the last decodes alone
    captured.clear()
    runner._capture_all(lazy=False)  # eager: every shape, largest first
    assert captured == [("prompt", 32), ("prompt", 16), ("prompt", 8), ("decode", 6), ("decode", 4), ("decode", 2),
                        ("decode", 1)]  # fmt: skip
    assert runner._uncaptured == set()
