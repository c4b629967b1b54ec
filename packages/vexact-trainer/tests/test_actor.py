"""The actor's logprobs: independent of the logits chunk size and of what else is in the batch; clear errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import vexact_kernels as vk
from vexact_models import AttentionMetadata, random_model, tiny_qwen3_config
from vexact_trainer import Actor, ActorConfig, pack

VOCAB = 272


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_qwen3_config(max_position_embeddings=96), seed=2)


def _batch(n: int, seed: int, max_prompt: int = 12, max_resp: int = 12):
    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for _ in range(n):
        p = int(torch.randint(1, max_prompt + 1, (1,), generator=g))
        r = int(torch.randint(0, max_resp + 1, (1,), generator=g))
        prompts.append(torch.randint(0, VOCAB, (p,), generator=g).tolist())
        responses.append(torch.randint(0, VOCAB, (r,), generator=g).tolist())
    return prompts, responses


def _equal_lists(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_logprobs_and_entropy_shapes(model):
    prompts, responses = [[1, 2, 3], [4], [5, 6]], [[7, 8], [9, 10, 11, 12], []]
    out = Actor(model).compute_log_probs(prompts, responses, with_entropy=True)
    assert [t.shape for t in out.logprobs] == [(2,), (4,), (0,)]
    assert [t.shape for t in out.entropy] == [(2,), (4,), (0,)]
    assert all(t.dtype == torch.float32 for t in out.logprobs + out.entropy)
    assert all(bool((t <= 0).all()) for t in out.logprobs)
    assert all(
        bool((t >= 0).all()) and bool((t <= torch.log(torch.tensor(float(VOCAB))) + 1e-4).all()) for t in out.entropy
    )
    assert Actor(model).compute_log_probs(prompts, responses).entropy is None


def test_logprobs_are_the_model_distribution_of_each_response_token(model):
    prompt, response = [10, 20, 30], [40, 50, 60, 70]
    seq = prompt + response
    hidden = model(torch.tensor(seq), torch.arange(len(seq)), AttentionMetadata.packed([len(seq)]))
    logp = vk.log_softmax(model.logits(hidden), 0.7)
    expected = logp[torch.arange(2, 6), torch.tensor(response)]
    out = Actor(model).compute_log_probs([prompt], [response], temperature=0.7, with_entropy=True)
    assert torch.equal(out.logprobs[0], expected)
    assert torch.equal(out.entropy[0], vk.entropy_from_logprobs(logp[2:6]))
    other = Actor(model).compute_log_probs([prompt], [response], temperature=1.0)
    assert not torch.equal(other.logprobs[0], expected)  # temperature is applied


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 5), seed=st.integers(0, 2**16), chunk=st.integers(1, 40), data=st.data())
def test_independent_of_chunk_size_and_batch_composition(model, n, seed, chunk, data):
    prompts, responses = _batch(n, seed)
    ref = Actor(model).compute_log_probs(prompts, responses, with_entropy=True)
    chunked = Actor(model, ActorConfig(logprob_chunk_size=chunk)).compute_log_probs(
        prompts, responses, with_entropy=True
    )
    assert _equal_lists(chunked.logprobs, ref.logprobs) and _equal_lists(chunked.entropy, ref.entropy)
    # a sub-batch in another order, padded out with unrelated sequences
    picks = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n), label="picks")
    extra_p, extra_r = _batch(2, seed + 1)
    sub = Actor(model, ActorConfig(logprob_chunk_size=chunk)).compute_log_probs(
        [prompts[i] for i in picks] + extra_p, [responses[i] for i in picks] + extra_r
    )
    assert _equal_lists(sub.logprobs[: len(picks)], [ref.logprobs[i] for i in picks])


def test_per_sequence_temperature(model):
    prompts, responses = _batch(3, seed=4, max_resp=6)
    mixed = Actor(model).compute_log_probs(prompts, responses, temperature=[0.5, 1.0, 1.5])
    for i, t in enumerate([0.5, 1.0, 1.5]):
        alone = Actor(model).compute_log_probs([prompts[i]], [responses[i]], temperature=t)
        assert torch.equal(mixed.logprobs[i], alone.logprobs[0])


def test_fast_backend_is_close_but_separate(model):
    prompts, responses = _batch(3, seed=5)
    inv = Actor(model).compute_log_probs(prompts, responses)
    fast = Actor(model, ActorConfig(backend="fast")).compute_log_probs(prompts, responses)
    for a, b in zip(inv.logprobs, fast.logprobs, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0.15)


def test_accepts_tensors(model):
    prompts, responses = _batch(2, seed=6)
    ref = Actor(model).compute_log_probs(prompts, responses)
    out = Actor(model).compute_log_probs([torch.tensor(p) for p in prompts], [torch.tensor(r) for r in responses])
    assert _equal_lists(out.logprobs, ref.logprobs)


def test_pack_layout():
    b = pack([[1, 2], [3]], [[4], [5, 6]], vocab_size=10, max_len=8)
    assert b.input_ids.tolist() == [1, 2, 4, 3, 5, 6]
    assert b.positions.tolist() == [0, 1, 2, 0, 1, 2]
    assert b.targets.tolist() == [2, 4, 0, 5, 6, 0]
    assert b.cu_seqlens.tolist() == [0, 3, 6] and b.prompt_lens == [2, 1] and b.seq_lens == [3, 3]


@pytest.mark.parametrize(
    "prompts,responses,kw,message",
    [
        ([], [], {}, "empty batch: no sequences to score"),
        ([[1]], [[2], [3]], {}, "1 prompts but 2 responses"),
        ([[1], [2]], [[3]], {}, "2 prompts but 1 responses"),
        ([[1, 2], []], [[3], [4]], {}, "sequence 1: prompt is empty"),
        ([[1] * 90], [[2] * 7], {}, "sequence 0 has 97 tokens; the model's max length is 96"),
        ([[1, 2]], [[3, VOCAB]], {}, rf"sequence 0: token id {VOCAB} is outside the vocabulary \[0, {VOCAB}\)"),
        ([[1, -5]], [[3]], {}, r"sequence 0: token id -5 is outside the vocabulary"),
        ([[1]], [[2]], {"temperature": 0}, "got 0: temperature 0 \\(greedy\\) has no logprobs.*temperature=1.0"),
        ([[1]], [[2]], {"temperature": -1.5}, r"temperature must be a finite number > 0, got -1.5"),
        ([[1], [2]], [[3], [4]], {"temperature": [1.0, 0.0]}, r"temperature\[1\] must be a finite number > 0, got 0.0"),
        ([[1], [2]], [[3], [4]], {"temperature": [1.0]}, "1 temperatures for 2 sequences"),
    ],
)
def test_bad_input(model, prompts, responses, kw, message):
    with pytest.raises(ValueError, match=message):
        Actor(model).compute_log_probs(prompts, responses, **kw)


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    "temperature,message",
    [
        (NAN, r"^temperature must be a finite number > 0, got nan$"),
        (INF, r"^temperature must be a finite number > 0, got inf$"),
        (-INF, r"^temperature must be a finite number > 0, got -inf$"),
        (1e39, r"^temperature must be a finite number > 0, got 1e\+39 \(inf in fp32\)$"),
        (1e-50, r"^temperature must be a finite number > 0, got 1e-50 \(0.0 in fp32\)$"),
        ("hot", r"^temperature must be a finite number > 0, got 'hot'$"),
        (True, r"^temperature must be a finite number > 0, got True$"),
        (torch.tensor(NAN), r"^temperature must be a finite number > 0, got nan$"),
        ([1.0, 0.5, NAN], r"^temperature\[2\] must be a finite number > 0, got nan$"),
        ([1.0, INF, 1.0], r"^temperature\[1\] must be a finite number > 0, got inf$"),
        ((0.7, -INF, 1.0), r"^temperature\[1\] must be a finite number > 0, got -inf$"),
        ([1.0, None, 1.0], r"^temperature\[1\] must be a finite number > 0, got None$"),
        (torch.tensor([1.0, 1.0, NAN]), r"^temperature\[2\] must be a finite number > 0, got nan$"),
        (torch.tensor([-1.0, NAN, 1.0]), r"^temperature\[0\] must be a finite number > 0, got -1.0$"),
        (torch.tensor([0.5, 1.0]), r"^2 temperatures for 3 sequences$"),
        (torch.ones(3, 1), r"^temperature must be a scalar or 1-D, got a tensor of shape \(3, 1\)$"),
    ],
)
def test_non_finite_temperature_is_refused_by_value_and_index(model, temperature, message):
    """A NaN temperature gave NaN logprobs (NaN passes ``t <= 0``); now refused, naming the value and where it is."""
    prompts, responses = _batch(3, seed=4)
    with pytest.raises(ValueError, match=message):
        Actor(model).compute_log_probs(prompts, responses, temperature=temperature)


def test_temperature_as_tensor_equals_list(model):
    prompts, responses = _batch(3, seed=5)
    want = Actor(model).compute_log_probs(prompts, responses, temperature=[0.5, 1.0, 1.5]).logprobs
    for t in (torch.tensor([0.5, 1.0, 1.5]), torch.tensor([0.5, 1.0, 1.5], dtype=torch.float64)):
        got = Actor(model).compute_log_probs(prompts, responses, temperature=t).logprobs
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    got = Actor(model).compute_log_probs(prompts, responses, temperature=torch.tensor(0.7)).logprobs
    want = Actor(model).compute_log_probs(prompts, responses, temperature=0.7).logprobs
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_forward_packed_refuses_a_non_finite_temperature(model):
    prompts, responses = _batch(2, seed=6)
    batch = pack(prompts, responses, VOCAB, 96)
    per_token = torch.ones(len(batch.input_ids))
    per_token[3] = NAN
    with pytest.raises(ValueError, match=r"^temperature\[3\] must be a finite number > 0, got nan$"):
        Actor(model).forward_packed(batch, per_token)
    with pytest.raises(
        ValueError, match=rf"^{len(batch.input_ids) - 1} temperatures for {len(batch.input_ids)} tokens"
    ):
        Actor(model).forward_packed(batch, per_token[1:])
    with pytest.raises(ValueError, match=r"^temperature must be a finite number > 0, got inf$"):
        Actor(model).forward_packed(batch, INF)


def test_bad_config():
    with pytest.raises(ValueError, match=r"backend must be one of \('invariant', 'fast'\), got 'foo'"):
        ActorConfig(backend="foo")
    with pytest.raises(ValueError, match="logprob_chunk_size must be >= 1, got 0"):
        ActorConfig(logprob_chunk_size=0)
