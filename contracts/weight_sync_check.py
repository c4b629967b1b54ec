"""Engine == trainer after a weight sync, through each transport (see ``test_weight_sync.py``).

The trainer holds fp32 master weights and computes with their bf16 cast (round to nearest even, FSDP's cast); the
engine starts from other weights. After a sync the engine's sampled-token logprobs must equal the trainer's on the
bf16 cast, ``torch.equal``. The multi-process checks (gloo broadcast; CUDA IPC between two processes on one GPU, of
bucket buffers or of the engine's own packed weights) run their ranks with ``torch.multiprocessing`` from functions of
this module, so the child processes can import them.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vexact_engine import LLM, PipelineLLM, SamplingParams
from vexact_models import (
    BucketPacker,
    DirectWriter,
    WeightSyncGroup,
    ipc_handle,
    load_weights,
    open_ipc_handle,
    random_model,
    send_buckets,
    tiny_deepseek_v3_config,
    tiny_gpt_oss_config,
    tiny_qwen3_config,
    tiny_qwen3_moe_config,
)
from vexact_trainer import Actor, iter_weights, sync_weights_broadcast

# CUDA graphs on (on CUDA): an in-place sync must leave the captured decode graphs valid
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=64, block_size=4, num_kv_blocks=64)
TIMEOUT_S = 120  # a member that never comes fails the check instead of hanging it
BUCKET_BYTES = 24 << 10  # small: many buckets, and the embedding (and a stacked expert) split by rows
LAYERS = 3


def config(family: str = "qwen3", dtype: str = "bfloat16"):
    configs = {
        "qwen3_moe": tiny_qwen3_moe_config,
        "deepseek_v3": tiny_deepseek_v3_config,
        "gpt_oss": tiny_gpt_oss_config,
    }
    cfg = configs[family]() if family in configs else tiny_qwen3_config(num_hidden_layers=LAYERS)
    return dataclasses.replace(cfg, torch_dtype=dtype)


def master(family: str = "qwen3", device: str = "cpu"):
    """The trainer's fp32 master weights (the engine starts from other ones)."""
    return random_model(config(family, "float32"), seed=11, device=device)


def engine_model(family: str = "qwen3", device: str = "cpu"):
    return random_model(config(family), seed=5, device=device)


def workload():
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (int(n),), generator=g).tolist() for n in torch.randint(3, 20, (6,), generator=g)]
    params = [SamplingParams(max_tokens=8, temperature=[0.0, 0.7, 1.0][i % 3], seed=i) for i in range(6)]
    return prompts, params


def generate(llm) -> dict:
    prompts, params = workload()
    outs = llm.generate(prompts, params, use_tqdm=False)
    # plain lists: results cross process boundaries (a tensor in a queue would need its sender alive)
    return {"prompts": [o.prompt_token_ids for o in outs], "tokens": [o.token_ids for o in outs],
            "logprobs": [o.logprobs.cpu().tolist() for o in outs]}  # fmt: skip


def trainer_logprobs(fp32_master, result: dict) -> list[torch.Tensor]:
    """The trainer's logprobs of the engine's samples, computed with the bf16 cast of the master weights."""
    _, params = workload()
    temps = [p.temperature if p.temperature > 0 else 1.0 for p in params]
    # the parameters' bf16 cast (rotary tables stay fp32 buffers, as in the trainer's FSDP forward)
    device = next(fp32_master.parameters()).device
    bf16 = random_model(dataclasses.replace(fp32_master.config, torch_dtype="bfloat16"), seed=0, device=device)
    load_weights(bf16, iter_weights(fp32_master), strict=True)
    return [lp.cpu() for lp in Actor(bf16).compute_log_probs(result["prompts"], result["tokens"], temps).logprobs]


