"""The engine: a request's tokens and logprobs depend on its prompt and seed only, never on the batch, the step
budget, the page size or preemption; stopping rules; abort; text prompts."""

from __future__ import annotations

import pytest
import torch

import vexact_kernels as vk
from vexact_engine import LLM, LLMEngine, RequestOutput, SamplingParams
from vexact_models import AttentionMetadata, default_checkpoint, random_model, tiny_qwen3_config

SEED = 5


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_qwen3_config(), seed=SEED)


def _prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 30) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(0, 256, (k,), generator=g).tolist() for k in lens]


def _same(a: RequestOutput, b: RequestOutput) -> None:
    assert a.token_ids == b.token_ids
    assert torch.equal(a.logprobs, b.logprobs)
    assert a.finish_reason == b.finish_reason


def _rescore(model, out: RequestOutput, temperature: float) -> torch.Tensor:
    """The logprobs of the generated tokens recomputed on the packed (trainer) layout, in one forward."""
    seq = out.prompt_token_ids + out.token_ids[:-1]
    hidden = model(torch.tensor(seq), torch.arange(len(seq)), AttentionMetadata.packed([len(seq)]))
    rows = hidden[len(out.prompt_token_ids) - 1 :]
    lp, _ = model.logprobs(rows, torch.tensor(out.token_ids), temperature)
    return lp


CONFIGS = [
    dict(max_num_batched_tokens=512, block_size=16, max_num_seqs=64),
    dict(max_num_batched_tokens=8, block_size=4, max_num_seqs=8),  # chunked prefill, several steps per prompt
    dict(max_num_batched_tokens=13, block_size=1, max_num_seqs=3),  # odd budget, one token per page, few slots
]


@pytest.mark.parametrize("kw", CONFIGS, ids=["roomy", "chunked", "tight"])
def test_same_seed_same_output_whatever_the_batch(model, kw):
    target = [11, 22, 33, 44, 55, 66, 77]
    params = SamplingParams(temperature=0.9, max_tokens=12, seed=1234, ignore_eos=True)
    alone = LLM(model=model, num_kv_blocks=512, **CONFIGS[0]).generate([target], params, use_tqdm=False)[0]
    others = _prompts(7, seed=1)
    batch = others[:3] + [target] + others[3:]
    batch_params = (
        [SamplingParams(temperature=0.7 + 0.1 * i, top_k=50 * (i % 2), max_tokens=5 + i, seed=i) for i in range(3)]
        + [params]
        + [SamplingParams(max_tokens=9, seed=100 + i) for i in range(4)]
    )
    outs = LLM(model=model, num_kv_blocks=512, **kw).generate(batch, batch_params, use_tqdm=False)
    assert len(alone.token_ids) == 12 and alone.finish_reason == "length"
    _same(outs[3], alone)
    assert outs[3].prompt_token_ids == target


def test_logprobs_are_what_the_packed_layout_computes(model):
    """The reported logprob is log_softmax(logits / T) of the sampled token, as a one-shot packed forward gives."""
    params = SamplingParams(temperature=0.8, max_tokens=10, seed=3, ignore_eos=True)
    outs = LLM(model=model, num_kv_blocks=64, max_num_batched_tokens=8, max_num_seqs=4, block_size=4).generate(
        _prompts(3, seed=2), params, use_tqdm=False
    )
    for out in outs:
        assert out.logprobs.dtype == torch.float32 and out.logprobs.shape == (10,)
        assert torch.equal(out.logprobs, _rescore(model, out, 0.8))


def test_greedy(model):
    prompts = _prompts(3, seed=3)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = LLM(model=model, num_kv_blocks=64).generate(prompts, greedy, use_tqdm=False)
    # greedy ignores the seed and the engine's seed
    again = LLM(model=model, num_kv_blocks=64, seed=99).generate(
        prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, seed=7), use_tqdm=False
    )
    for out, out2, prompt in zip(outs, again, prompts, strict=True):
        _same(out, out2)
        seq = prompt + out.token_ids
        hidden = model(torch.tensor(seq), torch.arange(len(seq)), AttentionMetadata.packed([len(seq)]))
        logits = model.logits(hidden[len(prompt) - 1 : -1])
        assert out.token_ids == logits.argmax(-1).tolist()
        # greedy reports logprobs at temperature 1
        assert torch.equal(out.logprobs, vk.log_softmax(logits).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0])


