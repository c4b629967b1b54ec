"""Pipeline-parallel engine on GPUs == one GPU, bitwise (run on a host with >= 2 GPUs).

    torchrun --nproc_per_node=2 scripts/pp_check.py [--shape 0.6b|1.7b] [--layers N] [--prompts 48]

Every rank builds the same random Qwen3-shaped model (bf16, HF config shapes); rank r keeps stage r's layers.
Rank 0 generates a workload through the pipeline (sampled and greedy requests, chunked prefill, a KV cache small
enough to preempt), then the same workload on one GPU with the same weights, and compares tokens and logprobs with
torch.equal. Then it shows the check can fail: the same pipeline with the stage boundary off by one bf16 ulp (the
last mantissa bit of every activation flipped: a deliberately perturbed transfer) must differ. Exit status 0 only if
equal and the perturbation is caught.
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
from vexact_models import Qwen3Config, random_model

SHAPES = {"0.6b": QWEN3_06B, "1.7b": QWEN3_17B}


def workload(n: int):
    g = torch.Generator().manual_seed(11)
    prompts = [
        torch.randint(0, 150000, (int(k),), generator=g).tolist() for k in torch.randint(8, 300, (n,), generator=g)
    ]
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
    print(
        f"pipeline x{dist.get_world_size()}: {sum(len(o.token_ids) for o in outs)} tokens in "
        f"{time.perf_counter() - t0:.1f}s, {llm.num_preemptions} preemptions, layers of rank 0: {list(llm.stage)}"
    )
    return outs


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="0.6b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--prompts", type=int, default=48)
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    shape = dict(SHAPES[args.shape], torch_dtype="bfloat16")
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    cfg = Qwen3Config(**shape)
    engine_kw = dict(
        device=f"cuda:{rank}",
        max_num_seqs=32,
        max_num_batched_tokens=512,
        block_size=16,
        num_kv_blocks=120,
        max_model_len=1024,
    )
    prompts, params = workload(args.prompts)
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
    ok = True
    if rank == 0:
        one = dict(engine_kw, enforce_eager=True)
        t0 = time.perf_counter()
        ref = LLM(model=random_model(cfg, seed=0, embed_std=0.02).to(f"cuda:{rank}"), **one).generate(
            prompts, params, use_tqdm=False
        )
        print(f"one GPU: {sum(len(o.token_ids) for o in ref)} tokens in {time.perf_counter() - t0:.1f}s")
        same = sum(
            o.token_ids == r.token_ids and torch.equal(o.logprobs, r.logprobs) for o, r in zip(outs, ref, strict=True)
        )
        caught = sum(
            o.token_ids != r.token_ids or not torch.equal(o.logprobs, r.logprobs) for o, r in zip(bad, ref, strict=True)
        )
        toks = sum(len(r.token_ids) for r in ref)
        print(f"pipeline == one GPU (tokens and logprobs, torch.equal): {same}/{len(ref)} requests, {toks} tokens")
        print(f"perturbed pipeline (last-bit-flipped boundary) differs from one GPU in {caught}/{len(ref)} requests")
        ok = same == len(ref) and caught > 0
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
