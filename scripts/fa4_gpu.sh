#!/usr/bin/env bash
# FlashAttention 4 checks on the GPU machine, after its wheels are installed (scripts/fa4_device_wheels.sh stage /
# install, in the same warm machine) and `source scripts/device_env.sh`. One step or several per call:
#   bash scripts/fa4_gpu.sh <h100|h200> <step>...
# Steps (logs and results into $OUT; the device tool brings back at most 8 files, two folders deep):
#   probe      scripts/fa4_probe.py -> $OUT/fa4-probe.txt
#   kernels    packages/vexact-kernels/tests/test_fa4_attention.py -m gpu -> $OUT/fa4-kernels-<target>.log
#   contracts  the contract suite with VEXACT_ATTENTION=fa4 -> $OUT/fa4-contracts-<target>.log (the golden test skips
#              until fixtures/<target>-fa4 is recorded: step `golden`)
#   golden     record contracts/fixtures/<target>-fa4/{qwen3,qwen3_moe} and copy them to $OUT/golden-fa4-<family>/
#   bench      benchmarks/attention.py (ours, FA4, SDPA default, SDPA flash) -> $OUT/attention-<target>.md
set -uo pipefail
cd "$(dirname "$0")/.."
TARGET=${1:?target: h100 | h200}
shift
OUT=${OUT:-/tmp/vexact-out}
mkdir -p "$OUT"
# FA4 compiles each kernel variant on first use (5-25 s each, seen cross-compiling on CPU); keep the compiled kernels
# on disk so later steps and calls on the same warm machine reuse them (FA4's own cache, keyed by its source)
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4-jit-cache
status=0
for step in "$@"; do
  echo "=== $step ($TARGET) $(date +%T)"
  case "$step" in
    probe)
      python3 scripts/fa4_probe.py 2>&1 | tee "$OUT/fa4-probe.txt" || status=1 ;;
    kernels)
      python3 -m pytest -q -p no:xdist -m gpu -rs packages/vexact-kernels/tests/test_fa4_attention.py 2>&1 \
        | tee "$OUT/fa4-kernels-$TARGET.log" || status=1 ;;
    contracts)
      VEXACT_ATTENTION=fa4 python3 -m pytest -q -p no:xdist contracts --target "$TARGET" -rs 2>&1 \
        | tee "$OUT/fa4-contracts-$TARGET.log" || status=1 ;;
    golden)
      VEXACT_ATTENTION=fa4 python3 -m contracts.golden --target "$TARGET" || status=1
      for fam in qwen3 qwen3_moe; do
        mkdir -p "$OUT/golden-fa4-$fam"
        cp "contracts/fixtures/$TARGET-fa4/$fam/"golden.* "$OUT/golden-fa4-$fam/"
      done ;;
    bench)
      python3 benchmarks/attention.py --out "$OUT/attention-$TARGET.md" || status=1 ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
exit $status
