#!/usr/bin/env bash
# The verify pair: the same verl 0.9.1 GRPO run on verl's default stack and on VeXact, then compare.py.
#
#   PAIR=dense-1k bash examples/verify/run_pair.sh RESULTS_DIR [ARM ...]   # ARM: vllm, vexact, fast (default: vllm vexact)
#
# PAIR names the shape (examples/verify/shapes.py holds the table; `python examples/verify/shapes.py PAIR` prints it):
#   smoke (default)  128 sequences x 64 tokens, byte vocabulary (272): the quick run of the whole path
#   dense-1k         Qwen3-1.7B shape (28 layers), vocabulary 151,936, 64 prompts x n 8 = 512 sequences x 1024 tokens
#   dense-4k         the same with 4096-token responses
#   dense8b-1k       Qwen3-8B shape (36 layers), 512 x 1024, FSDP over NGPUS=2 GPUs
#   moe-1k           Qwen3-30B-A3B widths at LAYERS depth (default 4), 512 x 1024
#   gptoss-1k        gpt-oss-20b widths at 4 layers, byte vocabulary, 512 x 1024 (the vllm arm: VeOmni's eager MoE and
#                    the vLLM plugin of examples/verify/vllm_plugin, which vLLM 0.24.0 needs for bf16 gpt-oss weights)
# Arms (same model, data, seeds, learning rate, steps, batch, mini-batch, lengths and token budgets in each):
# - vllm:   verl's default stack as users run it: `rollout.name=vllm` (vLLM 0.24.0, the version verl 0.9.1's `vllm`
#           extra pins) and verl's stock actor: its FSDP engine on the transformers model for dense; for MoE its
#           VeOmni engine (`model_engine=veomni`, `moe_implementation=fused_triton`: VeOmni's grouped-GEMM MoE), the
#           actor verl recommends for MoE.
# - vexact: `rollout.name=vexact` (invariant kernels) + `actor.strategy=vexact` (the invariant FSDP actor).
# - fast:   the vexact rollout on its `fast` backend (cuBLAS / SDPA kernels) against the same invariant actor.
#
# Tuning (every pair but smoke; shapes.py says where each value comes from): as verl's example scripts tune a run:
# `use_dynamic_bsz=True` with a per-GPU token budget (`ppo_max_token_len_per_gpu` = max(16384, 2 x (prompt +
# response)), `log_prob_max_token_len_per_gpu` 2x that), `use_remove_padding=True` and
# `enable_gradient_checkpointing=True` (verl's defaults, passed as its examples pass them), the rollout's scheduler at
# verl's defaults. The vexact arm gets the same budgets: its actor is verl's FSDP engine, micro-batched by verl.
# Knobs that exist in one stack only: the vllm arm's attention (below) and, on dense shapes, its log-probs through
# verl's fused linear + log-prob kernel (`actor_rollout_ref.model.use_fused_kernels=True`, `impl_backend=triton`, as
# verl users set it; FUSED_KERNELS=0 leaves it out): without it and without flash-attn 2's Triton cross entropy
# (`flash_attn.ops.triton.cross_entropy`, which verl takes where flash-attn 2 is installed; no build for this stack)
# verl 0.9.1 computes each packed token's log-sum-exp over the vocabulary in a Python loop, one token at a time
# (`verl.utils.torch_functional.logprobs_from_logits_v2` on the [tokens, vocab] logits of a packed micro-batch); on
# an H200 at dense-1k with FA4 that arm ran at perf/mfu/actor 0.055. The vexact arm's kernel backend.
#
# Attention of the vllm arm's actor: FlashAttention 4 through transformers (`flash_attention_4`) where it can run on
# the arm's path, else SDPA; examples/verify/actor_attention.py decides before the run and says why, in the log and
# the meta (`stack.attention`, `stack.attention_why`); `ACTOR_ATTN` sets it. verl asks for flash_attention_2 by
# default, and flash-attn 2 has no build for this stack (PyPI has only its source, 2.8.3.post2; building it needs nvcc
# and hours; its GitHub releases carry no wheel for torch 2.11 + CUDA 13). With padding removed verl packs a
# micro-batch into one row: on FA4, transformers takes the sequences' cu_seqlens from the row's position_ids and runs
# `flash_attn.cute.flash_attn_varlen_func` (flash-attn-4 4.0.0b36: varlen forward and backward on SM90), through
# verl's remove-padding patch as for flash_attention_2. With the stack staged here (transformers 5.9.0, flash-attn-4
# 4.0.0b36) that call does not run as shipped: transformers passes max_seqlen_q/max_seqlen_k as 0-d tensors,
# flash-attn-4 takes Python ints only (on an H200 the arm's first actor forward failed with `ValueError: Expected
# IntTuple, whose leaves are integers, but got 1079`). actor_attention.py finds this on the CPU (transformers'
# prepare_fa_kwargs_from_position_ids on a small packed row) and then names fa4_shim/fa4_varlen_ints.py, which
# verl imports in its workers through its own hook (`actor_rollout_ref.model.external_lib`) and which turns the two
# lengths into ints before flash-attn-4 sees them; the log and meta say so. ACTOR_ATTN=sdpa runs SDPA. On SDPA,
# transformers hands PyTorch a block-diagonal causal mask over the whole row, so its memory-efficient kernel
# computes the masked-out blocks too (exact, slow:
# perf/mfu/actor 0.035 at dense-1k on an H200). FA4 comes from scripts/staging/fa4_device_wheels.sh (the package the
# vexact arm uses): PYTHONPATH_FA4 (default: `scripts/staging/rl_stack_wheels.sh path fa4`, empty where not
# installed) goes in front of PYTHONPATH_VLLM on this arm, since vLLM's folder pins apache-tvm-ffi 0.1.9 and
# flash-attn-4 needs >= 0.1.11; on SDPA the arm's path is PYTHONPATH_VLLM alone. The MoE arm's VeOmni takes the same
# name (its veomni_flash_attention_4_with_sp).
# The vexact and fast arms run vexact_kernels' attention (FA4 where it loads, else Triton), recorded in the meta.
#
# Environment:
#   PAIR (smoke), SHAPE (smoke only: qwen3-1.7b (default) or qwen3-30b-a3b), LAYERS (depth: the pair's by default),
#   STEPS, LR (3e-6), GPU_MEM (rollout's share of GPU memory), NGPUS (GPUs per arm), PPO_MAX_TOKENS and
#   LOGPROB_MAX_TOKENS (the token budgets), ACTOR_ATTN (FA4 where it runs, else sdpa), FUSED_KERNELS (1: the dense
#   vllm arm's log-probs through verl's fused kernel in tuned pairs, 0: verl's default path), PYTHONPATH_FA4 (above), TAG
#   (file prefix: the GPU, e.g. h100), MODEL_DIR (where the checkpoint is written), DATA (the dataset folder), COMMIT
#   or VEXACT_COMMIT (recorded in the metas; git's HEAD where neither is set)
#   GEN_STATS=1 (default 0): the vllm arm logs vLLM's engine stats: `actor_rollout_ref.rollout.disable_log_stats=False`
#   in its command (verl's default is True; the meta lists it among the settings that differ) and
#   VLLM_LOGGING_LEVEL=INFO in its environment (verl's Ray runtime env sets WARN unless the launching shell sets it), so
#   vLLM's stats lines (running and waiting requests, throughput, KV cache usage, every ~10 s) and its KV cache size
#   reach the arm's .log, where examples/verify/gen_profile.py reads them; the vexact arms record .phases.jsonl always
#   SHARED_HOST=1: other Ray jobs run on this host (each on its own GPUs, CUDA_VISIBLE_DEVICES): no `ray stop` between
#   arms (it would stop theirs too); set RAY_ADDRESS=local as well, so each arm starts its own Ray cluster
#   PYTHONPATH_VLLM / PYTHONPATH_VEXACT: put in front of PYTHONPATH for the vllm arm / the vexact and fast arms, where
#   the two stacks live in separate folders (scripts/staging/rl_stack_wheels.sh path vllm|vexact prints them)
#
# Every arm samples with `ignore_eos=True`, so each step generates exactly train_batch_size x n x max_response_length
# tokens in every arm: equal work for the timing (benchmarks/rl_step.py reads the same files). Outputs, per arm:
# RESULTS_DIR/<TAG>-<STEM>-<ARM>.jsonl (STEM: smoke's model, e.g. qwen3-1.7b, else the pair's name; verl's file
# logger: one record a step), .meta.json (the run's config, stack, the settings that differ from verl's defaults, GPU,
# commit, command, peak GPU memory sampled by nvidia-smi), .log (its first line: the actor attention, why, the
# folders in front of PYTHONPATH and the variables set for the arm alone; with GEN_STATS=1, vLLM's stats lines on the
# vllm arm) and, for the vexact and fast arms, .phases.jsonl
# (each replica's generation phases: time inside engine steps against the phase's wall time, vexact_verl.server
# GenPhase); with two or more arms compare.py then writes
# <TAG>-<STEM>.png over the arms that exited 0 (one arm a call: run compare.py on the files afterwards, as this
# script prints). The script exits 1 when any arm exits non-zero (its meta and the tail of its log written first),
# else with compare.py's status.
# Needs verl, Ray and vLLM importable (on an air-gapped machine: scripts/staging/rl_stack_wheels.sh install).
set -euo pipefail
cd "$(dirname "$0")/../.."
RESULTS=${1:?usage: run_pair.sh RESULTS_DIR [vllm] [vexact] [fast]}
shift
ARMS=("$@")
[ ${#ARMS[@]} -gt 0 ] || ARMS=(vllm vexact)
PAIR=${PAIR:-smoke}
# PAIR_* variables: the pair's settings after the environment's overrides (shapes.py validates them)
EXPANDED=$(python3 examples/verify/shapes.py "$PAIR") || exit 2
eval "$EXPANDED"
SHAPE=$PAIR_SHAPE LAYERS=$PAIR_LAYERS MOE=$PAIR_MOE GPU_MEM=$PAIR_GPU_MEMORY_UTILIZATION NGPUS=$PAIR_NGPUS
STEPS=$PAIR_STEPS STEM=$PAIR_STEM
LR=${LR:-3e-6}
ACTOR_ATTN=${ACTOR_ATTN:-}  # empty: actor_attention.py picks FA4 where it runs on the vllm arm's path, else sdpa
ACTOR_ATTN_LIB=""  # actor_attention.py's: the module verl imports in the vllm arm's workers for FA4, if any
FUSED_KERNELS=${FUSED_KERNELS:-1}  # the dense vllm arm's log-probs through verl's fused kernel (tuned pairs); 0: off
case "$FUSED_KERNELS" in 0 | 1) ;; *) echo "FUSED_KERNELS must be 0 or 1, got '$FUSED_KERNELS'" >&2; exit 2 ;; esac
GEN_STATS=${GEN_STATS:-0}  # 1: vLLM's engine stats in the vllm arm's log (gen_profile.py reads them)
case "$GEN_STATS" in 0 | 1) ;; *) echo "GEN_STATS must be 0 or 1, got '$GEN_STATS'" >&2; exit 2 ;; esac
PYTHONPATH_FA4=${PYTHONPATH_FA4-$(bash scripts/staging/rl_stack_wheels.sh path fa4)}
TAG=${TAG:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oiE 'h100|h200|b200|a100' \
  | tr 'A-Z' 'a-z' || true)}
