#!/usr/bin/env bash
# One MoE replica over the GPUs of one host (benchmarks/parallel_throughput.py): expert parallel against pipeline
# parallel, one GPU and vLLM on the same GPUs, on the RL workload, one torchrun rank per GPU (NCCL, NVLink multicast
# off), the results file in RESULTS_DIR:
#
#   bash scripts/checks/parallel_bench_gpu.sh RESULTS_DIR [MODEL]       # MODEL: qwen3-30b-a3b (default), moonlight, ...
#
# Writes RESULTS_DIR/parallel-<gpu>-<model>.md (date, GPU, commit, command, a table per batch limit, the EP goals) and
# RESULTS_DIR/parallel-<gpu>-<model>.log. GPUs: those of CUDA_VISIBLE_DEVICES, else all. vLLM comes from the staged
# stack (scripts/staging/rl_stack_wheels.sh install); without it the vllm rows say why. Environment: PAR_MODES
# (default one,ep,pp,vllm), PAR_ARGS (more parallel_throughput.py flags, e.g. '--num-prompts 256 --layers 24'),
# PAR_TIMEOUT_S (the whole run's limit, default 3000), VEXACT_COMMIT (where the checkout has no .git).
set -uo pipefail
RESULTS=${1:?usage: parallel_bench_gpu.sh RESULTS_DIR [MODEL]}
MODEL=${2:-qwen3-30b-a3b}
mkdir -p "$RESULTS" && RESULTS=$(cd "$RESULTS" && pwd) || exit 2
cd "$(dirname "$0")/../.."
# shellcheck disable=SC1091
source scripts/staging/device_env.sh
export NCCL_NVLS_ENABLE=0
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
[ "$NGPU" -ge 2 ] || { echo "parallel_bench_gpu.sh needs 2 or more GPUs; $NGPU visible" >&2; exit 2; }
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oiE 'h100|h200|b200|a100' | tr 'A-Z' 'a-z')
VLLM_SITE=/tmp/vllmsite
[ -f /tmp/site/.complete ] && [ -f /tmp/vllmsite/.complete ] && VLLM_SITE=$(bash scripts/staging/rl_stack_wheels.sh path vllm)
OUT=$RESULTS/parallel-${GPU:-gpu}-$MODEL
# shellcheck disable=SC2086
timeout --kill-after=60 "${PAR_TIMEOUT_S:-3000}" python3 -m torch.distributed.run --standalone --nproc_per_node "$NGPU" \
  benchmarks/parallel_throughput.py --model "$MODEL" --modes "${PAR_MODES:-one,ep,pp,vllm}" --vllm-site "$VLLM_SITE" \
  ${PAR_ARGS:-} --out "$OUT.md" > "$OUT.log" 2>&1
rc=$?
tail -n 30 "$OUT.md" 2> /dev/null || tail -n 30 "$OUT.log"
exit $rc
