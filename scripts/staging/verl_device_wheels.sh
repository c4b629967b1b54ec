#!/usr/bin/env bash
# verl 0.9.1 + Ray for an air-gapped GPU machine. Three verbs:
#
#   here (a machine with internet), in the repo root:
#     bash scripts/staging/verl_device_wheels.sh download   # wheels for Linux x86_64 / CPython 3.12 into .whl-verl/, files
#                                                   # over a bundle cut into pieces, grouped into bundles b1, b2, ...
#                                                   # of at most BUNDLE_MIB each (the packing is
#                                                   # scripts/staging/wheel_parts.py's); prints the plan
#   on the GPU machine, once per bundle copied to .whl-verl/bN (/tmp keeps the earlier bundles):
#     bash scripts/staging/verl_device_wheels.sh stage      # copy the bundle(s) in .whl-verl/ to /tmp/verl-wheels
#   on the GPU machine, once the last bundle is staged:
#     bash scripts/staging/verl_device_wheels.sh install    # join cut wheels (sha256 checked), pip install into /tmp/site (no index, no deps)
#     export PYTHONPATH=/tmp/site:$PYTHONPATH       # then `source scripts/staging/device_env.sh` for the repo's own paths
#
# What is staged: verl, Ray and every package in their dependency closure (verl's install_requires, ray[default],
# transformers 5.9.0's, and the modules verl's default trainer imports beyond those: TransferQueue, pyzmq, msgspec,
# fastapi, uvicorn, cachetools; see packages/vexact-verl/pyproject.toml) that the GPU machine's image does not have, plus the two the image has at versions verl cannot use:
# transformers (image: 5.17; verl 0.9.1 needs <5.11, we pin 5.9.0) and tokenizers (image: 0.23.2; transformers
# 5.9.0 needs <=0.23.0). cupy-cuda13x (with cuda-pathfinder, which finds the image's CUDA 13 libraries) for verl's
# nccl checkpoint engine, which separate_async uses to sync weights. veomni 0.1.12 (model_engine=veomni, 1.9 MB) is installed like every wheel here, with no
# deps: its pins (datasets<=2.21, a CUDA torch via timm) are not what verl's path imports (requirements/veomni.txt).
# Versions are the ones the CPU CI installs (requirements/test.txt, requirements/veomni.txt), so both run the same
# code. The list was computed from the installed closure minus the image's package list (the comments of
# scripts/staging/rl_stack_wheels.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=.whl-verl
STAGE=/tmp/verl-wheels
BUNDLE_MIB=${BUNDLE_MIB:-52}  # bundles a size-limited copy channel takes one at a time

WHEELS=(
  verl==0.9.1 ray==2.60.0 transformers==5.9.0 tokenizers==0.22.2 tensordict==0.10.0 torchdata==0.11.0
  hydra-core==1.3.8 omegaconf==2.3.1 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
  codetiming==1.4.0 pylatexenc==2.11 wandb==0.31.0 pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0
  typing-inspection==0.4.5 orjson==3.13.0 pyvers==0.1.0 importlib-metadata==10.2.0 jsonschema==4.26.0
  jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 aiohttp-cors==0.8.1 colorful==0.5.8
  opencensus==0.11.4 opencensus-context==0.1.3 google-api-core==2.44.0 google-auth==2.62.2
  googleapis-common-protos==1.76.0 proto-plus==1.29.0 pyasn1==0.6.5 pyasn1-modules==0.4.2 cryptography==50.0.2
  cffi==2.1.1 pycparser==3.12 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2
  opentelemetry-semantic-conventions==0.66b2 opentelemetry-proto==1.45.2 opentelemetry-exporter-prometheus==0.66b2
  opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-otlp-proto-http==1.45.2
  opentelemetry-exporter-http-transport==0.66b2 opentelemetry-exporter-otlp-common==0.66b2 smart-open==9.0.2
  py-spy==0.4.3 virtualenv==21.14.5 distlib==0.4.4 platformdirs==4.14.7 python-discovery==1.9.5 distro==1.9.0
  sniffio==1.3.1 tzdata==2026.6 lazy-importer==0.1.0 cwevals==0.0.1b1
  transferqueue==0.1.11 pyzmq==27.3.0 msgspec==0.22.0 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0
  cachetools==8.0.1
  veomni==0.1.12
  cupy-cuda13x==14.2.0 cuda-pathfinder==1.9.1
)
# Published as a source archive only (omegaconf 2.3 needs antlr4 4.9.*): built here into a pure-Python wheel.
SDIST_ONLY=(antlr4-python3-runtime==4.9.3)

