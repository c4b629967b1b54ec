"""Every bad input gets a clear error; in LLM.generate a bad request is rejected and the others run untouched."""

from __future__ import annotations

import pytest
import torch

from vexact_engine import LLM, EngineConfig, LLMEngine, SamplingParams
from vexact_models import random_model, tiny_config, tiny_qwen3_config

VOCAB = 272


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_qwen3_config(max_position_embeddings=64), seed=11)


@pytest.fixture
def engine(model):
    return LLMEngine(model=model, num_kv_blocks=16, block_size=4)


def _bad_params(**fields) -> SamplingParams:
    """A SamplingParams made bad after construction (as a caller mutating one would), to reach add_request."""
    p = SamplingParams(max_tokens=4)
    for k, v in fields.items():
        setattr(p, k, v)
    return p


BAD_PROMPTS = [
    pytest.param([], ValueError, r"request \S+: prompt is empty", id="empty"),
    pytest.param(list(range(1, 80)), ValueError, r"prompt has 79 tokens; max_model_len is 64", id="too-long"),
    pytest.param(list(range(1, 65)), ValueError, r"prompt has 64 tokens; max_model_len is 64 \(room", id="no-room"),
    pytest.param(
        [1, VOCAB, 3], ValueError, r"token id 272 at position 1 is outside the vocabulary \[0, 272\)", id="oov"
    ),
    pytest.param([1, 2, -1], ValueError, r"token id -1 at position 2 is outside the vocabulary", id="negative"),
    pytest.param([1, 2.0, 3], TypeError, r"prompt token at position 1 is 2.0; token ids must be integers", id="float"),
    pytest.param([1, "a"], TypeError, r"prompt token at position 1 is 'a'", id="str-token"),
    pytest.param([1, True], TypeError, r"prompt token at position 1 is True", id="bool-token"),
    pytest.param(None, TypeError, r"prompt must be a string or a list of token ids, got NoneType", id="none"),
    pytest.param(7, TypeError, r"prompt must be a string or a list of token ids, got int", id="int"),
]

BAD_PARAMS = [
    pytest.param(
        _bad_params(temperature=-0.5), r"temperature must be a finite number >= 0, got -0.5", id="temperature"
    ),
    pytest.param(_bad_params(top_p=0.0), r"top_p must be a finite number in \(0, 1\], got 0.0", id="top_p-0"),
    pytest.param(_bad_params(top_p=1.5), r"top_p must be a finite number in \(0, 1\], got 1.5", id="top_p-1.5"),
    pytest.param(_bad_params(temperature=float("nan")), r"temperature must be a finite number >= 0, got nan", id="nan"),
    pytest.param(_bad_params(temperature=float("inf")), r"temperature must be a finite number >= 0, got inf", id="inf"),
    pytest.param(_bad_params(temperature=True), r"temperature must be a finite number >= 0, got True", id="bool"),
    pytest.param(
        _bad_params(temperature=1e-38), r"temperature 1e-38 is below 1e-05: .* use 0 for greedy", id="temperature-tiny"
    ),
    pytest.param(
        _bad_params(top_p=float("nan")), r"top_p must be a finite number in \(0, 1\], got nan", id="top_p-nan"
    ),
    pytest.param(_bad_params(max_tokens=0), r"max_tokens must be >= 1, got 0", id="max_tokens"),
    pytest.param(_bad_params(top_k=-3), r"top_k must be -1 \(off\), 0 \(off\) or >= 1, got -3", id="top_k"),
    pytest.param(_bad_params(seed=-1), r"seed must be a non-negative integer or None, got -1", id="seed"),
]


@pytest.mark.parametrize("prompt,exc,message", BAD_PROMPTS)
def test_bad_prompt_raises_naming_the_problem(engine, prompt, exc, message):
    with pytest.raises(exc, match=message):
        engine.add_request(prompt, SamplingParams(max_tokens=1))
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("params,message", BAD_PARAMS)
def test_bad_sampling_params_rejected_at_add_request(engine, params, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request([1, 2, 3], params)


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"temperature": -0.1}, r"temperature must be a finite number >= 0, got -0.1"),
        ({"temperature": "hot"}, r"temperature must be a finite number >= 0, got 'hot'"),
        ({"temperature": float("nan")}, r"temperature must be a finite number >= 0, got nan"),
        ({"temperature": float("inf")}, r"temperature must be a finite number >= 0, got inf"),
        ({"temperature": float("-inf")}, r"temperature must be a finite number >= 0, got -inf"),
        ({"top_p": 0}, r"top_p must be a finite number in \(0, 1\], got 0"),
        ({"top_p": 1.5}, r"top_p must be a finite number in \(0, 1\], got 1.5"),
        ({"top_p": float("nan")}, r"top_p must be a finite number in \(0, 1\], got nan"),
        ({"top_p": float("inf")}, r"top_p must be a finite number in \(0, 1\], got inf"),
        ({"max_tokens": 0}, r"max_tokens must be >= 1, got 0"),
        ({"max_tokens": 2.5}, r"max_tokens must be >= 1, got 2.5"),
        ({"top_k": -2}, r"top_k must be -1"),
        ({"seed": -4}, r"seed must be a non-negative integer"),
    ],
)
def test_sampling_params_validate_at_construction(kw, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kw)


