#!/usr/bin/env bash
# DeepSeek-R1-Distill-Qwen-1.5B, the verify pair on MATH: the same GRPO run on verl's vLLM rollout with verl's own
# FSDP actor (arm vllm) and on the vexact rollout with the invariant actor (arm vexact), validated on AIME 2024 and
# AIME 2025 (mean@16 at temperature 0.6, top-p 0.95, DeepSeek's sampling for this model) every 10 steps; then
# examples/verify/compare.py prints and plots rollout/actor K3 KL, reward and step time per arm, and fails unless the
# vexact arm's K3 KL is exactly 0.0 at every step.
# Hardware: 1 GPU of 80 GB (the default; each arm in turn) or 8 on one node (GPUS_PER_NODE=8). The vllm arm needs
# vLLM importable (pip install 'verl[vllm]==0.9.1').
#
#   python examples/data/prepare.py math --out data
#   python examples/data/prepare.py aime24 --out data && python examples/data/prepare.py aime25 --out data
#   MODEL_DIR=/models/DeepSeek-R1-Distill-Qwen-1.5B DATA_DIR=data bash examples/recipes/r1_distill_qwen_1.5b_verify_pair_math.sh
#
# GRPO: 128 prompts x 8 responses up to 8192 tokens, 4 mini-batches, lr 1e-6, k3 KL loss 0.001, sampling at
# temperature 1.0. Also read: ARMS (default "vllm vexact"; one arm runs alone, without the comparison), TAG (the
# file-name prefix compare.py reads as the GPU; default the GPU's name, or cpu). Outputs:
# RUN_DIR/<TAG>-r1-distill-qwen-1.5b-<arm>.jsonl per arm and RUN_DIR/<TAG>-r1-distill-qwen-1.5b.png.
# Environment and SMOKE=1: examples/recipes/common.sh.
source "$(dirname "$0")/common.sh"
recipe_init r1-distill-qwen-1.5b-verify-pair-math 1 1
need_data math/train.parquet aime24/test.parquet aime25/test.parquet
read -r -a ARM_LIST <<< "${ARMS:-vllm vexact}"
for arm in "${ARM_LIST[@]}"; do
  case "$arm" in vllm | vexact) ;; *) die "ARMS: unknown arm '$arm' (vllm, vexact)" ;; esac
done
[ ${#ARM_LIST[@]} -gt 0 ] || die "ARMS is empty; name vllm, vexact or both"
if [[ " ${ARM_LIST[*]} " == *" vllm "* ]] && ! python3 -c "import vllm" 2> /dev/null; then
  die "ARMS includes vllm but vLLM is not importable: pip install 'verl[vllm]==0.9.1', or ARMS=vexact"
fi
TAG=${TAG:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -1 | grep -oiE 'h100|h200|b200|a100' \
  | tr 'A-Z' 'a-z' || true)}
TAG=${TAG:-cpu}
SHAPE=r1-distill-qwen-1.5b

# the settings both arms share (compare.py refuses runs whose configs differ)
COMMON=(
  algorithm.adv_estimator=grpo
  algorithm.use_kl_in_reward=False
  data.train_files="$DATA_DIR/math/train.parquet"
  data.val_files="[$DATA_DIR/aime24/test.parquet,$DATA_DIR/aime25/test.parquet]"
  data.train_batch_size="$(pick 128 2)"
  data.max_prompt_length="$(pick 1024 384)"
  data.max_response_length="$(pick 8192 16)"
  data.filter_overlong_prompts=True
  data.truncation=error
  data.seed=0
  actor_rollout_ref.model.enable_gradient_checkpointing=True
  actor_rollout_ref.actor.optim.lr=1e-6
  actor_rollout_ref.actor.ppo_mini_batch_size="$(pick 32 2)"
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu="$(pick 4 8)"
  actor_rollout_ref.actor.use_kl_loss=True
  actor_rollout_ref.actor.kl_loss_coef=0.001
  actor_rollout_ref.actor.kl_loss_type=low_var_kl
  actor_rollout_ref.actor.entropy_coeff=0
  actor_rollout_ref.actor.loss_agg_mode=token-mean
  actor_rollout_ref.rollout.n=8
  actor_rollout_ref.rollout.temperature=1.0
  actor_rollout_ref.rollout.gpu_memory_utilization=0.5
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu="$(pick 8 8)"
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu="$(pick 8 8)"
  actor_rollout_ref.rollout.val_kwargs.do_sample=True
  actor_rollout_ref.rollout.val_kwargs.n="$(pick 16 2)"
  actor_rollout_ref.rollout.val_kwargs.temperature=0.6
  actor_rollout_ref.rollout.val_kwargs.top_p=0.95
  trainer.val_before_train=True
  trainer.test_freq=10
  trainer.save_freq=-1
  "$(pick trainer.total_epochs=5 trainer.total_training_steps=2)"
)
FILES=()
for arm in "${ARM_LIST[@]}"; do
  RECIPE="$TAG-$SHAPE-$arm"
  export VERL_FILE_LOGGER_PATH="$RUN_DIR/$RECIPE.jsonl"
  FILES+=("$VERL_FILE_LOGGER_PATH")
  if [ "$arm" = vllm ]; then
    # verl's stock stack: vLLM rollout, verl's FSDP actor on the transformers model (SDPA attention: no flash-attn
    # wheel is needed)
    launch --entry verl.trainer.main_ppo actor_rollout_ref.rollout.name=vllm \
      +actor_rollout_ref.model.override_config.attn_implementation=sdpa "${COMMON[@]}" "$@"
  else
    launch "${VEXACT[@]}" "${COMMON[@]}" "$@"
  fi
  # each arm's Ray cluster is its driver's own (verl's ray.init): it ends with the arm, before the next one starts
done
if [ ${#FILES[@]} -gt 1 ]; then
  python3 "$ROOT/examples/verify/compare.py" "${FILES[@]}" --plot "$RUN_DIR/$TAG-$SHAPE.png" --expect-exact vexact
fi
