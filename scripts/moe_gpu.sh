#!/usr/bin/env bash
# The Qwen3-MoE GPU checks, on the GPU machine, one step (or several) per call:
#   source scripts/device_env.sh && bash scripts/moe_gpu.sh <h100|h200> <step>... 
# Steps:
#   golden     record contracts/fixtures/<target>/{qwen3,qwen3_moe} (after a version bump) and copy them to $OUT
#   kernels    the fused-MoE kernel's GPU tests (invariance at the Qwen3-30B-A3B layer shape, tile configs, CUDA graph)
#   contracts  the whole contract suite for the target (MoE included), log in $OUT/contracts-<target>.log
#   bench      benchmarks/moe.py -> $OUT/moe-<target>.md
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
    golden)
      python3 -m contracts.golden --target "$TARGET" || status=1
      for fam in qwen3 qwen3_moe; do
        mkdir -p "$OUT/golden-$fam"
        cp "contracts/fixtures/$TARGET/$fam/"golden.* "$OUT/golden-$fam/"
      done ;;
    kernels)
      python3 -m pytest -q -p no:xdist -m gpu packages/vexact-kernels/tests/test_triton_moe.py \
        packages/vexact-kernels/tests/test_moe.py 2>&1 | tee "$OUT/kernels-$TARGET.log" || status=1 ;;
    contracts)
      python3 -m pytest -q -p no:xdist contracts --target "$TARGET" -rs 2>&1 | tee "$OUT/contracts-$TARGET.log" \
        || status=1 ;;
    bench)
      python3 benchmarks/moe.py --out "$OUT/moe-$TARGET.md" 2>&1 | tee "$OUT/bench-$TARGET.log" || status=1 ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
exit $status
