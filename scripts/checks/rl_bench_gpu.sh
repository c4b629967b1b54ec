#!/usr/bin/env bash
# The RL-shaped throughput table of one model on one GPU (benchmarks/throughput.py --workload rl): VeXact invariant
# (its default loop; and invariant-sync, the synchronous one, where EngineConfig has async_decode) against vLLM
# default and vLLM batch-invariant at batch limits 256 and 512, with where VeXact's decode step goes
# (--profile-steps). Two runs side by side on a 2-GPU host, one model a GPU, each writing its own files:
#
#   source scripts/staging/device_env.sh            # once, in the shell that starts both
#   mkdir -p "$OUT/rl"
#   CUDA_VISIBLE_DEVICES=0 bash scripts/checks/rl_bench_gpu.sh 1.7b "$OUT/rl" > "$OUT/rl/run-1.7b.txt" 2>&1 &
#   CUDA_VISIBLE_DEVICES=1 bash scripts/checks/rl_bench_gpu.sh 8b "$OUT/rl" > "$OUT/rl/run-8b.txt" 2>&1 &
#   wait
#
# Writes into RESULTS_DIR, for GPU g (h100, h200, ...) and model m:
#   throughput-<workload>-<g>-<m>.md       the results file: date, GPU, commit, command, a table per batch limit
#                                          (tok/s, ratio to vLLM default and batch-invariant, roofline fraction,
#                                          decode-only step ms), the decode step by kernel kind and host gap
#   throughput-<workload>-<g>-<m>-full.md  the whole report (step-time split, batch-1 decode step)
#   throughput-<workload>-<g>-<m>.log      the run's output; vllm-<m>/ the vLLM workers' logs
#
# Needs vLLM staged (scripts/staging/rl_stack_wheels.sh install: /tmp/vllmsite; FA4 in /tmp/fa4site is used by VeXact
# where installed, as VEXACT_ATTENTION=auto picks it; set VEXACT_ATTENTION=triton for the Triton kernel).
# Environment:
#   CUDA_VISIBLE_DEVICES  one GPU index (required: two runs must not share a GPU)
#   WORKLOAD              rl (default) or rl-long
#   RL_NUM_PROMPTS        prompts (default: 512 for 1.7b, 256 for 8b with rl, the workload's own otherwise): the rl
#                         workload's 1024 cut so that one model's run stays near 15 minutes on an H100, an estimate
#                         from the H200 rates of throughput-h200.md scaled to H100 bandwidth (1.7b at 512: about 10 minutes of
#                         generation for 4 modes x 2 limits, 5 of engine starts and profiles; 8b reads about 1.6x the
#                         bytes a step); the results file names the cut
#   RL_MODES              default invariant,invariant-sync,vllm,vllm-bi (invariant-sync left out, with a note in the
#                         results file, where this engine's EngineConfig has no async_decode)
#   PROFILE_STEPS         decode steps timed and profiled after each VeXact run (default 20; 0: none)
#   RL_CKPT_DIR           where the HF checkpoint vLLM loads goes, a folder per model (default /tmp/rl-bench-peers;
#                         it needs the model's bf16 size free: 3.4 GB for 1.7b, 16.4 GB for 8b; kept for a rerun)
#   RL_TIMEOUT_S          the whole run's limit in seconds (default 2700)
#   RL_ARGS               more benchmarks/throughput.py flags (they win over the workload's and the ones above)
#   VLLM_SITE             vLLM's folders for PYTHONPATH (default: /tmp/vllmsite, behind it verl's /tmp/site where
#                         both are staged, as scripts/checks/gpu_checks.sh has it)
#   VEXACT_COMMIT         the commit to name where the checkout has no .git
set -uo pipefail
MODEL=${1:?usage: rl_bench_gpu.sh MODEL RESULTS_DIR (MODEL: 1.7b, 8b, ...)}
RESULTS=${2:?usage: rl_bench_gpu.sh MODEL RESULTS_DIR}
mkdir -p "$RESULTS" && RESULTS=$(cd "$RESULTS" && pwd) || exit 2
cd "$(dirname "$0")/../.."
WORKLOAD=${WORKLOAD:-rl}
case "$WORKLOAD" in rl | rl-long) ;; *) echo "WORKLOAD: unknown workload '$WORKLOAD' (rl, rl-long)" >&2; exit 2 ;; esac
case "${CUDA_VISIBLE_DEVICES:-}" in
  '' | *,*) echo "CUDA_VISIBLE_DEVICES must name one GPU, got '${CUDA_VISIBLE_DEVICES:-}'" >&2; exit 2 ;;
esac
if [ -z "${RL_NUM_PROMPTS:-}" ] && [ "$WORKLOAD" = rl ]; then
  case "$MODEL" in 1.7b) RL_NUM_PROMPTS=512 ;; 8b) RL_NUM_PROMPTS=256 ;; esac
fi
prompts=()
if [ -n "${RL_NUM_PROMPTS:-}" ]; then
  case "$RL_NUM_PROMPTS" in
    '' | *[!0-9]* | 0) echo "RL_NUM_PROMPTS must be a positive integer, got '$RL_NUM_PROMPTS'" >&2; exit 2 ;;
  esac
  prompts=(--num-prompts "$RL_NUM_PROMPTS")
