#!/usr/bin/env bash
# Qwen3-1.7B, GRPO on GSM8K with verl's asynchronous trainer and a separate rollout: the trainer on GPUS_PER_NODE GPUs
# (default 1: GPU 0), the vexact rollout on ROLLOUT_GPUS more (default 1: GPU 1), weights synced by verl's checkpoint
# engine over NCCL after every step while the rollout keeps generating (partial rollouts: requests cut by a sync resume
# under the new weights). MODE=sync runs the same batch and lengths with verl's synchronous trainer, colocated on the
# same GPUs (GPUS_PER_NODE + ROLLOUT_GPUS of them), for the throughput comparison; MODE=colocate_async verl's
# asynchronous trainer on those GPUs with the rollout colocated (aborted, asleep while the actor trains).
#
#   python examples/data/prepare.py gsm8k --out data
#   MODEL_DIR=/models/Qwen3-1.7B DATA_DIR=data bash examples/recipes/qwen3_1.7b_separate_async.sh
#   MODE=sync MODEL_DIR=/models/Qwen3-1.7B DATA_DIR=data bash examples/recipes/qwen3_1.7b_separate_async.sh
#
# 128 prompts x 4 responses (512 sequences) of up to 1024 tokens a step (the shape of the throughput goal), 4 PPO
# mini-batches (separate_async: a weight sync every 4 of them, parameter_sync_step=4), lr 1e-6, 20 steps. Metrics per
# step (RUN_DIR/metrics.jsonl): perf/throughput (tokens/s per GPU), timing_s/update_weights and vexact/weight_sync/*
# (the sync; the gloo engine's), training/off_policy/trajectory_staleness/* (versions behind the trainer, from the
# versions the vexact server stamps), rollout_corr/k3_kl (against the trainer's current weights: 0.0 on an on-policy
# step, staleness otherwise). verl's own ReplayBuffer: OrderedReplayBuffer refuses the asynchronous modes.
# On CPU: VERL_PLATFORM=cpu uses the gloo checkpoint engine (vexact_verl.checkpoint_engine) instead of NCCL.
# Environment and SMOKE=1: examples/recipes/common.sh.
source "$(dirname "$0")/common.sh"
recipe_init qwen3-1.7b-separate-async 1 1
need_data gsm8k/train.parquet gsm8k/test.parquet
MODE=${MODE:-separate_async}
ROLLOUT_GPUS=${ROLLOUT_GPUS:-1}
[[ "$ROLLOUT_GPUS" =~ ^[1-9][0-9]*$ ]] || die "ROLLOUT_GPUS must be a positive integer, got '$ROLLOUT_GPUS'"
TOTAL=$((GPUS_PER_NODE + ROLLOUT_GPUS))
if [ "${VERL_PLATFORM:-}" != cpu ]; then
  visible=$(python3 -c "import torch; print(torch.cuda.device_count())" 2> /dev/null || echo 0)
  [ "$TOTAL" -le "$visible" ] \
    || die "GPUS_PER_NODE=$GPUS_PER_NODE + ROLLOUT_GPUS=$ROLLOUT_GPUS GPUs but this node sees $visible"
  SYNC_BACKEND=nccl
else
  SYNC_BACKEND=gloo
fi
BATCH=$(pick 128 4)
MINI=$(pick 32 4)
case "$MODE" in
  separate_async)
    PLACEMENT=(
      trainer.v1.trainer_mode=separate_async
      trainer.v1.separate_async.parameter_sync_step=$((BATCH / MINI))
      actor_rollout_ref.hybrid_engine=False
      actor_rollout_ref.rollout.nnodes="$NNODES"
      actor_rollout_ref.rollout.n_gpus_per_node="$ROLLOUT_GPUS"
      actor_rollout_ref.rollout.checkpoint_engine.backend="$SYNC_BACKEND"
      actor_rollout_ref.rollout.gpu_memory_utilization=0.85
    )
    # verl 0.9.1 logs the hybrid_engine=False set-up with logger.info(..., flush=True): a TypeError at INFO level
    export VERL_LOGGING_LEVEL=${VERL_LOGGING_LEVEL:-WARN}
    ;;
  sync | colocate_async)
    GPUS_PER_NODE=$TOTAL
    PLACEMENT=(trainer.v1.trainer_mode="$MODE" actor_rollout_ref.rollout.gpu_memory_utilization=0.5)
    ;;
  *) die "MODE must be separate_async, colocate_async or sync, got '$MODE'" ;;
esac

launch "${VEXACT[@]}" "${PLACEMENT[@]}" \
  algorithm.adv_estimator=grpo \
  algorithm.use_kl_in_reward=False \
  data.train_files="$DATA_DIR/gsm8k/train.parquet" \
  data.val_files="$DATA_DIR/gsm8k/test.parquet" \
  data.train_batch_size="$BATCH" \
  data.max_prompt_length="$(pick 512 384)" \
  data.max_response_length="$(pick 1024 16)" \
  data.filter_overlong_prompts=True \
  data.truncation=error \
  actor_rollout_ref.model.enable_gradient_checkpointing=True \
  actor_rollout_ref.actor.optim.lr=1e-6 \
  actor_rollout_ref.actor.ppo_mini_batch_size="$MINI" \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu="$(pick 16 4)" \
  actor_rollout_ref.actor.use_kl_loss=False \
  actor_rollout_ref.actor.entropy_coeff=0 \
  actor_rollout_ref.actor.loss_agg_mode=token-mean \
  actor_rollout_ref.rollout.n="$(pick 4 2)" \
  actor_rollout_ref.rollout.temperature=1.0 \
  actor_rollout_ref.rollout.max_num_seqs=512 \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu="$(pick 32 4)" \
  trainer.val_before_train=False \
  trainer.test_freq=-1 \
  trainer.save_freq=-1 \
  trainer.total_training_steps="$(pick 20 2)" \
  "$@"
