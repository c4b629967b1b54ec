#!/usr/bin/env bash
# Prefix caching and the fp32 matmul precision on the GPU machine, one step (or several) per call:
#   source scripts/device_env.sh && bash scripts/prefix_gpu.sh <h100|h200> <step>...
# Steps:
#   kernels    GPU tests of the matmul (fp32 precision test included), fused-MoE and logprobs kernels, whose tl.dot
#              now names its input precision: $OUT/kernels-<target>.log
#   contracts  the engine GPU contracts (GRPO groups with prefix caching on == off == trainer, sleep/wake and weight
#              updates with the cache on) and the golden fixtures (bf16 numerics unchanged): $OUT/contracts-<target>.log
#   bench      benchmarks/throughput.py --grpo-only (n = 8 samples of 32 prompts of 512-2048 tokens, caching on/off):
#              $OUT/throughput-grpo-<target>.md
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
    kernels)
      python3 -m pytest -q -p no:xdist -m gpu packages/vexact-kernels/tests/test_triton_matmul.py \
        packages/vexact-kernels/tests/test_triton_moe.py packages/vexact-kernels/tests/test_triton_logprobs.py -rs \
        2>&1 | tee "$OUT/kernels-$TARGET.log" || status=1 ;;
    contracts)
      python3 -m pytest -q -p no:xdist contracts/test_engine_gpu.py contracts/test_golden.py --target "$TARGET" -rs \
        -k "prefix or sleep_wake_and_update or across_settings or golden" 2>&1 | tee "$OUT/contracts-$TARGET.log" \
        || status=1 ;;
    bench)
      python3 benchmarks/throughput.py --grpo-only --modes invariant,fast --out "$OUT/throughput-grpo-$TARGET.md" \
        2>&1 | grep -v "it/s\]" | tee "$OUT/bench-$TARGET.log" || status=1 ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
exit $status
