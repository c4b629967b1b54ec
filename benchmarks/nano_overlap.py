"""Would a decode step run faster as two half-batch forwards on two CUDA streams than as one forward?

At the RL shape the decode step is mostly paged attention, which reads the KV cache at the memory bound, and the
projections, which at M = 256 keep the tensor cores about half busy; one forward runs them one after the other. Two
half batches on two streams let one half's attention overlap the other half's GEMMs. Every kernel is row-invariant,
so each row's hidden state is the same bits either way (checked here with ``torch.equal``); the question is time.

One model of a dense shape with random weights, a paged KV cache of random values, ``--batch`` sequences whose
contexts are drawn from ``--context`` x [0.5, 1.5] (the RL workload's spread around its mean), one new token each.
Each form is captured as one CUDA graph and replayed ``--replays`` times:

- ``full``: one forward of the whole batch (what the engine runs now);
- ``halves``: two forwards of half the batch, one after the other (what smaller GEMMs cost alone);
- ``streams``: the two half forwards on two streams, forked and joined inside the graph;
- ``streams+D``: the same with the second stream started after a spin of D microseconds, so that the halves run
  out of phase (one in attention while the other is in its projections).

    python benchmarks/nano_overlap.py --shape 1.7b --batch 256 --context 1088

Prints a table of ms per step and the ratio to ``full``, and whether every form's rows equal ``full``'s.
"""

from __future__ import annotations

import argparse
import sys

import throughput  # benchmarks/throughput.py: the model shapes
import torch

from vexact_engine.model_runner import kv_cache_shapes
from vexact_models import random_model
from vexact_models.attention_metadata import AttentionMetadata

PAGE = 16


def build(shape: str, layers: int | None, batch: int, context: int, device: torch.device, seed: int = 0):
    """``(model, kv_caches, rows)``: the model, its KV cache, and per row ``(token id, context length, pages)``."""
    family, sizes = throughput.SHAPES[shape]
    over = {"torch_dtype": "bfloat16"} | ({} if layers is None else {"num_hidden_layers": layers})
    cfg = throughput.CONFIGS[family](**{**sizes, **over})
    model = random_model(cfg, seed=seed, embed_std=0.02, device=device)
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(max(1, context // 2), context * 3 // 2 + 1, (batch,), generator=g).tolist()
    pages, rows, first = [-(-n // PAGE) for n in lens], [], 0
    for n, p in zip(lens, pages, strict=True):
        rows.append((int(torch.randint(0, cfg.vocab_size, (1,), generator=g)), n, list(range(first, first + p))))
        first += p
    k_shape, v_shape = kv_cache_shapes(cfg, first, PAGE)
    gk = torch.Generator(device=device).manual_seed(seed + 1)
    kv = [tuple(torch.randn(s, generator=gk, device=device).to(torch.bfloat16) for s in (k_shape, v_shape))
          for _ in range(cfg.num_hidden_layers)]  # fmt: skip
    return model, kv, rows


def step_inputs(rows, device: torch.device):
    """``(ids, positions, AttentionMetadata)`` of one decode step of ``rows`` (fresh tensors: one capture each)."""
    width = max(len(p) for *_, p in rows)
    tables = torch.tensor([p + [p[-1]] * (width - len(p)) for *_, p in rows], dtype=torch.int64, device=device)
    ctx = torch.tensor([n for _, n, _ in rows], dtype=torch.int64, device=device)
    pos = ctx - 1
    slots = torch.tensor([p[(n - 1) // PAGE] * PAGE + (n - 1) % PAGE for _, n, p in rows], dtype=torch.int64,
                         device=device)  # fmt: skip
    ids = torch.tensor([t for t, *_ in rows], dtype=torch.int64, device=device)
    cu = torch.arange(len(rows) + 1, dtype=torch.int64, device=device)
    return ids, pos, AttentionMetadata(cu_seqlens=cu, slot_mapping=slots, block_tables=tables, context_lens=ctx)


def forms(model, kv, rows, delays_us: list[int], device: torch.device) -> dict:
    """Each form as a function that runs it and returns the hidden rows in batch order (inputs made here, one set
    per form, as each is captured once)."""
    half = len(rows) // 2

    def full():
        ids, pos, meta = step_inputs(rows, device)
        return lambda: model(ids, pos, meta, kv)

    def halves():
        a, b = step_inputs(rows[:half], device), step_inputs(rows[half:], device)
        return lambda: torch.cat([model(*a, kv), model(*b, kv)])

    def streams(delay_us: int):
        a, b = step_inputs(rows[:half], device), step_inputs(rows[half:], device)
        side = torch.cuda.Stream(device) if device.type == "cuda" else None
        cycles = int(delay_us * torch.cuda.clock_rate(device) * 1e-3) if device.type == "cuda" and delay_us else 0

        def run():
            if side is None:
                return torch.cat([model(*a, kv), model(*b, kv)])
            main = torch.cuda.current_stream(device)
            side.wait_stream(main)
            out_a = model(*a, kv)
            with torch.cuda.stream(side):
                if cycles:
                    torch.cuda._sleep(cycles)
                out_b = model(*b, kv)
            main.wait_stream(side)
            return torch.cat([out_a, out_b])

        return run

    out = {"full": full(), "halves": halves(), "streams": streams(0)}
    for d in delays_us:
        out[f"streams+{d}"] = streams(d)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="1.7b", choices=[s for s, (f, _) in throughput.SHAPES.items() if f == "qwen3"])
    ap.add_argument("--layers", type=int, default=None, help="layers (default: the shape's own)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=1088, help="mean context length of a row")
    ap.add_argument("--delays-us", default="100,250,500", help="spins before the second stream, microseconds")
    ap.add_argument("--replays", type=int, default=20)
    args = ap.parse_args(argv)
    if args.batch < 2 or args.context < 2:
        ap.error(f"--batch and --context must be >= 2, got {args.batch}, {args.context}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    delays = [int(d) for d in args.delays_us.split(",") if d]
    model, kv, rows = build(args.shape, args.layers, args.batch, args.context, device)
    print(f"{args.shape}, {model.config.num_hidden_layers} layers, batch {args.batch}, contexts "
          f"{min(n for _, n, _ in rows)}-{max(n for _, n, _ in rows)} (mean {args.context}), "
          f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}")  # fmt: skip
    with torch.no_grad():
        runs = forms(model, kv, rows, delays, device)
        if device.type != "cuda":  # a smoke of the inputs and the bits on CPU
            ref = runs.pop("full")()
            for name, run in runs.items():
                print(f"{name}: rows equal full's: {torch.equal(run(), ref)}")
            return 0
        from vexact_kernels.triton_ops.matmul_tuning import graph_time  # (ms per replay, output) of a CUDA graph

        results = {name: graph_time(run, args.replays, warmups=2) for name, run in runs.items()}
    base, ref = results["full"]
    print("\n| form | ms per step | / full | rows == full's |\n| --- | --- | --- | --- |")
    for name, (ms, out) in results.items():
        print(f"| {name} | {ms:.3f} | {ms / base:.3f} | {'yes' if torch.equal(out, ref) else 'NO'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