fi
PROFILE_STEPS=${PROFILE_STEPS:-20}
case "$PROFILE_STEPS" in '' | *[!0-9]*) echo "PROFILE_STEPS must be an integer >= 0, got '$PROFILE_STEPS'" >&2; exit 2 ;; esac

# the monorepo on PYTHONPATH, FA4's folders where staged; a shell that sourced device_env.sh already has them (two
# runs started from it then do not both install .whl/ into /tmp/site at once)
case ":${PYTHONPATH:-}:" in
  *":$PWD/packages/vexact-engine/src:"*) ;;
  # shellcheck disable=SC1091
  *) source scripts/staging/device_env.sh ;;
esac
# vLLM's folders as scripts/checks/gpu_checks.sh finds them
if [ -z "${VLLM_SITE:-}" ]; then
  VLLM_SITE=/tmp/vllmsite
  [ -f /tmp/site/.complete ] && [ -f /tmp/vllmsite/.complete ] && VLLM_SITE=$(bash scripts/staging/rl_stack_wheels.sh path vllm)
fi
[ -d "${VLLM_SITE%%:*}/vllm" ] || {
  echo "vLLM is not staged in ${VLLM_SITE%%:*}: scripts/staging/rl_stack_wheels.sh install" >&2
  exit 2
}
# FA4 compiles each kernel variant on first use; a cache folder per GPU keeps two runs from writing one at once
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
export FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=${FLASH_ATTENTION_CUTE_DSL_CACHE_DIR:-/tmp/fa4-jit-cache-gpu$CUDA_VISIBLE_DEVICES}

gpu_name=$(python3 -c "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU')") \
  || exit 1
case "$gpu_name" in *H100*) GPU=h100 ;; *H200*) GPU=h200 ;; *B200*) GPU=b200 ;; CPU) GPU=cpu ;; *) GPU=gpu ;; esac
MODES=${RL_MODES:-invariant,invariant-sync,vllm,vllm-bi}
notes=()
if [[ ",$MODES," == *,invariant-async,* || ",$MODES," == *,invariant-sync,* ]]; then
  python3 -c "import dataclasses, sys; from vexact_engine import EngineConfig
sys.exit(0 if 'async_decode' in {f.name for f in dataclasses.fields(EngineConfig)} else 3)"
  case $? in
    0) ;;
    3)
      MODES=$(tr ',' '\n' <<< "$MODES" | grep -vxE 'invariant-(async|sync)' | paste -sd, -)
      notes+=(--note "invariant-async/-sync left out: EngineConfig has no async_decode in this checkout")
      echo "rl_bench_gpu.sh: EngineConfig has no async_decode; running $MODES" ;;
    *) echo "rl_bench_gpu.sh: vexact_engine does not import (PYTHONPATH: scripts/staging/device_env.sh)" >&2; exit 1 ;;
  esac
fi
[ ${#prompts[@]} -gt 0 ] && notes+=(--note "RL_NUM_PROMPTS=$RL_NUM_PROMPTS: the $WORKLOAD workload with \
$RL_NUM_PROMPTS prompts, so that one model's run stays near 15 minutes on an H100")
host_gpus=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU')
if [ "${host_gpus:-0}" -gt 1 ]; then
  notes+=(--note "run by scripts/checks/rl_bench_gpu.sh on GPU $CUDA_VISIBLE_DEVICES of a $host_gpus-GPU host; the \
host's other GPUs may run another benchmark at the same time")
else
  notes+=(--note "run by scripts/checks/rl_bench_gpu.sh on a one-GPU machine")
fi

base=$RESULTS/throughput-$WORKLOAD-$GPU-$MODEL
ckpt=${RL_CKPT_DIR:-/tmp/rl-bench-peers}/$MODEL
echo "rl_bench_gpu.sh: $MODEL on $gpu_name (CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES), $WORKLOAD, modes $MODES -> $base.md"
# shellcheck disable=SC2086  # RL_ARGS: flags, split on purpose
timeout --kill-after=60 "${RL_TIMEOUT_S:-2700}" python3 benchmarks/throughput.py --workload "$WORKLOAD" \
  --models "$MODEL" --modes "$MODES" "${prompts[@]}" --profile-steps "$PROFILE_STEPS" --vllm-site "$VLLM_SITE" \
  --ckpt-dir "$ckpt" --results-md "$base.md" --out "$base-full.md" "${notes[@]}" ${RL_ARGS:-} 2>&1 \
  | grep --line-buffered -Ev "(it|req)/s\]|s/(it|req)\]" > "$base.log"
status=${PIPESTATUS[0]}
mkdir -p "$RESULTS/vllm-$MODEL"
cp "$ckpt"/*.log "$RESULTS/vllm-$MODEL/" 2> /dev/null
[ "$status" = 124 ] && echo "rl_bench_gpu.sh: timed out after ${RL_TIMEOUT_S:-2700} s (RL_TIMEOUT_S)" | tee -a "$base.log"
tail -n 40 "$base.log"
echo "rl_bench_gpu.sh: $MODEL exit status $status; results in $RESULTS"
exit "$status"
