#!/usr/bin/env bash
# The DeepSeek-V3 / Moonlight GPU checks, on the GPU machine, one step (or several) per call:
#   source scripts/device_env.sh && bash scripts/deepseek_gpu.sh <h100|h200> <step>...
# Steps:
#   golden     record contracts/fixtures/<target>/deepseek_v3 and copy it to $OUT/golden-deepseek_v3
#   contracts  the contract suite's deepseek_v3 cases for the target (Moonlight-16B-A3B-shaped engine contracts:
#              chunked prefill, preemption, CUDA graphs on/off, alone == in a batch of 64, sleep/wake, update_weights;
#              HF parity bf16 + greedy; model invariance; FSDP ws1), log in $OUT/ds-contracts-<target>.log
#   bench      benchmarks/mla.py at the Moonlight and DeepSeek-V3 layer shapes -> $OUT/mla-<target>.md, mla-v3-<target>.md
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
      python3 -m contracts.golden --target "$TARGET" --family deepseek_v3 || status=1
      mkdir -p "$OUT/golden-deepseek_v3"
      cp "contracts/fixtures/$TARGET/deepseek_v3/"golden.* "$OUT/golden-deepseek_v3/" ;;
    contracts)
      python3 -m pytest -q -p no:xdist contracts --target "$TARGET" -rs -k "deepseek or moonlight" 2>&1 \
        | tee "$OUT/ds-contracts-$TARGET.log" || status=1 ;;
    bench)
      python3 benchmarks/mla.py --out "$OUT/mla-$TARGET.md" 2>&1 | tee "$OUT/mla-bench-$TARGET.log" || status=1
      python3 benchmarks/mla.py --shape deepseek-v3 --out "$OUT/mla-v3-$TARGET.md" || status=1 ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
exit $status
