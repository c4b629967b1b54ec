"""GPU engine contracts (targets h100/h200/b200): the engine on CUDA with sampling on the device, CUDA-graph decode,
sleep/wake and weight updates still returns exactly the trainer's logprobs.

Models: Qwen3-0.6B-, Qwen3-1.7B-, Qwen3-30B-A3B-, Llama-3.2-1B-, Qwen2.5-7B-, Mistral-7B-v0.1- and
Moonlight-16B-A3B-shaped (real HF config shapes, random weights) with ``LAYERS`` decoder layers instead of 16 to 48
(Moonlight: 3 of 27, the first dense as in the real model) to keep the run short: every per-layer shape (hidden, heads,
head_dim, MLA ranks, intermediate, experts, vocabulary, biases, rope scaling) is the real one, so every kernel runs at
its real size; only the depth is cut. ``-k`` picks shapes by name (``-k "llama or qwen2.5 or mistral"``,
``-k moonlight``).

Run on the GPU machine: ``python -m pytest -q -n 0 contracts/test_engine_gpu.py --target h100 -s``
(``-s`` shows the memory figures of the sleep/wake cycles; ``VEXACT_SLEEP_CYCLES`` sets their number, default 100).
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from contracts.harness import DENSE_SHAPES, MOONLIGHT_3L, QWEN3_06B, QWEN3_17B, QWEN3_30B_A3B, logprob_mismatches
from vexact_engine import LLM, EngineConfig, SamplingParams
from vexact_engine.model_runner import ModelRunner
from vexact_models import (
    named_weights,
    random_model,
    tiny_config,
    tiny_deepseek_v3_config,
    tiny_qwen3_config,
    tiny_qwen3_moe_config,
    weight_dtype,
)

pytestmark = pytest.mark.gpu

LAYERS = int(os.environ.get("VEXACT_GPU_CONTRACT_LAYERS", "4"))
SHAPES = {"qwen3-0.6b": QWEN3_06B, "qwen3-1.7b": QWEN3_17B, "qwen3-30b-a3b": QWEN3_30B_A3B,
          **{name: shape for name, (_, shape) in DENSE_SHAPES.items()}, "moonlight-16b-a3b": MOONLIGHT_3L}  # fmt: skip
MAX_LEN = 1024


@pytest.fixture(scope="module")
def cuda(device):
    if device == "cpu":
        pytest.skip("GPU targets only (--target h100|h200|b200): CUDA graphs, device sampling, device sleep/wake")
    return torch.device("cuda")


def _model(shape: str, seed: int, cuda) -> torch.nn.Module:
    if "kv_lora_rank" in SHAPES[shape]:  # Moonlight: its own three layers (one dense, two MoE)
        return random_model(tiny_deepseek_v3_config(**SHAPES[shape]), seed=seed, embed_std=0.02, device=cuda)
    if shape in DENSE_SHAPES:
        make = functools.partial(tiny_config, DENSE_SHAPES[shape][0])
    else:
        make = tiny_qwen3_moe_config if "num_experts" in SHAPES[shape] else tiny_qwen3_config
    cfg = make(**{**SHAPES[shape], "num_hidden_layers": LAYERS})
    return random_model(cfg, seed=seed, embed_std=0.02, device=cuda)  # drawn on the GPU: an MoE is ~6 GB at 4 layers


@pytest.fixture(scope="module", params=list(SHAPES))
def shape_model(request, cuda):
    return request.param, _model(request.param, seed=7, cuda=cuda)


def _workload(n: int, seed: int, lo: int = 8, hi: int = 400, max_tokens: int = 24, vocab: int = 151936):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]  # fmt: skip
    params = [
        SamplingParams(temperature=[1.0, 0.7, 0.0, 1.2][i % 4], top_k=[-1, 50][i % 2], top_p=[1.0, 0.95][i % 3 == 0],
                       max_tokens=max_tokens - i % 5, seed=1000 + i, ignore_eos=True)
        for i in range(n)
    ]  # fmt: skip
    return prompts, params


def _trainer_logprobs(model, outs, params):
    from vexact_trainer import Actor

    temps = [p.temperature if p.temperature > 0 else 1.0 for p in params]
    return (
        Actor(model).compute_log_probs([o.prompt_token_ids for o in outs], [o.token_ids for o in outs], temps).logprobs
    )


def _run(model, prompts, params, **kw):
    llm = LLM(model=model, config=EngineConfig(max_model_len=MAX_LEN, **kw))
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.ok for o in outs), [o.error for o in outs if not o.ok]
    return outs, llm


def _same(outs, ref):
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(outs, ref, strict=True))


# (name, settings): batch size, chunk size (token budget), page size, KV pages (tight: preemption), graphs on/off,
# the one-step-ahead loop on/off (on by default on CUDA: the settings that name no async_decode run it)
ENGINE_SETTINGS = [
    ("graphs", dict(max_num_seqs=64, max_num_batched_tokens=2048, num_kv_blocks=2048)),
    ("graphs-sync", dict(max_num_seqs=64, max_num_batched_tokens=2048, num_kv_blocks=2048, async_decode=False)),
    ("eager", dict(max_num_seqs=64, max_num_batched_tokens=2048, num_kv_blocks=2048, enforce_eager=True)),
    ("batch-5-chunk-96", dict(max_num_seqs=5, max_num_batched_tokens=96, num_kv_blocks=2048)),
    ("batch-24-odd-graphs", dict(max_num_seqs=24, max_num_batched_tokens=512, cuda_graph_batch_sizes=[3, 7, 24])),
    ("preempt-page-8", dict(max_num_seqs=32, max_num_batched_tokens=384, block_size=8, num_kv_blocks=160)),
    (
        "preempt-sync",
        dict(max_num_seqs=32, max_num_batched_tokens=384, block_size=8, num_kv_blocks=160, async_decode=False),
    ),
    # one step ahead: each step read back a step late, the drawn tokens fed on the device
    ("graphs-async", dict(max_num_seqs=64, max_num_batched_tokens=2048, num_kv_blocks=2048, async_decode=True)),
    (
        "preempt-async",
        dict(max_num_seqs=32, max_num_batched_tokens=384, block_size=8, num_kv_blocks=160, async_decode=True),
    ),
]


def test_engine_equals_trainer_across_settings(shape_model):
    """Every setting gives the same tokens and logprobs as every other, and they equal the trainer's."""
    _, model = shape_model
    prompts, params = _workload(40, seed=1, vocab=model.config.vocab_size)
    ref = None
    for name, kw in ENGINE_SETTINGS:
        outs, llm = _run(model, prompts, params, **{"num_kv_blocks": 1024, **kw})
        if name == "graphs":
            assert llm.runner.graph_error is None, llm.runner.graph_error
            # 7 decode batch sizes (1..64) and 8 token counts (256..2048) of steps with prompt tokens
            assert llm.runner.num_graphs == 7 + 8 and llm.runner.num_padded_steps > 0
            assert llm.runner.num_padded_prompt_steps > 0
        if name == "eager":
            assert llm.runner.num_graphs == 0 and llm.runner.num_padded_steps == 0
            assert llm.runner.num_padded_prompt_steps == 0
        if name.startswith("preempt"):
            assert llm.num_preemptions > 0, "the KV cache was meant to be tight enough to preempt"
        if name.endswith("async"):
            assert llm.runner.graph_error is None and llm.runner.num_fed_rows > 0, llm.runner.graph_error
        assert logprob_mismatches(outs, _trainer_logprobs(model, outs, params)) == [], name
        if ref is None:
            ref = outs
        else:
            _same(outs, ref)
        del llm
        torch.cuda.empty_cache()