TAG=${TAG:-gpu}
# the checkpoint's context holds a whole prompt and response (the engines cap max_model_len at it); the byte
# vocabulary's models were written at 1024 before, and keep that folder name there
MODEL_ARGS=(--shape "$SHAPE" --layers "$LAYERS" --context "$PAIR_CONTEXT")
if [ "$PAIR_VOCAB" = real ]; then
  MODEL_ARGS+=(--vocab real)
  MODEL_DIR=${MODEL_DIR:-outputs/models/$SHAPE-l$LAYERS-real-c$PAIR_CONTEXT}
elif [ "$PAIR_CONTEXT" != 1024 ]; then
  MODEL_DIR=${MODEL_DIR:-outputs/models/$SHAPE-l$LAYERS-c$PAIR_CONTEXT}
fi
MODEL_DIR=${MODEL_DIR:-outputs/models/$SHAPE-l$LAYERS}
DATA=${DATA:-outputs/data/arith}
# DRY_RUN=1: print each arm's command (one line: arm, then the command's words, NUL-separated) and run nothing
DRY_RUN=${DRY_RUN:-0}
mkdir -p "$RESULTS"
# absolute paths: vLLM's engine process and verl's workers resolve a relative one from another directory (as a hub id)
MODEL_DIR=$(realpath -m "$MODEL_DIR")
DATA=$(realpath -m "$DATA")
[ "$DRY_RUN" = 1 ] || [ -f "$MODEL_DIR/config.json" ] || python3 examples/verl_grpo/make_model.py "${MODEL_ARGS[@]}" \
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

