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

``--graphs``: decode steps padded to the sizes 2 and 3 (``cuda_graph_batch_sizes``), every rank to the size of the
largest rank's decode rows, captured as CUDA graphs on CUDA (the collectives inside), run eagerly from the same
static buffers on CPU; then also ``padded steps``: every rank ran padded steps (a rank with nothing to run, a
pad-only one), some rank padded rows of its own, and on CUDA every rank captured its graphs without a fallback.
``--eager``: no padded steps (``enforce_eager``); neither: the engine's default (graphs on CUDA, eager on CPU).
``--idle-rank``: the last rank gets no request (prompt ``i`` on rank ``i % (W - 1)``) and joins every step with pad
rows or zero rows only.

``--perturb`` (the contract can fail; the exit status is then 0 when it was caught): ``arrival`` makes the combine
add each token's expert rows in the order of the ranks they come from (the arrival order of an all-to-all) instead of
its own top-k order: check 1 must then fail at top-k > 2. ``pad_rows`` (with ``--graphs``) starts a padded step's pad
mark one row early: the last real row goes to no expert and check 1 must fail. ``own_size`` (with ``--graphs``, CPU
only) pads each rank to the size of its own decode rows: the ranks' collectives stop matching and gloo aborts the run
(on NCCL it would hang, so the GPU script does not run it). Prints one JSON summary line on rank 0; exits 1 if a
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
from vexact_models import (
    AttentionMetadata,
    default_checkpoint,
    expected_tensors,
    load_model,
    random_model,
    tiny_checkpoint_config,
)
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


def _own_size_begin_step(self, num_tokens, decode_rows=None, sizes=()):
    """The perturbation ``own_size``: the ranks agree on ``C`` and on whether any has prompt tokens, but each pads to
    the size of its own decode rows (``_Exchange.begin_step`` otherwise)."""
    n = torch.tensor([num_tokens, int(decode_rows is None)], dtype=torch.int64, device=self.comm)
    dist.all_reduce(n, op=dist.ReduceOp.MAX, group=self.group)
    tokens, any_eager = n.tolist()
    size = None if any_eager or not decode_rows else next((s for s in sizes if s >= decode_rows), None)
    self.rows, self.padded = (tokens, False) if size is None else (size, True)
    return size


def _pad_rows_fill(self, batch, blocks, size, draw=False):
    """The perturbation ``pad_rows``: a padded step's pad mark one row early (the last real row goes to no expert)."""
    _FILL_DECODE(self, batch, blocks, size, draw)
    self.exchange.live.fill_(max(len(batch) - 1, 0))


_FILL_DECODE = ep._ExpertRunner._fill_decode
PERTURBATIONS = ("arrival", "pad_rows", "own_size")
GRAPH_SIZES = (2, 3)  # --graphs: padded decode sizes (max_num_seqs is 3): a step of one row a rank pads on every rank


