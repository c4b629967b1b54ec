#!/usr/bin/env bash
# gpt-oss-20b (24 layers, a window of 128 keys on alternate layers, a sink logit per head, 32 experts top-4), GRPO on
# GSM8K, validated on GSM8K's test split (greedy) every 10 steps.
# Hardware: 8 GPUs of 80 GB on one node (the default; H100 or H200): the released checkpoint's MXFP4 experts load
# dequantised to bf16, 42 GB of weights, which one GPU holds with room for the KV cache, so 8 rollout replicas; the
# actor is FSDP2 over the 8 GPUs with parameters and optimizer state offloaded between phases.
#
#   python examples/data/prepare.py gsm8k --out data
#   MODEL_DIR=/models/gpt-oss-20b DATA_DIR=data bash examples/recipes/gpt_oss_20b_grpo.sh
#
# GRPO: 256 prompts x 8 responses up to 2048 tokens (the chat template's reasoning comes before the answer), 4
# mini-batches of 64 prompts, lr 1e-6, k3 KL loss 0.001, no entropy bonus, 15 epochs. Environment and SMOKE=1:
# examples/recipes/common.sh.
source "$(dirname "$0")/common.sh"
recipe_init gpt-oss-20b-grpo-gsm8k 1 8
need_data gsm8k/train.parquet gsm8k/test.parquet

launch "${VEXACT[@]}" \
  algorithm.adv_estimator=grpo \
  algorithm.use_kl_in_reward=False \
  data.train_files="$DATA_DIR/gsm8k/train.parquet" \
  data.val_files="$DATA_DIR/gsm8k/test.parquet" \
  data.train_batch_size="$(pick 256 2)" \
  data.max_prompt_length="$(pick 512 384)" \
  data.max_response_length="$(pick 2048 16)" \
  data.filter_overlong_prompts=True \
  data.truncation=error \
  actor_rollout_ref.model.enable_gradient_checkpointing=True \
  actor_rollout_ref.actor.optim.lr=1e-6 \
  actor_rollout_ref.actor.grad_clip=1.0 \
  actor_rollout_ref.actor.ppo_mini_batch_size="$(pick 64 2)" \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu="$(pick 4 8)" \
  actor_rollout_ref.actor.use_kl_loss=True \
  actor_rollout_ref.actor.kl_loss_coef=0.001 \
  actor_rollout_ref.actor.kl_loss_type=low_var_kl \
  actor_rollout_ref.actor.entropy_coeff=0 \
  actor_rollout_ref.actor.loss_agg_mode=token-mean \
  actor_rollout_ref.actor.fsdp_config.param_offload=True \
  actor_rollout_ref.actor.fsdp_config.optimizer_offload=True \
  actor_rollout_ref.ref.fsdp_config.param_offload=True \
  actor_rollout_ref.rollout.n=8 \
  actor_rollout_ref.rollout.temperature=1.0 \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.7 \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu="$(pick 8 8)" \
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu="$(pick 8 8)" \
  actor_rollout_ref.rollout.val_kwargs.do_sample=False \
  actor_rollout_ref.rollout.val_kwargs.n=1 \
  trainer.val_before_train=True \
  trainer.test_freq=10 \
  trainer.save_freq=50 \
  "$(pick trainer.total_epochs=15 trainer.total_training_steps=2)" \
  "$@"
