#!/usr/bin/env bash
# A verl GRPO run rerun and resumed, bitwise, on one GPU (the Qwen3-1.7B shape, random weights):
#
#   bash scripts/checks/resume_gpu.sh RESULTS_DIR
#
# Three jobs of examples/verl_grpo/run_grpo.sh (vexact rollout and invariant actor, seeded per request, batch in
# dataloader order), one after another:
#   A  STEPS steps (20) uninterrupted, checkpoint at the last step;
#   B  the same job stopped after STOP steps (10), checkpoint there (model, optimizer, LR scheduler and RNG states,
#      dataloader position);
#   C  B's directory resumed with verl's trainer.resume_mode=auto up to step STEPS.
# Then examples/verl_grpo/resume_results.py: rerun (B's steps 1..STOP against A's) and resume (C's steps
# STOP+1..STEPS and C's final weights against A's), every logged number except timings with ==, every checkpoint
# tensor with torch.equal. Exit status 1 when anything differs or a job fails.
#
# Outputs in RESULTS_DIR: resume-<TAG>.md (date, GPU, commit, commands, the table), resume-<TAG>-{a,b,c}.jsonl (verl's
# file logger) and .log, progress.log. Checkpoints, model and data go to WORK (default /tmp/vexact-resume-gpu-<TAG>),
# removed at the end with the Ray temp dir (KEEP_WORK=1 keeps them). The final checkpoints of A and C hold the model
# and extra states only (5.6 GB of fp32 weights at 28 layers), B's the optimizer too (17 GB): about 28 GB at the peak;
# trainer.max_actor_ckpt_to_keep=1.
#
# Environment: SHAPE (qwen3-1.7b), LAYERS (28), STEPS (20), STOP (10), BATCH (32 prompts), N (4 responses each),
# RESP (64 tokens), LR (3e-6), GPU_MEM (0.4), JOB_TIMEOUT (600 s a job), TAG (file-name prefix: the GPU, e.g. h100),
# COMMIT. LR 3e-6 is the verify pairs' (examples/verify) on the same model and data. The reward is reward.py's
# compute_score_half_digits, whose digit credit peaks at half digits: with the plain share-of-digits credit the
# policy writes only digits from step 11 on (H100, lr 3e-6), and every later step has zero advantages and a zero
# gradient (at 1e-4 from step 3 on). resume_results.py fails a run with more than 2 zero-gradient steps.
# Estimate on an H100 at the defaults: a step ~11 s, verl's start ~90 s, checkpoint writes and loads ~1 min in all:
# A ~5.5 min, B ~3.5, C ~4, model and comparison ~1; about 14 minutes (LAYERS=14: about 10).
# Each job starts a Ray cluster of its own (RAY_ADDRESS=local, its files under /tmp/ray-resume-<TAG>, where the Ray
# processes a failed or timed-out job leaves are found and stopped) and writes only under RESULTS_DIR, WORK and that
# folder, so it runs beside other jobs on other GPUs of the host (CUDA_VISIBLE_DEVICES picks this one).
# VERL_PLATFORM=cpu: the same flow on CPU at tiny sizes (hidden 64, 2 layers, 4 steps stopped at 2, 4 x 2 responses
# of 16 tokens, lr 1e-4), to check the script itself.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
RESULTS=$(realpath -m "${1:?usage: resume_gpu.sh RESULTS_DIR}")
mkdir -p "$RESULTS"
exec > >(tee -a "$RESULTS/progress.log") 2>&1
export RAY_ADDRESS=local
source scripts/checks/verl_job_lib.sh
verl_job_setup resume
if [ "$CPU" = 1 ]; then
  SHAPE_ARGS=(--hidden 64 --layers 2)
  SHAPE_TEXT="tiny Qwen3 (hidden 64, 2 layers)"
  STEPS=${STEPS:-4} STOP=${STOP:-2} BATCH=${BATCH:-4} N=${N:-2} RESP=${RESP:-16} LR=${LR:-1e-4}
  EXTRA=("${CPU_EXTRA[@]}" actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8
         actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8)
else
  SHAPE=${SHAPE:-qwen3-1.7b} LAYERS=${LAYERS:-28}
  SHAPE_ARGS=(--shape "$SHAPE" --layers "$LAYERS")
  SHAPE_TEXT="$SHAPE shape, $LAYERS layers, random weights (examples/verl_grpo/make_model.py --seed 0)"
  STEPS=${STEPS:-20} STOP=${STOP:-10} BATCH=${BATCH:-32} N=${N:-4} RESP=${RESP:-64} LR=${LR:-3e-6}
  EXTRA=()
fi
[ "$STOP" -gt 0 ] && [ "$STOP" -lt "$STEPS" ] || { echo "STOP=$STOP must be in 1..$((STEPS - 1))" >&2; exit 2; }
WORK=$(realpath -m "${WORK:-/tmp/vexact-resume-gpu-$TAG}")
JOB_TIMEOUT=${JOB_TIMEOUT:-600}
rm -rf "$WORK" && mkdir -p "$WORK"
echo "== resume_gpu: $GPU, commit $COMMIT, $SHAPE_TEXT, $STEPS steps, stop at $STOP, work dir $WORK ($(df -h --output=avail "$WORK" | tail -1) free)"
date -u

T0=$(date +%s)
python3 examples/verl_grpo/make_model.py "${SHAPE_ARGS[@]}" --out "$WORK/model" || exit 1
python3 examples/verl_grpo/make_dataset.py --out "$WORK/data" || exit 1
echo "== model and data: $(( $(date +%s) - T0 )) s, model $(du -sh "$WORK/model" | cut -f1)"