def _generate(llm, prompts, params, rank: int, spread: int) -> list:
    mine = [i for i in range(len(prompts)) if i % spread == rank]
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
    graphs: bool = False,
    eager: bool = False,
    idle_rank: bool = False,
) -> dict | None:
    """This rank's part of the check (the process group is initialised); rank 0 returns the summary."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = f"cuda:{rank}" if device == "cuda" else "cpu"
    if perturb not in (None, *PERTURBATIONS):
        raise ValueError(f"unknown perturbation {perturb!r}; one of {PERTURBATIONS}")
    if perturb in ("pad_rows", "own_size") and not graphs:
        raise ValueError(f"the perturbation {perturb!r} perturbs padded steps: it needs graphs=True")
    if graphs and eager:
        raise ValueError("graphs=True and eager=True: pick one")
    if idle_rank and (world < 2 or driven):
        raise ValueError(f"idle_rank needs two or more ranks and driven=False, got world={world}, driven={driven}")
    if perturb == "arrival":
        ep._combine_home = _arrival_order_combine
    elif perturb == "pad_rows":
        ep._ExpertRunner._fill_decode = _pad_rows_fill
    elif perturb == "own_size":
        ep._Exchange.begin_step = _own_size_begin_step
    path = default_checkpoint(checkpoint)
    mode = dict(cuda_graph_batch_sizes=GRAPH_SIZES) if graphs else dict(enforce_eager=True) if eager else {}
    llm = ExpertParallelLLM(model=load_model(path, device=dev), driven=driven, **ENGINE, **mode)
    prompts, params = workload(long)
    spread = world - 1 if idle_rank else world
    new = random_model(tiny_checkpoint_config(checkpoint), seed=11, device=dev) if weights else None
    if driven:
        got, got_new, names, aborts = _driven(llm, prompts, params, new)
    else:
        got = _gather(_generate(llm, prompts, params, rank, spread), rank, world)
    idle = [None] * world if rank == 0 else None
    dist.gather_object(llm.runner.num_idle_steps, idle, dst=0)
    if weights and not driven:
        llm.sleep(2)
        llm.wake_up()
        loaded = llm.update_weights(list(expected_tensors(new).items()))
        got_new = _gather(_generate(llm, prompts, params, rank, spread), rank, world)
        names = [None] * world if rank == 0 else None
        dist.gather_object(loaded, names, dst=0)
    r = llm.runner
    mine = dict(padded_steps=r.num_padded_steps, pad_rows=r.num_pad_rows, idle_padded_steps=r.num_idle_padded_steps,
                graphs=r.num_graphs, captures=r.captures, graph_error=r.graph_error)  # fmt: skip
    padded = [None] * world if rank == 0 else None
    dist.gather_object(mine, padded, dst=0)
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
    if graphs:
        # every rank ran padded steps, and some rank padded its own rows (a smaller decode batch than another's)
        ran = all(p["padded_steps"] + p["idle_padded_steps"] > 0 for p in padded) and any(p["pad_rows"] for p in padded)
        idle_ok = not idle_rank or (padded[-1]["padded_steps"] == 0 and padded[-1]["idle_padded_steps"] > 0)
        captured = device != "cuda" or all(p["graph_error"] is None and p["captures"] > 0 for p in padded)
        checks.append({"check": "padded steps", "ok": ran and idle_ok and captured})
    return {
        "checkpoint": checkpoint,
        "world": world,
        "device": device,
        "backend": dist.get_backend(),
        "perturb": perturb,
        "driven": driven,
        "graphs": graphs,
        "idle_rank": idle_rank,
        "idle_steps": idle,
        "padded": padded,
        "checks": checks,
        "ok": all(c["ok"] for c in checks),
    }


def capture_failure(fail_rank: int = 1) -> dict | None:
    """A CUDA graph capture that fails on rank ``fail_rank`` only: every rank drops its graphs (a rank without them
    would miss the eager collectives of another rank's later lazy capture). CPU has no graphs, so the runners get
    stand-ins; a capture call that succeeds everywhere keeps them. Rank 0 returns each rank's state after each call."""
    rank, world = dist.get_rank(), dist.get_world_size()
    llm = ExpertParallelLLM(model=load_model(default_checkpoint("qwen3_moe")), cuda_graph_batch_sizes=GRAPH_SIZES,
                            **ENGINE)  # fmt: skip
    r = llm.runner
    r._graphs[("decode", 3)] = None
    r._uncaptured = {("decode", 2)}
    states = []
    for fails in (False, True):

        def capture(fails=fails):
            if fails and rank == fail_rank:
                raise RuntimeError("an op that cannot be captured")

        r._guarded(capture)
        states.append(dict(graphs=len(r._graphs), uncaptured=len(r._uncaptured), error=r.graph_error))
    got = [None] * world if rank == 0 else None
    dist.gather_object(states, got, dst=0)
    return None if rank else {"states": got}


def forward_at_start(forget: bool = False) -> dict | None:
    """The model run the engine makes at start-up on CUDA when it sizes its KV cache from GPU memory
    (``kv_cache.profile_activation_bytes``: one packed forward of ``max_num_batched_tokens`` tokens, before any
    step), on every rank together right after construction; ``forget`` drops the exchange's agreement first (what
    the replica did before agreeing it at start-up), which must fail. Rank 0 returns each rank's outcome."""
    rank, world = dist.get_rank(), dist.get_world_size()
    llm = ExpertParallelLLM(model=load_model(default_checkpoint("qwen3_moe")), **ENGINE)
    if forget:
        llm.runner.exchange.rows = 0
    t, n = llm.config.max_num_batched_tokens, llm.config.max_num_seqs
    meta = AttentionMetadata.packed([t // n + (1 if i < t % n else 0) for i in range(n)])
    zeros = torch.zeros(t, dtype=torch.int64)
    try:
        with torch.no_grad(), vk.use_backend(llm.config.backend):
            rows = llm.model(zeros, zeros, meta)
        outcome = dict(ok=bool(torch.isfinite(rows).all()), rows=int(rows.shape[0]), error=None)
    except RuntimeError as e:
        outcome = dict(ok=False, rows=0, error=str(e))
    got = [None] * world if rank == 0 else None
    dist.gather_object(outcome, got, dst=0)
    return None if rank else {"ranks": got}


def batch(cases: list[dict]) -> dict | None:
    """Each of ``cases`` in turn in this process group (a case: the keyword arguments of :func:`run`, or of the entry
    its ``entry`` names), a perturbation undone after its case, so that one set of ranks serves many checks without
    paying each one's process start-up (``contracts/test_expert_parallel.py``). Rank 0 returns the summaries in
    order. ``own_size`` aborts the ranks: it runs alone."""
    if any(c.get("perturb") == "own_size" for c in cases):
        raise ValueError("the perturbation 'own_size' aborts the ranks: run it alone, not in a batch")
    patched = (ep, "_combine_home"), (ep._ExpertRunner, "_fill_decode"), (ep._Exchange, "begin_step")
    saved = [getattr(owner, name) for owner, name in patched]
    summaries = []
    for case in cases:
        kwargs = dict(case)
        try:
            summaries.append(ENTRIES[kwargs.pop("entry", "run")](**kwargs))
        finally:
            for (owner, name), value in zip(patched, saved, strict=True):
                setattr(owner, name, value)
    return None if dist.get_rank() else {"summaries": summaries}


ENTRIES = {"run": run, "capture_failure": capture_failure, "forward_at_start": forward_at_start, "batch": batch}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(rank: int, world: int, port: int, out: str, kwargs: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    summary = ENTRIES[kwargs.pop("entry", "run")](**kwargs)  # run, or another of ENTRIES
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
    ap.add_argument("--perturb", choices=PERTURBATIONS, default=None)
    ap.add_argument("--weights", action="store_true", help="also sleep(2), wake and update_weights")
    ap.add_argument("--long", action="store_true", help="the golden fixtures' workload size")
    ap.add_argument("--driven", action="store_true", help="rank 0 takes every request; the other ranks serve")
    ap.add_argument("--graphs", action="store_true", help="padded decode steps (CUDA graphs on CUDA), sizes 2 and 3")
    ap.add_argument("--eager", action="store_true", help="no padded steps (enforce_eager)")
    ap.add_argument("--idle-rank", action="store_true", help="the last rank gets no request")
    args = ap.parse_args()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    flags = dict(graphs=args.graphs, eager=args.eager, idle_rank=args.idle_rank)
    summary = run(args.checkpoint, args.device, args.perturb, args.weights, args.long, args.driven, **flags)
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
