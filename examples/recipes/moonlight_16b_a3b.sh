#!/usr/bin/env bash
# Moonlight-16B-A3B (DeepSeek-V3 architecture: MLA attention, 64 routed experts top-6 plus 2 shared), two recipes:
#   ALGO=grpo          GRPO on GSM8K, validated on GSM8K's test split (greedy) every 10 steps (the default)
#   ALGO=reinforce_pp  REINFORCE++ on DAPO-Math-17k, validated on AIME 2024 (mean@16, temperature 1.0, top-p 0.7)
# Hardware: 8 GPUs of 80 GB on one node (the 32 GB of bf16 weights fit one GPU: 8 rollout replicas); the actor is
# FSDP2 over the 8 GPUs with parameters and optimizer state offloaded between phases. Moonlight's tokenizer is custom
# code: the model directory's tokenization_moonshot.py is loaded (trust_remote_code).
#
#   python examples/data/prepare.py gsm8k --out data          # ALGO=grpo
#   python examples/data/prepare.py dapo_math --out data && python examples/data/prepare.py aime24 --out data
#   MODEL_DIR=/models/Moonlight-16B-A3B-Instruct DATA_DIR=data ALGO=grpo bash examples/recipes/moonlight_16b_a3b.sh
#
# GRPO: 256 prompts x 8 responses, 4 mini-batches, lr 1e-6, k3 KL loss 0.001, responses up to 1024 tokens.
# REINFORCE++: as qwen3_30b_a3b_reinforce_pp_dapo_math.sh (k1 KL penalty 0.001 in the reward, batch-whitened
# advantages, clip 0.2), 256 prompts x 4 responses up to 8192 tokens. Environment and SMOKE=1: examples/recipes/common.sh.
source "$(dirname "$0")/common.sh"
ALGO=${ALGO:-grpo}
case "$ALGO" in
  grpo) recipe_init moonlight-16b-a3b-grpo-gsm8k 1 8 ;;
  reinforce_pp) recipe_init moonlight-16b-a3b-reinforce-pp-dapo-math 1 8 ;;
  *) RECIPE=moonlight-16b-a3b die "ALGO must be grpo or reinforce_pp, got '$ALGO'" ;;
esac

if [ "$ALGO" = grpo ]; then
  need_data gsm8k/train.parquet gsm8k/test.parquet
  ALGO_ARGS=(
    algorithm.adv_estimator=grpo
    algorithm.use_kl_in_reward=False
    data.train_files="$DATA_DIR/gsm8k/train.parquet"
    data.val_files="$DATA_DIR/gsm8k/test.parquet"
    data.train_batch_size="$(pick 256 2)"
    data.max_prompt_length="$(pick 512 384)"
    data.max_response_length="$(pick 1024 16)"
    data.truncation=error
    actor_rollout_ref.actor.ppo_mini_batch_size="$(pick 64 2)"
    actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.rollout.n=8
    actor_rollout_ref.rollout.val_kwargs.do_sample=False
    actor_rollout_ref.rollout.val_kwargs.n=1
    "$(pick trainer.total_epochs=15 trainer.total_training_steps=2)"
  )
else
  need_data dapo_math/train.parquet aime24/test.parquet
  ALGO_ARGS=(
    algorithm.adv_estimator=reinforce_plus_plus
    algorithm.gamma=1.0
    algorithm.use_kl_in_reward=True
    algorithm.kl_penalty=kl
    algorithm.kl_ctrl.type=fixed
    algorithm.kl_ctrl.kl_coef=0.001
    data.train_files="$DATA_DIR/dapo_math/train.parquet"
    data.val_files="$DATA_DIR/aime24/test.parquet"
    data.train_batch_size="$(pick 256 2)"
    data.max_prompt_length="$(pick 2048 384)"
    data.max_response_length="$(pick 8192 16)"
    data.truncation=left
    actor_rollout_ref.actor.ppo_mini_batch_size="$(pick 32 2)"
    actor_rollout_ref.actor.use_kl_loss=False
    actor_rollout_ref.actor.optim.lr_warmup_steps=10
    actor_rollout_ref.rollout.n=4
    actor_rollout_ref.rollout.val_kwargs.do_sample=True
    actor_rollout_ref.rollout.val_kwargs.n="$(pick 16 2)"
    actor_rollout_ref.rollout.val_kwargs.temperature=1.0
    actor_rollout_ref.rollout.val_kwargs.top_p=0.7
    "$(pick trainer.total_epochs=10 trainer.total_training_steps=2)"
  )
fi

launch "${VEXACT[@]}" \
  actor_rollout_ref.model.trust_remote_code=True \
  data.trust_remote_code=True \
  data.filter_overlong_prompts=True \
  actor_rollout_ref.model.enable_gradient_checkpointing=True \
  actor_rollout_ref.actor.optim.lr=1e-6 \
  actor_rollout_ref.actor.grad_clip=1.0 \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu="$(pick 4 8)" \
  actor_rollout_ref.actor.entropy_coeff=0 \
  actor_rollout_ref.actor.clip_ratio=0.2 \
  actor_rollout_ref.actor.loss_agg_mode=token-mean \
  actor_rollout_ref.actor.fsdp_config.param_offload=True \
  actor_rollout_ref.actor.fsdp_config.optimizer_offload=True \
  actor_rollout_ref.ref.fsdp_config.param_offload=True \
  actor_rollout_ref.rollout.temperature=1.0 \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu="$(pick 8 8)" \
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu="$(pick 8 8)" \
  trainer.val_before_train=True \
  trainer.test_freq=10 \
  trainer.save_freq=20 \
  "${ALGO_ARGS[@]}" \
  "$@"