# the vllm arm's actor attention and path: FA4's folders in front of vLLM's where the actor runs FA4
VLLM_PATH=${PYTHONPATH_VLLM:-}
if [[ " ${ARMS[*]} " == *" vllm "* ]]; then
  PROBE_PATH=${PYTHONPATH_FA4:+$PYTHONPATH_FA4:}$VLLM_PATH
  CHOICE=$(PYTHONPATH="$PROBE_PATH${PYTHONPATH:+:$PYTHONPATH}" ACTOR_ATTN="$ACTOR_ATTN" \
    python3 examples/verify/actor_attention.py) || exit 2
  eval "$CHOICE"
  # gpt-oss's learned sinks join every softmax: transformers' GptOss runs them on FA4 or eager only, and eager is no
  # baseline for a packed row: its mask is built without position_ids, so each sequence of a micro-batch attends to
  # the ones before it (huggingface/transformers#39997; packages/vexact-verl/tests/test_verl_veomni_default_stack.py),
  # and its token x token scores of a 16k-token micro-batch take tens of GB. FA4 or nothing, unless ACTOR_ATTN=eager
  if [[ "$SHAPE" == gpt-oss* ]] && [ "$ACTOR_ATTN" = sdpa ]; then
    echo "the gpt-oss vllm arm needs FlashAttention 4 for its actor (${ACTOR_ATTN_WHY}): transformers has no SDPA" \
      "path for gpt-oss's sinks, and its eager attention mixes the packed sequences of a micro-batch" \
      "(huggingface/transformers#39997). Stage FA4 (scripts/staging/fa4_device_wheels.sh) and set PYTHONPATH_FA4," \
      "or set ACTOR_ATTN=eager to run eager anyway" >&2
    exit 2
  fi
  [ "$ACTOR_ATTN" != flash_attention_4 ] || VLLM_PATH=$PROBE_PATH
  # the module verl imports in its workers (external_lib) for FA4 to take transformers' call; its folder in front
  [ -z "$ACTOR_ATTN_LIB" ] || VLLM_PATH=$PWD/examples/verify/fa4_shim:$VLLM_PATH
  # vLLM 0.24.0 loads no bf16 gpt-oss weights, from a checkpoint or from verl's weight sync; the vLLM plugin in this
  # folder maps the experts' names (examples/verify/vllm_plugin/vexact_vllm_plugin.py says why)
  [[ "$SHAPE" != gpt-oss* ]] || VLLM_PATH=$PWD/examples/verify/vllm_plugin:$VLLM_PATH
