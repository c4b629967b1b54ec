"""Weight sync benchmark (GPU): seconds per full sync of a model's bf16 weights from the trainer to the engine, and
GB/s, against the bound measured in the same run.

``--mode colocated`` (default; one GPU): the trainer is this process, the engine (``vexact_engine.LLM``) a spawned
process on the same GPU, as in verl's hybrid mode. Paths:

- ``host`` (the old ``ServerAdapter`` path): per tensor a copy to host memory, the bucket handed over through shared
  host memory (as Ray's object store does), the engine's ``update_weights`` copies it back to the device; one bucket
  at a time.
- ``ipc`` (the new one): the trainer packs into two device buffers of half a bucket each, the engine opens their CUDA
  IPC handles once and per bucket gets only its ``TensorSpec`` list, copying into its parameters in place while the
  trainer packs the next bucket (``vexact_models.BucketPacker`` / ``send_buckets``, the code the adapter runs).
- ``ipc-stacked`` (MoE shapes): the same with each stacked expert tensor sent whole (``iter_weights(stacked=True)``,
  531 tensors for Qwen3-30B-A3B instead of 18867 per expert and projection): what verl's ``get_per_tensor_param``
  (state-dict tensors) hands the rollout; the engine copies each bucket's tensors with one ``torch._foreach_copy_``.
- ``ipc-direct`` (single copy): the engine's parameters live in packed flat buffers (``pack_parameters``); it hands
  the trainer their CUDA IPC handles and a ``WeightTable`` (checkpoint name -> buffer, offset, shape, dtype), and the
  trainer copies each exported tensor straight into its parameter (``vexact_models.DirectWriter``:
  ``torch._foreach_copy_`` per 256 MB of tensors), synchronises, and tells the engine: two messages per sync, one
  device copy per weight. Handles opened once and kept while the engine stays awake; the row "opened per sync" opens
  them every sync, which is what verl's hybrid flow pays (every sync follows a wake, which re-allocates the weights).
  ``ipc-direct-stacked`` (MoE shapes): stacked expert tensors whole, as in ``ipc-stacked``. ``*-memcpy``: the same
  with a memcpy per tensor of 32 MB or more (``DirectWriter(memcpy_min_bytes=...)``; the default issues every copy in
  ``torch._foreach_copy_`` launches, see ``vexact_models.weight_sync.MEMCPY_MIN_BYTES``).
- ``bound``: bytes / device-to-device copy rate (bytes a ``copy_`` of 2 GiB moves per second, half of
  ``hardware.copy_bandwidth``, which counts bytes read and written; measured here): one copy of every weight. The
  bucket paths copy twice (pack, then unpack), so 2x the bound is their floor; the direct path copies once, so its
  floor is the bound itself.

``--mode nccl`` (two GPUs, ``torchrun --nproc_per_node 2``): rank 0 is the trainer on GPU 0, rank 1 an engine on GPU 1;
``vexact_models.broadcast_weights`` over a ``WeightSyncGroup`` (NCCL), bound = bytes / measured NCCL broadcast
bandwidth (1 GiB) in the same group.

After every path the engine's weights are checked against the trainer's (a per-tensor fingerprint of the bf16 bits:
sum and position-weighted sum of the int16 view); a mismatch is reported in the table.

Shapes: Qwen3-1.7B, Qwen3-8B (dense), Qwen3-30B-A3B (MoE: its 61 GB must fit twice on the device, so it is skipped on
an 80 GB H100). Random bf16 weights drawn on the GPU; values do not change the speed.

Usage (on the GPU machine, after ``source scripts/staging/device_env.sh``)::

    python benchmarks/weight_sync.py --out benchmarks/results/weight-sync-h100.md
    torchrun --standalone --nproc_per_node 2 benchmarks/weight_sync.py --mode nccl --out weight-sync-nccl.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import hardware
import torch
import torch.multiprocessing as mp

from vexact_engine import LLM
from vexact_models import (
    MODEL_CLASSES,
    QWEN3_MOE_SHAPES,
    QWEN3_SHAPES,
    BucketPacker,
    DirectWriter,
    WeightSyncGroup,
    broadcast_weights,
    expected_tensors,
    ipc_handle,
    open_ipc_handle,
    random_model,
    send_buckets,
    tiny_qwen3_config,
    tiny_qwen3_moe_config,
)
from vexact_trainer import iter_weights

GB = 1e9
SHAPES = {"qwen3-1.7b": ("dense", QWEN3_SHAPES["qwen3-1.7b"]), "qwen3-8b": ("dense", QWEN3_SHAPES["qwen3-8b"]),
          "qwen3-30b-a3b": ("moe", QWEN3_MOE_SHAPES["qwen3-30b-a3b"])}  # fmt: skip
MEMCPY_OPTION = 32 << 20  # the *-memcpy rows: DirectWriter(memcpy_min_bytes=...)
PROFILE_HOST = False  # --profile-host: print a cProfile of one ipc-direct sync per shape (stderr)
DIRECT_GROUP_BYTES = 256 << 20  # the direct path issues its copies per 256 MB of tensors
DIRECT_PHASES = ("begin (round trip, handles)", "issue copies (host)", "wait for copies", "finish (round trip)",
                 "close views")  # fmt: skip
PATHS = (
    "host", "ipc", "ipc-stacked", "ipc-direct", "ipc-direct-memcpy", "ipc-direct-per-sync", "ipc-direct-stacked",
    "ipc-direct-stacked-memcpy",
)  # fmt: skip
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=1024, block_size=16, num_kv_blocks=64,
              enforce_eager=True)  # fmt: skip


def shape_config(name: str):
    kind, over = SHAPES[name]
    return tiny_qwen3_moe_config(**over) if kind == "moe" else tiny_qwen3_config(**over)


def empty_model(cfg, device):
    """The engine's model: real parameter shapes, contents left to the sync."""
    with torch.device("meta"):
        model = MODEL_CLASSES[cfg.model_type](cfg)
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval().requires_grad_(False)


