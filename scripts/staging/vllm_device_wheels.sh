#!/usr/bin/env bash
# vLLM 0.24.0 for an air-gapped GPU machine: the version verl 0.9.1's `vllm` extra pins (built against torch 2.11: its
# METADATA says torch==2.11.0, the GPU machines' torch), with what verl's vLLM rollout imports. It serves verl's
# default stack (examples/verify/run_pair.sh, arm `vllm`) and the peer columns of benchmarks/throughput.py.
#
#   on a machine with internet, in the repo root:
#     bash scripts/staging/vllm_device_wheels.sh download  # wheels for CPython 3.12 / manylinux x86_64 into .whl-vllm/p1,
#                                                  # p2, ... (each <= PART_MIB; scripts/staging/wheel_parts.py)
#   on the GPU machine, with the parts copied into .whl-vllm/ (all at once, or one part at a time while /tmp survives):
#     bash scripts/staging/vllm_device_wheels.sh install   # copies the parts to /tmp/vllmparts; once every file of MANIFEST
#                                                  # is there: re-joins cut wheels, checks sha256, installs into
#                                                  # /tmp/vllmsite (--no-index --no-deps), imports verl's rollout
#   then: export PYTHONPATH=/tmp/vllmsite:$PYTHONPATH, in front of verl's /tmp/site (fastapi: vLLM needs < 0.137).
#   scripts/staging/rl_stack_wheels.sh stages these together with verl's and FA4's wheels.
#
# What is staged: the vLLM wheel and the packages its server path imports that the GPU image lacks (the image's
# list is in the comments of scripts/staging/rl_stack_wheels.sh), found by importing verl's vLLM rollout
# (verl.workers.rollout.vllm_rollout.vllm_async_server: vllm.entrypoints.openai.api_server, cli.serve, AsyncLLM,
# the v1 engine core, GPU worker and model runner, Qwen3 / Qwen3-MoE, FlashAttention, fused MoE) with nothing else
# on the path: the OpenAI-compatible server (fastapi < 0.137, starlette, uvicorn, prometheus-fastapi-instrumentator,
# python-multipart, email-validator, watchfiles), the request types (openai, openai-harmony, anthropic,
# partial-json-parser, mistral_common), structured output (xgrammar 0.2.7 with vLLM's apache-tvm-ffi 0.1.9: xgrammar
# 0.2.8 needs a newer tvm-ffi; llguidance, outlines_core, lark, lm-format-enforcer, diskcache), serialisation and
# hashing (cbor2, pybase64, msgspec, pyzmq, blake3), compressed-tensors, depyf, opentelemetry's AI conventions.
# openai is 2.30 (3.x needs httpx2, which the stack does not have). pydantic comes from verl's wheels.
#
# Left out (Requires-Dist of vLLM that this path does not import on Hopper bf16): flashinfer-python/-cubin,
# tilelang, nvidia-cutlass-dsl, quack-kernels, tokenspeed-mla, humming-kernels, nvidia-cudnn-frontend,
# fastsafetensors (kernels and loaders chosen only when asked for, or on other GPUs; VLLM_USE_FLASHINFER_SAMPLER=0
# keeps the sampler off flashinfer), mcp and the API-server extras verl does not start (fastapi-cli, rich-toolkit).
# From the vLLM wheel itself (279 MiB -> about 180 MiB): vllm_flash_attn/_vllm_fa2_C.abi3.so (FlashAttention 2:
# vLLM runs FA3 on compute capability 9.x), vllm-rs (the Rust HTTP frontend), third_party/deep_gemm and
# third_party/fmha_sm100 (fp8 DeepGEMM and Blackwell-only kernels, imported lazily). The RECORD is rewritten to match.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
DIR=.whl-vllm
PARTS=/tmp/vllmparts
SITE=/tmp/vllmsite
PART_MIB=${PART_MIB:-55}  # parts small enough to copy one at a time

WHEELS=(
  vllm==0.24.0
  fastapi==0.136.3 prometheus-fastapi-instrumentator==8.1.0 python-multipart==0.0.34 email-validator==2.4.0
  watchfiles==1.3.0 openai==2.30.0 jiter==0.13.0 anthropic==0.71.1 docstring-parser==0.18.0 openai-harmony==0.0.8
  partial-json-parser==0.2.1.1.post7 mistral-common==1.13.1 xgrammar==0.2.7 apache-tvm-ffi==0.1.9 llguidance==1.7.6
  outlines-core==0.2.14 lark==1.2.2 lm-format-enforcer==0.11.3 diskcache==5.6.3 cbor2==6.3.0 pybase64==1.5.1
  blake3==1.0.11 compressed-tensors==0.17.0 depyf==0.20.0 opentelemetry-semantic-conventions-ai==0.5.1
  model-hosting-container-standards==0.1.16 python-json-logger==4.2.0 ijson==3.6.0 setproctitle==1.3.8
  jmespath==1.1.0  # transformers 5.9 imports it unguarded on the rollout server's chat path
)
STRIP=(vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs vllm/third_party/deep_gemm/ vllm/third_party/fmha_sm100/)

