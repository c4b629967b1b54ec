"""EngineConfig.async_decode: the loop launches step N+1 before it reads step N back, the rows of step N+1 read the
tokens step N drew from the device, and the stopping rules, aborts and preemption apply one step late. Every request's
tokens and logprobs equal the engine's without it, bitwise, and no request or KV page is lost.

On CPU the steps run synchronously but through the same control flow (the deferred read-back, the fed rows, the
dropped rows of requests that stopped), over random workloads: mixed lengths, stop tokens and EOS, max_tokens,
aborts mid-run, preemption under a tiny KV cache, prefix caching on and off, greedy, top-k / top-p and fused-draw
rows, eager and padded steps, the draw from the static buffers on and off. The ``gpu`` tests run the same on CUDA with
CUDA graphs."""

from __future__ import annotations

import random

import pytest
import torch

import vexact_engine.cuda_graphs as cuda_graphs
import vexact_engine.model_runner as model_runner
from vexact_engine import LLM, EngineConfig, LLMEngine, RequestOutput, SamplingParams
from vexact_engine.in_flight import feed_drawn
from vexact_models import default_checkpoint, random_model, tiny_qwen3_config


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_qwen3_config(), seed=48)


def _workload(seed: int, vocab: int, eos: int):
    """Requests ``(id, prompt, params)``, aborts ``{id: after this many tokens}`` and engine settings, at random."""
    r = random.Random(seed)
    bases = [[r.randrange(256) for _ in range(r.randint(1, 40))] for _ in range(4)]
    requests = []
    for i in range(r.randint(6, 14)):
        base = r.choice(bases)
        # a shared prompt (the samples of one group), a shared prefix with a tail of its own, or a prompt of its own
        prompt = r.choice([base, base + [r.randrange(256) for _ in range(r.randint(1, 9))],
                           [r.randrange(256) for _ in range(r.randint(1, 30))]])  # fmt: skip
        kind = r.choice(["fused", "fused", "greedy", "top_k", "top_p"])
        sp = dict(temperature=r.choice([0.7, 1.0, 1.3]), max_tokens=r.randint(1, 20), seed=r.randrange(1 << 20))
        if kind == "greedy":
            sp["temperature"] = 0.0
        elif kind == "top_k":
            sp["top_k"] = r.randint(1, 40)
        elif kind == "top_p":
            sp["top_p"] = r.choice([0.5, 0.9])
        if r.random() < 0.6:  # stop tokens that come up often enough to end requests mid-run
            sp["stop_token_ids"] = r.sample(range(vocab), r.randint(5, 30))
        if r.random() < 0.3:
            sp["stop_token_ids"] = sp.get("stop_token_ids", []) + [eos]
        sp["ignore_eos"] = r.random() < 0.5
        requests.append((f"r{i}", prompt, SamplingParams(**sp)))
    aborts = {rid: r.randint(0, 4) for rid, *_ in r.sample(requests, r.randint(0, 2))}
    block = r.choice([1, 2, 4, 16])
    seqs = r.randint(1, 8)
    peak = max(-(-(len(p) + sp.max_tokens) // block) for _, p, sp in requests)
    kw = dict(
        max_num_seqs=seqs,
        max_num_batched_tokens=r.choice([seqs, 8, 16, 64]) if seqs <= 8 else 64,
        block_size=block,
        num_kv_blocks=r.choice([peak, peak + 2, 4 * peak, 512 // block]),  # the smaller ones force preemption
        enable_prefix_caching=r.random() < 0.7,
    )
    kw["max_num_batched_tokens"] = max(kw["max_num_batched_tokens"], seqs)
    if r.random() < 0.6:  # padded decode steps (the draw from the static buffers when every row takes the fused draw)
        kw["cuda_graph_batch_sizes"] = r.choice([[1, 2, 4, 8], [3, 8], [8]])
        kw["draw_in_graph"] = r.random() < 0.7
    if r.random() < 0.4:  # padded steps with prompt tokens
        kw["cuda_graph_token_sizes"] = [16, kw["max_num_batched_tokens"]]
    return requests, aborts, kw


def _drive(model, requests, aborts, **kw) -> tuple[LLMEngine, dict[str, RequestOutput]]:
    """Run every request to its end on an engine of ``model`` (a module, or a checkpoint path); a request in
    ``aborts`` is aborted once the host holds that many of its tokens (the same point of its output whether the loop
    reads steps back at once or a step late)."""
    eng = LLMEngine(model=model, **kw) if isinstance(model, torch.nn.Module) else LLMEngine(model, **kw)
    for rid, prompt, params in requests:
        eng.add_request(prompt, params, request_id=rid)
    outs: dict[str, RequestOutput] = {}

    def abort_due():
        for rid, k in aborts.items():
            seq = eng._seqs.get(rid)
            if seq is not None and len(seq.output_token_ids) >= k:
                outs[rid] = eng.abort_request(rid)

    abort_due()
    while eng.has_unfinished_requests():
        for out in eng.step():
            assert out.request_id not in outs, f"{out.request_id} came back twice"
            outs[out.request_id] = out
        abort_due()
    return eng, outs


def _assert_same(outs: dict[str, RequestOutput], ref: dict[str, RequestOutput], requests) -> None:
    assert sorted(outs) == sorted(ref) == sorted(rid for rid, *_ in requests)  # no request lost
    for rid in ref:
        a, b = outs[rid], ref[rid]
        assert a.token_ids == b.token_ids, rid
        assert torch.equal(a.logprobs, b.logprobs), rid
        assert a.finish_reason == b.finish_reason, rid


def _assert_quiet(eng: LLMEngine) -> None:
    """Nothing left behind: every page free (or cached and evictable), no step in flight."""
    assert eng.blocks.num_free == eng.blocks.num_blocks
    assert all(c == 0 for c in eng.blocks.ref_counts)
    assert eng._in_flight is None and not eng._seqs


@pytest.mark.parametrize("seed", range(24))
def test_random_workloads_give_the_bits_of_the_synchronous_loop(model, seed):
    requests, aborts, kw = _workload(seed, model.config.vocab_size, model.config.eos_token_ids[0])
    sync, ref = _drive(model, requests, aborts, **kw)
    eng, outs = _drive(model, requests, aborts, async_decode=True, **kw)
    _assert_same(outs, ref, requests)
    _assert_quiet(sync)
    _assert_quiet(eng)
    assert eng.runner.num_fed_rows > 0 or all(len(o.token_ids) <= 1 for o in ref.values())
    assert sync.runner.num_fed_rows == 0 and sync.num_dropped_rows == 0


def test_the_workloads_reach_every_path(model):
    """The random workloads above stop requests on tokens (so async rows are dropped), preempt, abort mid-run, hit
    the prefix cache, and draw from the static buffers with rows fed from the device."""
    seen = dict(dropped=0, preempted=0, aborted=0, cached=0, graph_draws=0, fed=0, padded_prompt=0)
    for seed in range(24):
        requests, aborts, kw = _workload(seed, model.config.vocab_size, model.config.eos_token_ids[0])
        eng, outs = _drive(model, requests, aborts, async_decode=True, **kw)
        seen["dropped"] += eng.num_dropped_rows
        seen["preempted"] += eng.num_preemptions
        seen["aborted"] += sum(o.finish_reason == "abort" and len(o.token_ids) > 0 for o in outs.values())
        seen["cached"] += eng.stats["cached_prompt_tokens"]
        seen["graph_draws"] += eng.runner.num_graph_draws
        seen["fed"] += eng.runner.num_fed_rows
        seen["padded_prompt"] += eng.runner.num_padded_prompt_steps
    assert all(v > 0 for v in seen.values()), seen


def test_a_request_that_stops_has_its_extra_row_dropped(model):
    """A stop token drawn at step N is read after step N+1 is launched: its row there is dropped, its pages come
    back, and the requests beside it keep their bits."""
    prompts = [[5, 6, 7], [9, 10, 11, 12], [1, 2]]
    ref = LLM(model=model, num_kv_blocks=64, block_size=4).generate(
        prompts, [SamplingParams(max_tokens=12, seed=i, ignore_eos=True) for i in range(3)], use_tqdm=False
    )
    stop = ref[0].token_ids[4]  # request 0 stops at its first draw of this token
    params = [SamplingParams(max_tokens=12, seed=0, ignore_eos=True, stop_token_ids=[stop])] + [
        SamplingParams(max_tokens=12, seed=i, ignore_eos=True) for i in (1, 2)
    ]
    kw = dict(num_kv_blocks=64, block_size=4, cuda_graph_batch_sizes=[1, 2, 4])
    want = LLM(model=model, **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(model=model, async_decode=True, **kw)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert got[0].finish_reason == "stop" and got[0].token_ids[-1] == stop
    assert llm.num_dropped_rows >= 1 and llm.runner.num_fed_rows > 0 and llm.runner.num_graph_draws > 0
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids and torch.equal(a.logprobs, b.logprobs)
    assert got[1].token_ids == ref[1].token_ids and got[2].token_ids == ref[2].token_ids
    _assert_quiet(llm)


def test_a_request_that_ends_by_length_is_not_scheduled_again(model):
    """max_tokens and max_model_len are known when the last token is drawn: no extra row is launched for them."""
    prompts = [[3, 4, 5], [6, 7]]
    params = [SamplingParams(max_tokens=n, seed=n, ignore_eos=True) for n in (3, 9)]
    llm = LLM(model=model, async_decode=True, num_kv_blocks=64, max_model_len=9, cuda_graph_batch_sizes=[1, 2])
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [3, 7]  # the second ends at max_model_len
    assert llm.num_dropped_rows == 0


def test_aborting_a_request_with_a_token_in_flight(model):
    """An abort between steps returns the tokens the host holds; the row in flight is dropped, its pages come back at
    once, and the others run on with their bits."""
    prompts = [[11, 12, 13], [14, 15], [16, 17, 18, 19]]
    params = [SamplingParams(max_tokens=10, seed=i, ignore_eos=True) for i in range(3)]
    ref = LLM(model=model, num_kv_blocks=64, block_size=4).generate(prompts, params, use_tqdm=False)
    eng = LLMEngine(model=model, num_kv_blocks=64, block_size=4, async_decode=True)
    for rid, p, sp in zip("abc", prompts, params, strict=True):
        eng.add_request(p, sp, request_id=rid)
    done: dict[str, RequestOutput] = {}
    while len(eng._seqs["b"].output_token_ids) < 3:
        done.update((o.request_id, o) for o in eng.step())
    assert eng._in_flight is not None and eng._seqs["b"].num_pending == 1
    aborted = eng.abort_request("b")
    assert aborted.token_ids == ref[1].token_ids[:3] and torch.equal(aborted.logprobs, ref[1].logprobs[:3])
    while eng.has_unfinished_requests():
        done.update((o.request_id, o) for o in eng.step())
    assert sorted(done) == ["a", "c"] and eng.num_dropped_rows >= 1
    for rid, want in (("a", ref[0]), ("c", ref[2])):
        assert done[rid].token_ids == want.token_ids and torch.equal(done[rid].logprobs, want.logprobs)
    _assert_quiet(eng)


def test_aborting_the_last_request_leaves_nothing_in_flight(model):
    eng = LLMEngine(model=model, num_kv_blocks=64, async_decode=True)
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=8, seed=0), request_id="only")
    eng.step()
    eng.step()
    assert eng._in_flight is not None
    assert eng.abort_request("only").finish_reason == "abort"
    assert not eng.has_unfinished_requests() and eng._in_flight is None and eng.step() == []
    _assert_quiet(eng)


def test_sleep_wake_and_update_weights_after_an_async_generate(model):
    """After generate returns nothing is in flight: sleep, wake_up and update_weights work as without it."""
    prompts = [[21, 22, 23], [24, 25]]
    params = [SamplingParams(max_tokens=6, seed=i, stop_token_ids=[7, 8, 9]) for i in range(2)]
    kw = dict(num_kv_blocks=64, cuda_graph_batch_sizes=[1, 2])
    ref = LLM(model=model, **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(model=model, async_decode=True, **kw)
    first = llm.generate(prompts, params, use_tqdm=False)
    llm.sleep(level=1)
    llm.wake_up()
    llm.update_weights([("lm_head.weight", model.lm_head.weight.detach().clone())])
    again = llm.generate(prompts, params, use_tqdm=False)
    for outs in (first, again):
        for a, b in zip(outs, ref, strict=True):
            assert a.token_ids == b.token_ids and torch.equal(a.logprobs, b.logprobs)


def test_the_equality_fails_when_the_drawn_tokens_are_not_fed(model, monkeypatch):
    """The equality above can fail: rows that keep the host's placeholder id instead of the drawn token."""
    prompts = [[31, 32, 33], [34, 35, 36, 37]]
    params = [SamplingParams(max_tokens=8, seed=i, ignore_eos=True) for i in range(2)]
    ref = LLM(model=model, num_kv_blocks=64).generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(model_runner, "feed_drawn", lambda *args: None)
    monkeypatch.setattr(cuda_graphs, "feed_drawn", lambda *args: None)
    monkeypatch.setattr("vexact_engine.in_flight.feed_drawn", lambda *args: None)
    outs = LLM(model=model, num_kv_blocks=64, async_decode=True).generate(prompts, params, use_tqdm=False)
    assert any(a.token_ids != b.token_ids for a, b in zip(outs, ref, strict=True))


def _split_kw(seed: int, model):
    """A random workload whose decode steps run padded (so a step with prompt tokens can be split)."""
    requests, aborts, kw = _workload(seed, model.config.vocab_size, model.config.eos_token_ids[0])
    kw.setdefault("cuda_graph_batch_sizes", [1, 2, 4, 8])
    return requests, aborts, kw


@pytest.mark.parametrize("seed", range(12))
def test_split_mixed_steps_give_the_bits_of_one_launch(model, seed):
    """A step with decode rows and prompt chunks runs as a padded decode launch and a launch of the prompt chunks
    (EngineConfig.split_mixed_steps): every request's tokens and logprobs equal the one-launch step's, in the
    synchronous loop and one step ahead (the decode rows fed from the device)."""
    requests, aborts, kw = _split_kw(seed, model)
    one, ref = _drive(model, requests, aborts, split_mixed_steps=False, **kw)
    assert one.runner.num_split_steps == 0
    for extra in (dict(), dict(async_decode=True)):
        eng, outs = _drive(model, requests, aborts, **extra, **kw)
        _assert_same(outs, ref, requests)
        _assert_quiet(eng)


def test_the_split_workloads_split_steps(model):
    """The workloads above do split steps, with prompt chunks padded and eager, and fed decode rows."""
    split = fed = 0
    for seed in range(12):
        requests, aborts, kw = _split_kw(seed, model)
        eng, _ = _drive(model, requests, aborts, async_decode=True, **kw)
        split += eng.runner.num_split_steps
        fed += eng.runner.num_fed_rows
    assert split > 0 and fed > 0


def test_split_mixed_steps_with_the_rows_joined_out_of_order_are_caught(model, monkeypatch):
    """The equality above can fail: the two launches' rows joined prompt rows first, so tokens go to the wrong
    requests."""
    prompts = [[31, 32, 33], [34, 35, 36, 37], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    params = [SamplingParams(max_tokens=n, seed=i, ignore_eos=True) for i, n in enumerate((3, 8, 6))]
    kw = dict(num_kv_blocks=64, max_num_seqs=2, max_num_batched_tokens=16, cuda_graph_batch_sizes=[1, 2])
    ref = LLM(model=model, split_mixed_steps=False, **kw).generate(prompts, params, use_tqdm=False)
    join_rows = model_runner.join_rows

    def prompt_rows_first(launches):
        both, items = join_rows(launches[::-1])
        return both, join_rows(launches)[1]

    monkeypatch.setattr(model_runner, "join_rows", prompt_rows_first)
    llm = LLM(model=model, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.runner.num_split_steps > 0
    assert any(a.token_ids != b.token_ids for a, b in zip(outs, ref, strict=True))


def test_the_engine_decides_the_default_from_the_model_device(model):
    """On CPU the default loop is the synchronous one; the caller's config is left as it was."""
    cfg = EngineConfig(num_kv_blocks=64)
    eng = LLMEngine(model=model, config=cfg)
    assert eng.config.async_decode is False and eng.config.draw_in_graph is False
    assert cfg.async_decode is None and cfg.draw_in_graph is None


def test_feed_drawn_writes_the_named_rows_only():
    ids = torch.tensor([7, 0, 9, 0, 0])
    feed_drawn(ids, torch.tensor([1, 3]), torch.tensor([2, 0]), torch.tensor([40, 41, 42]))
    assert ids.tolist() == [7, 42, 9, 40, 0]


def test_async_decode_setting_is_checked(monkeypatch):
    monkeypatch.delenv("VEXACT_DRAW_IN_GRAPH", raising=False)
    assert EngineConfig().async_decode is None  # the default: decided by the engine once it knows the device
    assert EngineConfig().resolved(on_cuda=False).async_decode is False
    auto = EngineConfig().resolved(on_cuda=True)
    assert auto.async_decode and auto.draw_in_graph
    for off in (dict(enforce_eager=True), dict(backend="fast"), dict(backend="fast:attention")):
        assert EngineConfig(**off).resolved(on_cuda=True).async_decode is False, off  # where it cannot run
    assert EngineConfig(async_decode=False).resolved(on_cuda=True).async_decode is False  # an explicit value wins
    on = EngineConfig(async_decode=True)
    assert on.async_decode and on.draw_in_graph  # the draw from the static buffers comes with it
    assert EngineConfig(async_decode=True, draw_in_graph=False).draw_in_graph is False  # an explicit value wins
    monkeypatch.setenv("VEXACT_DRAW_IN_GRAPH", "0")
    assert EngineConfig(async_decode=True).draw_in_graph is False
    with pytest.raises(TypeError, match="async_decode must be True, False or None, got 1"):
        EngineConfig(async_decode=1)
    with pytest.raises(
        ValueError, match="async_decode=True needs the padded steps CUDA graphs replay, got enforce_eager=True"
    ):
        EngineConfig(async_decode=True, enforce_eager=True)
    with pytest.raises(
        ValueError, match=r"invariant attention and logprobs kernels, got backend='fast' \(attention, logprobs"
    ):
        EngineConfig(async_decode=True, backend="fast")
    with pytest.raises(ValueError, match=r"got backend='fast:logprobs' \(logprobs fast"):
        EngineConfig(async_decode=True, backend="fast:logprobs")
    assert EngineConfig(async_decode=True, backend="fast:linear").async_decode  # kernels that read nothing back


def test_the_pipeline_engine_refuses_async_decode(model):
    from vexact_engine import PipelineLLM

    with pytest.raises(ValueError, match="PipelineLLM does not run EngineConfig.async_decode=True"):
        PipelineLLM(model=model, num_kv_blocks=16, async_decode=True)


GPU_KW = dict(max_num_seqs=32, max_num_batched_tokens=256, block_size=16, device="cuda")
SYNC = dict(async_decode=False)  # the reference loop (async_decode is on by default on CUDA)


def _gpu_workload(seed: int, n: int):
    """``n`` requests for the default checkpoint (272 tokens, 512 positions): prompts of 4-300 tokens, a quarter of
    them repeated (prefix-cache hits), fused-draw rows and a few short greedy and top-p ones, stop tokens, EOS
    honoured on odd rows."""
    r = random.Random(seed)
    prompts = [[r.randrange(256) for _ in range(r.randint(4, 300))] for _ in range(n)]
    prompts[1::4] = prompts[0::4][: len(prompts[1::4])]  # shared prompts: prefix-cache hits
    params = []
    for i in range(n):
        sp = dict(temperature=[1.0, 0.7, 1.3][i % 3], max_tokens=r.randint(1, 120), seed=i, ignore_eos=i % 2 == 0)
        if i % 5 == 1:
            sp["stop_token_ids"] = r.sample(range(272), 20)
        if i % 7 == 3:  # greedy and top-p rows sample eagerly: short, so later steps draw in the graph
            sp.update(temperature=0.0, max_tokens=r.randint(1, 10))
        if i % 11 == 4:
            sp.update(top_p=0.9, max_tokens=r.randint(1, 10))
        params.append(SamplingParams(**sp))
    return [(f"g{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]


@pytest.mark.gpu
@pytest.mark.parametrize("num_kv_blocks", [2048, 48], ids=["roomy", "preempting"])
def test_gpu_async_decode_gives_the_bits_of_the_synchronous_loop(num_kv_blocks):
    """On CUDA with CUDA graphs and the draw graph: launched one step ahead, fed on the device, copies through pinned
    memory; tokens and logprobs equal the synchronous loop's for every request, with stop tokens, aborts, preemption
    and prefix-cache hits; every page comes back."""
    ckpt = default_checkpoint()
    requests = _gpu_workload(seed=num_kv_blocks, n=40)
    aborts = {"g6": 5, "g13": 0, "g21": 30}
    kw = dict(GPU_KW, num_kv_blocks=num_kv_blocks, draw_in_graph=True)
    sync, ref = _drive(ckpt, requests, aborts, **SYNC, **kw)
    eng, outs = _drive(ckpt, requests, aborts, async_decode=True, **kw)
    _assert_same(outs, ref, requests)
    _assert_quiet(eng)
    runner = eng.runner
    assert runner.graph_error is None and runner._decode.pinned
    assert runner.num_graph_draws > 0 and runner.num_fed_rows > 0 and eng.num_dropped_rows > 0
    if num_kv_blocks < 100:
        assert eng.num_preemptions > 0


@pytest.mark.gpu
def test_gpu_async_generate_through_sleep_equals_the_synchronous_loop():
    """generate with async_decode, a sleep/wake cycle (graphs captured again, lazily) and generate again: the bits
    of the synchronous loop both times."""
    ckpt = default_checkpoint()
    requests = _gpu_workload(seed=3, n=24)
    prompts, params = [p for _, p, _ in requests], [sp for *_, sp in requests]
    kw = dict(GPU_KW, num_kv_blocks=1024)
    ref = LLM(ckpt, **SYNC, **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(ckpt, **kw)  # async_decode: the default on CUDA
    assert llm.config.async_decode and llm.config.draw_in_graph
    for _ in range(2):
        outs = llm.generate(prompts, params, use_tqdm=False)
        for a, b in zip(outs, ref, strict=True):
            assert a.token_ids == b.token_ids and torch.equal(a.logprobs, b.logprobs), a.request_id
        assert llm._in_flight is None and llm.runner.graph_error is None
        llm.sleep(level=1)
        llm.wake_up()


@pytest.mark.gpu
def test_gpu_a_step_is_read_back_through_pinned_memory():
    """What lets the host run ahead: the step in flight copies its results into pinned memory (queued, not waited
    for), and the static buffers go over from pinned memory."""
    eng = LLMEngine(default_checkpoint(), async_decode=True, **GPU_KW, num_kv_blocks=256)
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=8, seed=0, ignore_eos=True))
    eng.step()
    assert eng._in_flight is not None and eng._in_flight._host.is_pinned()
    assert eng.runner._decode.pinned and eng.runner._prompt.pinned
    while eng.has_unfinished_requests():
        eng.step()
    _assert_quiet(eng)


@pytest.mark.gpu
def test_gpu_split_mixed_steps_give_the_bits_of_one_launch():
    """On CUDA: steps with decode rows and prompt chunks run as the decode graph (with its draw) and a prompt graph
    of their own; every request's tokens and logprobs equal the one-launch steps', synchronous and one step ahead."""
    ckpt = default_checkpoint()
    requests = _gpu_workload(seed=5, n=40)
    aborts = {"g6": 5, "g21": 30}
    kw = dict(GPU_KW, num_kv_blocks=2048, draw_in_graph=True)
    one, ref = _drive(ckpt, requests, aborts, **SYNC, split_mixed_steps=False, **kw)
    assert one.runner.num_split_steps == 0
    for extra in (SYNC, dict(async_decode=True)):
        eng, outs = _drive(ckpt, requests, aborts, **extra, **kw)
        _assert_same(outs, ref, requests)
        _assert_quiet(eng)
        assert eng.runner.num_split_steps > 0 and eng.runner.graph_error is None


@pytest.mark.gpu
def test_gpu_launching_a_step_never_waits_for_the_stream():
    """What one step ahead needs: launching a step (decode-only, or split: decode rows and prompt chunks) runs no
    synchronizing CUDA call, such as a copy from pageable memory or an ``.item()`` (torch's sync debug mode raises on
    one). A step that admitted a prompt once waited for every queued step this way."""
    eng = LLMEngine(default_checkpoint(), async_decode=True, **GPU_KW, num_kv_blocks=1024)
    runner = eng.runner
    launch = runner.launch
    checked = {"decode": 0, "split": 0, "prompt": 0}  # prompt: a step of prompt chunks alone, if one comes

    def strict_launch(batch, blocks):
        kinds = {it.num_new_tokens == 1 and not it.admitted for it in batch}
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = launch(batch, blocks)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        checked["split" if kinds == {True, False} else "decode" if kinds == {True} else "prompt"] += 1
        return out

    for i in range(8):
        eng.add_request(list(range(1, 40 + i)), SamplingParams(max_tokens=40, seed=i, ignore_eos=True))
    for _ in range(4):  # the first launches: lazily compiled shapes, allocator growth
        eng.step()
    runner.launch = strict_launch
    for i in range(8):
        eng.add_request(list(range(3, 90 + i)), SamplingParams(max_tokens=20, seed=100 + i, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    del runner.launch
    assert checked["decode"] and checked["split"], checked
    _assert_quiet(eng)
