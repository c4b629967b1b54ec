#!/usr/bin/env bash
# Every recipe of examples/recipes/ for a few steps on one GPU, on random weights of its family's real shape at reduced
# depth, with the committed sample data; one results table:
#
#   bash scripts/checks/recipes_gpu.sh RESULTS_DIR
#
# and one recipe at its model's real depth on the 8 GPUs of one node (the Qwen3-30B-A3B DAPO recipe, 48 layers: 61 GB
# of bf16 weights written first; its rollout as pipeline replicas of the recipe's 2 stages):
#
#   GPUS=8 LAYERS=48 STEPS=3 ONLY=qwen3_30b_a3b_dapo_math RECIPE_TIMEOUT=1800 BUDGET=2400 \
#     bash scripts/checks/recipes_gpu.sh RESULTS_DIR
#
# Each recipe runs through its own script with SMOKE=1 (its small-run switch: batch, lengths and steps shrink, every
# other setting stays the recipe's), NNODES=1 GPUS_PER_NODE=GPUS (default 1; on one GPU, PP=1 for the Qwen3-30B-A3B
# recipes, whose rollout defaults to 2 pipeline stages; the vexact arm alone for the verify pair: the vllm arm needs
# vLLM's own stack), and
# these overrides: trainer.total_training_steps=STEPS, trainer.save_freq=-1 (no checkpoint),
# trainer.val_before_train=False (the recipe's validation runs once, after the last step), verl's dashboard off, and
# examples/verl_grpo/reward.py as the reward (verl's GSM8K rule plus a small credit for digits: random weights never
# answer, so verl's scorers alone give every response 0, every advantage 0, and DAPO's dynamic sampling drops every
# group). One recipe after another, one of each family first; a failing one is recorded and the next runs.
# Data: examples/data/prepare.py on examples/data/samples/ (no hub). Models: examples/verl_grpo/make_model.py --shape
# (qwen3-1.7b, qwen3-30b-a3b, moonlight-16b-a3b, r1-distill-qwen-1.5b, llama-3.1-8b) at LAYERS layers (default 2),
# written in the background beside the first runs.
#
# Outputs in RESULTS_DIR: recipes-<TAG>.md (date, GPU, commit, command, the table: K3 KL, reward mean, response
# length and step time per step, pass/fail), recipes-<TAG>-<recipe>.jsonl (verl's file logger) and .log,
# recipes-<TAG>-runs.jsonl (the table's input), progress.log. Models, data and run directories go to WORK (default
# /tmp/vexact-recipes-gpu-<TAG>), removed at the end with the Ray temp dir (KEEP_WORK=1 keeps them).
# Environment: LAYERS (2), STEPS (5), GPUS (1: the GPUs of the one node each recipe runs on), ONLY (space-separated
# recipe names to run, default all), RECIPE_TIMEOUT (300 s a recipe), BUDGET (900 s: the whole run's wall-clock
# limit; no recipe starts after BUDGET - MIN_RUN (150) s, and those left are listed as not run), TAG
# (file-name prefix: the GPU, e.g. h100), COMMIT. Estimate on an H100: ~2 minutes a recipe (verl's start ~90 s, then
# 5 small steps and one validation), ~15 minutes for the seven.
# Each run starts a Ray cluster of its own (RAY_ADDRESS=local, its files under /tmp/ray-recipes-<TAG>, where the Ray
# processes a failed or timed-out run leaves are found and stopped) and writes only under RESULTS_DIR, WORK and that
# folder, so it runs beside other jobs on other GPUs of the host (CUDA_VISIBLE_DEVICES picks this one).
# VERL_PLATFORM=cpu: the same flow on CPU, each family at hidden 64 (make_model.py --hidden 64 --family ...), STEPS 2,
# to check the script itself; with GPUS=2, Ray counts 2 GPUs and each recipe runs 2 CPU workers (the Qwen3-30B-A3B
# DAPO recipe: FSDP world size 2 and one rollout replica of 2 pipeline stages, K3 KL 0.0 at both steps).
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
RESULTS=$(realpath -m "${1:?usage: recipes_gpu.sh RESULTS_DIR}")
mkdir -p "$RESULTS"
exec > >(tee -a "$RESULTS/progress.log") 2>&1
export RAY_ADDRESS=local
unset VERL_FILE_LOGGER_PATH
LAYERS=${LAYERS:-2}
GPUS=${GPUS:-1}
[[ "$GPUS" =~ ^[1-9][0-9]*$ ]] || { echo "GPUS must be a positive integer, got '$GPUS'" >&2; exit 2; }
source scripts/checks/verl_job_lib.sh
verl_job_setup recipes
EXTRA=("${CPU_EXTRA[@]}")
if [ "$CPU" = 1 ]; then STEPS=${STEPS:-2}; else STEPS=${STEPS:-5}; fi
WORK=$(realpath -m "${WORK:-/tmp/vexact-recipes-gpu-$TAG}")
RECIPE_TIMEOUT=${RECIPE_TIMEOUT:-300}
BUDGET=${BUDGET:-900}   # seconds for the whole run: a recipe starts only while at least MIN_RUN of them are left
MIN_RUN=${MIN_RUN:-150}
rm -rf "$WORK" && mkdir -p "$WORK"
RUNS="$RESULTS/recipes-$TAG-runs.jsonl"
: > "$RUNS"
T0=$(date +%s)
echo "== recipes_gpu: $GPU, $GPUS GPU(s) a recipe, commit $COMMIT, $LAYERS layers, $STEPS steps, work dir $WORK ($(df -h --output=avail "$WORK" | tail -1) free)"
date -u