def test_sampling_is_not_greedy_and_seeds_matter(model):
    prompt = _prompts(1, seed=4)
    llm = LLM(model=model, num_kv_blocks=64)
    a = llm.generate(prompt, SamplingParams(max_tokens=12, seed=1, ignore_eos=True), use_tqdm=False)[0]
    b = llm.generate(prompt, SamplingParams(max_tokens=12, seed=2, ignore_eos=True), use_tqdm=False)[0]
    c = llm.generate(prompt, SamplingParams(max_tokens=12, seed=1, ignore_eos=True), use_tqdm=False)[0]
    g = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    _same(a, c)
    assert a.token_ids != b.token_ids
    assert a.token_ids != g.token_ids


def test_engine_seed_derives_request_seeds(model):
    prompts = _prompts(3, seed=5)
    p = SamplingParams(max_tokens=8, ignore_eos=True)
    run = lambda seed: LLM(model=model, num_kv_blocks=64, seed=seed).generate(prompts, p, use_tqdm=False)  # noqa: E731
    first, same, other = run(0), run(0), run(1)
    for x, y in zip(first, same, strict=True):
        _same(x, y)
    assert [o.token_ids for o in first] != [o.token_ids for o in other]


def test_max_tokens_and_max_model_len(model):
    llm = LLM(model=model, num_kv_blocks=64, max_model_len=20)
    outs = llm.generate(
        [[1, 2, 3], list(range(1, 16))], SamplingParams(max_tokens=7, seed=0, ignore_eos=True), use_tqdm=False
    )
    assert len(outs[0].token_ids) == 7 and outs[0].finish_reason == "length"
    assert len(outs[1].token_ids) == 5 and outs[1].finish_reason == "length"  # 15 + 5 = max_model_len 20
    assert outs[0].logprobs.shape == (7,)