def test_padded_graph_decode_contract_fails_on_a_wrong_pad_row(shape_model, monkeypatch):
    """The graph-padding contract can fail: pad rows that write their K/V (slot 0 instead of -1) corrupt a page."""
    _, model = shape_model
    prompts, params = _workload(6, seed=2, hi=64, max_tokens=12, vocab=model.config.vocab_size)
    monkeypatch.setattr(ModelRunner, "PAD_ROW", (0, 0, 0, 1))
    outs, llm = _run(model, prompts, params, max_num_seqs=8, num_kv_blocks=256)
    assert llm.runner.num_padded_steps > 0
    assert logprob_mismatches(outs, _trainer_logprobs(model, outs, params)) != []


def test_same_seed_same_tokens_whatever_the_batch(shape_model):
    _, model = shape_model
    target = list(range(100, 180))
    p = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=77, ignore_eos=True)
    (alone,), _ = _run(model, [target], [p], max_num_seqs=8, num_kv_blocks=512)
    prompts, params = _workload(63, seed=3, hi=200, vocab=model.config.vocab_size)  # a batch of 64 with it
    prompts.insert(17, target)
    params.insert(17, p)
    outs, _ = _run(model, prompts, params, max_num_seqs=64, max_num_batched_tokens=512, num_kv_blocks=1024)
    _same([outs[17]], [alone])


