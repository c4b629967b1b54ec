#!/usr/bin/env bash
# The verify pair: the same verl 0.9.1 GRPO run on verl's default stack and on VeXact, one GPU, then compare.py.
#
#   bash examples/verify/run_pair.sh RESULTS_DIR [ARM ...]        # ARM: vllm, vexact, fast (default: vllm vexact)
#
# Arms (same model, data, seeds, learning rate, steps, batch and response lengths in each):
# - vllm:   verl's default stack as users run it: `rollout.name=vllm` (vLLM 0.24.0, the version verl 0.9.1's `vllm`
#           extra pins) and verl's stock actor: its FSDP engine on the transformers model for dense; for MoE its
#           VeOmni engine (`model_engine=veomni`, `moe_implementation=fused_triton`: VeOmni's grouped-GEMM MoE), the
#           actor verl recommends for MoE. Attention: SDPA (flash-attn 2 has no wheel for torch 2.11 / CUDA 13).
# - vexact: `rollout.name=vexact` (invariant kernels) + `actor.strategy=vexact` (the invariant FSDP actor).
# - fast:   the vexact rollout on its `fast` backend (cuBLAS / SDPA kernels) against the same invariant actor.
#
# Environment:
#   SHAPE   qwen3-1.7b (default) or qwen3-30b-a3b: random weights of that width (examples/verl_grpo/make_model.py)
#   LAYERS  depth (default: 1.7B's own 28; 4 for 30B-A3B, so that both stacks fit one 80 GB GPU)
#   STEPS (10), LR (3e-6), GPU_MEM (rollout's share of GPU memory: 0.4 dense, 0.25 MoE), TAG (file prefix: the GPU,
#   e.g. h100), MODEL_DIR (where the checkpoint is written), DATA (the dataset folder), COMMIT (recorded in the metas)
#   SHARED_HOST=1: other Ray jobs run on this host (each on its own GPUs, CUDA_VISIBLE_DEVICES): no `ray stop` between
#   arms (it would stop theirs too); set RAY_ADDRESS=local as well, so each arm starts its own Ray cluster
#   PYTHONPATH_VLLM / PYTHONPATH_VEXACT: put in front of PYTHONPATH for the vllm arm / the vexact and fast arms, where
#   the two stacks live in separate folders (scripts/staging/rl_stack_wheels.sh path vllm|vexact prints them)
#
# Every arm samples with `ignore_eos=True`, so each step generates exactly train_batch_size x n x max_response_length
# tokens in every arm: equal work for the timing (benchmarks/rl_step.py reads the same files). Outputs, per arm:
# RESULTS_DIR/<TAG>-<SHAPE>-<ARM>.jsonl (verl's file logger: one record a step), .meta.json (the run's config, stack,
# GPU, commit, command, peak GPU memory sampled by nvidia-smi) and .log; then compare.py writes <TAG>-<SHAPE>.png.
# Needs verl, Ray and vLLM importable (on an air-gapped machine: scripts/staging/rl_stack_wheels.sh install).
set -euo pipefail
cd "$(dirname "$0")/../.."
RESULTS=${1:?usage: run_pair.sh RESULTS_DIR [vllm] [vexact] [fast]}
shift
ARMS=("$@")
[ ${#ARMS[@]} -gt 0 ] || ARMS=(vllm vexact)
SHAPE=${SHAPE:-qwen3-1.7b}
case "$SHAPE" in
  qwen3-1.7b) MOE=0; LAYERS=${LAYERS:-28}; GPU_MEM=${GPU_MEM:-0.4} ;;
  qwen3-30b-a3b) MOE=1; LAYERS=${LAYERS:-4}; GPU_MEM=${GPU_MEM:-0.25} ;;
  *) echo "SHAPE must be qwen3-1.7b or qwen3-30b-a3b, got '$SHAPE'" >&2; exit 2 ;;
esac
STEPS=${STEPS:-10}
LR=${LR:-3e-6}
TAG=${TAG:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oiE 'h100|h200|b200|a100' \
  | tr 'A-Z' 'a-z' || true)}