def test_sampling_params_not_a_sampling_params(engine):
    with pytest.raises(TypeError, match=r"must be a SamplingParams, got a dict \{'temperature': 1.0\}: SamplingParams"):
        engine.add_request([1, 2], {"temperature": 1.0})
    with pytest.raises(TypeError, match="sampling params must be a SamplingParams, got str"):
        engine.add_request([1, 2], "greedy")


def test_generate_names_a_dict_of_sampling_params(model):
    """A dict is iterable (its keys): without the check each prompt was paired with a key and rejected as "got str"."""
    llm = LLM(model=model, num_kv_blocks=16)
    with pytest.raises(TypeError, match=r"sampling_params must be a SamplingParams or a list of them, got a dict"):
        llm.generate([[1, 2]], {"temperature": 0.5}, use_tqdm=False)
    out = llm.generate([[1, 2]], [{"temperature": 0.5}], use_tqdm=False)[0]  # one per prompt: rejected by name
    assert not out.ok and out.finish_reason == "rejected" and "got a dict" in out.error


def test_duplicate_request_id(engine):
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2), request_id="a")
    with pytest.raises(ValueError, match="request id 'a' is already in use"):
        engine.add_request([4, 5], SamplingParams(max_tokens=2), request_id="a")
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request([4, 5], SamplingParams(max_tokens=2), request_id="a")  # free again once finished


def test_text_prompt_without_tokenizer(engine):
    assert engine.tokenizer is None
    with pytest.raises(ValueError, match="text prompt given but the model has no tokenizer; pass token ids"):
        engine.add_request("hello", SamplingParams(max_tokens=2))


def test_request_that_can_never_fit_the_kv_cache(model):
    eng = LLMEngine(model=model, num_kv_blocks=3, block_size=4)
    with pytest.raises(ValueError, match=r"needs 5 KV pages for 18 tokens; the cache has 3 pages of 4 tokens"):
        eng.add_request(list(range(1, 9)), SamplingParams(max_tokens=10))
    eng.add_request(list(range(1, 9)), SamplingParams(max_tokens=4))  # 12 tokens: 3 pages, fits