fi
# the vllm arm's MoE in VeOmni: its grouped-GEMM kernel, except for gpt-oss, which VeOmni 0.1.12 runs only as `eager`
# or `quack` (fused_triton: KeyError "Unknown kernel 'triton' for op='moe_experts', variant='gpt_oss'", seen on an
# H200); quack's CuTe kernels are not staged with this stack
MOE_IMPL=fused_triton
[[ "$SHAPE" != gpt-oss* ]] || MOE_IMPL=eager

write_meta() {  # $1: the arm's exit code, empty while it has not finished; the arm's own folders on the path, so
  # the versions recorded are the ones the arm ran
  ARM="$arm" NAME="$NAME" RESULTS="$RESULTS" ATTN="$ATTN" ATTN_WHY="$WHY" ACTOR="$ACTOR" MOE="$MOE" SHAPE="$SHAPE" \
  LAYERS="$LAYERS" PAIR="$PAIR" STEM="$STEM" VOCAB_SIZE="$PAIR_VOCAB_SIZE" RC="$1" CMDLINE="${CMD[*]}" \
  PYTHONPATH="$ARM_PATH${PYTHONPATH:+:$PYTHONPATH}" env "${ARM_ENV[@]}" python3 examples/verify/write_meta.py
}

# the settings every arm shares (compare.py refuses runs whose `config` differ)
COMMON=(
  algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=False
  data.train_files="$DATA/train.parquet" data.val_files="$DATA/test.parquet" data.train_batch_size="$PAIR_TRAIN_BATCH_SIZE"
  data.max_prompt_length="$PAIR_MAX_PROMPT_LENGTH" data.max_response_length="$PAIR_MAX_RESPONSE_LENGTH" data.seed=0
  actor_rollout_ref.model.path="$MODEL_DIR" actor_rollout_ref.model.use_remove_padding=True
  actor_rollout_ref.actor.optim.lr="$LR" actor_rollout_ref.actor.ppo_mini_batch_size="$PAIR_PPO_MINI_BATCH_SIZE"
)
if [ "$PAIR_TUNED" = 1 ]; then
  # verl's examples: a token budget per GPU instead of micro-batch sizes, for the actor's update and for the
  # forward-only log-prob passes (rollout's recompute and ref); gradient checkpointing on
  COMMON+=(
    actor_rollout_ref.model.enable_gradient_checkpointing=True actor_rollout_ref.actor.use_dynamic_bsz=True
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu="$PAIR_PPO_MAX_TOKEN_LEN_PER_GPU"
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu="$PAIR_LOG_PROB_MAX_TOKEN_LEN_PER_GPU"
    actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True
    actor_rollout_ref.ref.log_prob_max_token_len_per_gpu="$PAIR_LOG_PROB_MAX_TOKEN_LEN_PER_GPU"
  )