TAG=${TAG:-gpu}
MODEL_DIR=${MODEL_DIR:-outputs/models/$SHAPE-l$LAYERS}
DATA=${DATA:-outputs/data/arith}
# DRY_RUN=1: print each arm's command (one line: arm, then the command's words, NUL-separated) and run nothing
DRY_RUN=${DRY_RUN:-0}
mkdir -p "$RESULTS"
# absolute paths: vLLM's engine process and verl's workers resolve a relative one from another directory (as a hub id)
MODEL_DIR=$(realpath -m "$MODEL_DIR")
DATA=$(realpath -m "$DATA")
[ "$DRY_RUN" = 1 ] || [ -f "$MODEL_DIR/config.json" ] || python3 examples/verl_grpo/make_model.py --shape "$SHAPE" --layers "$LAYERS" \
  --out "$MODEL_DIR"
[ "$DRY_RUN" = 1 ] || [ -f "$DATA/train.parquet" ] || python3 examples/verl_grpo/make_dataset.py --out "$DATA"
for arm in "${ARMS[@]}"; do
  case "$arm" in vllm | vexact | fast) ;; *) echo "unknown arm '$arm' (vllm, vexact, fast)" >&2; exit 2 ;; esac
done
if [ "$DRY_RUN" != 1 ] && [[ " ${ARMS[*]} " == *" vllm "* ]] \
  && ! PYTHONPATH="${PYTHONPATH_VLLM:-}${PYTHONPATH:+:$PYTHONPATH}" python3 -c "import vllm" 2> /dev/null; then
  echo "vLLM is not importable: pip install 'verl[vllm]==0.9.1' (vllm 0.24.0), or on an air-gapped GPU machine" \
    "bash scripts/staging/rl_stack_wheels.sh download (where pip works) and then install there" >&2
  exit 2
fi