def test_no_chunked_prefill_needs_a_step_that_holds_a_whole_sequence(model):
    """Without chunked prefill a longer prompt (or a preempted request's recompute) could never be scheduled."""
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(8\) must be >= max_model_len \(64\)"):
        LLM(model=model, enable_chunked_prefill=False, max_num_batched_tokens=8, max_num_seqs=4)
    llm = LLM(model=model, enable_chunked_prefill=False, max_num_batched_tokens=64, max_num_seqs=4, num_kv_blocks=32)
    outs = llm.generate([list(range(1, 40)), [1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert [len(o.token_ids) for o in outs] == [3, 3]


@pytest.mark.parametrize(
    "kw,exc,message",
    [
        ({"backend": "foo"}, ValueError, r"backend must be one of \('invariant', 'fast'\), got 'foo'"),
        (
            {"max_num_seqs": 8, "max_num_batched_tokens": 4},
            ValueError,
            r"max_num_batched_tokens \(4\) must be >= max_num_seqs \(8\)",
        ),
        ({"block_size": 0}, ValueError, r"EngineConfig.block_size must be a positive integer, got 0"),
        ({"max_num_seqs": 1.5}, ValueError, r"EngineConfig.max_num_seqs must be a positive integer, got 1.5"),
        ({"num_kv_blocks": 0}, ValueError, r"EngineConfig.num_kv_blocks must be a positive integer, got 0"),
        ({"kv_cache_bytes": -1}, ValueError, r"EngineConfig.kv_cache_bytes must be a positive integer"),
        ({"max_model_len": 1}, ValueError, r"EngineConfig.max_model_len must be >= 2, got 1"),
    ],
)
def test_bad_engine_config(kw, exc, message):
    with pytest.raises(exc, match=message):
        EngineConfig(**kw)


def test_engine_construction_errors(model):
    with pytest.raises(ValueError, match="backend must be one of"):
        LLM(model=model, backend="foo")
    with pytest.raises(TypeError, match="either config=EngineConfig"):
        LLMEngine(model=model, config=EngineConfig(), block_size=8)
    with pytest.raises(ValueError, match="LLMEngine needs a model_path or a model"):
        LLMEngine()


def test_generate_params_length_mismatch(model):
    llm = LLM(model=model, num_kv_blocks=16)
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        llm.generate([[1], [2], [3]], [SamplingParams(), SamplingParams()], use_tqdm=False)


GOOD = [[5, 6, 7, 8], [9, 10], list(range(20, 33))]

BAD_IN_A_BATCH = [
    pytest.param([], None, "prompt is empty", id="empty"),
    pytest.param(list(range(1, 70)), None, "max_model_len is 64", id="too-long"),
    pytest.param([3, 300], None, "token id 300 at position 1 is outside the vocabulary", id="oov"),
    pytest.param([3, 4.5], None, "token ids must be integers", id="non-int"),
    pytest.param("some text", None, "no tokenizer", id="text"),
    pytest.param([3, 4], _bad_params(temperature=-1.0), "temperature must be a finite number >= 0", id="temperature"),
    pytest.param([3, 4], _bad_params(temperature=float("nan")), "finite number >= 0, got nan", id="nan"),
    pytest.param([3, 4], _bad_params(temperature=float("inf")), "finite number >= 0, got inf", id="inf"),
    pytest.param([3, 4], _bad_params(top_p=0.0), "top_p must be a finite number in (0, 1]", id="top_p"),
    pytest.param([3, 4], _bad_params(max_tokens=0), "max_tokens must be >= 1", id="max_tokens"),
    pytest.param([3, 4], SamplingParams(max_tokens=60), "KV pages", id="never-fits"),
]


@pytest.mark.parametrize("bad_prompt,bad_params,message", BAD_IN_A_BATCH)
@pytest.mark.parametrize("where", [0, 2])
def test_generate_rejects_one_bad_request_and_runs_the_others_untouched(model, bad_prompt, bad_params, message, where):
    # default seeds (seed=None): the engine derives them from arrival order, so a rejected request must not take
    # an arrival slot, or every request after it would sample differently
    good = SamplingParams(max_tokens=6)
    kw = {"num_kv_blocks": 12, "block_size": 4, "max_num_batched_tokens": 16, "max_num_seqs": 4}
    prompts = list(GOOD)
    prompts.insert(where, bad_prompt)
    params = [good] * len(GOOD)
    params.insert(where, bad_params or good)
    outs = LLM(model=model, **kw).generate(prompts, params, use_tqdm=False)
    alone = LLM(model=model, **kw).generate(GOOD, good, use_tqdm=False)
    assert len(outs) == 4
    bad = outs[where]
    assert bad.finish_reason == "rejected" and not bad.ok
    assert message in bad.error
    assert bad.token_ids == [] and bad.logprobs.numel() == 0
    rest = outs[:where] + outs[where + 1 :]
    for got, ref in zip(rest, alone, strict=True):
        assert got.ok and got.finish_reason in ("stop", "length")
        assert got.prompt_token_ids == ref.prompt_token_ids
        assert got.token_ids == ref.token_ids
        assert torch.equal(got.logprobs, ref.logprobs)


def test_max_model_len_beyond_a_sliding_window_is_refused_at_construction():
    """The kernels attend to every earlier key, which is the model's window only while a sequence fits in it: a
    max_model_len larger than ``sliding_window`` is refused; without one, the window caps it."""
    windowed = random_model(tiny_config("mistral", sliding_window=24, num_hidden_layers=1), seed=1)
    with pytest.raises(ValueError, match=r"max_model_len 25 > the model's sliding_window 24: sliding-window attention"):
        LLMEngine(model=windowed, max_model_len=25)
    assert LLMEngine(model=windowed, num_kv_blocks=16).max_model_len == 24
    assert LLMEngine(model=windowed, max_model_len=20, num_kv_blocks=16).max_model_len == 20


def test_an_eager_step_reads_nothing_back_before_sampling(monkeypatch):
    """The model's input checks (token ids, positions, each layer's rotary) use the ranges the runner recorded while
    building the step's tensors: no host read stalls an eager step (steps with prompt tokens) between its layers."""
    from vexact_kernels import _ranges

    reads = []
    real = _ranges._read
    monkeypatch.setattr(_ranges, "_read", lambda t: reads.append(t) or real(t))
    llm = LLM(model=random_model(tiny_qwen3_config(), seed=3), max_num_seqs=4, enforce_eager=True)
    out = llm.generate([[5, 6, 7, 8, 9], [10, 11]], SamplingParams(max_tokens=3, seed=1, ignore_eos=True))
    assert [len(o.token_ids) for o in out] == [3, 3]
    assert not reads