def test_sleep_wake_and_update_weights(shape_model, cuda):
    """After sleep(1)/wake_up generation is bitwise unchanged; after sleep(2)/wake_up/update_weights (buckets) it
    equals a fresh engine loaded with those weights and the trainer on them."""
    shape, model = shape_model
    prompts, params = _workload(16, seed=4, hi=200, vocab=model.config.vocab_size)
    llm = LLM(model=_model(shape, seed=7, cuda=cuda), max_model_len=MAX_LEN, max_num_seqs=16, num_kv_blocks=512)
    before = llm.generate(prompts, params, use_tqdm=False)
    llm.sleep(level=1)
    llm.wake_up()
    _same(llm.generate(prompts, params, use_tqdm=False), before)
    new = _model(shape, seed=8, cuda=cuda)
    llm.sleep(level=2)
    llm.wake_up()
    named = [(n, p.detach().to(weight_dtype(n, torch.bfloat16))) for n, p in named_weights(new)]  # fp32 bias too
    for i in range(0, len(named), 5):
        llm.update_weights(iter(named[i : i + 5]))
    after = llm.generate(prompts, params, use_tqdm=False)
    fresh, _ = _run(new, prompts, params, max_num_seqs=16, num_kv_blocks=512)
    _same(after, fresh)
    assert logprob_mismatches(after, _trainer_logprobs(new, after, params)) == []
    assert any(a.token_ids != b.token_ids for a, b in zip(after, before, strict=True))