fetch() {  # the wheels, whole (vLLM's stripped), into $1 (scripts/staging/rl_stack_wheels.sh packs them with the others)
  mkdir -p "$1"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 \
    --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 --platform any -d "$1" "${WHEELS[@]}"
  unzip -p "$1"/vllm-0.24.0-*.whl 'vllm-0.24.0.dist-info/METADATA' | grep -qx 'Requires-Dist: torch==2.11.0' \
    || { echo "vllm 0.24.0 does not pin torch==2.11.0: wrong wheel" >&2; exit 1; }
  python3 - "$1" "${STRIP[@]}" <<'EOF'
# rewrite the vLLM wheel without the members named in STRIP (and their RECORD lines)
import glob, os, sys, zipfile
root, strip = sys.argv[1], sys.argv[2:]
src = glob.glob(os.path.join(root, "vllm-0.24.0-*.whl"))[0]
tmp = src + ".tmp"
drop = lambda n: any(n == s or (s.endswith("/") and n.startswith(s)) for s in strip)
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as zout:
    for info in zin.infolist():
        if drop(info.filename):
            continue
        data = zin.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            lines = data.decode().splitlines(keepends=True)
            data = "".join(line for line in lines if not drop(line.split(",")[0])).encode()
        zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
os.replace(tmp, src)
print(f"stripped {os.path.basename(src)}: {os.path.getsize(src) / 2**20:.1f} MiB")
EOF
}

download() {
  cd "$(dirname "$HERE")/../.."
  grep -qx "/$DIR/" .git/info/exclude 2>/dev/null || echo "/$DIR/" >> .git/info/exclude
  rm -rf "$DIR" && fetch "$DIR/all"
  python3 scripts/staging/wheel_parts.py pack "$DIR" "$PART_MIB" p  # parts p1, p2, ..., each with its MANIFEST
  echo "copy $DIR/ (or one part at a time) to the GPU machine's checkout, then: bash scripts/staging/vllm_device_wheels.sh install"
}

install() {  # from the repo root on the GPU machine, where .whl-vllm/pN was copied
  mkdir -p "$PARTS"
  compgen -G "$DIR/p*/MANIFEST" > /dev/null || { echo "no part under $DIR/ (run 'download' where pip works)" >&2; exit 1; }
  # one cp per part: every part holds the same MANIFEST (one cp of several same-named sources fails)
  for part in "$DIR"/p*/; do cp "$part"* "$PARTS"/; done
  echo "parts here: $(ls -d "$DIR"/p* | xargs -n1 basename | tr '\n' ' ')-> $PARTS holds $(ls "$PARTS" | wc -l) files"
  local rc=0
  python3 scripts/staging/wheel_parts.py join "$PARTS" || rc=$?
  [ "$rc" = 3 ] && return 0  # more parts to come
  [ "$rc" = 0 ] || exit "$rc"
  (cd "$PARTS" && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" $(awk '{print $2}' MANIFEST))
  check
}

check() {  # vLLM's compiled ops against this torch, and verl's vLLM rollout (needs verl's /tmp/site behind it)
  PYTHONPATH="$SITE:/tmp/site:${PYTHONPATH:-}" VLLM_USE_FLASHINFER_SAMPLER=0 python3 -c "
import torch, vllm, vllm._C_stable_libtorch, vllm._moe_C_stable_libtorch
import vllm.v1.engine.core, vllm.v1.worker.gpu_worker, vllm.v1.worker.gpu_model_runner
import vllm.model_executor.models.qwen3, vllm.model_executor.models.qwen3_moe, vllm.v1.attention.backends.flash_attn
from vllm.vllm_flash_attn.flash_attn_interface import FA3_AVAILABLE, FA3_UNAVAILABLE_REASON
print('vllm', vllm.__version__, 'torch', torch.__version__, 'FA3', FA3_AVAILABLE, FA3_UNAVAILABLE_REASON or '')
try:
    import verl.workers.rollout.vllm_rollout.vllm_async_server as s
    print('verl vLLM rollout imports:', s.__name__)
except ImportError as e:
    print('verl vLLM rollout does not import (is verl in /tmp/site?):', e)
"
  echo "installed: export PYTHONPATH=$SITE:/tmp/site:\$PYTHONPATH"
}

case "${1:-}" in
  download) download ;;
  install) install ;;
  fetch) fetch "${2:?usage: $0 fetch DIR}" ;;
  check) check ;;
  *) echo "usage: $0 download|install|fetch DIR|check" >&2; exit 2 ;;
esac
