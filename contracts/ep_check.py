"""Expert-parallel contract check: an ``ExpertParallelLLM`` over W ranks == one device == the trainer, torch.equal.

Run under torchrun, one rank per device (NCCL on GPUs, gloo on CPU)::

    torchrun --standalone --nproc_per_node=2 -m contracts.ep_check --device cuda --checkpoint qwen3_moe_top8 --long

or through :func:`spawn` (gloo processes on CPU; ``contracts/test_expert_parallel.py``). Every rank loads the same
committed tiny checkpoint (``--checkpoint``: ``qwen3_moe``, ``deepseek_v3``, ``qwen3_moe_top8``, ...), keeps its
shard of the routed experts and generates its share of one workload (prompt ``i`` on rank ``i % W``; the ranks get
different numbers of requests and tokens, so some steps find a rank with nothing to run). Rank 0 gathers the
outputs, runs the whole workload on one device and scores the EP tokens with the trainer (``Actor``), and checks:

1. ``ep == one device``: tokens and logprobs of every request, ``torch.equal``;
2. ``ep == trainer``: the trainer's logprobs of the EP tokens, ``torch.equal``;
3. with ``--weights``: every rank sleeps (level 2: weights dropped), wakes, takes the whole model's HF-named tensors
   of other weights through ``update_weights`` (each rank keeps its experts), and generates again: == one device
   holding those weights, and the ranks together loaded every name of the checkpoint.

``--driven``: rank 0 alone takes the workload, the weight lifecycle and two aborts through the one-device API
(``ExpertParallelLLM(driven=True)``, what a server drives), spreading the requests over the ranks; the others serve.

``--perturb arrival`` makes the combine add each token's expert rows in the order of the ranks they come from (the
arrival order of an all-to-all) instead of its own top-k order: check 1 must then fail at top-k > 2 (the contract
can fail); the exit status is then 0 when it was caught. Prints one JSON summary line on rank 0; exits 1 if a
check failed (or a perturbation went unseen). ``bash scripts/checks/ep_gpu.sh`` runs every case on a GPU host.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys

import torch
import torch.distributed as dist

import vexact_kernels as vk
from vexact_engine import LLM, ExpertParallelLLM, SamplingParams
from vexact_engine import expert_parallel as ep
from vexact_models import default_checkpoint, expected_tensors, load_model, random_model, tiny_checkpoint_config
from vexact_trainer import Actor, ActorConfig

ENGINE = dict(max_num_seqs=3, max_num_batched_tokens=24, block_size=4, num_kv_blocks=40)


def workload(long: bool = False):
    """Seven requests of different lengths (some ranks finish early and step with no tokens); ``long``: eight of up
    to 48 + 24 tokens, the golden fixtures' size, where a combine order that changes an fp32 last bit reaches the
    logprobs."""
    g = torch.Generator().manual_seed(5)
    n, top = (8, 48) if long else (7, 28)
    prompts = [torch.randint(0, 256, (int(k),), generator=g).tolist() for k in torch.randint(3, top, (n,), generator=g)]
    lengths = [24, 20, 24, 2, 24, 16, 24, 8] if long else [9, 4, 12, 2, 7, 10, 3]
    params = [
        SamplingParams(max_tokens=lengths[i], temperature=[0.0, 0.8, 1.1][i % 3], top_p=0.9, seed=i, ignore_eos=True)
        for i in range(n)
    ]
    return prompts, params


def _arrival_order_combine(back, ids, weights, per_rank, dtype):
    """The perturbation: each token's rows added in the order they arrive from an all-to-all that sends each rank's
    rows expert by expert: by source rank, then expert id (for sorted shards: by expert id)."""
    order = torch.sort(ids.long(), dim=1, stable=True).indices
    ids, weights = ids.gather(1, order), weights.gather(1, order)
    t, k = ids.shape
    tok = torch.arange(t, device=ids.device).unsqueeze(1).expand(t, k)
    rows = back[ids.long() // per_rank, tok, order]
    return vk.moe_combine(rows, weights, dtype)


def _generate(llm, prompts, params, rank: int, world: int) -> list:
    mine = [i for i in range(len(prompts)) if i % world == rank]
    outs = llm.generate([prompts[i] for i in mine], [params[i] for i in mine], use_tqdm=False)
    return [(i, o.token_ids, o.logprobs.tolist()) for i, o in zip(mine, outs, strict=True)]


def _gather(rows: list, rank: int, world: int) -> list | None:
    got = [None] * world if rank == 0 else None
    dist.gather_object(rows, got, dst=0)
    if rank:
        return None
    return [r for _, r in sorted((i, (t, lp)) for part in got for i, t, lp in part)]


def _compare(name: str, got: list, ref_outs) -> dict:
    bad = [
        i
        for i, ((tokens, lps), o) in enumerate(zip(got, ref_outs, strict=True))
        if tokens != o.token_ids or not torch.equal(torch.tensor(lps, dtype=torch.float32), o.logprobs)
    ]
    return {"check": name, "ok": not bad, "mismatched_requests": bad}


def _trainer_check(model, prompts, params, got) -> dict:
    temps = [p.temperature if p.temperature > 0 else 1.0 for p in params]
    lps = Actor(model, ActorConfig()).compute_log_probs(prompts, [t for t, _ in got], temps).logprobs
    bad = [i for i, ((_, mine), lp) in enumerate(zip(got, lps, strict=True))
           if not torch.equal(torch.tensor(mine, dtype=torch.float32), lp.cpu())]  # fmt: skip
    return {"check": "ep == trainer", "ok": not bad, "mismatched_requests": bad}


def _driven(llm, prompts, params, new):
    """``driven``: rank 0 takes the whole workload (and the weight lifecycle) through the one-device API, spreading
    the requests over the ranks; the other ranks serve."""
    if not llm.is_driver:
        llm.serve()
        return None, None, None, None
    outs = llm.generate(prompts, params, use_tqdm=False)
    got = [(o.token_ids, o.logprobs.tolist()) for o in outs]
    # aborts: one request on each of the first two ranks (the least loaded, ties to the lower rank), one step, then
    # both stopped from the driver, each with its partial output
    ids = [llm.add_request(prompts[i], SamplingParams(max_tokens=50, seed=i)) for i in range(2)]
    where = [llm.rank_of(rid) for rid in ids]
    llm.step()
    aborted = [llm.abort_request(rid) for rid in ids]
    stopped = [o is not None and o.finish_reason == "abort" for o in aborted] == [True, True]
    ok = stopped and where == [0, 1] and not llm.has_unfinished_requests()
    aborts = {"check": "driven: a request aborted on rank 0 and on rank 1", "ok": ok, "ranks": where}
    got_new = names = None
    if new is not None:
        llm.sleep(2)
        llm.wake_up()
        names = [llm.update_weights(list(expected_tensors(new).items()))]
        got_new = [(o.token_ids, o.logprobs.tolist()) for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.shutdown()
    return got, got_new, names, aborts


def run(
    checkpoint: str,
    device: str = "cpu",
    perturb: str | None = None,
    weights: bool = False,
    long: bool = False,
    driven: bool = False,
) -> dict | None:
    """This rank's part of the check (the process group is initialised); rank 0 returns the summary."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = f"cuda:{rank}" if device == "cuda" else "cpu"
    if perturb == "arrival":
        ep._combine_home = _arrival_order_combine
    elif perturb is not None:
        raise ValueError(f"unknown perturbation {perturb!r}")
    path = default_checkpoint(checkpoint)
    llm = ExpertParallelLLM(model=load_model(path, device=dev), driven=driven, **ENGINE)
    prompts, params = workload(long)
    new = random_model(tiny_checkpoint_config(checkpoint), seed=11, device=dev) if weights else None
    if driven:
        got, got_new, names, aborts = _driven(llm, prompts, params, new)
    else:
        got = _gather(_generate(llm, prompts, params, rank, world), rank, world)
    idle = [None] * world if rank == 0 else None
    dist.gather_object(llm.runner.num_idle_steps, idle, dst=0)
    if weights and not driven:
        llm.sleep(2)
        llm.wake_up()
        loaded = llm.update_weights(list(expected_tensors(new).items()))
        got_new = _gather(_generate(llm, prompts, params, rank, world), rank, world)
        names = [None] * world if rank == 0 else None
        dist.gather_object(loaded, names, dst=0)
    if rank:
        return None
    ref_model = load_model(path, device=dev)
    ref = LLM(model=load_model(path, device=dev), **ENGINE).generate(prompts, params, use_tqdm=False)
    checks = [_compare("ep == one device", got, ref), _trainer_check(ref_model, prompts, params, got)]
    if driven:
        checks.append(aborts)
    if weights:
        ref_new = LLM(model=new, **ENGINE).generate(prompts, params, use_tqdm=False)
        checks.append(_compare("ep == one device after sleep(2), wake, update_weights", got_new, ref_new))
        every = set(expected_tensors(new))
        all_loaded = {n for part in names for n in part}
        checks.append({"check": "update_weights: every name loaded on some rank", "ok": all_loaded == every})
    return {
        "checkpoint": checkpoint,
        "world": world,
        "device": device,
        "backend": dist.get_backend(),
        "perturb": perturb,
        "driven": driven,
        "idle_steps": idle,
        "checks": checks,
        "ok": all(c["ok"] for c in checks),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(rank: int, world: int, port: int, out: str, kwargs: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    summary = run(**kwargs)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(summary, f)
    # all ranks tear the group down together, then leave without the interpreter's teardown (a gloo rank can abort
    # there now and then; test_pipeline.py does the same)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(world: int, out: str, **kwargs) -> dict:
    """Run the check in ``world`` gloo processes on CPU; returns rank 0's summary."""
    import torch.multiprocessing as mp

    mp.start_processes(_spawned, args=(world, _free_port(), out, kwargs), nprocs=world, start_method="spawn")
    with open(out) as f:
        return json.load(f)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="qwen3_moe")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--perturb", choices=["arrival"], default=None)
    ap.add_argument("--weights", action="store_true", help="also sleep(2), wake and update_weights")
    ap.add_argument("--long", action="store_true", help="the golden fixtures' workload size")
    ap.add_argument("--driven", action="store_true", help="rank 0 takes every request; the other ranks serve")
    args = ap.parse_args()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    summary = run(args.checkpoint, args.device, args.perturb, args.weights, args.long, args.driven)
    ok = True
    if dist.get_rank() == 0:
        print(json.dumps(summary), flush=True)
        ok = summary["ok"] if args.perturb is None else not summary["checks"][0]["ok"]
    flag = torch.tensor([int(ok)], device=args.device if args.device == "cpu" else torch.device("cuda"))
    dist.broadcast(flag, 0)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if flag.item() else 1


if __name__ == "__main__":
    sys.exit(main())
