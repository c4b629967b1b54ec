#!/usr/bin/env bash
# The GPU checks of the dense families beyond Qwen3 (Llama, Qwen2, Mistral), on the GPU machine:
#   source scripts/device_env.sh && bash scripts/dense_gpu.sh <h100|h200> <step>...
# Steps:
#   golden     record contracts/fixtures/<target>/{qwen2,llama,mistral} and copy them to $OUT/golden-<family>/
#   contracts  the contracts of those families on the target (tiny models; Llama-3.2-1B, Qwen2.5-7B and Mistral-7B
#              layer shapes on the GPU engine contract), log in $OUT/dense-contracts-<target>.log
# Results land in $OUT (7 files: the device tool brings back at most 8, two folders deep).
set -uo pipefail
cd "$(dirname "$0")/.."
TARGET=${1:?target: h100 | h200}
shift
OUT=${OUT:-/tmp/vexact-out}
mkdir -p "$OUT"
FAMILIES=(qwen2 llama mistral)
status=0
for step in "$@"; do
  echo "=== $step ($TARGET) $(date +%T)"
  case "$step" in
    golden)
      for fam in "${FAMILIES[@]}"; do
        python3 -m contracts.golden --target "$TARGET" --family "$fam" || status=1
        mkdir -p "$OUT/golden-$fam"
        cp "contracts/fixtures/$TARGET/$fam/"golden.* "$OUT/golden-$fam/"
      done ;;
    contracts)
      python3 -m pytest -q -p no:xdist contracts --target "$TARGET" -rs -k "llama or qwen2 or mistral" 2>&1 \
        | tee "$OUT/dense-contracts-$TARGET.log" || status=1 ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
exit $status
