#!/usr/bin/env bash
# FlashAttention 4 (flash-attn-4, CuTe DSL) for an air-gapped GPU machine. Three verbs:
#
#   here (a machine with internet), in the repo root:
#     bash scripts/staging/fa4_device_wheels.sh download   # wheels for Linux x86_64 / CPython 3.12 into .whl-fa4/p1, p2, ...
#                                                  # (each part <= PART_MIB; a wheel over that is cut into pieces by
#                                                  # scripts/staging/wheel_parts.py and joined back by `install`); prints the
#                                                  # copy plan
#   on the GPU machine, once per part copied to .whl-fa4/pN (/tmp keeps the earlier parts):
#     bash scripts/staging/fa4_device_wheels.sh stage      # copy the part(s) in .whl-fa4/ to /tmp/fa4parts
#   on the GPU machine, once the last part is staged:
#     bash scripts/staging/fa4_device_wheels.sh install    # join cut wheels (sha256 checked), pip install --target /tmp/fa4site (no index,
#                                                  # no deps), then check that flash_attn.cute imports
#     source scripts/staging/device_env.sh                 # puts /tmp/fa4site and the DSL's dsl_packages on PYTHONPATH
#
# What is staged: flash-attn-4 and the runtime packages it needs that the GPU machine's image lacks (the image's
# list is in the comments of scripts/staging/rl_stack_wheels.sh). The image has torch 2.11+cu130, einops, typing-extensions, protobuf,
# packaging and cuda-bindings; it lacks the CuTe DSL (nvidia-cutlass-dsl: the meta package, libs-base = the Python
# DSL and MLIR bindings, libs-core, libs-cu13 = the CUDA 13 runtime libraries), quack-kernels (FA4 imports its
# helpers), apache-tvm-ffi and torch-c-dlpack-ext. The cu12 libs that nvidia-cutlass-dsl names unconditionally are
# not staged: the machine is CUDA 13 and the DSL looks for cu13/lib as well as cu12/lib.
# A `--target` install does not run .pth files, so nvidia_cutlass_dsl_packages.pth (it puts
# nvidia_cutlass_dsl/dsl_packages on sys.path, where the `cutlass` package lives) is replaced by device_env.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=${FA4_WHL_DIR:-.whl-fa4}
STAGE=/tmp/fa4parts
SITE=/tmp/fa4site
PART_MIB=${PART_MIB:-56}  # parts of a size that a slow or size-limited copy channel takes one at a time

WHEELS=(
  flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
  nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5
  apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5
)

fetch() {  # the wheels, whole, into $1 (scripts/staging/rl_stack_wheels.sh packs them with verl's and vLLM's)
  mkdir -p "$1"
  python3 -m pip download -q --no-deps --pre --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$1" "${WHEELS[@]}"
}

download() {
  rm -rf "$DIR" && fetch "$DIR/all"
  # parts p1, p2, ... of at most PART_MIB (the CUDA 13 libs cut into pieces), each with the MANIFEST `install` checks
  python3 scripts/staging/wheel_parts.py pack "$DIR" "$PART_MIB" p
  n=$(ls -d "$DIR"/p* | wc -l)
  echo
  echo "copy plan: $n parts, staged one at a time on the GPU machine (/tmp keeps the earlier ones):"
  for i in $(seq 1 "$n"); do
    if [ "$i" -lt "$n" ]; then
      echo "  step $i: copy $(basename "$DIR")/p$i, then: bash scripts/staging/fa4_device_wheels.sh stage"
    else
      echo "  step $i: copy $(basename "$DIR")/p$i, then: bash scripts/staging/fa4_device_wheels.sh stage && \\"
      echo "          bash scripts/staging/fa4_device_wheels.sh install && source scripts/staging/device_env.sh && ..."
    fi
  done
}

stage() {
  mkdir -p "$STAGE"
  compgen -G "$DIR/p*/*" > /dev/null || { echo "no part under $DIR/" >&2; exit 1; }
  for part in "$DIR"/p*/; do cp "$part"* "$STAGE"/; done  # one cp per part: every part holds the same MANIFEST
  echo "staged: $(ls "$STAGE" | wc -l) files in $STAGE: $(ls "$STAGE" | tr '\n' ' ')"
}

install() {
  python3 scripts/staging/wheel_parts.py join "$STAGE" \
    || { echo "stage every part first (see the copy plan of 'download')" >&2; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$STAGE"/*.whl
  check
}

check() {
  PYTHONPATH="$SITE/nvidia_cutlass_dsl/dsl_packages:$SITE${PYTHONPATH:+:$PYTHONPATH}" python3 -c "
import torch, cutlass, flash_attn.cute.interface as fi
print('fa4 installed:', fi.__file__, 'cutlass', getattr(cutlass, '__version__', '?'), 'torch', torch.__version__)"
}

case "${1:-}" in
  download) download ;;
  fetch) fetch "${2:?usage: $0 fetch DIR}" ;;
  check) check ;;
  stage) stage ;;
  install) install ;;
  *) echo "usage: $0 download|stage|install|fetch DIR|check" >&2; exit 2 ;;
esac
