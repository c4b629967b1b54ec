"""TIM diagnostics on one GPU (run from the repo root after ``source scripts/staging/device_env.sh``; writes under
$OUT).

1. a random-weight Qwen3 (``--preset``: hidden 1024, 8 layers by default) as a checkpoint;
2. rollouts of it with our engine on the ``fast`` backend (cuBLAS/SDPA: today's baseline) and on ``invariant``,
   written in the ``vexact`` layout;
3. ``vexact tim rescore`` of each with the invariant trainer on the GPU (``--expect-exact`` on the invariant ones);
4. ``vexact tim attribute`` (engine mode): the fast kernel of one op family at a time.

Files under $OUT (at most 8 come back): fast/report.html (PNGs embedded), fast/summary.json,
invariant/summary.json, attribution.json, attribution.png, log lines on stdout.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

PRESETS = {
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=32),
    "medium": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=16,
                   num_key_value_heads=8, head_dim=64),
}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="medium", choices=sorted(PRESETS))
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/tim_gpu"))
    args = ap.parse_args()
    import torch

    from vexact.cli import main as cli
    from vexact_engine import LLM, SamplingParams
    from vexact_models import make_tiny_checkpoint, tiny_qwen3_config
    from vexact_trainer import rollouts_from_outputs, rollouts_to_jsonl

    out = Path(args.out)
    work = Path("/tmp/tim_gpu_work")
    ckpt = make_tiny_checkpoint(work / args.preset, tiny_qwen3_config(**PRESETS[args.preset]), seed=0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (int(torch.randint(8, 64, (1,), generator=g)),), generator=g).tolist()
               for _ in range(args.prompts)]  # fmt: skip
    params = [SamplingParams(temperature=1.0, max_tokens=args.max_tokens, seed=i) for i in range(args.prompts)]
    rc = {}
    for backend in ("fast", "invariant"):
        llm = LLM(ckpt, backend=backend, device="cuda", max_num_seqs=min(args.prompts, 128))
        outs = llm.generate(prompts, params)
        path = work / f"{backend}.jsonl"
        rollouts_to_jsonl(rollouts_from_outputs(outs, 1.0), path)
        del llm
        torch.cuda.empty_cache()
        flags = ["--expect-exact"] if backend == "invariant" else []
        rc[backend] = cli(["tim", "rescore", str(path), "--model", str(ckpt), "--device", "cuda", "--out",
                           str(out / backend), *flags])  # fmt: skip
        print(f"vexact tim rescore ({backend} rollouts): exit {rc[backend]}", flush=True)
    for png in out.glob("*/*.png"):
        png.unlink()  # report.html embeds them already: the results folder keeps one copy
    (out / "invariant" / "report.html").unlink()
    rc["attribute"] = cli(["tim", "attribute", "--model", str(ckpt), "--device", "cuda", "--prompts", "64",
                           "--prompt-len", "64", "--max-tokens", "64", "--out", str(out)])  # fmt: skip
    print(f"exit codes: {rc} (expected fast 0, invariant 0 under --expect-exact, attribute 0)")
    return 0 if rc == {"fast": 0, "invariant": 0, "attribute": 0} else 1


if __name__ == "__main__":
    sys.exit(main())