def mismatches(fp32_master, result: dict) -> list[int]:
    """Indices of the requests whose engine logprobs are not torch.equal to the trainer's."""
    ref = trainer_logprobs(fp32_master, result)
    got = [torch.tensor(lp, dtype=torch.float32) for lp in result["logprobs"]]
    return [i for i, (a, b) in enumerate(zip(got, ref, strict=True)) if not torch.equal(a, b)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- separate placement: trainer rank 0 broadcasts (gloo on CPU) to an engine and a 2-stage pipeline


def _broadcast_rank(rank: int, world: int, ports: tuple[int, int], family: str, queue) -> None:
    """Rank 0: the trainer. Rank 1: a one-device engine. Ranks 2..: the stages of one pipeline replica (their own
    gloo group for the pipeline, beside the weight sync group)."""
    torch.set_num_threads(1)
    sync_port, pp_port = ports
    try:
        if rank == 0:
            group = WeightSyncGroup("127.0.0.1", sync_port, 0, world, timeout_s=TIMEOUT_S)
            sent = sync_weights_broadcast(master(family), group, BUCKET_BYTES)
            queue.put((rank, {"sent": sent}))
        elif rank == 1:
            llm = LLM(model=engine_model(family), **ENGINE)
            group = WeightSyncGroup("127.0.0.1", sync_port, 1, world, timeout_s=TIMEOUT_S)
            loaded = llm.receive_weights(group)
            queue.put((rank, {"loaded": len(loaded), **generate(llm)}))
        else:
            stage, stages = rank - 2, world - 2
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(pp_port))
            dist.init_process_group("gloo", rank=stage, world_size=stages)
            try:
                llm = PipelineLLM(model=engine_model(family), **ENGINE)
                if llm.is_driver:
                    llm.join_weight_sync("127.0.0.1", sync_port, 2, world, TIMEOUT_S)
                    loaded = llm.receive_weights()
                    out = generate(llm)
                    llm.shutdown()
                    queue.put((rank, {"loaded": len(loaded), **out}))
                else:
                    llm.serve()
                dist.barrier()  # the stages tear their group down together (a gloo rank left alone can abort)
            finally:
                dist.destroy_process_group()
            # and leave without the interpreter's teardown, where a gloo rank can abort now and then (seen in
            # CI, test_pp_check); the result is in the queue already (a SimpleQueue writes as it puts)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
    except Exception:
        queue.put((rank, {"error": traceback.format_exc()}))
        raise


def _stage_process(index: int, world: int, ports: tuple[int, int], family: str, queue) -> None:
    _broadcast_rank(2 + index, world, ports, family, queue)


def _broadcast_cuda_rank(rank: int, port: int, family: str, queue) -> None:
    """Separate placement over NCCL: rank 0 the trainer on cuda:0, rank 1 an engine on cuda:1."""
    try:
        device = f"cuda:{rank}"
        torch.cuda.set_device(rank)
        if rank == 0:
            group = WeightSyncGroup("127.0.0.1", port, 0, 2, device, timeout_s=TIMEOUT_S)
            queue.put((rank, {"sent": sync_weights_broadcast(master(family, device), group, BUCKET_BYTES)}))
        else:
            llm = LLM(model=engine_model(family, device), **ENGINE)
            group = WeightSyncGroup("127.0.0.1", port, 1, 2, device, timeout_s=TIMEOUT_S)
            loaded = llm.receive_weights(group)
            queue.put((rank, {"loaded": len(loaded), **generate(llm)}))
    except Exception:
        queue.put((rank, {"error": traceback.format_exc()}))
        raise


def run_broadcast_cuda(family: str = "qwen3") -> dict[int, dict]:
    """The NCCL twin of :func:`run_broadcast` on two GPUs (two spawned processes); returns each rank's result."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    ranks = mp.start_processes(
        _broadcast_cuda_rank, args=(free_port(), family, queue), nprocs=2, start_method="spawn", join=False
    )
    while not ranks.join():
        pass
    return _drain(queue)


def run_broadcast(family: str = "qwen3", world: int = 4) -> dict[int, dict]:
    """The trainer (rank 0) and a one-device engine (rank 1) in threads of this process, the ``world - 2`` pipeline
    stages in spawned processes (each needs its own default group); returns each reporting rank's result."""
    import threading

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    ports = (free_port(), free_port())
    stages = mp.start_processes(
        _stage_process, args=(world, ports, family, queue), nprocs=world - 2, start_method="spawn", join=False
    )
    local = [threading.Thread(target=_broadcast_rank, args=(r, world, ports, family, queue)) for r in (0, 1)]
    for t in local:
        t.start()
    for t in local:
        t.join()
    while not stages.join():
        pass
    return _drain(queue)


def _drain(queue) -> dict[int, dict]:
    """The ``(rank, result)`` pairs the ranks put on ``queue``, by rank."""
    results = {}
    while not queue.empty():
        rank, res = queue.get()
        results[rank] = res
    return results


# ---- colocated: trainer and engine in two processes on one GPU, CUDA IPC handles of two bucket buffers


def _ipc_engine(conn, family: str, sleep_first: bool, out) -> None:
    """The engine process: opens the trainer's bucket buffers and loads each bucket it is told about."""
    try:
        torch.cuda.set_device(0)
        llm = LLM(model=engine_model(family, "cuda"), **ENGINE)
        if sleep_first:  # verl's colocated order: sleep (level 2) while the trainer trains, wake, sync
            llm.sleep(level=2)
            conn.send("asleep")
            conn.recv()
            llm.wake_up()
        conn.send("ready")
        handles = conn.recv()
        buffers = [open_ipc_handle(h, torch.cuda.current_device()) for h in handles]
        loaded = []
        while (msg := conn.recv()) is not None:
            index, specs, nbytes = msg
            loaded += llm.load_bucket(buffers[index][:nbytes], specs)
            torch.cuda.current_stream().synchronize()  # the trainer may refill this buffer once we answer
            conn.send("done")
        del buffers
        torch.cuda.ipc_collect()
        res = generate(llm)
        out.put({"loaded": len(loaded), **res})
    except Exception:
        out.put({"error": traceback.format_exc()})
        raise


