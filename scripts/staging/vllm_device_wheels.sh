#!/usr/bin/env bash
# vLLM 0.26.0 (the release built against torch 2.11, the GPU machines' torch: its METADATA says torch==2.11.0) on the
# GPU device, which has no internet, for the peer columns of benchmarks/throughput.py. Two verbs:
#
#   here (a machine with internet), in the repo root (the coordinator's checkout, /work/main: only it travels):
#     bash scripts/staging/vllm_device_wheels.sh download  # wheels for CPython 3.12 / manylinux x86_64 into .whl-vllm/p1,
#                                                  # p2, ... (each <= PART_MIB; scripts/staging/wheel_parts.py), adds
#                                                  # /.whl-vllm/ to .git/info/exclude, prints the device plan
#   on the device, one call per part, back to back on the same warm machine (/tmp survives only while it is warm):
#     bash scripts/staging/vllm_device_wheels.sh install   # copies the carried part(s) to /tmp/vllmparts; once every file
#                                                  # of MANIFEST is there: re-joins the cut wheels, checks sha256
#                                                  # pip install --no-index --no-deps --target /tmp/vllmsite, imports
#   then: export PYTHONPATH=/tmp/vllmsite:$PYTHONPATH (benchmarks/throughput.py --vllm-site /tmp/vllmsite does it).
#
# Device calls (`download` prints the plan for the parts it made; vLLM 0.26.0 gives 3 parts, 156 MiB in all):
#   call 1: carry [".whl-vllm/p1"]  command: bash scripts/staging/vllm_device_wheels.sh install 2>&1 | tee $OUT/vllm_install_p1.log
#   call 2: carry [".whl-vllm/p2"]  command: bash scripts/staging/vllm_device_wheels.sh install 2>&1 | tee $OUT/vllm_install_p2.log
#   call 3: carry [".whl-vllm/p3"]  command: bash scripts/staging/vllm_device_wheels.sh install 2>&1 | tee $OUT/vllm_install_p3.log
#           (the last call installs and prints `vllm 0.26.0 ... FA3 True`)
#   call 4 (same warm machine, no carry; needs benchmarks/peers.py and throughput.py on the travelling checkout):
#     source scripts/staging/device_env.sh && python benchmarks/throughput.py --vllm-site /tmp/vllmsite --ckpt-dir /tmp/peers \
#       --out $OUT/throughput-h100.md 2>&1 | tee $OUT/throughput.log; cp /tmp/peers/*.log $OUT/
#   (add --quick for a first look; the full run is sized for under 8 minutes on one H100)
#
# What is carried, and why: the set the OFFLINE path imports (`from vllm import LLM, SamplingParams`; v1 LLMEngine,
# EngineCore in its own process over ZMQ/msgspec, GPU worker and model runner, Qwen3, FlashAttention and Triton
# attention backends, batch-invariant ops, torch.compile backend, sampler, scheduler, model loader), found by importing
# those modules with every module outside (GPU image's package list, KINDS.md) + (this list) blocked, minus what the
# image already has (torch 2.11, triton 3.6, transformers, tokenizers, safetensors, numpy, httpx, anyio, psutil,
# regex, cloudpickle, einops, py-cpuinfo, sentencepiece, tiktoken, uvloop, prometheus-client, pillow, opencv ...).
# Module-level imports that are not used offline but cannot be avoided without patching vLLM are carried too:
# fastapi/starlette (vllm.entrypoints.serve, imported by the pooling path of LLM), openai/openai-harmony/
# partial-json-parser (chat and tool-parser types), xgrammar/llguidance/apache-tvm-ffi (structured-output types that
# vllm.v1.request imports), cbor2/pybase64 (hashing, serialisation).
#
# Left out (Requires-Dist of vLLM that the offline LLM path does not import at module level, or only where the
# feature is used): flashinfer-python, tilelang, nvidia-cutlass-dsl, quack-kernels, tokenspeed-mla,
# humming-kernels, nvidia-cudnn-frontend, fastsafetensors (alternative kernels/loaders, chosen only when asked for or
# on other GPUs: Hopper dense bf16 uses vLLM's own FA3 and Triton/cuBLAS; but vLLM 0.26 imports flashinfer when it
# builds its top-k/top-p sampler, so benchmarks/peers.py sets VLLM_USE_FLASHINFER_SAMPLER=0: the first H100 run
# stopped on 'No module named flashinfer' there), torchcodec, PyNvVideoCodec, torchaudio
# extras, mistral_common, lm-format-enforcer, outlines_core, lark (multimodal / other tokenizers and grammar
# backends), anthropic, mcp, model-hosting-container-standards, prometheus-fastapi-instrumentator, watchfiles,
# python-json-logger, opentelemetry-* (the API server, tracing), blake3 (multimodal hashing only), setproctitle
# (optional: vLLM skips it when missing), depyf (only with a compile debug dump path), ijson (mistral tool parser),
# numba (n-gram speculative decoding), nvtx, ray (multi-node executor).
# From the vLLM wheel itself (303 MiB -> about 140 MiB): vllm_flash_attn/_vllm_fa2_C.abi3.so (FlashAttention 2:
# vLLM uses FA3 on compute capability 9.x, H100/H200, also with VLLM_BATCH_INVARIANT=1; FA2 is optional in
# vllm_flash_attn/flash_attn_interface.py), vllm-rs (the Rust HTTP frontend), third_party/deep_gemm and
# third_party/fmha_sm100 (DeepGEMM fp8 and Blackwell-only kernels, imported lazily). The RECORD is rewritten to match.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
DIR=.whl-vllm
PARTS=/tmp/vllmparts
SITE=/tmp/vllmsite
PART_MIB=56  # a device call carries 64 MiB together with the working tree (~4 MiB): keep a margin