fetch() {  # the wheels, whole, into $1 (scripts/staging/rl_stack_wheels.sh packs them with vLLM's and FA4's)
  mkdir -p "$1"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    --platform manylinux_2_5_x86_64 --platform any -d "$1" "${WHEELS[@]}"
  python3 -m pip wheel -q --no-deps -w "$1" "${SDIST_ONLY[@]}"
}

download() {
  grep -qx "/$DIR/" .git/info/exclude 2>/dev/null || echo "/$DIR/" >> .git/info/exclude
  rm -rf "$DIR" && fetch "$DIR/all"
  # bundles b1, b2, ... of at most BUNDLE_MIB (Ray cut into pieces), each with the MANIFEST `install` checks
  python3 scripts/staging/wheel_parts.py pack "$DIR" "$BUNDLE_MIB" b
  n=$(ls -d "$DIR"/b* | wc -l)
  echo
  echo "copy plan: $n bundles, staged one at a time on the GPU machine:"
  for i in $(seq 1 "$n"); do
    if [ "$i" -lt "$n" ]; then
      echo "  step $i: copy $DIR/b$i, then: bash scripts/staging/verl_device_wheels.sh stage"
    else
      echo "  step $i: copy $DIR/b$i, then: bash scripts/staging/verl_device_wheels.sh stage && \\"
      echo "          bash scripts/staging/verl_device_wheels.sh install && export PYTHONPATH=/tmp/site:\$PYTHONPATH && ..."
    fi
  done
  echo "(/tmp/verl-wheels and /tmp/site live in /tmp: stage every bundle before the machine restarts)"
}

stage() {
  mkdir -p "$STAGE"
  compgen -G "$DIR/b*/*" > /dev/null || { echo "no bundle under $DIR/" >&2; exit 1; }
  cp "$DIR"/b*/* "$STAGE"/
  echo "staged: $(ls "$STAGE" | wc -l) files in $STAGE"
}

install() {
  python3 scripts/staging/wheel_parts.py join "$STAGE" || { echo "stage every bundle first (see the copy plan)" >&2; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$STAGE"/*.whl
  check
}

check() {
  # conflicts with the image's own packages show here (not fatal: --no-deps installs cannot see them otherwise)
  PYTHONPATH=/tmp/site python3 -m pip check || true
  # the modules verl's default trainer path imports (a missing one fails here, not an hour into a run)
  PYTHONPATH=/tmp/site python3 -c "import verl, ray, transformers, tokenizers, torch
import verl.trainer.main_ppo, verl.trainer.ppo.v1, verl.workers.engine_workers, verl.experimental.agent_loop
print('verl', verl.__version__, 'ray', ray.__version__, 'transformers', transformers.__version__, 'tokenizers',
      tokenizers.__version__, 'torch', torch.__version__)"
  # model_engine=veomni (ENGINE=veomni in verl_gpu.sh): reported, not fatal, so the other runs do not depend on it
  PYTHONPATH=/tmp/site python3 -c "import veomni, verl.workers.engine.veomni; print('veomni', veomni.__version__)" \
    2>&1 | tail -1 || true
  # verl's nccl checkpoint engine (separate_async: scripts/checks/async_gpu.sh) imports cupy and its NCCL binding,
  # which finds libnccl in the image's nvidia packages: reported, not fatal
  PYTHONPATH=/tmp/site python3 -c "import cupy, cupy.cuda.nccl, verl.checkpoint_engine.nccl_checkpoint_engine
print('cupy', cupy.__version__, 'nccl', cupy.cuda.nccl.get_version())" 2>&1 | tail -1 || true
}

case "${1:-}" in
  download) download ;;
  fetch) fetch "${2:?usage: $0 fetch DIR}" ;;
  check) check ;;
  stage) stage ;;
  install) install ;;
  *) echo "usage: $0 download|stage|install|fetch DIR|check" >&2; exit 2 ;;
esac