def fingerprint(named) -> dict[str, tuple[int, int]]:
    """Per tensor: the sum and a position-weighted sum of its bf16 bits (int16), in chunks (little extra memory)."""
    out = {}
    for name, t in named:
        flat = t.detach().contiguous().view(torch.int16).reshape(-1)
        plain = weighted = 0
        for start in range(0, flat.numel(), 1 << 25):
            bits = flat[start : start + (1 << 25)].to(torch.int64)
            weight = (torch.arange(start, start + bits.numel(), device=bits.device) % 251) + 1
            plain += int(bits.sum())
            weighted += int((bits * weight).sum())
        out[name] = (plain, weighted)
    return out


def host_blob(nbytes: int, path: str | None = None) -> tuple[torch.Tensor, str]:
    """A host buffer both processes map (in /dev/shm when it has room, else /tmp): the object store's role."""
    import shutil
    import uuid

    if path is None:
        root = (
            "/dev/shm"
            if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > nbytes + (1 << 30)
            else "/tmp"
        )
        path = os.path.join(root, f"vexact-weight-sync-{uuid.uuid4().hex}")
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8), path


# ---- colocated: the engine process


def _engine_main(conn, shape: str) -> None:
    try:
        torch.cuda.set_device(0)
        cfg = shape_config(shape)
        llm = LLM(model=empty_model(cfg, "cuda"), **ENGINE)
        buffers = []
        conn.send("ready")
        while True:
            msg = conn.recv()
            op = msg[0]
            if op == "quit":
                break
            if op == "zero":
                for p in llm.model.parameters():
                    p.data.zero_()
                torch.cuda.synchronize()
                conn.send("ok")
            elif op == "open":
                buffers = [open_ipc_handle(h, 0) for h in msg[1]]
                conn.send("ok")
            elif op == "close":
                buffers = []
                torch.cuda.ipc_collect()
                conn.send("ok")
            elif op == "bucket":
                _, index, specs, nbytes = msg
                llm.load_bucket(buffers[index][:nbytes], specs)
                torch.cuda.current_stream().synchronize()
                conn.send("ok")
            elif op == "open_host":
                blob, _ = host_blob(msg[1], msg[2])
                conn.send("ok")
            elif op == "host":  # views of the shared blob (a zero-copy get), then update_weights copies to device
                named = [(s.name, blob[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape)) for s in msg[1]]
                llm.update_weights(named)
                torch.cuda.synchronize()
                conn.send("ok")
            elif op == "direct_begin":  # the single-copy path: handles only when the trainer has none open
                table, buffers = llm.begin_weight_write()
                fresh = msg[1] != table.key
                conn.send((table.key, table if fresh else None, [ipc_handle(b) for b in buffers] if fresh else None))
            elif op == "direct_finish":
                conn.send(len(llm.finish_weight_write(msg[1], msg[2])))
            elif op == "fingerprint":
                conn.send(fingerprint(expected_tensors(llm.model).items()))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        raise


