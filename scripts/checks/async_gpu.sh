#!/usr/bin/env bash
# Asynchronous RL with exact rollouts on one host: verl's sync trainer against its separate_async trainer on the same
# GPUs (the Qwen3-1.7B shape, random weights), one after the other:
#
#   bash scripts/checks/async_gpu.sh RESULTS_DIR                 # 2 GPUs: trainer on GPU 0, rollout on GPU 1
#   TRAINER_GPUS=2 ROLLOUT_GPUS=2 bash scripts/checks/async_gpu.sh RESULTS_DIR      # 2 + 2 on a 4-GPU host
#
# Both runs are examples/recipes/qwen3_1.7b_separate_async.sh (MODE=sync on all TRAINER_GPUS + ROLLOUT_GPUS, then
# MODE=separate_async), 128 prompts x 4 responses of up to 1024 tokens a step, STEPS steps (8), on the local
# arithmetic dataset (examples/verl_grpo/make_dataset.py, no hub) scored by examples/verl_grpo/reward.py's
# compute_score_half_digits (a random model scores 0 on GSM8K's rule, and zero advantages would leave the weights,
# hence the versions, unchanged). Then examples/recipes/async_results.py writes RESULTS_DIR/async-<TAG>.md: training
# tokens/s of each mode and their ratio (goal 1.3x), the weight-sync time against the NCCL bound (NCCL_GBPS: a
# measured broadcast bandwidth in GB/s; without it the bound is left out), staleness per step, and K3 exactly 0.0 at
# every step of staleness 0 (the exit status is 1 otherwise). With CHECK_VERSIONS=1 (the default) the separate_async
# run also carries each token's policy version into the actor (VersionedAgentLoopManager) and keeps the previous
# version's weights on the host (vexact.keep_previous_version): every step must log the actor's per-version check,
# each token against the actor at its own version, K3 exactly 0.0 with no token left unchecked, which tests the versions
# that travel with verl's NCCL sync; it costs one more actor forward per old_log_prob, so CHECK_VERSIONS=0 measures
# throughput without it.
#
# Environment: LAYERS (28), STEPS (8), TRAINER_GPUS (1), ROLLOUT_GPUS (1), NCCL_GBPS, JOB_TIMEOUT (1800 s a run),
# CHECK_VERSIONS (1), TAG (file-name prefix), COMMIT. VERL_PLATFORM=cpu: the same flow on CPU at tiny sizes (SMOKE=1 of the recipe, the
# gloo checkpoint engine), to check the script itself.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
RESULTS=$(realpath -m "${1:?usage: async_gpu.sh RESULTS_DIR}")
mkdir -p "$RESULTS"
exec > >(tee -a "$RESULTS/progress.log") 2>&1
export RAY_ADDRESS=local
TRAINER_GPUS=${TRAINER_GPUS:-1} ROLLOUT_GPUS=${ROLLOUT_GPUS:-1}
GPUS=$((TRAINER_GPUS + ROLLOUT_GPUS))
source scripts/checks/verl_job_lib.sh
verl_job_setup async
STEPS=${STEPS:-8}
if [ "$CPU" = 1 ]; then
  SHAPE_ARGS=(--hidden 64 --layers 2)
  MODEL_TEXT="tiny Qwen3 (hidden 64, 2 layers)"
  export SMOKE=1
  EXTRA=("${CPU_EXTRA[@]}")
else
  SHAPE_ARGS=(--shape qwen3-1.7b --layers "${LAYERS:-28}" --context 2048)  # prompt 512 + response 1024
  MODEL_TEXT="Qwen3-1.7B shape, ${LAYERS:-28} layers"
  EXTRA=()
