"""Contract 2, cache hits: with prefix caching a request's tokens and logprobs are bitwise those it gets without it.

A prefix-cache hit turns a request's prefill into a chunked prefill from a cached context; the chunk-invariant
kernels make that the K/V and logits of a full recompute. Checked here with ``torch.equal`` for a GRPO group (n
samples of one prompt, sharing pages already in the step that computes them), a second ``generate()`` that finds
everything cached, a KV pool small enough to preempt (a preempted request finds its own pages again), and a weight
update (which must drop the cache: stale K/V would change the logprobs). Each is shown failing once on a
deliberately broken cache.
"""

from __future__ import annotations

import pytest
import torch

from contracts.harness import logprob_mismatches
from vexact_engine import LLM, EngineConfig, SamplingParams
from vexact_engine.block_manager import BlockManager
from vexact_models import named_weights, random_model, tiny_deepseek_v3_config, tiny_qwen3_config, tiny_qwen3_moe_config
from vexact_trainer import Actor

FAMILIES = ["qwen3", "qwen3_moe", "deepseek_v3"]  # deepseek_v3: MLA pages, K wider than V (kv_cache_dims)
CONFIGS = {"qwen3": tiny_qwen3_config, "qwen3_moe": tiny_qwen3_moe_config, "deepseek_v3": tiny_deepseek_v3_config}
BLOCK = 4
MAX_LEN = 96


def _model(request, family: str):
    return request.getfixturevalue("family_model")(family)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _group(prompt: list[int], n: int, max_tokens: int = 8, seed0: int = 0):
    """n samples of one prompt (a GRPO group): the same prompt, a seed each."""
    params = [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=max_tokens, seed=seed0 + i, ignore_eos=True)
              for i in range(n)]  # fmt: skip
    return [prompt] * n, params


def _engine(model, caching: bool, **kw) -> LLM:
    cfg = dict(max_num_seqs=8, max_num_batched_tokens=48, block_size=BLOCK, max_model_len=MAX_LEN)
    return LLM(model=model, config=EngineConfig(enable_prefix_caching=caching, **{**cfg, **kw}))


def _gen(llm: LLM, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.ok for o in outs), [o.error for o in outs if not o.ok]
    return outs


def _differences(outs, ref) -> list[int]:
    """Indices of requests whose tokens or logprobs are not bitwise those of ``ref``."""
    return [i for i, (a, b) in enumerate(zip(outs, ref, strict=True))
            if a.token_ids != b.token_ids or not torch.equal(a.logprobs, b.logprobs)]  # fmt: skip


def _workload():
    p = _tokens(37, seed=1)
    prompts, params = _group(p, 8)
    # a second prompt sharing the first one's leading 21 tokens (5 whole pages), and a lone one
    more, more_params = _group(p[:21] + _tokens(11, seed=2), 3, seed0=100)
    lone, lone_params = _group(_tokens(13, seed=3), 1, seed0=200)
    return prompts + more + lone, params + more_params + lone_params