else
  COMMON+=(actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16)
fi
COMMON+=(
  actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.actor.entropy_coeff=0
  actor_rollout_ref.rollout.n="$PAIR_ROLLOUT_N" actor_rollout_ref.rollout.tensor_model_parallel_size=1
  actor_rollout_ref.rollout.gpu_memory_utilization="$GPU_MEM"
)
# smoke: the small pair's scheduler limits; the tuned pairs leave vLLM's scheduler at verl's defaults
[ "$PAIR_TUNED" = 1 ] || COMMON+=(actor_rollout_ref.rollout.max_num_seqs=256 actor_rollout_ref.rollout.max_num_batched_tokens=4096)
COMMON+=(actor_rollout_ref.rollout.calculate_log_probs=True actor_rollout_ref.rollout.ignore_eos=True)
[ "$PAIR_TUNED" = 1 ] || COMMON+=(actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16)
COMMON+=(
  reward.custom_reward_function.path=examples/verl_grpo/reward.py
  trainer.n_gpus_per_node="$NGPUS" trainer.nnodes=1 trainer.total_training_steps="$STEPS" trainer.val_before_train=False
  trainer.test_freq=-1 trainer.save_freq=-1 'trainer.logger=["console","file"]' trainer.project_name=vexact_verify
)
PASSED=() FAILED=()
for arm in "${ARMS[@]}"; do
  NAME="$TAG-$STEM-$arm"
  ARM_ENV=()  # variables set for this arm's process alone (GEN_STATS=1: vLLM's logging level)
  case "$arm" in
    vllm)
      ENTRY=verl.trainer.main_ppo
      ARGS=(actor_rollout_ref.rollout.name=vllm)
      if [ "$MOE" = 1 ]; then
        ATTN=$ACTOR_ATTN ACTOR="verl VeOmni engine ($MOE_IMPL MoE)"
        ARGS+=(model_engine=veomni actor_rollout_ref.actor.veomni.attn_implementation="$ACTOR_ATTN"
               actor_rollout_ref.actor.veomni.moe_implementation="$MOE_IMPL")
        # where VeOmni builds the model: on one GPU (no FSDP) only on an accelerator (ValueError "Only FSDP
        # training supports `init_device=meta`"), under FSDP2 only on meta, verl's default (AssertionError "Please
        # use init_device: meta for FSDP2")
        [ "$NGPUS" != 1 ] \
          || ARGS+=(actor_rollout_ref.actor.veomni.init_device=cuda actor_rollout_ref.ref.veomni.init_device=cuda)
        # on one GPU VeOmni applies no FSDP mixed precision: with verl's mixed_precision=true its weights are fp32
        # (verl's forward still autocasts to bf16) and reach the fused_triton MoE as fp32, which it refuses
        # (AssertionError: torch.float32, seen on an H100); bf16 weights there. Not for the eager MoE (gpt-oss): on
        # bf16 weights AdamW loses each update below half a bf16 ulp, at LR 3e-6 most of them
        # (packages/vexact-verl/tests/test_verl_veomni_default_stack.py), so it keeps verl's fp32 weights
        if [ "$NGPUS" = 1 ] && [ "$MOE_IMPL" = fused_triton ]; then
          ACTOR="$ACTOR, bf16 weights (one GPU: no FSDP mixed precision)"
          ARGS+=(actor_rollout_ref.actor.veomni.mixed_precision=False actor_rollout_ref.ref.veomni.mixed_precision=False)
        fi
      else
        ATTN=$ACTOR_ATTN ACTOR="verl FSDP engine (transformers model)"
        ARGS+=(+actor_rollout_ref.model.override_config.attn_implementation="$ACTOR_ATTN")
        if [ "$PAIR_TUNED" = 1 ] && [ "$FUSED_KERNELS" = 1 ]; then
          ACTOR="$ACTOR, verl's fused linear + log-prob kernel (Triton)"
          ARGS+=(actor_rollout_ref.model.use_fused_kernels=True
                 actor_rollout_ref.model.fused_kernel_options.impl_backend=triton)
        fi
      fi
      [ -z "$ACTOR_ATTN_LIB" ] || ARGS+=(actor_rollout_ref.model.external_lib="$ACTOR_ATTN_LIB")
      if [ "$GEN_STATS" = 1 ]; then
        ARGS+=(actor_rollout_ref.rollout.disable_log_stats=False)
        ARM_ENV=(VLLM_LOGGING_LEVEL=INFO)
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
  # the vexact replicas' account of each generation phase (engine steps against the phase's wall time)
  export VEXACT_GEN_PHASE_LOG="$RESULTS/$NAME.phases.jsonl"
  ARM_PATH=${PYTHONPATH_VEXACT:-} WHY="vexact_kernels.get_attention_impl()"
  [ "$arm" = vllm ] && ARM_PATH=$VLLM_PATH WHY=$ACTOR_ATTN_WHY
  rm -f "$VERL_FILE_LOGGER_PATH" "$VEXACT_GEN_PHASE_LOG"
  CMD=(python3 -m "$ENTRY" "${COMMON[@]}" "${ARGS[@]}" trainer.experiment_name="$NAME"
       trainer.default_local_dir="outputs/verify/checkpoints/$NAME" hydra.run.dir="outputs/verify/hydra/$NAME")
  NOTE="== $NAME: actor attention $ATTN ($WHY); PYTHONPATH in front: ${ARM_PATH:-(none)}"
  [ ${#ARM_ENV[@]} = 0 ] || NOTE="$NOTE; environment: ${ARM_ENV[*]}"
  if [ "$DRY_RUN" = 1 ]; then
    echo "$NOTE" >&2
    printf '%s\0' "$arm" "${CMD[@]}"; printf '\n'
    continue
  fi
  # the meta before the run as well (exit_code null), so an arm stopped early still has its config for compare.py
  write_meta ""
  MEMLOG="$RESULTS/$NAME.mem"
  # the GPUs this arm runs on (the first NGPUS of CUDA_VISIBLE_DEVICES), not every GPU of the host; the meta's peak
  # is the largest sample of any one of them
  GPU_INDEX=$(echo "${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((NGPUS - 1)))}" | cut -d, -f1-"$NGPUS")
  nvidia-smi -i "$GPU_INDEX" --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "$MEMLOG" \
    2> /dev/null &
  SMI=$!
  echo "$NOTE"
  echo "== $NAME: ${CMD[*]}"
  START=$(date +%s)
  rc=0
  echo "$NOTE" > "$RESULTS/$NAME.log"
  PYTHONPATH="$ARM_PATH${PYTHONPATH:+:$PYTHONPATH}" env "${ARM_ENV[@]}" "${CMD[@]}" >> "$RESULTS/$NAME.log" 2>&1 \
    || rc=$?
  kill "$SMI" 2> /dev/null || true
  # a stack's Ray cluster and rollout processes must be gone before the next arm measures memory and time; where
  # other Ray jobs share the host (SHARED_HOST=1), only the arm's own driver ends, whose exit stops its local cluster
  if [ "${SHARED_HOST:-0}" != 1 ]; then
    ray stop --force > /dev/null 2>&1 || true
    pkill -f "VLLM::EngineCore" 2> /dev/null || true
  fi
  sleep 3
  echo "== $NAME: exit $rc after $(( $(date +%s) - START )) s, $(wc -l < "$VERL_FILE_LOGGER_PATH" 2> /dev/null || echo 0) steps"
  write_meta "$rc"
  if [ "$rc" = 0 ]; then
    PASSED+=("$arm")
  else
    FAILED+=("$arm")
    tail -30 "$RESULTS/$NAME.log"
  fi
done
[ "$DRY_RUN" = 1 ] && exit 0
status=0
if [ ${#ARMS[@]} -lt 2 ]; then  # one arm a call (e.g. each on its own GPU): compare once both have run
  echo "== compare when the other arm has run: python3 examples/verify/compare.py $RESULTS/$TAG-$STEM-vllm.jsonl" \
    "$RESULTS/$TAG-$STEM-vexact.jsonl --plot $RESULTS/$TAG-$STEM.png --expect-exact vexact"
elif [ ${#PASSED[@]} -ge 2 ]; then  # a failed arm's log is not a run to compare
  FILES=()
  for arm in "${PASSED[@]}"; do FILES+=("$RESULTS/$TAG-$STEM-$arm.jsonl"); done
  EXACT=()
  [[ " ${PASSED[*]} " == *" vexact "* ]] && EXACT=(--expect-exact vexact)
  python3 examples/verify/compare.py "${FILES[@]}" --plot "$RESULTS/$TAG-$STEM.png" "${EXACT[@]}" || status=$?
fi
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "== failed: ${FAILED[*]} (exit codes in their .meta.json, the tails of their logs above)" >&2
  exit 1
fi
exit "$status"
