#!/usr/bin/env bash
# The RL stacks of examples/verify/run_pair.sh for an air-gapped GPU machine, staged by one script: verl 0.9.1 + Ray
# (scripts/staging/verl_device_wheels.sh), vLLM 0.24.0 with verl's vLLM rollout (scripts/staging/vllm_device_wheels.sh) and, with
# `fa4`, FlashAttention 4 (scripts/staging/fa4_device_wheels.sh). The GPU machine needs only its own torch 2.11 + Triton.
#
#   on a machine with internet, in the repo root:
#     bash scripts/staging/rl_stack_wheels.sh download [verl] [vllm] [fa4]   # default: verl vllm fa4
#         wheels for CPython 3.12 / manylinux x86_64, named GROUP__WHEEL, packed into .whl-stack/p1, p2, ... of at
#         most PART_MIB each (big wheels cut into pieces; scripts/staging/wheel_parts.py), group by group in the
#         order given: the first group's parts come first, and it installs before the later groups arrive
#   on the GPU machine, in the repo root, with the parts copied to .whl-stack/ (all at once, or one part a step for a
#   copy channel that takes one part at a time: /tmp keeps what earlier steps brought):
#     bash scripts/staging/rl_stack_wheels.sh install
#         copies the parts to /tmp/stackparts; each group whose files are all whole (sha256 checked) and not yet
#         installed is installed with --no-index --no-deps into its own folder: verl -> /tmp/site, vllm ->
#         /tmp/vllmsite, fa4 -> /tmp/fa4site, and its import check runs. Exit 0 also while parts are missing (it
#         names the groups still waiting).
#     bash scripts/staging/rl_stack_wheels.sh path vllm|vexact|fa4  # one arm's folders (fa4: FA4's), for PYTHONPATH
#
# Why three folders: the groups pin different versions of a few shared packages (fastapi: vLLM < 0.137, verl's
# resolve 0.165; apache-tvm-ffi: vLLM 0.24.0 pins 0.1.9, FA4 needs >= 0.1.11 and gets 0.1.15), so the vllm arm runs on
# vllmsite + site and the vexact arm on site + fa4site, each with its own versions. Where the vllm arm's actor runs
# FA4 (examples/verify/run_pair.sh), fa4site goes in front of vllmsite: apache-tvm-ffi is the one package both hold,
# and vLLM's own pin serves flashinfer, which is not staged (xgrammar 0.2.7 asks for >= 0.1.10).
# The GPU image's own packages (not staged): torch 2.11, triton 3.6, numpy, aiohttp, httpx, anyio, uvloop, typer,
# rich, pillow, opencv, regex, einops, numba, prometheus-client, psutil, pyyaml, safetensors, sentencepiece, tiktoken.
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=.whl-stack
PARTS=/tmp/stackparts
PART_MIB=${PART_MIB:-55}
declare -A SITE=([verl]=/tmp/site [vllm]=/tmp/vllmsite [fa4]=/tmp/fa4site)

download() {
  local groups=("$@")
  [ ${#groups[@]} -gt 0 ] || groups=(verl vllm fa4)
  grep -qx "/$DIR/" .git/info/exclude 2>/dev/null || echo "/$DIR/" >> .git/info/exclude
  rm -rf "$DIR" && mkdir -p "$DIR/all"
  for g in "${groups[@]}"; do
    [ -n "${SITE[$g]:-}" ] || { echo "unknown group '$g' (verl, vllm, fa4)" >&2; exit 2; }
    bash "scripts/staging/${g}_device_wheels.sh" fetch "$DIR/tmp-$g"
    for f in "$DIR/tmp-$g"/*; do mv "$f" "$DIR/all/${g}__$(basename "$f")"; done
    rmdir "$DIR/tmp-$g"
  done
  python3 scripts/staging/wheel_parts.py pack "$DIR" "$PART_MIB" p --order "$(IFS=,; echo "${groups[*]}")"
}

install() {
  mkdir -p "$PARTS"
  compgen -G "$DIR/p*/MANIFEST" > /dev/null || { echo "no part under $DIR/ (run 'download' where pip works)" >&2; exit 1; }
  for part in "$DIR"/p*/; do cp "$part"* "$PARTS"/; done  # one cp per part: each part holds the same MANIFEST
  local g rc waiting=()
  for g in verl vllm fa4; do  # each group as soon as its own files are whole (download packs them group by group)
    grep -q "  ${g}__" "$PARTS/MANIFEST" || continue
    if [ -f "${SITE[$g]}/.complete" ]; then echo "$g: installed already (${SITE[$g]})"; continue; fi
    rc=0
    python3 scripts/staging/wheel_parts.py join "$PARTS" --group "$g" || rc=$?
    if [ "$rc" = 3 ]; then waiting+=("$g"); continue; fi
    [ "$rc" = 0 ] || exit "$rc"
    rm -rf "$PARTS/$g" && mkdir -p "$PARTS/$g"
    for f in "$PARTS/${g}__"*; do ln -f "$f" "$PARTS/$g/${f##*/${g}__}"; done
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "${SITE[$g]}" \
      "$PARTS/$g"/*.whl
    echo "installed $g: $(ls "$PARTS/$g" | wc -l) wheels -> ${SITE[$g]}"
    touch "${SITE[$g]}/.complete"
    bash "scripts/staging/${g}_device_wheels.sh" check
  done
  [ ${#waiting[@]} -eq 0 ] || echo "waiting for more parts: ${waiting[*]} (copy the next part)"
}

arm_path() {  # the folders one arm puts in front of PYTHONPATH (FA4's: scripts/staging/device_env.sh adds them)
  case "$1" in
    vllm) echo "${SITE[vllm]}:${SITE[verl]}" ;;
    vexact) echo "${SITE[verl]}" ;;
    # FA4's folders, where installed (nothing otherwise): the DSL's `cutlass` package (a --target install skips its
    # .pth) and the site itself, with flash-attn-4's dist-info, which transformers reads to enable flash_attention_4
    fa4) [ ! -d "${SITE[fa4]}/nvidia_cutlass_dsl/dsl_packages" ] \
           || echo "${SITE[fa4]}/nvidia_cutlass_dsl/dsl_packages:${SITE[fa4]}" ;;
    *) echo "usage: $0 path vllm|vexact|fa4" >&2; exit 2 ;;
  esac
}

case "${1:-}" in
  download) shift; download "$@" ;;
  install) install ;;
  path) arm_path "${2:-}" ;;
  *) echo "usage: $0 download [verl] [vllm] [fa4] | install | path vllm|vexact|fa4" >&2; exit 2 ;;
esac