def _ask(conn, *msg):
    conn.send(msg)
    return _answer(conn)


def _answer(conn):
    ans = conn.recv()
    if isinstance(ans, tuple) and ans and ans[0] == "error":
        raise RuntimeError(f"engine process failed:\n{ans[1]}")
    return ans


def _host_sync(conn, model, bucket_bytes: int, blob: torch.Tensor) -> None:
    """The old path: each tensor copied to host memory (``t.to("cpu", copy=True)``), a bucket put into shared host
    memory (what ``ray.put`` does), the engine's ``update_weights`` copies it back; one bucket at a time."""
    from vexact_models import TensorSpec

    specs, size = [], 0
    for name, t in iter_weights(model):
        h = t.to("cpu", copy=True)
        n = h.numel() * h.element_size()
        blob[size : size + n].view(h.dtype).view(h.shape).copy_(h)
        specs.append(TensorSpec(name, tuple(h.shape), h.dtype, size))
        size += -(-n // 256) * 256
        if size >= bucket_bytes:
            _ask(conn, "host", specs)
            specs, size = [], 0
    if specs:
        _ask(conn, "host", specs)


def _ipc_sync(conn, model, bucket_bytes: int, stacked: bool = False) -> int:
    packer = BucketPacker(bucket_bytes // 2, "cuda")
    _ask(conn, "open", [ipc_handle(b) for b in packer.buffers])
    count = [0]

    def submit(bucket):
        conn.send(("bucket", bucket.index, bucket.specs, bucket.nbytes))
        count[0] += 1
        return bucket.index

    send_buckets(iter_weights(model, stacked=stacked), packer, submit, lambda _: _answer(conn))
    _ask(conn, "close")
    return count[0]


def _direct_sync(
    conn, model, writer: DirectWriter, stacked: bool = False, keep_open: bool = True, phases: dict | None = None
) -> int:
    """The single-copy path as the adapter runs it: begin (handles when none are open), copy every tensor into the
    engine's parameters in groups of DIRECT_GROUP_BYTES (as the adapter does in hybrid mode with a bucket: the copies
    of one group run while the next is checked), synchronise, finish. ``phases`` collects the seconds of each part
    (begin round trip with handle opening, issuing the copies, waiting for them, finish round trip, closing)."""
    t = [time.perf_counter()]
    key, table, handles = _ask(conn, "direct_begin", writer.key)
    if table is not None:
        writer.open_handles(table, handles, 0)
    t.append(time.perf_counter())
    writer.write(iter_weights(model, stacked=stacked), group_bytes=DIRECT_GROUP_BYTES, synchronize=False)
    t.append(time.perf_counter())
    writer.synchronize()
    t.append(time.perf_counter())
    loaded = _ask(conn, "direct_finish", key, writer.written_mask)
    t.append(time.perf_counter())
    if not keep_open:
        writer.close()
    t.append(time.perf_counter())
    if phases is not None:
        for name, a, b in zip(DIRECT_PHASES, t[:-1], t[1:], strict=True):
            phases.setdefault(name, []).append(b - a)
    return loaded


def _timed(fn, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return times


def run_colocated(shape: str, bucket_bytes: int, copy_bw: float, reps: int, paths=PATHS) -> list[dict]:
    cfg = shape_config(shape)
    nbytes = sum(p.numel() for p in empty_model(cfg, "meta").parameters()) * 2
    free, total = torch.cuda.mem_get_info()
    need = 2 * nbytes + bucket_bytes + (2 << 30)
    if need > free:
        return [{"shape": shape, "path": "skipped", "note": f"needs {need / GB:.0f} GB (the weights twice), "
                 f"{free / GB:.0f} GB free of {total / GB:.0f} GB"}]  # fmt: skip
    model = random_model(cfg, seed=0, embed_std=0.02, device="cuda")
    want = fingerprint(iter_weights(model))
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_engine_main, args=(there, shape))
    proc.start()
    rows = []
    try:
        assert here.recv() == "ready"
        ntensors = len(want)
        base = {"shape": shape, "GB": nbytes / GB, "tensors": ntensors}
        rows.append({**base, "path": "bound (one device copy)", "s": nbytes / copy_bw, "ok": ""})
        # MoE: also with each stacked expert tensor sent whole (as verl's state-dict export sends it)
        stacked_differs = len(list(iter_weights(model, stacked=True))) != ntensors
        stacked_paths = ("ipc-stacked", "ipc-direct-stacked", "ipc-direct-stacked-memcpy") if stacked_differs else ()
        for path in ("host", "ipc", "ipc-direct", "ipc-direct-memcpy", "ipc-direct-per-sync", *stacked_paths):
            if path not in paths:
                continue
            _ask(here, "zero")
            if path.startswith("ipc-direct"):
                stacked, keep = "stacked" in path, not path.endswith("per-sync")
                memcpy = path.endswith("memcpy")
                writer = DirectWriter(memcpy_min_bytes=MEMCPY_OPTION) if memcpy else DirectWriter()
                phases: dict[str, list[float]] = {}

                def once(writer=writer, stacked=stacked, keep=keep, phases=phases):
                    _direct_sync(here, model, writer, stacked, keep, phases)

                once()  # warm-up (opens the handles) and a first check
                phases.clear()
                times = _timed(once, reps)
                if PROFILE_HOST and path == "ipc-direct":  # where the host's time goes in one more sync
                    import cProfile
                    import pstats

                    prof = cProfile.Profile()
                    prof.runcall(once)
                    print(f"--- {shape} {path}: host profile of one sync (cProfile, by own time)", file=sys.stderr)
                    pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(12)
                writer.close()
                label = "CUDA IPC direct (single copy into the engine's packed weights"
                label += ", handles opened per sync)" if not keep else ")"
                if memcpy:
                    label += f", a memcpy per tensor of {MEMCPY_OPTION >> 20} MB or more (the rest in foreach launches)"
                if stacked:
                    label += f", stacked experts whole ({len(list(iter_weights(model, stacked=True)))} tensors)"
            elif path == "host":
                largest = max(t.numel() * 2 for _, t in iter_weights(model))
                blob, blob_path = host_blob(bucket_bytes + largest + 256)
                _ask(here, "open_host", blob.numel(), blob_path)
                times = _timed(lambda blob=blob: _host_sync(here, model, bucket_bytes, blob), 1)
                where = "/dev/shm" if blob_path.startswith("/dev/shm") else "a /tmp file"
                label = f"host (D2H, shared host memory in {where}, H2D)"
                del blob
                os.unlink(blob_path)
            else:
                stacked = path == "ipc-stacked"
                _ipc_sync(here, model, bucket_bytes, stacked)  # warm-up (and a first check)
                times = _timed(lambda stacked=stacked: _ipc_sync(here, model, bucket_bytes, stacked), reps)
                label = "CUDA IPC buckets (pack, engine copies in place: two copies)"
                if stacked:
                    n = len(list(iter_weights(model, stacked=True)))
                    label = f"CUDA IPC buckets, stacked experts whole ({n} tensors, as verl exports them)"
            got = _ask(here, "fingerprint")
            ok = got == want
            row = {**base, "path": label, "s": statistics.median(times), "ok": "yes" if ok else "NO"}
            if path.startswith("ipc-direct"):
                row["phases"] = {name: statistics.median(v) for name, v in phases.items()}
            rows.append(row)
        _ask_quiet(here)
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
        torch.cuda.empty_cache()
    return rows


def _ask_quiet(conn) -> None:
    conn.send(("quit",))


# ---- separate placement: NCCL broadcast between two GPUs (torchrun --nproc_per_node 2)


def run_nccl(shapes: list[str], bucket_bytes: int, reps: int) -> list[dict]:
    import torch.distributed as dist

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    if dist.get_world_size() != 2:
        raise SystemExit("--mode nccl runs under torchrun --nproc_per_node 2")
    port = int(os.environ.get("MASTER_PORT", "29500")) + 1
    group = WeightSyncGroup(os.environ.get("MASTER_ADDR", "127.0.0.1"), port, rank, 2, f"cuda:{rank}")
    probe = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        group.broadcast(probe).wait()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    nccl_bw = probe.numel() / statistics.median(times[1:])
    del probe
    rows = []
    for shape in shapes:
        cfg = shape_config(shape)
        nbytes = sum(p.numel() for p in empty_model(cfg, "meta").parameters()) * 2
        free = torch.cuda.mem_get_info()[0]
        if nbytes + 2 * bucket_bytes + (2 << 30) > free:
            rows.append({"shape": shape, "path": "skipped", "note": f"{nbytes / GB:.0f} GB does not fit"})
            continue
        if rank == 0:
            model = random_model(cfg, seed=0, embed_std=0.02, device="cuda")
            want = fingerprint(iter_weights(model))

            def once(model=model):  # stacked experts whole, as verl's state-dict export sends them
                broadcast_weights(group, iter_weights(model, stacked=True), bucket_bytes)
        else:
            llm = LLM(model=empty_model(cfg, "cuda"), **ENGINE)

            def once(llm=llm):
                llm.receive_weights(group)

        once()
        dist.barrier()
        ts = []
        for _ in range(reps):
            torch.cuda.synchronize()
            dist.barrier()
            t = time.perf_counter()
            once()
            torch.cuda.synchronize()
            dist.barrier()
            ts.append(time.perf_counter() - t)
        fp = [None, None]
        dist.all_gather_object(fp, fingerprint(expected_tensors(llm.model).items()) if rank == 1 else None)
        if rank == 0:
            base = {"shape": shape, "GB": nbytes / GB, "tensors": len(want)}
            rows.append({**base, "path": "bound (one NCCL broadcast)", "s": nbytes / nccl_bw, "ok": ""})
            rows.append({**base, "path": "NCCL broadcast (new)", "s": statistics.median(ts),
                         "ok": "yes" if fp[1] == want else "NO"})  # fmt: skip
            del model
        else:
            del llm
        torch.cuda.empty_cache()
    group.close()
    dist.destroy_process_group()
    return rows if rank == 0 else []


def table(rows: list[dict], title: str, notes: list[str]) -> str:
    head = "| shape | GB (bf16) | tensors | path | s / sync | GB/s | x bound | engine == trainer |"
    out = [f"# {title}", "", *notes, "", head, "| --- | ---: | ---: | --- | ---: | ---: | ---: | --- |"]
    bound = {}
    for r in rows:
        if r["path"].startswith("bound"):
            bound[r["shape"]] = r["s"]
    for r in rows:
        if r["path"] == "skipped":
            out.append(f"| {r['shape']} | | | skipped: {r['note']} | | | | |")
            continue
        x = r["s"] / bound[r["shape"]] if r["shape"] in bound else float("nan")
        out.append(f"| {r['shape']} | {r['GB']:.2f} | {r['tensors']} | {r['path']} | {r['s']:.3f} | "
                   f"{r['GB'] / r['s']:.1f} | {x:.2f} | {r.get('ok', '')} |")  # fmt: skip
    timed = [r for r in rows if r.get("phases")]
    if timed:  # where a direct sync's time goes (median ms of each part over the timed syncs)
        out += ["", "Single-copy path, median ms per part of a sync:", ""]
        out.append("| shape | path | " + " | ".join(DIRECT_PHASES) + " |")
        out.append("| --- | --- |" + " ---: |" * len(DIRECT_PHASES))
        for r in timed:
            cells = " | ".join(f"{r['phases'].get(name, float('nan')) * 1e3:.2f}" for name in DIRECT_PHASES)
            out.append(f"| {r['shape']} | {r['path']} | {cells} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("colocated", "nccl"), default="colocated")
    ap.add_argument("--shapes", default="qwen3-1.7b,qwen3-8b,qwen3-30b-a3b")
    ap.add_argument("--bucket-mb", type=int, default=1024, help="verl's update_weights_bucket_megabytes")
    ap.add_argument("--reps", type=int, default=3, help="timed syncs per path (the host path runs once)")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"colocated paths to run, of {','.join(PATHS)}")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--profile-host", action="store_true", help="print a host profile of one ipc-direct sync")
    args = ap.parse_args(argv)
    global PROFILE_HOST
    PROFILE_HOST = args.profile_host
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        ap.error(f"unknown shape(s) {unknown}; choose from {sorted(SHAPES)}")
    paths = [p for p in args.paths.split(",") if p]
    if set(paths) - set(PATHS):
        ap.error(f"unknown path(s) {sorted(set(paths) - set(PATHS))}; choose from {list(PATHS)}")
    if not torch.cuda.is_available():
        ap.error("the weight sync benchmark needs CUDA")
    bucket_bytes = args.bucket_mb << 20
    device = torch.cuda.get_device_name()
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    if args.mode == "nccl":
        rows = run_nccl(shapes, bucket_bytes, args.reps)
        if not rows:
            return 0
        notes = [f"{device} x2, torch {torch.__version__}, {stamp}; bucket {args.bucket_mb} MB (two buffers on the "
                 "sender); trainer rank 0 (GPU 0) broadcasts to an engine on GPU 1 (NCCL)."]  # fmt: skip
        title = "Weight sync, separate placement (NCCL broadcast)"
    else:
        copy_bw = hardware.copy_bandwidth("cuda") / 2  # bytes a copy moves per second
        rows = []
        for shape in shapes:
            t = time.perf_counter()
            try:
                rows += run_colocated(shape, bucket_bytes, copy_bw, args.reps, paths)
            except Exception:
                traceback.print_exc()
                rows.append({"shape": shape, "path": "skipped", "note": "failed: " + traceback.format_exc(limit=1)
                             .strip().splitlines()[-1]})  # fmt: skip
            print(f"{shape}: {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
        notes = [f"{device}, torch {torch.__version__}, {stamp}; bucket {args.bucket_mb} MB (the IPC path: two "
                 f"device buffers of half a bucket); device copy bandwidth measured here: {copy_bw / GB:.0f} GB/s. "
                 "Trainer = this process, engine = a spawned process on the same GPU (its weights packed in flat "
                 f"buffers). Seconds are the median of {args.reps} syncs after a warm-up (IPC); the host path runs "
                 "once."]  # fmt: skip
        title = "Weight sync, colocated (one GPU)"
    text = table(rows, title, notes)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