# recipe run name -> "script shape KEY=VALUE..." (the run's environment beside SMOKE, NNODES, GPUS_PER_NODE; PP=1 only
# on one GPU: on more, the recipe's own pipeline stages)
declare -A PLAN=(
  [qwen3_1.7b_grpo_gsm8k]="qwen3_1.7b_grpo_gsm8k qwen3-1.7b"
  [qwen3_30b_a3b_dapo_math]="qwen3_30b_a3b_dapo_math qwen3-30b-a3b PP=1"
  [qwen3_30b_a3b_reinforce_pp_dapo_math]="qwen3_30b_a3b_reinforce_pp_dapo_math qwen3-30b-a3b PP=1"
  [moonlight_16b_a3b-grpo]="moonlight_16b_a3b moonlight-16b-a3b ALGO=grpo"
  [moonlight_16b_a3b-reinforce_pp]="moonlight_16b_a3b moonlight-16b-a3b ALGO=reinforce_pp"
  [r1_distill_qwen_1.5b_verify_pair_math]="r1_distill_qwen_1.5b_verify_pair_math r1-distill-qwen-1.5b ARMS=vexact"
  [llama_3.1_8b_grpo_gsm8k]="llama_3.1_8b_grpo_gsm8k llama-3.1-8b"
)
# one recipe of each family first, then the second recipes of the MoE families
ORDER=(qwen3_1.7b_grpo_gsm8k r1_distill_qwen_1.5b_verify_pair_math llama_3.1_8b_grpo_gsm8k moonlight_16b_a3b-grpo
       qwen3_30b_a3b_dapo_math moonlight_16b_a3b-reinforce_pp qwen3_30b_a3b_reinforce_pp_dapo_math)
read -r -a SELECTED <<< "${ONLY:-${ORDER[*]}}"
for name in "${SELECTED[@]}"; do
  [ -n "${PLAN[$name]:-}" ] || { echo "ONLY: unknown recipe run '$name' (${ORDER[*]})" >&2; exit 2; }
done
if [ "$(comm -3 <(ls examples/recipes/*.sh | xargs -n1 basename | sed 's/\.sh$//' | grep -vx common | sort) \
  <(for n in "${ORDER[@]}"; do echo "${n%%-*}"; done | sort -u))" ]; then
  echo "recipes_gpu: examples/recipes/ and this script's list differ; add the new recipe to PLAN" >&2
  exit 2
fi