def test_prefix_cache_grpo_groups_equal_no_cache(shape_model):
    """GRPO-shaped: n = 8 samples of each of 6 prompts (100-700 tokens). Prefix caching on (CUDA graphs) == off,
    torch.equal, and == the trainer; a second generate() finds every prompt cached; a tight KV pool preempts (a
    preempted request finds its pages cached or recomputes them) and still equals."""
    _, model = shape_model
    base, _ = _workload(6, seed=8, lo=100, hi=700, vocab=model.config.vocab_size)
    prompts = [p for p in base for _ in range(8)]
    params = [SamplingParams(temperature=[1.0, 0.7][i % 2], top_p=0.95, max_tokens=24 - i % 5, seed=2000 + i,
                             ignore_eos=True) for i in range(len(prompts))]  # fmt: skip
    kw = dict(max_num_seqs=64, max_num_batched_tokens=2048, num_kv_blocks=2048)
    off, _ = _run(model, prompts, params, enable_prefix_caching=False, **kw)
    on, llm = _run(model, prompts, params, **kw)
    assert llm.runner.num_padded_steps > 0 and llm.stats["cached_prompt_tokens"] > 0
    _same(on, off)
    assert logprob_mismatches(on, _trainer_logprobs(model, on, params)) == []
    again = llm.generate(prompts, params, use_tqdm=False)
    _same(again, off)
    assert [o.num_cached_tokens for o in again] == [(len(p) - 1) // 16 * 16 for p in prompts]
    del llm
    tight, llm = _run(model, prompts, params, max_num_seqs=48, max_num_batched_tokens=512, num_kv_blocks=80)
    assert llm.num_preemptions > 0, "the KV cache was meant to be tight enough to preempt"
    _same(tight, off)
    del llm
    torch.cuda.empty_cache()


def test_burst_ten_times_the_kv_capacity(cuda):
    """Requests whose tokens add up to ~10x the KV cache all finish (preemption + recompute), none lost, and every
    logprob equals the unloaded run, bitwise."""
    model = _model("qwen3-0.6b", seed=9, cuda=cuda)
    prompts, params = _workload(96, seed=5, lo=32, hi=160, max_tokens=64)
    total = sum(len(p) + sp.max_tokens for p, sp in zip(prompts, params, strict=True))
    pages = total // (10 * 16)
    outs, llm = _run(model, prompts, params, max_num_seqs=32, max_num_batched_tokens=512, num_kv_blocks=pages)
    assert llm.num_preemptions > 0
    ref, roomy = _run(model, prompts, params, max_num_seqs=32, max_num_batched_tokens=512, num_kv_blocks=4 * pages * 10)
    assert roomy.num_preemptions == 0
    assert [len(o.token_ids) for o in outs] == [sp.max_tokens for sp in params]
    _same(outs, ref)


@pytest.mark.gpu_exclusive
def test_gpu_memory_utilization_sizes_the_cache_and_names_the_figures(cuda, tmp_path):
    from vexact_models import save_checkpoint

    model = _model("qwen3-0.6b", seed=10, cuda=cuda)
    # 256 sequences of 32768 tokens could use more than half the device: the budget decides the size
    llm = LLM(model=model, max_model_len=32768, max_num_seqs=256, gpu_memory_utilization=0.5)
    free, total = torch.cuda.mem_get_info()
    kv = sum(k.numel() * k.element_size() * 2 for k, _ in llm.runner.kv_caches)
    print(f"\ngpu_memory_utilization=0.5: KV {kv / 2**30:.2f} GiB, {llm.blocks.num_blocks} pages; "
          f"allocated {torch.cuda.memory_allocated() / 2**30:.2f} GiB of {total / 2**30:.2f} GiB")  # fmt: skip
    assert 0.3 * total < kv < 0.5 * total
    prompts, params = _workload(8, seed=6, hi=100, max_tokens=8)
    assert all(o.ok for o in llm.generate(prompts, params, use_tqdm=False))
    del llm
    torch.cuda.empty_cache()
    # few short sequences: the cache stops at what they can use
    small = LLM(model=model, max_model_len=MAX_LEN, max_num_seqs=4, gpu_memory_utilization=0.5)
    assert small.blocks.num_blocks == 4 * MAX_LEN // 16
    del small
    torch.cuda.empty_cache()
    with pytest.raises(ValueError, match=r"no room for a KV cache .* gpu_memory_utilization=0.003 of .* GiB"):
        LLM(model=model, max_model_len=MAX_LEN, gpu_memory_utilization=0.003)
    save_checkpoint(model.cpu(), tmp_path)
    with pytest.raises(ValueError, match=r"the model's weights take .* GiB but gpu_memory_utilization=1e-05"):
        LLM(str(tmp_path), device="cuda", gpu_memory_utilization=1e-5)


@pytest.mark.gpu_exclusive
def test_sleep_wake_cycles_return_memory_to_baseline(cuda):
    """N sleep/wake cycles: after each sleep the engine holds no device memory beyond its baseline (what was
    allocated before it existed), and after each wake it holds what it held at start."""
    cycles = int(os.environ.get("VEXACT_SLEEP_CYCLES", "100"))
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated()
    model = _model("qwen3-0.6b", seed=11, cuda=cuda)
    llm = LLM(model=model, max_model_len=MAX_LEN, max_num_seqs=64, kv_cache_bytes=4 << 30)
    del model
    prompts, params = _workload(4, seed=7, hi=64, max_tokens=4)
    ref = llm.generate(prompts, params, use_tqdm=False)
    awake = torch.cuda.memory_allocated()
    free_awake = torch.cuda.mem_get_info()[0]
    asleep_seen, awake_seen, free_asleep = [], [], []
    for i in range(cycles):
        llm.sleep(level=1)
        asleep_seen.append(torch.cuda.memory_allocated() - baseline)
        free_asleep.append(torch.cuda.mem_get_info()[0])
        llm.wake_up()
        awake_seen.append(torch.cuda.memory_allocated())
        if i % 25 == 0 or i == cycles - 1:
            _same(llm.generate(prompts, params, use_tqdm=False), ref)
    gib = 2**30
    print(f"\n{cycles} sleep/wake cycles: engine held {(awake - baseline) / gib:.3f} GiB awake; after sleep it held "
          f"max {max(asleep_seen) / gib:.4f} GiB; device free memory awake {free_awake / gib:.2f} GiB, asleep "
          f"min {min(free_asleep) / gib:.2f} / max {max(free_asleep) / gib:.2f} GiB; awake allocated min "
          f"{min(awake_seen) / gib:.3f} max {max(awake_seen) / gib:.3f} GiB")  # fmt: skip
    assert max(asleep_seen) <= 64 << 20, "sleep must free (nearly) all of the engine's device memory"
    assert max(awake_seen) == min(awake_seen), "memory after waking must not grow from cycle to cycle"
    assert min(free_asleep) >= free_awake + (awake - baseline) * 0.9