WHEELS=(
  vllm==0.26.0
  pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5
  fastapi==0.136.3 starlette==1.10.0 openai==2.30.0 jiter==0.13.0 distro==1.9.0 sniffio==1.3.1
  openai-harmony==0.0.8 partial-json-parser==0.2.1.1.post7 xgrammar==0.2.7 apache-tvm-ffi==0.1.10
  llguidance==1.7.3 msgspec==0.22.0 pyzmq==27.3.0 cachetools==8.0.1 cbor2==6.3.0 pybase64==1.5.1
)
STRIP=(vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs vllm/third_party/deep_gemm/ vllm/third_party/fmha_sm100/)

download() {
  cd "${1:-$(dirname "$HERE")/../..}"  # the checkout that travels to the device (the coordinator's: /work/main)
  grep -qx "/$DIR/" .git/info/exclude 2>/dev/null || echo "/$DIR/" >> .git/info/exclude
  rm -rf "$DIR" && mkdir -p "$DIR/all"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 --platform manylinux1_x86_64 \
    --platform manylinux_2_5_x86_64 --platform any -d "$DIR/all" "${WHEELS[@]}"
  unzip -p "$DIR"/all/vllm-0.26.0-*.whl 'vllm-0.26.0.dist-info/METADATA' | grep -qx 'Requires-Dist: torch==2.11.0' \
    || { echo "vllm 0.26.0 does not pin torch==2.11.0: wrong wheel" >&2; exit 1; }
  python3 - "$DIR/all" "${STRIP[@]}" <<'EOF'
# rewrite the vLLM wheel without the members named in STRIP (and their RECORD lines)
import glob, os, sys, zipfile
root, strip = sys.argv[1], sys.argv[2:]
src = glob.glob(os.path.join(root, "vllm-0.26.0-*.whl"))[0]
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
  python3 scripts/staging/wheel_parts.py pack "$DIR" "$PART_MIB" p  # parts p1, p2, ..., each with its MANIFEST
  n=$(ls -d "$DIR"/p* | wc -l)
  echo
  echo "device plan: $n calls, back to back on the same warm machine, each from the repo root:"
  for i in $(seq 1 "$n"); do
    echo "  call $i: carry [\"$DIR/p$i\"]  command: bash scripts/staging/vllm_device_wheels.sh install 2>&1 | tee \$OUT/vllm_install_p$i.log"
  done
}

install() {  # run from the repo root on the device (where .whl-vllm/pN was carried)
  mkdir -p "$PARTS"
  compgen -G "$DIR/p*/MANIFEST" > /dev/null || { echo "no part carried under $DIR/ (carry .whl-vllm/pN)" >&2; exit 1; }
  # one cp per part: every part holds the same MANIFEST, and one cp of several same-named sources fails ("will not
  # overwrite just-created"), which stopped the install when the machine kept the earlier calls' parts
  for part in "$DIR"/p*/; do cp "$part"* "$PARTS"/; done
  echo "carried: $(ls -d "$DIR"/p* | xargs -n1 basename | tr '\n' ' ')-> $PARTS holds $(ls "$PARTS" | wc -l) files"
  local rc=0
  python3 scripts/staging/wheel_parts.py join "$PARTS" || rc=$?
  [ "$rc" = 3 ] && return 0  # the next call carries the next part
  [ "$rc" = 0 ] || exit "$rc"
  cd "$PARTS"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    $(awk '{print $2}' MANIFEST)
  cd - > /dev/null
  PYTHONPATH="$SITE:${PYTHONPATH:-}" python3 -m pip check 2>&1 | grep -i vllm || true
  PYTHONPATH="$SITE:${PYTHONPATH:-}" python3 -c "
import torch, vllm, vllm._C_stable_libtorch  # the compiled ops must load against this torch
from vllm import LLM, SamplingParams
import vllm.v1.engine.core, vllm.v1.worker.gpu_worker, vllm.v1.worker.gpu_model_runner, vllm.model_executor.models.qwen3
import vllm.v1.attention.backends.flash_attn, vllm.model_executor.layers.batch_invariant
from vllm.vllm_flash_attn.flash_attn_interface import FA3_AVAILABLE, FA3_UNAVAILABLE_REASON
print('vllm', vllm.__version__, 'torch', torch.__version__, 'FA3', FA3_AVAILABLE, FA3_UNAVAILABLE_REASON or '')"
  echo "installed: export PYTHONPATH=$SITE:\$PYTHONPATH"
}

case "${1:-}" in
  download) download "${2:-}" ;;
  install) install ;;
  *) echo "usage: $0 download|install" >&2; exit 2 ;;
esac
