"""Roll out a checkpoint with vLLM's offline API and write the rows ``vexact tim rescore --layout vllm`` reads.

Run on the GPU machine where vLLM is installed (untested here: vLLM is not installed on the CPU machine; on the GPU
machine ``scripts/checks/gpu_checks.sh <target> tim-vllm`` runs both modes on the checkpoint ``bench-throughput``
saved):

    python scripts/checks/tim_vllm_rollouts.py CKPT $OUT/vllm.jsonl [--batch-invariant]
    python -m vexact tim rescore $OUT/vllm.jsonl --model CKPT --layout vllm --device cuda --out $OUT/vllm

``logprobs_mode="processed_logprobs"`` makes vLLM report logprobs after temperature (as verl runs it; vLLM's default
``raw_logprobs`` is before it: then pass ``--vllm-logprobs-mode raw``). ``--batch-invariant`` sets
``VLLM_BATCH_INVARIANT=1`` (vLLM's batch-invariant kernels) before vLLM is imported. ``--make-checkpoint 1.7b``
writes the random-weights checkpoint of that shape first when CKPT has none (as ``bench-throughput`` saves it), so
this step does not wait for the peer table; ``--gpu-memory-utilization`` lowers vLLM's share when the GPU is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--batch-invariant", action="store_true")
    ap.add_argument("--make-checkpoint", metavar="SHAPE", help="benchmarks/throughput.py shape to write if missing")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    args = ap.parse_args()
    if args.make_checkpoint and not (Path(args.checkpoint) / "config.json").exists():
        make_checkpoint(args.make_checkpoint, args.checkpoint)
    if args.batch_invariant:
        os.environ["VLLM_BATCH_INVARIANT"] = "1"
    import random

    from vllm import LLM, SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(8, 64))] for _ in range(args.prompts)]
    # token ids in and out (the checkpoints benchmarks/peers.py saves have no tokenizer), as peers.py runs vLLM
    llm = LLM(model=args.checkpoint, logprobs_mode="processed_logprobs", enable_prefix_caching=False, seed=0,
              skip_tokenizer_init=True, dtype="bfloat16",
              gpu_memory_utilization=args.gpu_memory_utilization)  # fmt: skip
    params = [
        SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=i, logprobs=1, detokenize=False)
        for i in range(args.prompts)
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    with open(args.out, "w") as f:
        for o in outs:
            row = {
                "prompt_token_ids": list(o.prompt_token_ids),
                "temperature": args.temperature,
                "outputs": [
                    {
                        "token_ids": list(c.token_ids),
                        "logprobs": [
                            {str(t): {"logprob": lp.logprob, "rank": lp.rank} for t, lp in d.items()}
                            for d in c.logprobs
                        ],
                    }
                    for c in o.outputs
                ],
            }
            f.write(json.dumps(row) + "\n")


def make_checkpoint(shape: str, path: str) -> None:
    """The random-weights HF checkpoint of ``shape`` (benchmarks/throughput.py's weights for that shape and seed)."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import peers
    import throughput

    model = throughput.make_model(shape, None)
    peers.save_hf_checkpoint(model, path)
    del model
    torch.cuda.empty_cache()
    print(f"wrote {path} ({shape})")


if __name__ == "__main__":
    main()