# the settings every arm shares (compare.py refuses runs whose `config` differ)
COMMON=(
  algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=False
  data.train_files="$DATA/train.parquet" data.val_files="$DATA/test.parquet" data.train_batch_size=32
  data.max_prompt_length=128 data.max_response_length=64 data.seed=0
  actor_rollout_ref.model.path="$MODEL_DIR" actor_rollout_ref.model.use_remove_padding=True
  actor_rollout_ref.actor.optim.lr="$LR" actor_rollout_ref.actor.ppo_mini_batch_size=32
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 actor_rollout_ref.actor.use_kl_loss=False
  actor_rollout_ref.actor.entropy_coeff=0
  actor_rollout_ref.rollout.n=4 actor_rollout_ref.rollout.tensor_model_parallel_size=1
  actor_rollout_ref.rollout.gpu_memory_utilization="$GPU_MEM" actor_rollout_ref.rollout.max_num_seqs=256
  actor_rollout_ref.rollout.max_num_batched_tokens=4096 actor_rollout_ref.rollout.calculate_log_probs=True
  actor_rollout_ref.rollout.ignore_eos=True actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16
  reward.custom_reward_function.path=examples/verl_grpo/reward.py
  trainer.n_gpus_per_node=1 trainer.nnodes=1 trainer.total_training_steps="$STEPS" trainer.val_before_train=False
  trainer.test_freq=-1 trainer.save_freq=-1 'trainer.logger=["console","file"]' trainer.project_name=vexact_verify
)
for arm in "${ARMS[@]}"; do
  NAME="$TAG-$SHAPE-$arm"
  case "$arm" in
    vllm)
      ENTRY=verl.trainer.main_ppo
      ARGS=(actor_rollout_ref.rollout.name=vllm)
      if [ "$MOE" = 1 ]; then
        ATTN=sdpa ACTOR="verl VeOmni engine (fused_triton MoE)"
        ARGS+=(model_engine=veomni actor_rollout_ref.actor.veomni.attn_implementation=sdpa
               actor_rollout_ref.actor.veomni.moe_implementation=fused_triton
               actor_rollout_ref.actor.veomni.init_device=cuda actor_rollout_ref.ref.veomni.init_device=cuda)
        # on one GPU VeOmni applies no FSDP, so no mixed precision: its fp32 weights reach the fused_triton MoE,
        # which takes bf16/fp16 only (AssertionError: torch.float32, seen on an H100); bf16 weights there
        if [ "${NGPUS:-1}" = 1 ]; then
          ACTOR="$ACTOR, bf16 weights (one GPU: no FSDP mixed precision)"
          ARGS+=(actor_rollout_ref.actor.veomni.mixed_precision=False actor_rollout_ref.ref.veomni.mixed_precision=False)
        fi
      else
        ATTN=sdpa ACTOR="verl FSDP engine (transformers model)"
        ARGS+=(+actor_rollout_ref.model.override_config.attn_implementation=sdpa)
      fi
      ;;
    vexact | fast)
      ENTRY=vexact_verl.main_ppo
      backend=invariant; [ "$arm" = fast ] && backend=fast
      ATTN=fa4-or-triton
      [ "$DRY_RUN" = 1 ] || ATTN=$(PYTHONPATH="${PYTHONPATH_VEXACT:-}${PYTHONPATH:+:$PYTHONPATH}" python3 -c \
        "import vexact_kernels as vk; print(vk.get_attention_impl())" 2> /dev/null || echo triton)
      ACTOR="vexact FSDP actor (invariant)"
      ARGS=(actor_rollout_ref.rollout.name=vexact actor_rollout_ref.actor.strategy=vexact
            +actor_rollout_ref.rollout.engine_kwargs.vexact.backend=$backend)
      ;;
  esac
  export VERL_FILE_LOGGER_PATH="$RESULTS/$NAME.jsonl" VLLM_USE_FLASHINFER_SAMPLER=0
  ARM_PATH=${PYTHONPATH_VEXACT:-}
  [ "$arm" = vllm ] && ARM_PATH=${PYTHONPATH_VLLM:-}
  rm -f "$VERL_FILE_LOGGER_PATH"
  CMD=(python3 -m "$ENTRY" "${COMMON[@]}" "${ARGS[@]}" trainer.experiment_name="$NAME"
       trainer.default_local_dir="outputs/verify/checkpoints/$NAME" hydra.run.dir="outputs/verify/hydra/$NAME")
  if [ "$DRY_RUN" = 1 ]; then
    printf '%s\0' "$arm" "${CMD[@]}"; printf '\n'
    continue
  fi
  MEMLOG="$RESULTS/$NAME.mem"
  # the GPU this arm runs on (the first of CUDA_VISIBLE_DEVICES), not every GPU of the host
  GPU_INDEX=${CUDA_VISIBLE_DEVICES:-0}
  nvidia-smi -i "${GPU_INDEX%%,*}" --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "$MEMLOG" \
    2> /dev/null &
  SMI=$!
  echo "== $NAME: ${CMD[*]}"
  START=$(date +%s)
  rc=0
  PYTHONPATH="$ARM_PATH${PYTHONPATH:+:$PYTHONPATH}" "${CMD[@]}" > "$RESULTS/$NAME.log" 2>&1 || rc=$?
  kill "$SMI" 2> /dev/null || true
  # a stack's Ray cluster and rollout processes must be gone before the next arm measures memory and time; where
  # other Ray jobs share the host (SHARED_HOST=1), only the arm's own driver ends, whose exit stops its local cluster
  if [ "${SHARED_HOST:-0}" != 1 ]; then
    ray stop --force > /dev/null 2>&1 || true
    pkill -f "VLLM::EngineCore" 2> /dev/null || true
  fi
  sleep 3
  echo "== $NAME: exit $rc after $(( $(date +%s) - START )) s, $(wc -l < "$VERL_FILE_LOGGER_PATH" 2> /dev/null || echo 0) steps"
  ARM="$arm" NAME="$NAME" RESULTS="$RESULTS" ATTN="$ATTN" ACTOR="$ACTOR" MOE="$MOE" SHAPE="$SHAPE" LAYERS="$LAYERS" \
  RC="$rc" CMDLINE="${CMD[*]}" PYTHONPATH="$ARM_PATH${PYTHONPATH:+:$PYTHONPATH}" \
  python3 examples/verify/write_meta.py  # the arm's own folders: the versions recorded are the ones the arm ran
  [ "$rc" = 0 ] || tail -30 "$RESULTS/$NAME.log"
done
[ "$DRY_RUN" = 1 ] && exit 0
FILES=()
for arm in "${ARMS[@]}"; do FILES+=("$RESULTS/$TAG-$SHAPE-$arm.jsonl"); done
EXACT=()
[[ " ${ARMS[*]} " == *" vexact "* ]] && EXACT=(--expect-exact vexact)
python3 examples/verify/compare.py "${FILES[@]}" --plot "$RESULTS/$TAG-$SHAPE.png" "${EXACT[@]}"
