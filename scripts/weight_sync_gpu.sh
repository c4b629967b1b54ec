#!/usr/bin/env bash
# Weight sync on the GPU machine (issue 18), one step or several per call:
#   source scripts/device_env.sh && bash scripts/weight_sync_gpu.sh <h100|h200> <step>...
# Steps:
#   tests   the weight sync contract on CUDA (host and packed paths in one process; CUDA IPC between two processes on
#           one GPU, awake and after sleep(2)/wake/sync, dense and MoE) and the models/engine unit tests on CUDA
#   verl    the verl rollout GPU test (ServerAdapter -> CUDA IPC); needs verl + Ray wheels (scripts/verl_device_wheels.sh)
#   bench   benchmarks/weight_sync.py (old host path, CUDA IPC, copy bound; 1.7B, 8B, 30B-A3B if it fits twice)
#   nccl    the separate-placement benchmark on two GPUs (torchrun --nproc_per_node 2; needs a 2-GPU machine)
# Results land in $OUT (the device tool brings back at most 8 files, two folders deep).
set -uo pipefail
cd "$(dirname "$0")/.."
TARGET=${1:?target: h100 | h200}
shift
OUT=${OUT:-/tmp/vexact-out}
mkdir -p "$OUT"
status=0
for step in "$@"; do
  echo "=== $step ($TARGET) $(date +%T)"
  case "$step" in
    tests)
      python3 -m pytest -q -p no:xdist contracts/test_weight_sync.py --target "$TARGET" -rs \
        packages/vexact-models/tests/test_weight_transfer.py packages/vexact-engine/tests/test_weight_sync.py \
        2>&1 | tee "$OUT/weight-sync-tests-$TARGET.log" || status=1 ;;
    verl)
      python3 -m pytest -q -p no:xdist packages/vexact-verl/tests/test_verl_rollout_gpu.py -rs 2>&1 \
        | tee "$OUT/weight-sync-verl-$TARGET.log" || status=1 ;;
    bench)
      python3 benchmarks/weight_sync.py --out "$OUT/weight-sync-$TARGET.md" 2>&1 \
        | tee "$OUT/weight-sync-bench-$TARGET.log" || status=1 ;;
    nccl)
      torchrun --standalone --nproc_per_node 2 benchmarks/weight_sync.py --mode nccl \
        --out "$OUT/weight-sync-nccl-$TARGET.md" 2>&1 | tee "$OUT/weight-sync-nccl-$TARGET.log" || status=1 ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
exit $status
