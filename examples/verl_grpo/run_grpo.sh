#!/usr/bin/env bash
# Getting started: GRPO with verl 0.9.1 and the vexact rollout on a small Qwen3, one GPU.
#
#   python examples/verl_grpo/make_dataset.py --out data/arith        # the verifiable dataset (local, no hub)
#   MODEL=/path/to/Qwen3-0.6B bash examples/verl_grpo/run_grpo.sh      # a local HF checkpoint directory
#
# No checkpoint at hand (the GPU device has no hub)? `python examples/verl_grpo/make_model.py --out
# data/qwen3-random` writes a random-weights byte-level Qwen3 with a chat template; MODEL=data/qwen3-random.
#
# The only vexact-specific settings are `actor_rollout_ref.rollout.name=vexact`, the rollout backend
# (`BACKEND=invariant`, the default, or `fast` for the mismatch baseline) and, for zero mismatch, the
# invariant actor: pass `actor_rollout_ref.actor.strategy=vexact` (without it verl's stock HF actor recomputes the
# logprobs and a small mismatch remains). Everything else is stock verl GRPO. LR (default 1e-6, for a real
# checkpoint), STEPS, RUN_DIR, NAME, GPU_MEM are environment variables. No GPU: VERL_PLATFORM=cpu, see
# packages/vexact-verl/README.md ("verl on CPU").
# `calculate_log_probs=True` makes verl log its rollout-correction metrics (rollout_corr/k3_kl, rollout_corr/kl,
# rollout_corr/log_ppl_abs_diff, ...) every step: the rollout's logprobs against the actor's recomputed old_log_prob.
# Reproducible: the same command gives the same metrics and weights, bit for bit, and a job resumed from a checkpoint
# (trainer.save_freq, then trainer.resume_mode=auto) continues as the uninterrupted one would. That takes the three
# settings below: `vexact_single_turn_agent` seeds each request from (rollout.seed, step, dataset index, sample)
# instead of arrival order, `OrderedReplayBuffer` orders each step's batch as the dataloader gave it instead of
# as the rollouts finished, and `data.dataloader_num_workers=0` keeps a per-process random worker seed out of the
# checkpoint's dataloader state, data.pt (packages/vexact-verl/README.md, "Reproducible runs").
# Extra Hydra overrides given on the command line are passed through.
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${MODEL:?set MODEL to a local Qwen3 checkpoint directory (config.json, safetensors, tokenizer)}"
DATA=${DATA:-data/arith}
BACKEND=${BACKEND:-invariant}
STEPS=${STEPS:-20}
LR=${LR:-1e-6}
# GPU_MEM: the rollout engine's share of the device's total memory (lower it when two runs share one GPU)
GPU_MEM=${GPU_MEM:-0.4}
NAME=${NAME:-grpo-${BACKEND}}
RUN_DIR=${RUN_DIR:-outputs/verl_grpo}
mkdir -p "$RUN_DIR"
[ -f "$DATA/train.parquet" ] || python3 examples/verl_grpo/make_dataset.py --out "$DATA"
# verl's file logger: one JSON line of metrics per step (examples/verify/compare.py reads it)
export VERL_FILE_LOGGER_PATH=${VERL_FILE_LOGGER_PATH:-$RUN_DIR/$NAME.jsonl}
rm -f "$VERL_FILE_LOGGER_PATH"

python3 -m vexact_verl.main_ppo \
  algorithm.adv_estimator=grpo \
  algorithm.use_kl_in_reward=False \
  data.train_files="$DATA/train.parquet" \
  data.val_files="$DATA/test.parquet" \
  data.train_batch_size=32 \
  data.max_prompt_length=128 \
  data.max_response_length=64 \
  data.seed=0 \
  data.dataloader_num_workers=0 \
  actor_rollout_ref.model.path="$MODEL" \
  actor_rollout_ref.model.use_remove_padding=True \
  actor_rollout_ref.actor.optim.lr="$LR" \
  actor_rollout_ref.actor.ppo_mini_batch_size=32 \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 \
  actor_rollout_ref.actor.use_kl_loss=False \
  actor_rollout_ref.actor.entropy_coeff=0 \
  actor_rollout_ref.rollout.name=vexact \
  actor_rollout_ref.rollout.n=4 \
  actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
  actor_rollout_ref.rollout.gpu_memory_utilization="$GPU_MEM" \
  actor_rollout_ref.rollout.max_num_seqs=256 \
  actor_rollout_ref.rollout.max_num_batched_tokens=4096 \
  actor_rollout_ref.rollout.calculate_log_probs=True \
  actor_rollout_ref.rollout.agent.default_agent_loop=vexact_single_turn_agent \
  trainer.v1.sampler.custom_sampler.path=pkg://vexact_verl.replay \
  trainer.v1.sampler.custom_sampler.name=OrderedReplayBuffer \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 \
  +actor_rollout_ref.rollout.engine_kwargs.vexact.backend="$BACKEND" \
  trainer.n_gpus_per_node=1 \
  trainer.nnodes=1 \
  trainer.total_training_steps="$STEPS" \
  trainer.val_before_train=False \
  trainer.test_freq=-1 \
  trainer.save_freq=-1 \
  trainer.logger='["console","file"]' \
  trainer.project_name=vexact_verl \
  trainer.experiment_name="$NAME" \
  trainer.default_local_dir="$RUN_DIR/checkpoints/$NAME" \
  hydra.run.dir="$RUN_DIR/hydra/$NAME" \
  "$@"