@pytest.mark.parametrize("family", FAMILIES)
def test_cache_hit_equals_miss(request, family):
    """n = 8 samples of one prompt (and a prompt sharing its prefix): caching on == off, torch.equal, in the first
    call (the group shares the pages of the step that computes them) and in a second call that finds them cached."""
    model = _model(request, family)
    prompts, params = _workload()
    miss = _gen(_engine(model, caching=False), prompts, params)
    llm = _engine(model, caching=True)
    first = _gen(llm, prompts, params)
    second = _gen(llm, prompts, params)
    assert _differences(first, miss) == [] and _differences(second, miss) == []
    # the hits happened: 7 of the group in the first call's step, everything whole-page in the second call
    assert [o.num_cached_tokens for o in first[1:8]] == [36] * 7 and first[0].num_cached_tokens == 0
    assert [o.num_cached_tokens for o in second] == [(len(p) - 1) // BLOCK * BLOCK for p in prompts]
    assert all(o.num_cached_tokens == 0 for o in miss)
    assert llm.stats["cached_prompt_tokens"] == sum(o.num_cached_tokens for o in first + second)
    # and what the engine reports from cached pages is what the trainer computes
    temps = [p.temperature for p in params]
    scored = Actor(model).compute_log_probs(prompts, [o.token_ids for o in second], temps).logprobs
    assert logprob_mismatches(second, scored) == []


@pytest.mark.parametrize("padded", [False, True], ids=["eager", "padded"])
@pytest.mark.parametrize("family", FAMILIES)
def test_cache_hit_equals_miss_under_preemption(request, family, padded):
    """A KV pool that cannot hold every group at once: requests are preempted, find their own full pages cached
    when re-admitted (or recompute what was evicted) and still equal a roomy engine without caching; also with the
    steps padded as the CUDA graphs pad them (eager here on CPU: decode to 4 or 8 rows, prompt steps to 12 or 24
    tokens)."""
    model = _model(request, family)
    graphs = dict(cuda_graph_batch_sizes=[4, 8], cuda_graph_token_sizes=[12, 24]) if padded else {}
    prompts, params = [], []
    for g in range(3):
        p, sp = _group(_tokens(22 + 3 * g, seed=10 + g), 4, max_tokens=16, seed0=10 * g)
        prompts += p
        params += sp
    llm = _engine(model, caching=True, max_num_batched_tokens=24, num_kv_blocks=20, **graphs)
    outs = _gen(llm, prompts, params)
    assert llm.num_preemptions > 0, "the KV pool was meant to be small enough to preempt"
    assert not padded or (llm.runner.num_padded_steps > 0 and llm.runner.num_padded_prompt_steps > 0)
    assert llm.stats["recompute_tokens_cached"] > 0, "a preempted request was meant to find its pages cached"
    assert _differences(outs, _gen(_engine(model, caching=False), prompts, params)) == []


def test_split_steps_that_read_pages_before_they_are_written_are_caught(request, monkeypatch):
    """The padded run above can fail: with steps split (``EngineConfig.split_mixed_steps``), a one-token row of a
    request admitted in its step, put with the decode rows, reads prefix pages that the step's prompt chunks (another
    sample of its group) write only in the launch after it."""
    from vexact_engine.model_runner import ModelRunner

    split_mixed = ModelRunner.split_mixed

    def admitted_rows_with_the_decode_rows(self, batch):
        was = [(item, item.admitted) for item in batch]
        for item, _ in was:
            item.admitted = False
        try:
            return split_mixed(self, batch)
        finally:
            for item, admitted in was:
                item.admitted = admitted

    model = _model(request, "qwen3")
    graphs = dict(cuda_graph_batch_sizes=[4, 8], cuda_graph_token_sizes=[12, 24])
    prompts, params = [], []
    for g in range(3):
        p, sp = _group(_tokens(22 + 3 * g, seed=10 + g), 4, max_tokens=16, seed0=10 * g)
        prompts += p
        params += sp
    ref = _gen(_engine(model, caching=False), prompts, params)
    monkeypatch.setattr(ModelRunner, "split_mixed", admitted_rows_with_the_decode_rows)
    llm = _engine(model, caching=True, max_num_batched_tokens=24, num_kv_blocks=20, **graphs)
    assert _differences(_gen(llm, prompts, params), ref) != []
    assert llm.runner.num_split_steps > 0


def _fresh(family: str, seed: int):
    return random_model(CONFIGS[family](), seed=seed)


def _after_update_weights(family: str) -> tuple[list, list]:
    """Generate with weights A (filling the cache), update to weights B, generate the same prompts again; returns
    (those outputs, a fresh engine's with weights B)."""
    prompts, params = _workload()
    llm = _engine(_fresh(family, seed=1), caching=True)
    _gen(llm, prompts, params)
    assert llm.blocks.num_cached > 0
    new = _fresh(family, seed=2)
    llm.update_weights([(n, p.detach().clone()) for n, p in named_weights(new)])  # DeepSeek's bias buffer too
    return _gen(llm, prompts, params), _gen(_engine(new, caching=True), prompts, params)


@pytest.mark.parametrize("family", FAMILIES)
def test_update_weights_invalidates_the_cache(family):
    """After update_weights the same prompts equal a fresh engine with the new weights, torch.equal."""
    outs, ref = _after_update_weights(family)
    assert _differences(outs, ref) == []


def test_update_weights_contract_fails_on_a_stale_cache(monkeypatch):
    """The contract can fail: a cache that survives update_weights serves K/V of the old weights."""
    monkeypatch.setattr(BlockManager, "reset_prefix_cache", lambda self: None)
    outs, ref = _after_update_weights("qwen3")
    assert _differences(outs, ref) != []


def _shared_pages_workload():
    """A = [X, Y, ...]; B starts with Y (so a key without the parent confuses B's first page with A's second);
    C = [X, Y', ...] with Y' differing from Y in its last token only (a key missing a token confuses them)."""
    x, y = _tokens(BLOCK, seed=20), _tokens(BLOCK, seed=21)
    y2 = y[:-1] + [(y[-1] + 1) % 256]
    a = x + y + _tokens(9, seed=22)
    b = y + _tokens(9, seed=23)
    c = x + y2 + _tokens(9, seed=24)
    return [a], [b, c], [SamplingParams(temperature=1.0, max_tokens=6, seed=s, ignore_eos=True) for s in range(3)]


def _a_then_others(model, caching: bool):
    first, later, params = _shared_pages_workload()
    llm = _engine(model, caching=caching)
    return _gen(llm, first, params[:1]) + _gen(llm, later, params[1:])


def test_exact_keys_keep_unrelated_prefixes_apart(tiny_model):
    assert _differences(_a_then_others(tiny_model, True), _a_then_others(tiny_model, False)) == []


@pytest.mark.parametrize(
    "broken_key",
    [
        pytest.param(lambda parent, tokens: (-1, tuple(tokens)), id="key-ignores-parent"),
        pytest.param(lambda parent, tokens: (parent, tuple(tokens[:-1])), id="key-ignores-a-token"),
    ],
)
def test_hit_equals_miss_fails_on_a_wrong_key(tiny_model, monkeypatch, broken_key):
    """The hit == miss contract can fail: a page key that ignores its parent, or one of its tokens, reuses a page
    whose K/V belongs to other tokens."""
    miss = _a_then_others(tiny_model, False)
    monkeypatch.setattr(BlockManager, "block_key", staticmethod(broken_key))
    assert _differences(_a_then_others(tiny_model, True), miss) != []