for name in gsm8k math dapo_math aime24 aime25; do
  python3 examples/data/prepare.py "$name" --out "$WORK/data" --from "examples/data/samples/$name.jsonl" || exit 1
done
python3 examples/data/prepare.py gsm8k --out "$WORK/data" --from examples/data/samples/gsm8k.jsonl --split test || exit 1

make_models() {  # every selected recipe's model, in run order, one at a time: SHAPE.done or SHAPE.failed beside it
  local name shape spec margs
  for name in "${SELECTED[@]}"; do
    [ -e "$WORK/models/stop" ] && return
    read -r -a spec <<< "${PLAN[$name]}"
    shape=${spec[1]}
    [ -e "$WORK/models/$shape.done" ] && continue
    if [ "$CPU" = 1 ]; then
      case "$shape" in  # the family at a tiny width
        qwen3-30b-a3b) margs=(--experts 8 --top-k 2) ;;
        moonlight-16b-a3b) margs=(--family deepseek_v3 --experts 8 --top-k 2) ;;
        r1-distill-qwen-1.5b) margs=(--family qwen2) ;;
        llama-3.1-8b) margs=(--family llama) ;;
        *) margs=() ;;
      esac
      margs=(--hidden 64 "${margs[@]}")
    else
      margs=(--shape "$shape")
    fi
    if python3 examples/verl_grpo/make_model.py "${margs[@]}" --layers "$LAYERS" --out "$WORK/models/$shape"; then
      touch "$WORK/models/$shape.done"
    else
      touch "$WORK/models/$shape.failed"
    fi
  done
}
mkdir -p "$WORK/models"
make_models &  # beside the first recipes' runs: the models of the later ones are written on the host's CPU meanwhile
MAKER=$!

record() {  # record NAME SHAPE RC WALL METRICS ENV [SKIPPED]: one line of the table's input
  local label=$2
  [ "$CPU" = 1 ] && label="$2 family at hidden 64"
  NAME=$1 SHAPE=$label LAYERS=$LAYERS STEPS=$STEPS RC=$3 WALL=$4 METRICS=$5 ENVS=$6 SKIPPED=${7:-} python3 -c '
import json, os
e = os.environ
print(json.dumps(dict(name=e["NAME"], shape=e["SHAPE"], layers=int(e["LAYERS"]), steps=int(e["STEPS"]), rc=int(e["RC"]),
                      wall_s=int(e["WALL"]), metrics=e["METRICS"], env=e["ENVS"], skipped=e["SKIPPED"])))' >> "$RUNS"
}

