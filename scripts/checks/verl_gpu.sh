#!/usr/bin/env bash
# The verl GPU checks on a GPU machine, once verl is installed there (scripts/staging/verl_device_wheels.sh: stage
# every bundle, then `install`, on the same machine).
#
#   bash scripts/checks/verl_gpu.sh RESULTS_DIR N_GPUS STEPS WHAT [LR]
#
# WHAT:
# - tests:     `pytest -m gpu packages/vexact-verl/tests` (rollout and actor engine through verl's registries, CUDA)
# - invariant: one verl GRPO run, rollout backend invariant (examples/verl_grpo/run_grpo.sh)
# - fast:      the same run with the fast rollout backend
# - pair:      both, then examples/verify/compare.py --expect-exact invariant
# Every run: actor_rollout_ref.actor.strategy=vexact, a random-weights Qwen3-shaped model (hidden 1024, 8 layers,
# byte vocabulary: no hub access needed), the shaped reward examples/verl_grpo/reward.py, LR default 3e-6.
# A pair of 20-step runs takes about 11 minutes on one H100; `invariant` and `fast` may run as separate commands,
# then compare.py on the two JSONL files. JSONL and logs land in RESULTS_DIR.
#
# ENGINE (env) picks the actor's and ref's model engine:
# - fsdp (default): actor_rollout_ref.actor.strategy=vexact (the vexact FSDP engine)
# - veomni: model_engine=veomni with the vexact VeOmni engine (vexact_verl.veomni_engine.VexactVeOmniEngineConfig as
#   the _target_ of actor.veomni and ref.veomni); needs veomni in /tmp/site (verl_device_wheels.sh stages it).
#   `invariant`: K3 exactly 0.0 at every step; `fast`: the fast rollout against the same actor, K3 > 0.
# - veomni-verl: verl's own VeOmni engine (VeOmni's HF model, SDPA attention), the baseline a VeOmni user has today;
#   one GPU needs init_device=cuda there (VeOmni shards only when the data-parallel world is > 1). Not a contract.
# e.g. ENGINE=veomni bash scripts/checks/verl_gpu.sh $OUT 1 20 invariant; then the same with `fast`.
set -euo pipefail
cd "$(dirname "$0")/../.."
RESULTS=${1:?usage: verl_gpu.sh RESULTS_DIR N_GPUS STEPS tests|invariant|fast|pair [LR]}
NGPU=${2:-1}
STEPS=${3:-20}
WHAT=${4:-tests}
LR=${5:-3e-6}
mkdir -p "$RESULTS"
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
source scripts/staging/device_env.sh
python3 -c "import verl, ray; print('verl', verl.__version__, 'ray', ray.__version__)"

if [ "$WHAT" = tests ]; then
  python3 -m pytest -q -m gpu packages/vexact-verl/tests -p no:cacheprovider 2>&1 | tail -15
  exit "${PIPESTATUS[0]}"
fi

# EXPERTS=32 (env): a Qwen3-MoE of the same width, 32 experts top-4 in every layer
# FAMILY=deepseek_v3 (env): a DeepSeek-V3 / Moonlight-style model instead (MLA, first layer dense, EXPERTS routed
# experts (default 16) in 4 groups, top-4, one shared expert; the DeepSeek verl pair)
EXPERTS=${EXPERTS:-0}
FAMILY=${FAMILY:-qwen3}
MODEL=/tmp/verl-model-$FAMILY-e$EXPERTS
[ -f "$MODEL/config.json" ] || python3 examples/verl_grpo/make_model.py --out "$MODEL" --hidden 1024 --layers 8 \
  --experts "$EXPERTS" --family "$FAMILY"
