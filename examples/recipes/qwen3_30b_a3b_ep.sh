#!/usr/bin/env bash
# Qwen3-30B-A3B, GRPO on GSM8K, validated on GSM8K's test split (greedy) every 10 steps, with an expert-parallel
# rollout: each replica runs over EP GPUs (vexact_engine.ExpertParallelLLM), every GPU holding attention, router,
# embedding and head whole and 128/EP of the routed experts of each of the 48 sparse layers, with its own requests
# and KV cache (attention data-parallel over the replica's GPUs, verl's data_parallel_size = EP); a token's expert
# outputs are added on its own GPU in its own top-k order, so logprobs equal one GPU's and the trainer's, bit for bit.
# Hardware: 8 GPUs of 80 GB on one node: EP=2 (the default) gives 4 replicas of 2 GPUs, each GPU holding 3.1 GB of
# shared weights and 29 GB of experts beside its KV cache (the 61 GB of bf16 weights do not fit one H100 beside a KV
# cache and the actor's offload buffers); EP=4 or 8 leaves more room for KV. The actor is FSDP2 over the 8 GPUs with
# parameters and optimizer state offloaded to host memory between phases.
#
#   python examples/data/prepare.py gsm8k --out data
#   MODEL_DIR=/models/Qwen3-30B-A3B DATA_DIR=data bash examples/recipes/qwen3_30b_a3b_ep.sh
#
# GRPO: 256 prompts x 8 responses a step, 4 PPO mini-batches of 64 prompts, lr 1e-6, KL to the reference in the loss
# (low-variance k3, coefficient 0.001), no entropy bonus, responses up to 1024 tokens, 15 epochs. Weights reach each
# replica through its first GPU's server, which sends every GPU the shared weights and its own experts only.
# Also read: EP (GPUs a rollout replica, a divisor of GPUS_PER_NODE and of the 128 routed experts; default 2).
# Environment and SMOKE=1: examples/recipes/common.sh.
source "$(dirname "$0")/common.sh"
recipe_init qwen3-30b-a3b-ep-grpo-gsm8k 1 8
need_data gsm8k/train.parquet gsm8k/test.parquet
EP=${EP:-2}
[[ "$EP" =~ ^[1-9][0-9]*$ ]] && [ $((GPUS_PER_NODE % EP)) = 0 ] \
  || die "EP=$EP must be a positive integer that divides GPUS_PER_NODE=$GPUS_PER_NODE"

launch "${VEXACT[@]}" \
  algorithm.adv_estimator=grpo \
  algorithm.use_kl_in_reward=False \
  data.train_files="$DATA_DIR/gsm8k/train.parquet" \
  data.val_files="$DATA_DIR/gsm8k/test.parquet" \
  data.train_batch_size="$(pick 256 2)" \
  data.max_prompt_length="$(pick 512 384)" \
  data.max_response_length="$(pick 1024 16)" \
  data.filter_overlong_prompts=True \
  data.truncation=error \
  actor_rollout_ref.model.enable_gradient_checkpointing=True \
  actor_rollout_ref.actor.optim.lr=1e-6 \
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
  actor_rollout_ref.rollout.expert_parallel_size="$EP" \
  actor_rollout_ref.rollout.data_parallel_size="$EP" \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu="$(pick 8 8)" \
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu="$(pick 8 8)" \
  actor_rollout_ref.rollout.val_kwargs.do_sample=False \
  actor_rollout_ref.rollout.val_kwargs.n=1 \
  trainer.val_before_train=True \
  trainer.test_freq=10 \
  trainer.save_freq=20 \
  "$(pick trainer.total_epochs=15 trainer.total_training_steps=2)" \
  "$@"
