#!/usr/bin/env bash
# The FSDP trainer's GPU checks and benchmark, on the GPU machine:
#   source scripts/staging/device_env.sh && bash scripts/checks/trainer_gpu.sh [h100|h200]
# 1. fsdp_check at world size 1 (Qwen3-0.6B-shaped, tied embeddings): FSDP == unsharded == engine through updates;
# 2. the same with activation checkpointing;
# 3. world size 2 when two GPUs are visible (uneven split, micro-batches): == world size 1, == engine;
# 4. benchmarks/trainer.py (Qwen3-1.7B shape): invariant / fast tokens/s -> benchmarks/results/trainer-<target>.md.
# Each check prints one JSON line with "ok": true|false and exits non-zero on failure.
set -euo pipefail
cd "$(dirname "$0")/../.."
TARGET=${1:-h100}
CHECK_DIR=${VEXACT_FSDP_DIR:-/tmp/vexact-fsdp}  # not $OUT: a results folder, kept small
rm -rf "$CHECK_DIR" "$CHECK_DIR-ac"
RUN="python3 -m torch.distributed.run --standalone"
$RUN --nproc_per_node=1 -m contracts.fsdp_check --model qwen3-0.6b --device cuda --out "$CHECK_DIR"
$RUN --nproc_per_node=1 -m contracts.fsdp_check --model qwen3-0.6b --device cuda --out "$CHECK_DIR-ac" \
  --activation-checkpointing
if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  $RUN --nproc_per_node=2 -m contracts.fsdp_check --model qwen3-0.6b --device cuda --out "$CHECK_DIR" \
    --micro-batch-tokens 256
else
  echo "one GPU visible: world size 2 skipped (run on a machine with two GPUs)"
fi
$RUN --nproc_per_node=1 benchmarks/trainer.py --out "benchmarks/results/trainer-$TARGET.md"