# the settings the three jobs share (run_grpo.sh's own, then these); each job adds its steps and checkpoint settings
SHARED=(
  +ray_kwargs.ray_init.include_dashboard=False +ray_kwargs.ray_init._temp_dir="$RAY_TMP"
  actor_rollout_ref.actor.strategy=vexact
  data.train_batch_size="$BATCH" actor_rollout_ref.actor.ppo_mini_batch_size="$BATCH"
  actor_rollout_ref.rollout.n="$N" data.max_response_length="$RESP"
  reward.custom_reward_function.path="$ROOT/examples/verl_grpo/reward.py"
  reward.custom_reward_function.name=compute_score_half_digits
  trainer.max_actor_ckpt_to_keep=1
  "${EXTRA[@]}"
)
SMALL_CKPT=("actor_rollout_ref.actor.checkpoint.save_contents=[model,extra]")
declare -A WALL
COMMANDS=()
job() {  # job NAME RUN_DIR STEPS OVERRIDES...: one run of run_grpo.sh; metrics in RESULTS/resume-TAG-NAME.jsonl
  local name=$1 dir=$2 steps=$3
  shift 3
  local log="$RESULTS/resume-$TAG-$name"
  local cmd=(env MODEL="$WORK/model" DATA="$WORK/data" STEPS="$steps" LR="$LR" GPU_MEM="${GPU_MEM:-0.4}"
             RUN_DIR="$dir" NAME=grpo VERL_FILE_LOGGER_PATH="$log.jsonl"
             timeout "$JOB_TIMEOUT" bash examples/verl_grpo/run_grpo.sh "${SHARED[@]}" "$@")
  COMMANDS+=("$name: ${cmd[*]}")
  echo "== job $name: ${cmd[*]}"
  local start rc=0
  start=$(date +%s)
  "${cmd[@]}" > "$log.log" 2>&1 || rc=$?
  WALL[$name]=$(( $(date +%s) - start ))
  reap
  echo "== job $name: exit $rc after ${WALL[$name]} s, $(cat "$log.jsonl" 2> /dev/null | wc -l) metric lines"
  du -sh "$dir"/checkpoints/grpo/global_step_* 2> /dev/null
  [ "$rc" = 0 ] || { tail -40 "$log.log"; echo "resume_gpu: job $name failed (rc $rc), see $log.log"; }
  return "$rc"
}

FAILED=0
job a "$WORK/a" "$STEPS" trainer.save_freq="$STEPS" "${SMALL_CKPT[@]}" || FAILED=1
job b "$WORK/b" "$STOP" trainer.save_freq="$STOP" || FAILED=1
job c "$WORK/b" "$STEPS" trainer.save_freq="$STOP" trainer.resume_mode=auto "${SMALL_CKPT[@]}" \
  "actor_rollout_ref.actor.checkpoint.load_contents=[model,optimizer,extra]" || FAILED=1
CKPT_SIZES=$(for d in "$WORK"/{a,b}/checkpoints/grpo/global_step_*; do
  [ -d "$d" ] && printf '%s %s; ' "${d#"$WORK"/}" "$(du -sh "$d" | cut -f1)"
done)

HEADER=(
  "# Rerun and resume, bitwise: verl GRPO on one GPU"
  ""
  "- Date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  "- GPU: $GPU"
  "- Commit: $COMMIT"
  "- Command: \`bash scripts/checks/resume_gpu.sh $1\`$([ "$CPU" = 1 ] && echo " with VERL_PLATFORM=cpu")"
  "- Model: $SHAPE_TEXT; data: examples/verl_grpo/make_dataset.py; $BATCH prompts x $N responses of up to $RESP"
  "  tokens a step, lr $LR, reward examples/verl_grpo/reward.py:compute_score_half_digits"
  "- Jobs (examples/verl_grpo/run_grpo.sh): A $STEPS steps (${WALL[a]:-?} s), B stopped after $STOP (${WALL[b]:-?} s),"
  "  C resumed from B's step-$STOP checkpoint to $STEPS (${WALL[c]:-?} s); checkpoints (A and C: model and extra"
  "  states, B: with the optimizer; C's run keeps B's): ${CKPT_SIZES%; }"
  "- Metrics: resume-$TAG-a.jsonl, resume-$TAG-b.jsonl, resume-$TAG-c.jsonl (verl's file logger); compared by"
  "  examples/verl_grpo/resume_results.py (examples/verl_grpo/compare_runs.py: every number but timings, throughput"
  "  and memory with ==; checkpoint tensors with torch.equal)"
  ""
  "Commands (in the repository root):"
  ""
)
for c in "${COMMANDS[@]}"; do HEADER+=("    $c"); done
STATUS=0
python3 examples/verl_grpo/resume_results.py "$RESULTS/resume-$TAG-"{a,b,c}.jsonl --stop "$STOP" --steps "$STEPS" \
  --checkpoints "$WORK/b/checkpoints/grpo/global_step_$STEPS" "$WORK/a/checkpoints/grpo/global_step_$STEPS" \
  --out "$RESULTS/resume-$TAG.md" "${HEADER[@]/#/--header=}" || STATUS=1
[ "$FAILED" = 0 ] || STATUS=1
[ "${KEEP_WORK:-0}" = 1 ] || rm -rf "$WORK" "$RAY_TMP"
date -u
echo "resume_gpu done: $([ "$STATUS" = 0 ] && echo PASS || echo FAIL) after $(( $(date +%s) - T0 )) s; $RESULTS/resume-$TAG.md"
exit "$STATUS"
