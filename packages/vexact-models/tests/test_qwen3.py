"""Every family's forward (Qwen3, Qwen3-MoE, Llama, Qwen2, Mistral, DeepSeek-V3 with MLA, gpt-oss with its window
and sinks): a sequence's hidden states do not depend on the batch, and the paged (engine) layout gives the packed
(trainer) result bit for bit, whatever the prefill chunking and page size. The property tests draw few examples per
family (the contracts draw hundreds on the tiny Qwen3 and MoE)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import vexact_kernels as vk
from vexact_models import (
    AttentionMetadata,
    random_model,
    tiny_config,
    tiny_deepseek_v3_config,
    tiny_gpt_oss_config,
    tiny_qwen3_config,
    tiny_qwen3_moe_config,
)

FAMILIES = ["qwen3", "qwen3_moe", "llama", "qwen2", "mistral", "deepseek_v3", "gpt_oss"]
NON_DENSE = {
    "qwen3_moe": tiny_qwen3_moe_config,
    "deepseek_v3": tiny_deepseek_v3_config,
    "gpt_oss": tiny_gpt_oss_config,  # a window of 24: the sequences below outrun it
}
EXAMPLES = 10  # per family and property


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    """Each family's tiny model: every test below holds for dense, MoE and MLA alike."""
    cfg = NON_DENSE[request.param]() if request.param in NON_DENSE else tiny_config(request.param)
    return random_model(cfg, seed=1)


def _seqs(lens: list[int], seed: int, vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lens]


def _packed(model, seqs: list[torch.Tensor]) -> torch.Tensor:
    ids = torch.cat(seqs)
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    return model(ids, pos, AttentionMetadata.packed([len(s) for s in seqs]))


def _kv_caches(model, num_blocks: int, page: int):
    cfg = model.config
    heads, dk, dv = cfg.kv_cache_dims
    return [
        (
            torch.zeros(num_blocks, page, heads, dk, dtype=cfg.dtype),
            torch.zeros(num_blocks, page, heads, dv, dtype=cfg.dtype),
        )
        for _ in range(cfg.num_hidden_layers)
    ]