FAILED=0
for name in "${SELECTED[@]}"; do
  read -r -a spec <<< "${PLAN[$name]}"
  script=${spec[0]} shape=${spec[1]}
  envs=()
  for e in "${spec[@]:2}"; do [ "$GPUS" -gt 1 ] && [ "$e" = PP=1 ] || envs+=("$e"); done
  model="$WORK/models/$shape"
  out="$RESULTS/recipes-$TAG-$name"
  elapsed=$(( $(date +%s) - T0 ))
  if [ "$elapsed" -gt "$((BUDGET - MIN_RUN))" ]; then
    echo "== $name: not run, $elapsed s of the $BUDGET s budget spent"
    record "$name" "$shape" 0 0 "$out.jsonl" "SMOKE=1 NNODES=1 GPUS_PER_NODE=$GPUS ${envs[*]}" \
      "time budget: $elapsed of $BUDGET s spent"
    FAILED=1
    continue
  fi
  while [ ! -e "$model.done" ] && [ ! -e "$model.failed" ]; do sleep 2; done
  if [ -e "$model.failed" ]; then
    echo "== $name: make_model.py failed for $shape"
    record "$name" "$shape" 1 0 "$out.jsonl" "SMOKE=1 NNODES=1 GPUS_PER_NODE=$GPUS ${envs[*]}" \
      "make_model.py --shape $shape failed"
    FAILED=1
    continue
  fi
  run_dir="$WORK/runs/$name"
  cmd=(env SMOKE=1 NNODES=1 GPUS_PER_NODE=$GPUS MODEL_DIR="$model" DATA_DIR="$WORK/data" RUN_DIR="$run_dir" "${envs[@]}"
       timeout "$RECIPE_TIMEOUT" bash "examples/recipes/$script.sh" trainer.total_training_steps="$STEPS"
       trainer.save_freq=-1 trainer.val_before_train=False +ray_kwargs.ray_init.include_dashboard=False
       +ray_kwargs.ray_init._temp_dir="$RAY_TMP"
       reward.custom_reward_function.path="$ROOT/examples/verl_grpo/reward.py" "${EXTRA[@]}")
  echo "== $name: ${cmd[*]}"
  start=$(date +%s)
  rc=0
  "${cmd[@]}" > "$out.log" 2>&1 || rc=$?
  wall=$(( $(date +%s) - start ))
  reap
  metrics=$(ls "$run_dir"/*.jsonl 2> /dev/null | head -1)
  [ -n "$metrics" ] && cp "$metrics" "$out.jsonl"
  echo "== $name: exit $rc after $wall s, $(cat "$out.jsonl" 2> /dev/null | wc -l) metric lines"
  [ "$rc" = 0 ] || { FAILED=1; tail -30 "$out.log"; }
  record "$name" "$shape" "$rc" "$wall" "$out.jsonl" "SMOKE=1 NNODES=1 GPUS_PER_NODE=$GPUS ${envs[*]}"
done

HEADER=(
  "# Recipes, $GPUS GPU(s) a recipe: $STEPS steps each, random weights of each family's shape at $LAYERS layers"
  ""
  "- Date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  "- GPU: $GPU"
  "- Commit: $COMMIT"
  "- Command: \`bash scripts/checks/recipes_gpu.sh $1\`$([ "$CPU" = 1 ] && echo ", VERL_PLATFORM=cpu")$([ -n "${ONLY:-}" ] && echo ", ONLY='$ONLY'")$([ "$BUDGET" != 900 ] && echo ", BUDGET=$BUDGET")$([ "$GPUS" != 1 ] && echo ", GPUS=$GPUS")$([ "$LAYERS" != 2 ] && echo ", LAYERS=$LAYERS")"
  "- Each run: \`env SMOKE=1 NNODES=1 GPUS_PER_NODE=$GPUS MODEL_DIR=... DATA_DIR=... RUN_DIR=... [ENV] bash"
  "  examples/recipes/SCRIPT.sh trainer.total_training_steps=$STEPS trainer.save_freq=-1 trainer.val_before_train=False"
  "  +ray_kwargs.ray_init.include_dashboard=False +ray_kwargs.ray_init._temp_dir=$RAY_TMP"
  "  reward.custom_reward_function.path=examples/verl_grpo/reward.py"
  "  ${EXTRA[*]}\`"
  "- Data: examples/data/prepare.py on the committed samples (examples/data/samples/); models:"
  "  examples/verl_grpo/make_model.py --shape SHAPE --layers $LAYERS (byte vocabulary); metrics:"
  "  recipes-$TAG-<recipe>.jsonl (verl's file logger). K3 KL: verl's rollout_corr/k3_kl (rollout logprobs against the"
  "  actor's); a run passes with every step logged and K3 KL and training/rollout_probs_diff_max exactly 0.0 at each."
)
STATUS=0
python3 examples/recipes/smoke_results.py "$RUNS" --out "$RESULTS/recipes-$TAG.md" "${HEADER[@]/#/--header=}" || STATUS=1
[ "$FAILED" = 0 ] || STATUS=1
touch "$WORK/models/stop"
wait "$MAKER"  # at most the model it is writing (a bare `wait` would also wait for the tee of progress.log)
[ "${KEEP_WORK:-0}" = 1 ] || rm -rf "$WORK" "$RAY_TMP"
date -u
echo "recipes_gpu done: $([ "$STATUS" = 0 ] && echo PASS || echo FAIL) after $(( $(date +%s) - T0 )) s; $RESULTS/recipes-$TAG.md"
exit "$STATUS"
