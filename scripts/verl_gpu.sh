#!/usr/bin/env bash
# The verl GPU checks (issue #7) on the device, once verl is installed there (scripts/verl_device_wheels.sh: stage the
# three bundles, then `install`, on the same warm machine). One call:
#
#   bash scripts/verl_gpu.sh RESULTS_DIR [N_GPUS] [STEPS] [tests|runs|all]
#
# - tests: `pytest -m gpu packages/vexact-verl/tests` (the rollout and actor engine through verl's registries, CUDA)
# - runs:  the verify pair (examples/verify/run_pair.sh): the same verl GRPO run with the invariant and the fast
#          rollout backend, actor.strategy=vexact for both, on a random-weights Qwen3-shaped model (hidden 1024,
#          8 layers, byte vocabulary; the device has no hub) with the shaped reward (examples/verl_grpo/reward.py);
#          then examples/verify/compare.py --expect-exact, which fails unless every invariant step has K3 == 0.0
#          and the fast run does not.
# JSONL, plot and logs land in RESULTS_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
RESULTS=${1:?usage: verl_gpu.sh RESULTS_DIR [N_GPUS] [STEPS] [tests|runs|all]}
NGPU=${2:-1}
STEPS=${3:-20}
WHAT=${4:-all}
mkdir -p "$RESULTS"
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
source scripts/device_env.sh
python3 -c "import verl, ray; print('verl', verl.__version__, 'ray', ray.__version__)"

if [ "$WHAT" = tests ] || [ "$WHAT" = all ]; then
  python3 -m pytest -q -m gpu packages/vexact-verl/tests -p no:cacheprovider 2>&1 | tail -15 | tee "$RESULTS/pytest-verl-gpu.txt"
fi
if [ "$WHAT" = runs ] || [ "$WHAT" = all ]; then
  MODEL=/tmp/verl-model
  [ -f "$MODEL/config.json" ] || python3 examples/verl_grpo/make_model.py --out "$MODEL" --hidden 1024 --layers 8
  python3 examples/verl_grpo/make_dataset.py --out /tmp/verl-data
  # rollout.n=4 x 32 prompts = 128 sequences a step; 2 GPUs: 2 FSDP ranks and 2 rollout replicas
  LOG="$RESULTS/run_pair-${NGPU}gpu.log"
  rc=0
  MODEL=$MODEL DATA=/tmp/verl-data STEPS=$STEPS LR=1e-5 RUN_DIR="$RESULTS" TAG="-${NGPU}gpu" \
    bash examples/verify/run_pair.sh \
    trainer.n_gpus_per_node="$NGPU" \
    actor_rollout_ref.actor.strategy=vexact \
    reward.custom_reward_function.path=examples/verl_grpo/reward.py \
    > "$LOG" 2>&1 || rc=$?
  # errors first (if any), then compare.py's table and verdict (the log's tail)
  sed 's/\x1b\[[0-9;]*m//g' "$LOG" | grep -E "Error|Traceback" | grep -v "UserWarning\|truncation" | head -20 || true
  tail -32 "$LOG"
  echo "run_pair exit status: $rc"
  exit "$rc"
fi
