#!/usr/bin/env bash
# Qwen3-30B-A3B, REINFORCE++ on DAPO-Math-17k, validated on AIME 2024 (mean@16 at temperature 1.0, top-p 0.7) every
# 10 steps.
# Hardware: several nodes of 8 GPUs of 80 GB (default NNODES=4: 32 GPUs), one Ray cluster (README.md, "Recipes":
# start Ray on each node, then run this on the head node). Rollout: pipeline replicas of PP=2 stages (PP=1 where one
# GPU holds the model); actor: FSDP2 over every GPU, parameters and optimizer state offloaded between phases.
#
#   python examples/data/prepare.py dapo_math --out data && python examples/data/prepare.py aime24 --out data
#   NNODES=4 MODEL_DIR=/models/Qwen3-30B-A3B DATA_DIR=/shared/data bash examples/recipes/qwen3_30b_a3b_reinforce_pp_dapo_math.sh
#
# REINFORCE++: no critic; each token's return is the sequence reward (gamma 1) minus the per-token KL penalty to the
# reference (k1, coefficient 0.001, in the reward), and advantages are whitened over the whole batch rather than per
# prompt group. PPO-style clip 0.2 on the ratio, token-level loss, 512 prompts x 4 responses a step, 8 mini-batches,
# lr 1e-6 with 10 warm-up steps, responses up to 8192 tokens. Also read: PP, KV_BLOCKS (as in
# qwen3_30b_a3b_dapo_math.sh). Environment and SMOKE=1: examples/recipes/common.sh.
source "$(dirname "$0")/common.sh"
recipe_init qwen3-30b-a3b-reinforce-pp-dapo-math 4 8
need_data dapo_math/train.parquet aime24/test.parquet
PP=${PP:-2}
KV_BLOCKS=${KV_BLOCKS:-32768}
[[ "$PP" =~ ^[1-9][0-9]*$ ]] && [ $((GPUS_PER_NODE % PP)) = 0 ] \
  || die "PP=$PP must be a positive integer that divides GPUS_PER_NODE=$GPUS_PER_NODE"

launch "${VEXACT[@]}" \
  algorithm.adv_estimator=reinforce_plus_plus \
  algorithm.gamma=1.0 \
  algorithm.use_kl_in_reward=True \
  algorithm.kl_penalty=kl \
  algorithm.kl_ctrl.type=fixed \
  algorithm.kl_ctrl.kl_coef=0.001 \
  data.train_files="$DATA_DIR/dapo_math/train.parquet" \
  data.val_files="$DATA_DIR/aime24/test.parquet" \
  data.train_batch_size="$(pick 512 2)" \
  data.max_prompt_length="$(pick 2048 384)" \
  data.max_response_length="$(pick 8192 16)" \
  data.filter_overlong_prompts=True \
  data.truncation=left \
  actor_rollout_ref.model.enable_gradient_checkpointing=True \
  actor_rollout_ref.actor.optim.lr=1e-6 \
  actor_rollout_ref.actor.optim.lr_warmup_steps=10 \
  actor_rollout_ref.actor.grad_clip=1.0 \
  actor_rollout_ref.actor.ppo_mini_batch_size="$(pick 64 2)" \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu="$(pick 2 8)" \
  actor_rollout_ref.actor.use_kl_loss=False \
  actor_rollout_ref.actor.entropy_coeff=0 \
  actor_rollout_ref.actor.clip_ratio=0.2 \
  actor_rollout_ref.actor.loss_agg_mode=token-mean \
  actor_rollout_ref.actor.fsdp_config.param_offload=True \
  actor_rollout_ref.actor.fsdp_config.optimizer_offload=True \
  actor_rollout_ref.rollout.n=4 \
  actor_rollout_ref.rollout.temperature=1.0 \
  actor_rollout_ref.rollout.top_p=1.0 \
  actor_rollout_ref.rollout.pipeline_model_parallel_size="$PP" \
  +actor_rollout_ref.rollout.engine_kwargs.vexact.num_kv_blocks="$(pick "$KV_BLOCKS" 256)" \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu="$(pick 4 8)" \
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu="$(pick 4 8)" \
  actor_rollout_ref.ref.fsdp_config.param_offload=True \
  actor_rollout_ref.rollout.val_kwargs.do_sample=True \
  actor_rollout_ref.rollout.val_kwargs.n="$(pick 16 2)" \
  actor_rollout_ref.rollout.val_kwargs.temperature=1.0 \
  actor_rollout_ref.rollout.val_kwargs.top_p=0.7 \
  trainer.val_before_train=True \
  trainer.test_freq=10 \
  trainer.save_freq=20 \
  "$(pick trainer.total_epochs=10 trainer.total_training_steps=2)" \
  "$@"