[ -f /tmp/verl-data/train.parquet ] || python3 examples/verl_grpo/make_dataset.py --out /tmp/verl-data
# 32 prompts x rollout.n=4 a step; N_GPUS=2: 2 FSDP ranks and 2 rollout replicas (verl: world / TP)
ENGINE=${ENGINE:-fsdp}
VEOMNI_TARGET=vexact_verl.veomni_engine.VexactVeOmniEngineConfig
case "$ENGINE" in
  fsdp) ENGINE_ARGS=(actor_rollout_ref.actor.strategy=vexact) ;;
  veomni) ENGINE_ARGS=(model_engine=veomni actor_rollout_ref.actor.veomni._target_=$VEOMNI_TARGET
                       actor_rollout_ref.ref.veomni._target_=$VEOMNI_TARGET) ;;
  veomni-verl) ENGINE_ARGS=(model_engine=veomni actor_rollout_ref.actor.veomni.attn_implementation=sdpa
                            actor_rollout_ref.actor.veomni.init_device=cuda actor_rollout_ref.ref.veomni.init_device=cuda) ;;
  *) echo "unknown ENGINE: $ENGINE (fsdp, veomni, veomni-verl)" >&2; exit 2 ;;
esac
if [ "$ENGINE" != fsdp ]; then
  python3 -c "import veomni, verl.workers.engine.veomni; print('veomni', veomni.__version__)"
fi
# PP=2 (env): each rollout replica a pipeline of 2 stages over 2 GPUs (rollout.pipeline_model_parallel_size; issue
# a 2x H200 run: N_GPUS=2 gives one replica, its two stages on the two GPUs the 2 FSDP ranks also use)
PP=${PP:-1}
ARGS=(trainer.n_gpus_per_node="$NGPU" "${ENGINE_ARGS[@]}"
      actor_rollout_ref.rollout.pipeline_model_parallel_size="$PP"
      reward.custom_reward_function.path=examples/verl_grpo/reward.py)
# a pipeline's stages must hold the same number of KV pages, so it is given, not sized from free memory: 4096 pages of
# 16 tokens hold a step's 128 sequences of <= 192 tokens with room to spare
if [ "$PP" -gt 1 ]; then ARGS+=(+actor_rollout_ref.rollout.engine_kwargs.vexact.num_kv_blocks="${KV_BLOCKS:-4096}"); fi
export MODEL DATA=/tmp/verl-data STEPS LR RUN_DIR="$RESULTS"
# (if-statements, not `[ ] && echo` in a substitution: under set -e a false test there ended the script silently)
TAG=""
if [ "$ENGINE" != fsdp ]; then TAG="$TAG-$ENGINE"; fi
if [ "$FAMILY" != qwen3 ]; then TAG="$TAG-$FAMILY"; fi
if [ "$EXPERTS" -gt 0 ]; then TAG="$TAG-moe$EXPERTS"; fi
if [ "$PP" -gt 1 ]; then TAG="$TAG-pp$PP"; fi
TAG="$TAG-${NGPU}gpu-lr${LR}"
LOG="$RESULTS/$WHAT$TAG.log"
rc=0
case "$WHAT" in
  invariant|fast) BACKEND=$WHAT NAME="verl${TAG}-$WHAT" bash examples/verl_grpo/run_grpo.sh "${ARGS[@]}" > "$LOG" 2>&1 \
                    || rc=$? ;;
  pair) { for b in invariant fast; do BACKEND=$b NAME="verl${TAG}-$b" bash examples/verl_grpo/run_grpo.sh "${ARGS[@]}"; done \
          && python3 examples/verify/compare.py "$RESULTS/verl${TAG}-invariant.jsonl" "$RESULTS/verl${TAG}-fast.jsonl" \
               --plot "$RESULTS/verl${TAG}.png" --expect-exact invariant; } > "$LOG" 2>&1 || rc=$? ;;
  *) echo "unknown WHAT: $WHAT" >&2; exit 2 ;;
esac
# errors first (if any), then the log's tail (compare.py's table and verdict for a pair)
sed 's/\x1b\[[0-9;]*m//g' "$LOG" | grep -E "Error|Traceback" | grep -v "UserWarning\|truncation" | head -20 || true
tail -32 "$LOG" | sed 's/\x1b\[[0-9;]*m//g' | cut -c1-300
echo "exit status: $rc"
exit "$rc"