def test_stop_token_ids(model):
    prompt = [40, 41, 42, 43]
    free = LLM(model=model, num_kv_blocks=64).generate(
        prompt, SamplingParams(max_tokens=16, seed=8, ignore_eos=True), use_tqdm=False
    )[0]
    i = next(i for i in range(2, 16) if free.token_ids[i] not in free.token_ids[:i])
    stop = free.token_ids[i]
    out = LLM(model=model, num_kv_blocks=64).generate(
        prompt, SamplingParams(max_tokens=16, seed=8, ignore_eos=True, stop_token_ids=[stop]), use_tqdm=False
    )[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == free.token_ids[: i + 1]  # the stop token is reported, then nothing more
    assert torch.equal(out.logprobs, free.logprobs[: i + 1])


def test_eos_stops_unless_ignored():
    greedy = SamplingParams(temperature=0, max_tokens=10)
    base = random_model(tiny_qwen3_config(eos_token_id=None), seed=SEED)
    free = LLM(model=base, num_kv_blocks=64).generate([[7, 8, 9]], greedy, use_tqdm=False)[0]
    assert free.finish_reason == "length"
    i = next(i for i in range(1, 10) if free.token_ids[i] not in free.token_ids[:i])
    with_eos = random_model(tiny_qwen3_config(eos_token_id=free.token_ids[i]), seed=SEED)
    llm = LLM(model=with_eos, num_kv_blocks=64)
    stopped = llm.generate([[7, 8, 9]], greedy, use_tqdm=False)[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[: i + 1]
    ignored = llm.generate([[7, 8, 9]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    _same(ignored[0], free)


def test_abort_running_request_and_the_others_continue(model):
    prompts = _prompts(3, seed=6)
    params = [SamplingParams(max_tokens=10, seed=i, ignore_eos=True) for i in range(3)]
    reference = LLM(model=model, num_kv_blocks=64, block_size=4).generate(prompts, params, use_tqdm=False)

    eng = LLMEngine(model=model, num_kv_blocks=64, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    for rid, (p, sp) in zip("abc", zip(prompts, params, strict=True), strict=True):
        assert eng.add_request(p, sp, request_id=rid) == rid
    finished: dict[str, RequestOutput] = {}
    seqs = {s.request_id: s for s in eng.scheduler.waiting}
    while len(seqs["b"].output_token_ids) < 3:
        for out in eng.step():
            finished[out.request_id] = out
    assert "b" in {s.request_id for s in eng.running_sequences()}
    aborted = eng.abort_request("b")
    assert aborted.finish_reason == "abort" and aborted.request_id == "b"
    n = len(aborted.token_ids)
    assert 3 <= n < 10
    assert aborted.token_ids == reference[1].token_ids[:n]
    assert torch.equal(aborted.logprobs, reference[1].logprobs[:n])
    assert eng.abort_request("b") is None and eng.abort_request("nope") is None
    while eng.has_unfinished_requests():
        for out in eng.step():
            finished[out.request_id] = out
    assert sorted(finished) == ["a", "c"]
    _same(finished["a"], reference[0])
    _same(finished["c"], reference[2])
    assert eng.blocks.num_free == 64  # every page came back, the aborted request's included


def test_abort_waiting_request(model):
    eng = LLMEngine(model=model, num_kv_blocks=64, max_num_seqs=1, max_num_batched_tokens=8)
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=4), request_id="first")
    eng.add_request([4, 5, 6], SamplingParams(max_tokens=4), request_id="second")
    eng.step()
    out = eng.abort_request("second")
    assert out.finish_reason == "abort" and out.token_ids == [] and out.logprobs.shape == (0,)
    done = []
    while eng.has_unfinished_requests():
        done += eng.step()
    assert [o.request_id for o in done] == ["first"]


def test_tiny_kv_cache_forces_preemption_and_loses_nothing(model):
    prompts = _prompts(8, seed=7, lo=5, hi=12)
    params = [SamplingParams(max_tokens=14, seed=10 + i, ignore_eos=True) for i in range(8)]
    kw = dict(block_size=4, max_num_batched_tokens=32, max_num_seqs=8)
    big = LLM(model=model, num_kv_blocks=256, **kw)
    ref = big.generate(prompts, params, use_tqdm=False)
    assert big.num_preemptions == 0
    small = LLM(model=model, num_kv_blocks=8, **kw)  # one request at its peak needs 7 pages
    outs = small.generate(prompts, params, use_tqdm=False)
    assert small.num_preemptions > 0
    assert sum(o.num_preemptions for o in outs) == small.num_preemptions
    assert len(outs) == 8
    for got, want in zip(outs, ref, strict=True):
        assert got.finish_reason == "length" and len(got.token_ids) == 14
        _same(got, want)
    assert small.blocks.num_free == 8


def test_pages_of_128_tokens_give_the_bits_of_pages_of_16(model):
    """128-token pages (FA4's tile_n at head_dim 128, the page its TMA path takes) change no token and no logprob:
    with and without prefix caching, eager and padded, chunked prefill whose chunks end mid-page; and two full pages
    of a shared 270-token prefix come from the cache."""
    g = torch.Generator().manual_seed(12)
    shared = torch.randint(0, 256, (270,), generator=g).tolist()
    prompts = [shared + [1, 2], shared + [3], torch.randint(0, 256, (150,), generator=g).tolist(), [5, 6], shared[:130]]
    params = [SamplingParams(temperature=0.9, max_tokens=6 + i, seed=40 + i, ignore_eos=True) for i in range(5)]
    kw = dict(max_num_seqs=4, max_num_batched_tokens=100, max_model_len=512)
    runs = {}
    for page, pages, caching, padded in ((16, 160, False, None), (16, 160, True, None), (128, 24, False, None),
                                         (128, 24, True, None), (128, 24, True, [1, 2, 4])):  # fmt: skip
        llm = LLM(model=model, block_size=page, num_kv_blocks=pages, enable_prefix_caching=caching,
                  cuda_graph_batch_sizes=padded, **kw)  # fmt: skip
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert (llm.runner.num_padded_steps > 0) == bool(padded) and llm.num_preemptions == 0
        runs[page, caching, bool(padded)] = outs, llm.stats["cached_prompt_tokens"]
    ref, _ = runs[16, False, False]
    for (_, caching, _), (outs, cached) in runs.items():
        for got, want in zip(outs, ref, strict=True):
            _same(got, want)
        # the second prompt reuses the first's 256 leading tokens, the last prompt 128 (at either page size)
        assert cached == (256 + 128 if caching else 0)


@pytest.mark.gpu
def test_gpu_pages_of_128_tokens_give_the_bits_of_pages_of_16():
    """On CUDA, with the attention implementation in force (FA4 where it runs: heads of 128 take it, and a 128-token
    page is its TMA paged path), CUDA graphs for decode and prompt steps and prefix caching on: 128-token pages give
    the tokens and logprobs of 16-token pages, and the trainer's logprobs of the same tokens."""
    from vexact_trainer import Actor

    model = random_model(tiny_qwen3_config(head_dim=128), seed=SEED, device="cuda")
    g = torch.Generator().manual_seed(13)
    shared = torch.randint(0, 256, (300,), generator=g).tolist()
    prompts = [shared + [1], shared + [2, 3], torch.randint(0, 256, (200,), generator=g).tolist(), [7, 8, 9]]
    params = [SamplingParams(temperature=0.9, max_tokens=20 + i, seed=70 + i, ignore_eos=True) for i in range(4)]
    kw = dict(device="cuda", max_num_seqs=4, max_num_batched_tokens=256, max_model_len=512)
    outs = {page: LLM(model=model, block_size=page, num_kv_blocks=pages, **kw).generate(prompts, params, use_tqdm=False)
            for page, pages in ((16, 256), (128, 32))}  # fmt: skip
    for got, want in zip(outs[128], outs[16], strict=True):
        _same(got, want)
    scored = Actor(model).compute_log_probs(prompts, [o.token_ids for o in outs[128]], 0.9)
    for o, lp in zip(outs[128], scored.logprobs, strict=True):
        assert torch.equal(o.logprobs, lp.cpu())


def test_outputs_come_back_in_input_order(model):
    prompts = [list(range(1, 30)), [1], list(range(5, 12))]
    outs = LLM(model=model, num_kv_blocks=64, max_num_batched_tokens=8, max_num_seqs=2).generate(
        prompts, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False
    )
    assert [o.prompt_token_ids for o in outs] == prompts
    assert len({o.request_id for o in outs}) == 3
    assert all(o.ok and o.error is None and o.text is None for o in outs)


def test_single_token_id_prompt_and_tensor_prompt(model):
    llm = LLM(model=model, num_kv_blocks=64)
    p = SamplingParams(max_tokens=3, seed=1, ignore_eos=True)
    (single,) = llm.generate([5, 6, 7], p, use_tqdm=False)  # a flat list of ints is one prompt
    (tensor,) = llm.generate([torch.tensor([5, 6, 7])], p, use_tqdm=False)
    _same(single, tensor)


def test_fast_backend_runs_but_is_not_the_invariant_numerics(model):
    prompts = _prompts(2, seed=8)
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    inv = LLM(model=model, num_kv_blocks=64).generate(prompts, p, use_tqdm=False)
    fast = LLM(model=model, num_kv_blocks=64, backend="fast").generate(prompts, p, use_tqdm=False)
    for a, b in zip(inv, fast, strict=True):
        assert len(b.token_ids) == 6
        torch.testing.assert_close(b.logprobs[:1], a.logprobs[:1], rtol=0, atol=0.1)


@pytest.fixture(scope="module")
def text_llm():
    llm = LLM(default_checkpoint(), num_kv_blocks=64)
    if llm.tokenizer is None:
        pytest.skip("transformers is not installed, so the checkpoint's tokenizer cannot be loaded")
    return llm


def test_text_prompts_with_the_default_checkpoint_tokenizer(text_llm):
    params = SamplingParams(max_tokens=8, seed=21, ignore_eos=True)
    (out,) = text_llm.generate("Hello, VeXact!", params, use_tqdm=False)
    ids = text_llm.tokenizer("Hello, VeXact!", add_special_tokens=False)["input_ids"]
    assert out.prompt_token_ids == ids and len(ids) == len(b"Hello, VeXact!")  # byte-level, no merges
    assert text_llm.tokenizer.decode(ids) == "Hello, VeXact!"
    assert isinstance(out.text, str) and out.text == text_llm.tokenizer.decode(out.token_ids)
    (by_ids,) = text_llm.generate([ids], params, use_tqdm=False)
    _same(out, by_ids)
    mixed = text_llm.generate(["Hi", [1, 2, 3], "Hello, VeXact!"], params, use_tqdm=False)
    assert [o.finish_reason for o in mixed] == ["length"] * 3
    _same(mixed[2], out)


@pytest.mark.gpu
def test_cuda_engine_both_backends_and_invariant_matches_trainer():
    from vexact_trainer import Actor

    p = SamplingParams(temperature=0.8, max_tokens=6, seed=3, ignore_eos=True)
    fast = LLM(default_checkpoint(), device="cuda", backend="fast", num_kv_blocks=16)
    assert next(fast.model.parameters()).device.type == "cuda"
    (out,) = fast.generate([[1, 2, 3, 4]], p, use_tqdm=False)
    assert len(out.token_ids) == 6 and out.logprobs.shape == (6,) and bool((out.logprobs <= 0).all())
    inv = LLM(default_checkpoint(), device="cuda", num_kv_blocks=16, max_num_seqs=4, max_num_batched_tokens=8)
    outs = inv.generate([[1, 2, 3, 4], list(range(5, 30))], p, use_tqdm=False)
    scored = Actor(inv.model).compute_log_probs([o.prompt_token_ids for o in outs], [o.token_ids for o in outs], 0.8)
    for o, lp in zip(outs, scored.logprobs, strict=True):
        assert torch.equal(o.logprobs, lp.cpu())


def test_update_weights_equals_a_fresh_engine_with_those_weights():
    old, new = random_model(tiny_qwen3_config(), seed=1), random_model(tiny_qwen3_config(), seed=2)
    prompts, params = _prompts(6, seed=3), SamplingParams(max_tokens=8, temperature=0.9, seed=11)
    llm = LLM(model=old, max_num_seqs=4, max_num_batched_tokens=64)
    before = llm.generate(prompts, params, use_tqdm=False)
    # buckets of two tensors, as a trainer would stream them
    named = list(new.named_parameters())
    loaded = []
    for i in range(0, len(named), 2):
        loaded += llm.update_weights((n, p.detach().clone()) for n, p in named[i : i + 2])
    assert sorted(loaded) == sorted(n for n, _ in named)
    after = llm.generate(prompts, params, use_tqdm=False)
    fresh = LLM(model=random_model(tiny_qwen3_config(), seed=2), max_num_seqs=4, max_num_batched_tokens=64)
    for a, f in zip(after, fresh.generate(prompts, params, use_tqdm=False), strict=True):
        _same(a, f)
    assert any(a.token_ids != b.token_ids for a, b in zip(after, before, strict=True))


def test_update_weights_rejects_bad_tensors_and_in_flight_requests(model):
    from vexact_models import CheckpointError

    llm = LLMEngine(model=random_model(tiny_qwen3_config(), seed=1))
    with pytest.raises(CheckpointError, match="shape"):
        llm.update_weights([("model.norm.weight", torch.ones(3))])
    with pytest.raises(CheckpointError, match="does not have"):
        llm.update_weights([("model.nope.weight", torch.ones(3))])
    llm.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="unfinished"):
        llm.update_weights([])


def test_kv_report_names_the_setting_that_sized_the_cache(model):
    eng = LLMEngine(model=model, num_kv_blocks=64, block_size=4)
    assert eng.kv_report["source"] == "num_kv_blocks" and eng.kv_report["num_blocks"] == 64
    assert eng.kv_report["tokens"] == 256 and eng.kv_report["kv_bytes"] > 0
    per_token = eng.kv_report["kv_bytes"] // 256
    eng = LLMEngine(model=model, kv_cache_bytes=per_token * 4 * 10, block_size=4)
    assert (eng.kv_report["source"], eng.kv_report["num_blocks"], eng.kv_report["tokens"]) == ("kv_cache_bytes", 10, 40)
    assert LLMEngine(model=model).kv_report["source"] == "the CPU default"
    assert "activation_bytes" not in eng.kv_report  # measured only where GPU memory sizes the cache


@pytest.mark.gpu
def test_gpu_kv_report_and_graph_memory():
    """Sized from GPU memory, the report carries the budget, the weights and the activation peak it left room for
    twice, and the cache fills what they leave; the captures' reserved memory is counted."""
    model = random_model(tiny_qwen3_config(), seed=SEED, device="cuda")
    eng = LLMEngine(model=model, gpu_memory_utilization=0.3, max_num_seqs=8, max_num_batched_tokens=256,
                    cuda_graph_batch_sizes=[1, 8])  # fmt: skip
    r = eng.kv_report
    assert r["source"] == "gpu_memory_utilization" and r["activation_bytes"] > 0
    assert r["kv_bytes"] <= r["budget_bytes"] - r["weights_bytes"] - 2 * r["activation_bytes"]
    assert eng.runner.capture_reserved_bytes > 0
