#!/usr/bin/env bash
# Qwen3-30B-A3B, DAPO on DAPO-Math-17k, validated on AIME 2024 (mean@16 at temperature 1.0, top-p 0.7) every 10 steps.
# Hardware: 8 GPUs of 80 GB on one node. The rollout runs as pipeline replicas of PP=2 stages (the 61 GB of bf16
# weights plus a KV cache do not fit one H100 beside the actor's shards): 4 replicas of 2 GPUs. On GPUs that hold the
# model whole (H200, 141 GB) PP=1 gives 8 replicas. The actor is FSDP2 over the 8 GPUs with parameters and optimizer
# state offloaded to host memory between phases.
#
#   python examples/data/prepare.py dapo_math --out data && python examples/data/prepare.py aime24 --out data
#   MODEL_DIR=/models/Qwen3-30B-A3B DATA_DIR=data bash examples/recipes/qwen3_30b_a3b_dapo_math.sh
#
# DAPO: no KL term; decoupled clip (clip-higher: 0.2 below, 0.28 above); token-level loss; dynamic sampling (groups
# whose 16 answers are all right or all wrong are dropped and refilled, metric acc); overlong shaping (verl's dapo
# reward manager: a penalty growing linearly to -1 over the last 4096 tokens of the 20480 allowed). 128 prompts x 16
# responses a step, 4 mini-batches of 32 prompts, lr 1e-6 with 10 warm-up steps, weight decay 0.1, gradient clip 1.0.
# Also read: PP (rollout pipeline stages, default 2), KV_BLOCKS (KV pages of 16 tokens per stage, the same on every
# stage; default 32768: 24 of the 48 layers at 48 KiB a token make 24 GiB beside a stage's 30.5 GB of weights).
# Environment and SMOKE=1: examples/recipes/common.sh.
source "$(dirname "$0")/common.sh"
recipe_init qwen3-30b-a3b-dapo-math 1 8
need_data dapo_math/train.parquet aime24/test.parquet
PP=${PP:-2}
KV_BLOCKS=${KV_BLOCKS:-32768}
[[ "$PP" =~ ^[1-9][0-9]*$ ]] && [ $((GPUS_PER_NODE % PP)) = 0 ] \
  || die "PP=$PP must be a positive integer that divides GPUS_PER_NODE=$GPUS_PER_NODE"
RESP=$(pick 20480 16)
OVERLONG=$(pick 4096 4)

launch "${VEXACT[@]}" \
  algorithm.adv_estimator=grpo \
  algorithm.use_kl_in_reward=False \
  algorithm.filter_groups.enable=True \
  algorithm.filter_groups.metric=acc \
  data.train_files="$DATA_DIR/dapo_math/train.parquet" \
  data.val_files="$DATA_DIR/aime24/test.parquet" \
  data.train_batch_size="$(pick 128 2)" \
  data.max_prompt_length="$(pick 2048 384)" \
  data.max_response_length="$RESP" \
  data.filter_overlong_prompts=True \
  data.truncation=left \
  actor_rollout_ref.model.enable_gradient_checkpointing=True \
  actor_rollout_ref.actor.optim.lr=1e-6 \
  actor_rollout_ref.actor.optim.lr_warmup_steps=10 \
  actor_rollout_ref.actor.optim.weight_decay=0.1 \
  actor_rollout_ref.actor.grad_clip=1.0 \
  actor_rollout_ref.actor.ppo_mini_batch_size="$(pick 32 2)" \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu="$(pick 2 8)" \
  actor_rollout_ref.actor.use_kl_loss=False \
  actor_rollout_ref.actor.kl_loss_coef=0.0 \
  actor_rollout_ref.actor.entropy_coeff=0 \
  actor_rollout_ref.actor.clip_ratio_low=0.2 \
  actor_rollout_ref.actor.clip_ratio_high=0.28 \
  actor_rollout_ref.actor.clip_ratio_c=10.0 \
  actor_rollout_ref.actor.loss_agg_mode=token-mean \
  actor_rollout_ref.actor.fsdp_config.param_offload=True \
  actor_rollout_ref.actor.fsdp_config.optimizer_offload=True \
  actor_rollout_ref.rollout.n=16 \
  actor_rollout_ref.rollout.temperature=1.0 \
  actor_rollout_ref.rollout.top_p=1.0 \
  actor_rollout_ref.rollout.top_k=-1 \
  actor_rollout_ref.rollout.pipeline_model_parallel_size="$PP" \
  +actor_rollout_ref.rollout.engine_kwargs.vexact.num_kv_blocks="$(pick "$KV_BLOCKS" 256)" \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu="$(pick 4 8)" \
  actor_rollout_ref.rollout.val_kwargs.do_sample=True \
  actor_rollout_ref.rollout.val_kwargs.n="$(pick 16 2)" \
  actor_rollout_ref.rollout.val_kwargs.temperature=1.0 \
  actor_rollout_ref.rollout.val_kwargs.top_p=0.7 \
  reward.reward_manager.name=dapo \
  +reward.reward_kwargs.max_resp_len="$RESP" \
  +reward.reward_kwargs.overlong_buffer_cfg.enable=True \
  +reward.reward_kwargs.overlong_buffer_cfg.len="$OVERLONG" \
  +reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0 \
  +reward.reward_kwargs.overlong_buffer_cfg.log=True \
  trainer.val_before_train=True \
  trainer.test_freq=10 \
  trainer.save_freq=20 \
  "$(pick trainer.total_epochs=10 trainer.total_training_steps=2)" \
  "$@"