def _paged(model, seqs: list[torch.Tensor], chunks: list[list[int]], page: int, seed: int = 0) -> torch.Tensor:
    """Run the sequences through a paged KV cache, step i carrying chunk i of every sequence that still has one.

    Pages are given out in a shuffled order; the result is laid out like the packed batch.
    """
    lens = [len(s) for s in seqs]
    starts = [0, *torch.tensor(lens).cumsum(0).tolist()]
    n_pages = [-(-n // page) for n in lens]
    total_pages = sum(n_pages) + 1
    order = torch.randperm(total_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, used = [], 0
    for n in n_pages:
        tables.append(order[used : used + n])
        used += n
    caches = _kv_caches(model, total_pages, page)
    out = torch.full((sum(lens), model.config.hidden_size), float("nan"), dtype=model.config.dtype)
    done = [0] * len(seqs)
    for step in range(max(len(c) for c in chunks)):
        active = [b for b in range(len(seqs)) if step < len(chunks[b])]
        ids, pos, slots, rows, cu, ctx = [], [], [], [], [0], []
        for b in active:
            n = chunks[b][step]
            p = list(range(done[b], done[b] + n))
            ids += seqs[b][done[b] : done[b] + n].tolist()
            pos += p
            slots += [tables[b][i // page] * page + i % page for i in p]
            rows += [starts[b] + i for i in p]
            cu.append(cu[-1] + n)
            ctx.append(done[b] + n)
            done[b] += n
        width = max(len(tables[b]) for b in active)
        block_tables = torch.tensor([tables[b] + [0] * (width - len(tables[b])) for b in active])
        meta = AttentionMetadata(
            cu_seqlens=torch.tensor(cu),
            slot_mapping=torch.tensor(slots),
            block_tables=block_tables,
            context_lens=torch.tensor(ctx),
        )
        out[torch.tensor(rows)] = model(torch.tensor(ids), torch.tensor(pos), meta, caches)
    assert done == lens
    return out


def test_output_shapes_and_logprobs(model):
    seqs = _seqs([5, 8], seed=0, vocab=model.config.vocab_size)
    hidden = _packed(model, seqs)
    assert hidden.shape == (13, 64) and hidden.dtype == torch.bfloat16
    logits = model.logits(hidden)
    assert logits.shape == (13, 272) and logits.dtype == torch.float32
    targets = torch.cat(seqs)
    lp, ent = model.logprobs(hidden, targets, with_entropy=True)
    assert torch.equal(lp, vk.log_softmax(logits).gather(1, targets[:, None]).squeeze(1))
    assert ent.shape == (13,)


def test_different_inputs_give_different_outputs(model):
    """Guards the equality tests below against a model that ignores its input."""
    a, b = _seqs([6, 6], seed=1, vocab=272)
    assert not torch.equal(_packed(model, [a]), _packed(model, [b]))
    # and attention reaches back: changing token 0 changes the last position's state
    c = a.clone()
    c[0] = (c[0] + 1) % 272
    assert not torch.equal(_packed(model, [a])[-1], _packed(model, [c])[-1])


@settings(max_examples=EXAMPLES, deadline=None)
@given(lens=st.lists(st.integers(1, 40), min_size=2, max_size=4), seed=st.integers(0, 2**16))
def test_packed_batch_equals_each_sequence_alone(model, lens, seed):
    seqs = _seqs(lens, seed, model.config.vocab_size)
    batch = _packed(model, seqs)
    starts = [0, *torch.tensor(lens).cumsum(0).tolist()]
    for b, s in enumerate(seqs):
        assert torch.equal(_packed(model, [s]), batch[starts[b] : starts[b + 1]]), f"sequence {b} of {lens}"


def _chunking(n: int):
    def to_sizes(cuts):
        bounds = [0, *sorted(set(cuts) - {0, n}), n]
        return [e - s for s, e in zip(bounds, bounds[1:], strict=False)]

    return st.lists(st.integers(0, n), max_size=4).map(to_sizes)


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    lens=st.lists(st.integers(1, 36), min_size=1, max_size=3),
    page=st.sampled_from([1, 4, 16]),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_paged_chunked_prefill_equals_packed(model, lens, page, seed, data):
    seqs = _seqs(lens, seed, model.config.vocab_size)
    chunks = [data.draw(_chunking(n), label=f"chunks of seq {b}") for b, n in enumerate(lens)]
    assert torch.equal(_paged(model, seqs, chunks, page, seed), _packed(model, seqs))


def test_prefill_then_token_by_token_decode_equals_packed(model):
    seqs = _seqs([20, 3], seed=2, vocab=272)
    chunks = [[12, *[1] * 8], [1, 1, 1]]
    assert torch.equal(_paged(model, seqs, chunks, page=4), _packed(model, seqs))


def test_fast_backend_is_close_but_is_the_other_code_path(model):
    seqs = _seqs([17, 9], seed=3, vocab=272)
    inv = model.logits(_packed(model, seqs))
    with vk.use_backend("fast"):
        fast = model.logits(_packed(model, seqs))
    # tied embeddings (the tiny Llama) give logits ~10x larger, and bf16 rounding grows with them
    torch.testing.assert_close(fast, inv, rtol=0.05, atol=max(0.1, 0.01 * inv.abs().max().item()))


def test_input_errors(model):
    meta = AttentionMetadata.packed([4])
    with pytest.raises(ValueError, match=r"expected flat input_ids and positions of equal shape \[T\]"):
        model(torch.zeros(1, 4, dtype=torch.long), torch.arange(4), meta)
    with pytest.raises(ValueError, match=r"equal shape"):
        model(torch.zeros(4, dtype=torch.long), torch.arange(3), meta)
    with pytest.raises(ValueError, match="position 512 >= max_position_embeddings 512"):
        model(torch.zeros(4, dtype=torch.long), torch.tensor([0, 1, 2, 512]), meta)
    with pytest.raises(ValueError, match=r"token id 272 is outside the vocabulary \[0, 272\)"):
        model(torch.tensor([1, 2, 272, 3]), torch.arange(4), meta)
    with pytest.raises(ValueError, match=r"token id -1 is outside"):
        model(torch.tensor([1, -1, 2, 3]), torch.arange(4), meta)
    paged = AttentionMetadata(
        cu_seqlens=torch.tensor([0, 4]),
        slot_mapping=torch.arange(4),
        block_tables=torch.tensor([[0]]),
        context_lens=torch.tensor([4]),
    )
    with pytest.raises(ValueError, match="paged attention metadata given but no KV cache"):
        model(torch.arange(4), torch.arange(4), paged)


def test_paged_metadata_needs_all_parts():
    with pytest.raises(ValueError, match="needs slot_mapping, block_tables and context_lens together"):
        AttentionMetadata(cu_seqlens=torch.tensor([0, 2]), block_tables=torch.tensor([[0]]))
    meta = AttentionMetadata.packed([3, 0, 2])
    assert torch.equal(meta.cu_seqlens, torch.tensor([0, 3, 3, 5])) and not meta.paged


def test_mha_and_attention_bias_configs_run():
    cfg = tiny_qwen3_config(num_key_value_heads=4, attention_bias=True, num_hidden_layers=1)
    m = random_model(cfg, seed=2)
    assert m.model.layers[0].self_attn.q_proj.bias is not None
    seqs = _seqs([7, 5], seed=4, vocab=272)
    batch = _packed(m, seqs)
    assert torch.isfinite(batch.float()).all()
    assert torch.equal(_packed(m, seqs[1:]), batch[7:])