def _spawn_engine(target, family: str, sleep_first: bool):
    """Start the engine process (``target(conn, family, sleep_first, out)``) and build the trainer's fp32 master on
    cuda:0; with ``sleep_first``, let the engine sleep (level 2) and tell it to wake. Returns (pipe, result queue,
    process, master)."""
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    out = ctx.SimpleQueue()
    proc = ctx.Process(target=target, args=(there, family, sleep_first, out))
    proc.start()
    model = master(family, "cuda")
    if sleep_first:
        assert here.recv() == "asleep"
        here.send("wake")
    return here, out, proc, model


def run_ipc(
    family: str = "qwen3", sleep_first: bool = False, bucket_bytes: int = BUCKET_BYTES, stacked: bool = False
) -> dict:
    """This process is the trainer (fp32 master on cuda:0); a spawned process holds the engine on the same GPU.
    ``stacked``: stacked expert tensors go whole (``iter_weights(stacked=True)``, as verl exports them)."""
    here, out, proc, model = _spawn_engine(_ipc_engine, family, sleep_first)
    assert here.recv() == "ready"
    packer = BucketPacker(bucket_bytes, "cuda")
    here.send([ipc_handle(b) for b in packer.buffers])

    def submit(bucket):
        here.send((bucket.index, bucket.specs, bucket.nbytes))
        return bucket.index

    sent = send_buckets(iter_weights(model, stacked=stacked), packer, submit, lambda _: here.recv())
    here.send(None)
    res = out.get()
    proc.join(timeout=120)
    res["sent"] = sent
    res["mismatches"] = mismatches(model, res) if "error" not in res else None
    return res


# ---- colocated, single copy: the trainer process writes into the engine process's packed weights (CUDA IPC)


def _direct_engine(conn, family: str, sleep_first: bool, out) -> None:
    """The engine process: hands out its weight table and buffer handles, and after the sync compares its outputs
    with a fresh engine built from the trainer's weights (the same seeded draw on this GPU, cast to bf16)."""
    try:
        torch.cuda.set_device(0)
        llm = LLM(model=engine_model(family, "cuda"), **ENGINE)  # packed weights (pack_weights, the default)
        if sleep_first:  # verl's colocated order: sleep (level 2) while the trainer trains, wake, sync
            llm.sleep(level=2)
            conn.send("asleep")
            conn.recv()
            llm.wake_up()
        table, buffers = llm.begin_weight_write()
        ptrs = [p.data_ptr() for p in llm.model.parameters()]
        conn.send((table, [ipc_handle(b) for b in buffers]))
        key, written = conn.recv()
        loaded = llm.finish_weight_write(key, written)
        conn.send("loaded")
        conn.recv()  # the trainer has compared every tensor through its views and closed them
        res = generate(llm)
        fresh = engine_model(family, "cuda")
        load_weights(fresh, iter_weights(master(family, "cuda")), strict=True)
        want = generate(LLM(model=fresh, **ENGINE))
        res["same_as_fresh_engine"] = res["tokens"] == want["tokens"] and res["logprobs"] == want["logprobs"]
        res["same_storage"] = ptrs == [p.data_ptr() for p in llm.model.parameters()]
        out.put({"loaded": len(loaded), **res})
    except Exception:
        out.put({"error": traceback.format_exc()})
        raise


def run_direct(family: str = "qwen3", sleep_first: bool = False, stacked: bool = False) -> dict:
    """This process is the trainer (fp32 master on cuda:0); a spawned process holds the engine on the same GPU. The
    trainer opens the engine's buffers, copies its bf16 export straight into them (``DirectWriter``, one group), then
    reads every engine tensor back through the same views: ``unequal`` lists those not ``torch.equal`` to the export.
    ``stacked``: stacked expert tensors go whole (as verl exports them)."""
    here, out, proc, model = _spawn_engine(_direct_engine, family, sleep_first)
    table, handles = here.recv()
    writer = DirectWriter()
    writer.open_handles(table, handles, torch.cuda.current_device())
    written = writer.write(iter_weights(model, stacked=stacked))
    assert table.mask(written) == writer.written_mask
    here.send((table.key, writer.written_mask))
    assert here.recv() == "loaded"
    unequal = [name for name, t in iter_weights(model) if not torch.equal(writer.view(name), t)]
    writer.close()
    here.send("go")
    res = out.get()
    proc.join(timeout=120)
    res["sent"] = len(written)
    res["unequal"] = unequal
    res["mismatches"] = mismatches(model, res) if "error" not in res else None
    return res