fi
WORK=$(realpath -m "${WORK:-/tmp/vexact-async-gpu-$TAG}")
rm -rf "$WORK" && mkdir -p "$WORK"
echo "== async_gpu: $GPU x $GPUS, commit $COMMIT, $STEPS steps, work dir $WORK"
date -u
python3 examples/verl_grpo/make_model.py "${SHAPE_ARGS[@]}" --out "$WORK/model" || exit 1
python3 examples/verl_grpo/make_dataset.py --out "$WORK/data/gsm8k" || exit 1  # the recipe reads DATA_DIR/gsm8k
PARAMS=$(python3 -c "
import math, sys
from safetensors import safe_open
from pathlib import Path
print(sum(math.prod(f.get_slice(k).get_shape()) for p in Path(sys.argv[1]).glob('*.safetensors')
          for f in [safe_open(str(p), 'pt')] for k in f.keys()))" "$WORK/model") || exit 1

CHECK_VERSIONS=${CHECK_VERSIONS:-1}
VERSIONS=()
if [ "$CHECK_VERSIONS" = 1 ]; then
  VERSIONS=(
    +actor_rollout_ref.rollout.agent.agent_loop_manager_class=vexact_verl.agent_loop.VersionedAgentLoopManager
    actor_rollout_ref.actor.fsdp_config._target_=vexact_verl.actor_engine.VexactFSDPEngineConfig
    +actor_rollout_ref.actor.fsdp_config.vexact.keep_previous_version=true
  )
fi
FAILED=0
COMMANDS=()
run() {  # run MODE: the recipe in MODE; metrics in RESULTS/async-TAG-MODE.jsonl
  local mode=$1 log="$RESULTS/async-$TAG-$1"
  local per_version=()
  [ "$mode" = separate_async ] && per_version=("${VERSIONS[@]}")
  local cmd=(env MODE="$mode" MODEL_DIR="$WORK/model" DATA_DIR="$WORK/data" RUN_DIR="$WORK/$mode"
             GPUS_PER_NODE="$TRAINER_GPUS" ROLLOUT_GPUS="$ROLLOUT_GPUS" VERL_FILE_LOGGER_PATH="$log.jsonl"
             timeout "${JOB_TIMEOUT:-1800}" bash examples/recipes/qwen3_1.7b_separate_async.sh
             +ray_kwargs.ray_init._temp_dir="$RAY_TMP" +ray_kwargs.ray_init.include_dashboard=False
             reward.custom_reward_function.path="$ROOT/examples/verl_grpo/reward.py"
             reward.custom_reward_function.name=compute_score_half_digits
             trainer.total_training_steps="$STEPS" "${per_version[@]}" "${EXTRA[@]}")
  COMMANDS+=("$mode: ${cmd[*]}")
  echo "== $mode: ${cmd[*]}"
  local start rc=0
  start=$(date +%s)
  rm -f "$log.jsonl"
  "${cmd[@]}" > "$log.log" 2>&1 || rc=$?
  reap
  echo "== $mode: exit $rc after $(( $(date +%s) - start )) s"
  [ "$rc" = 0 ] || { tail -40 "$log.log"; FAILED=1; }
}
run sync
run separate_async

HEADER=(
  "# Asynchronous RL with exact rollouts: verl's sync and separate_async trainers"
  ""
  "- Date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  "- Hardware: $GPU x $GPUS (separate_async: trainer on $TRAINER_GPUS, rollout on $ROLLOUT_GPUS)"
  "- Commit: $COMMIT"
  "- Command: \`bash scripts/checks/async_gpu.sh $1\`$([ "$CPU" = 1 ] && echo " with VERL_PLATFORM=cpu")"
  "- Model: $PARAMS parameters, $MODEL_TEXT,"
  "  random weights; data: examples/verl_grpo/make_dataset.py; $STEPS steps"
  ""
  "Commands (in the repository root):"
  ""
)
for c in "${COMMANDS[@]}"; do HEADER+=("    $c"); done
STATUS=0
NCCL=()
[ -n "${NCCL_GBPS:-}" ] && NCCL=(--nccl-gbps "$NCCL_GBPS")
CHECKED=()
[ "$CHECK_VERSIONS" = 1 ] && CHECKED=(--versions)
python3 examples/recipes/async_results.py "$RESULTS/async-$TAG-sync.jsonl" "$RESULTS/async-$TAG-separate_async.jsonl" \
  --params "$PARAMS" "${NCCL[@]}" "${CHECKED[@]}" --out "$RESULTS/async-$TAG.md" "${HEADER[@]/#/--header=}" || STATUS=1
[ "$FAILED" = 0 ] || STATUS=1
[ "${KEEP_WORK:-0}" = 1 ] || rm -rf "$WORK" "$RAY_TMP"
date -u
echo "async_gpu done: $([ "$STATUS" = 0 ] && echo PASS || echo FAIL); $RESULTS/async-$TAG.md"
exit "$STATUS"
