"""Pipeline-parallel engine on GPUs == one GPU, bitwise (run on a host with >= 2 GPUs; one stage per rank).

    torchrun --nproc_per_node=N scripts/checks/pp_check.py [--shape 0.6b|1.7b] [--layers N] [--prompts 48]

Every rank builds the same random Qwen3-shaped model (bf16, HF config shapes); rank r keeps stage r's layers
(``vexact_engine.pipeline.stage_layers``: consecutive ranges, the first ``layers % N`` stages one layer more).
Rank 0 generates a workload through the pipeline (sampled and greedy requests, chunked prefill, a KV cache small
enough to preempt), then the same workload on one GPU with the same weights, and compares tokens and logprobs with
torch.equal. Then it shows the check can fail: the same pipeline with the stage boundary off by one bf16 ulp (the
last mantissa bit of every activation flipped: a deliberately perturbed transfer) must differ. Then (unless
``--no-weights``) the pipeline's verl-facing lifecycle on GPUs: sleep level 1 and wake (the same tokens as one GPU),
sleep level 2 (every stage drops its weights), wake, a bucketed ``update_weights`` to other weights driven from rank 0
through every stage, and the tokens and logprobs of one GPU holding those weights. Exit status 0 only if everything
is equal and the perturbation is caught.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

from contracts.harness import QWEN3_06B, QWEN3_17B
from vexact_engine import LLM, SamplingParams
from vexact_engine import pipeline as pp
from vexact_models import Qwen3Config, expected_tensors, random_model

# "tiny": the CPU smoke test's shape (tests/test_pp_check.py runs this script over gloo with --device cpu)
TINY = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=272, tie_word_embeddings=False)  # fmt: skip
# "tiny-tied": the head shares the embedding, as in Qwen3-0.6B/1.7B (an update's names then hold no lm_head.weight)
SHAPES = {"0.6b": QWEN3_06B, "1.7b": QWEN3_17B, "tiny": TINY, "tiny-tied": dict(TINY, tie_word_embeddings=True)}


def workload(n: int, vocab: int = 150000):
    g = torch.Generator().manual_seed(11)
    lengths = torch.randint(8, 300, (n,), generator=g)
    prompts = [torch.randint(0, min(vocab, 150000), (int(k),), generator=g).tolist() for k in lengths]
    params = [
        SamplingParams(max_tokens=48, temperature=[0.0, 0.7, 1.0][i % 3], top_p=0.95, seed=i, ignore_eos=True)
        for i in range(n)
    ]
    return prompts, params


def run_pipeline(cfg, engine_kw, prompts, params):
    llm = pp.PipelineLLM(model=random_model(cfg, seed=0, embed_std=0.02), **engine_kw)
    if not llm.is_driver:
        llm.serve()
        return None
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.shutdown()
    stages = [f"{r.start}-{r.stop - 1}" for r in pp.stage_layers(cfg.num_hidden_layers, dist.get_world_size())]
    print(
        f"pipeline x{dist.get_world_size()}: {sum(len(o.token_ids) for o in outs)} tokens in "
        f"{time.perf_counter() - t0:.1f}s, {llm.num_preemptions} preemptions, layers per stage: {stages}"
    )
    return outs


def run_weights(cfg, engine_kw, prompts, params):
    """Sleep level 1 / wake, generate; sleep level 2 / wake, update_weights (buckets of 16 tensors) to the seed-1
    weights, generate. Returns (outputs after level 1, outputs after the update, names loaded, the new weights' model)
    on rank 0."""
    llm = pp.PipelineLLM(model=random_model(cfg, seed=0, embed_std=0.02), **engine_kw)
    if not llm.is_driver:
        llm.serve()
        return None
    llm.sleep(1)
    llm.wake_up()
    after_level1 = llm.generate(prompts, params, use_tqdm=False)
    llm.sleep(2)
    llm.wake_up()
    new = random_model(cfg, seed=1, embed_std=0.02)
    items = sorted(new.state_dict().items())
    loaded = []
    for i in range(0, len(items), 16):
        loaded += llm.update_weights(items[i : i + 16])
    after_update = llm.generate(prompts, params, use_tqdm=False)
    llm.shutdown()
    return after_level1, after_update, loaded, new


def _same(outs, ref) -> int:
    pairs = zip(outs, ref, strict=True)
    return sum(o.token_ids == r.token_ids and torch.equal(o.logprobs, r.logprobs) for o, r in pairs)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="0.6b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--no-weights", action="store_true", help="skip the sleep / wake / update_weights phase")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: gloo, a smoke test of the script")
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
        dev = f"cuda:{rank}"
    else:  # the CPU smoke test of this script
        dist.init_process_group("gloo")
        dev = "cpu"
    shape = dict(SHAPES[args.shape], torch_dtype="bfloat16")
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    cfg = Qwen3Config(**shape)
    engine_kw = dict(
        device=dev,
        max_num_seqs=32,
        max_num_batched_tokens=512,
        block_size=16,
        num_kv_blocks=120,
        max_model_len=1024,
    )
    prompts, params = workload(args.prompts, cfg.vocab_size)
    outs = run_pipeline(cfg, engine_kw, prompts, params)

    # the perturbed pipeline: the boundary flips the last bit of every activation
    send = pp._StageRunner._send

    def lossy_send(self, t, dst):
        if t.dtype == torch.uint8 and dst != 0:  # flip the last mantissa bit of every activation (one bf16 ulp)
            t = (t.contiguous().view(torch.int16) ^ 1).view(torch.uint8)
        send(self, t, dst)

    pp._StageRunner._send = lossy_send
    bad = run_pipeline(cfg, engine_kw, prompts, params)
    pp._StageRunner._send = send
    weights = None if args.no_weights else run_weights(cfg, engine_kw, prompts, params)
    ok = True
    if rank == 0:
        one = dict(engine_kw, enforce_eager=True)
        t0 = time.perf_counter()
        ref = LLM(model=random_model(cfg, seed=0, embed_std=0.02).to(dev), **one).generate(
            prompts, params, use_tqdm=False
        )
        print(f"one device: {sum(len(o.token_ids) for o in ref)} tokens in {time.perf_counter() - t0:.1f}s")
        same = _same(outs, ref)
        caught = sum(
            o.token_ids != r.token_ids or not torch.equal(o.logprobs, r.logprobs) for o, r in zip(bad, ref, strict=True)
        )
        toks = sum(len(r.token_ids) for r in ref)
        print(f"pipeline == one device (tokens and logprobs, torch.equal): {same}/{len(ref)} requests, {toks} tokens")
        print(f"perturbed pipeline (last-bit-flipped boundary) differs from one device in {caught}/{len(ref)} requests")
        ok = same == len(ref) and caught > 0
        if weights is not None:
            after_level1, after_update, loaded, new = weights
            ref_new = LLM(model=new.to(dev), **one).generate(prompts, params, use_tqdm=False)
            n1, n2 = _same(after_level1, ref), _same(after_update, ref_new)
            # checkpoint names: a tied lm_head.weight is not one of them (the loader takes the embedding's)
            all_loaded = set(loaded) == set(expected_tensors(new))
            print(f"after sleep(1) + wake_up: pipeline == one device in {n1}/{len(ref)} requests")
            print(f"after sleep(2) + wake_up + update_weights ({len(loaded)} tensors, all: {all_loaded}): pipeline == "
                  f"one device with the new weights in {n2}/{len(ref)} requests")  # fmt: skip
            ok = ok and n1 == len(ref) and n2 == len(ref) and all_loaded
    dist.barrier()  # the ranks tear the group down together (on gloo a rank left alone can abort)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    rc = main()
    # leave without the interpreter's teardown: after the barrier and destroy_process_group a gloo rank can abort
    # now and then at exit ("terminate called without an active exception", seen in CI), with every
    # result already printed
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
