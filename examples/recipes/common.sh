# Shared by the recipes of this folder (sourced, not run): the environment they read, the checks that fail early with
# the value named, the small-run switch, and the launch of verl's trainer with the vexact rollout and actor.
#
# Environment (every recipe):
#   MODEL_DIR      a local Hugging Face checkpoint directory (config.json, safetensors, tokenizer with a chat template)
#   DATA_DIR       the data root examples/data/prepare.py writes: DATA_DIR/<dataset>/{train,test}.parquet
#   NNODES         nodes in the Ray cluster (default: the recipe's)
#   GPUS_PER_NODE  GPUs per node (default: the recipe's; at most the GPUs visible on this node)
#   RUN_DIR        where metrics (RUN_DIR/metrics.jsonl, verl's file logger; VERL_FILE_LOGGER_PATH to put them
#                  elsewhere), checkpoints and Hydra's files go (default outputs/recipes/<recipe>)
#   SMOKE=1        a small run: batch, lengths and steps shrink (2 steps); every other setting stays the recipe's
#   VERL_PLATFORM=cpu  runs on CPU (packages/vexact-verl/README.md, "verl on CPU"); no GPU count is checked then
# Arguments after the script are Hydra overrides, passed to verl last (so they win).

set -euo pipefail
RECIPES=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$RECIPES/../.." && pwd)
SMOKE=${SMOKE:-0}

die() {
  echo "$RECIPE: $*" >&2
  exit 2
}

# recipe_init NAME DEFAULT_NNODES DEFAULT_GPUS_PER_NODE: read and check the environment every recipe shares
recipe_init() {
  RECIPE=$1
  NNODES=${NNODES:-$2}
  GPUS_PER_NODE=${GPUS_PER_NODE:-$3}
  [ -n "${MODEL_DIR:-}" ] || die "set MODEL_DIR to a local checkpoint directory (config.json, weights, tokenizer)"
  [ -d "$MODEL_DIR" ] || die "MODEL_DIR=$MODEL_DIR is not a directory"
  [ -f "$MODEL_DIR/config.json" ] || die "MODEL_DIR=$MODEL_DIR has no config.json (not a Hugging Face checkpoint)"
  [ -n "${DATA_DIR:-}" ] || die "set DATA_DIR to the data root of examples/data/prepare.py"
  [ -d "$DATA_DIR" ] || die "DATA_DIR=$DATA_DIR is not a directory (python examples/data/prepare.py NAME --out DIR)"
  case "$SMOKE" in 0 | 1) ;; *) die "SMOKE must be 0 or 1, got '$SMOKE'" ;; esac
  [[ "$NNODES" =~ ^[1-9][0-9]*$ ]] || die "NNODES must be a positive integer, got '$NNODES'"
  [[ "$GPUS_PER_NODE" =~ ^[1-9][0-9]*$ ]] || die "GPUS_PER_NODE must be a positive integer, got '$GPUS_PER_NODE'"
  if [ "${VERL_PLATFORM:-}" != cpu ]; then
    local visible
    visible=$(python3 -c "import torch; print(torch.cuda.device_count())" 2> /dev/null || echo 0)
    [ "$GPUS_PER_NODE" -le "$visible" ] \
      || die "GPUS_PER_NODE=$GPUS_PER_NODE but this node sees $visible GPU(s) (CUDA_VISIBLE_DEVICES='${CUDA_VISIBLE_DEVICES:-}')"
  fi
  # absolute paths: verl's workers resolve a relative one from another directory (as a hub id)
  MODEL_DIR=$(realpath "$MODEL_DIR")
  DATA_DIR=$(realpath "$DATA_DIR")
  RUN_DIR=$(realpath -m "${RUN_DIR:-$ROOT/outputs/recipes/$RECIPE}")
  mkdir -p "$RUN_DIR"
}

# need_data FILE...: the parquet files (relative to DATA_DIR) this recipe reads
need_data() {
  local f
  for f in "$@"; do
    [ -f "$DATA_DIR/$f" ] || die "DATA_DIR=$DATA_DIR has no $f (python examples/data/prepare.py ${f%%/*} --out $DATA_DIR)"
  done
}

# pick FULL SMALL: the recipe's value, or the small run's under SMOKE=1 (batch, lengths and steps only)
pick() {
  if [ "$SMOKE" = 1 ]; then echo "$2"; else echo "$1"; fi
}

# launch [ENTRY] OVERRIDES...: verl's trainer with the settings every recipe shares, then the recipe's, then "$@"
# (no dataloader worker processes: with them verl's dataloader saves a per-process random worker seed in its
# checkpoint, and a resumed run's data.pt differs from the uninterrupted run's)
# of the recipe (the caller passes them last). ENTRY defaults to vexact_verl.main_ppo.
launch() {
  local entry=vexact_verl.main_ppo
  if [ "${1:-}" = --entry ]; then
    entry=$2
    shift 2
  fi
  # verl's file logger starts the file afresh; a rerun in the same RUN_DIR resumes from its last checkpoint (verl's
  # trainer.resume_mode=auto)
  export VERL_FILE_LOGGER_PATH=${VERL_FILE_LOGGER_PATH:-$RUN_DIR/metrics.jsonl}
  cd "$ROOT"
  echo "== $RECIPE: $NNODES node(s) x $GPUS_PER_NODE GPU(s), SMOKE=$SMOKE, metrics in $VERL_FILE_LOGGER_PATH"
  python3 -m "$entry" \
    actor_rollout_ref.model.path="$MODEL_DIR" \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.calculate_log_probs=True \
    data.dataloader_num_workers=0 \
    trainer.nnodes="$NNODES" \
    trainer.n_gpus_per_node="$GPUS_PER_NODE" \
    trainer.logger='["console","file"]' \
    trainer.project_name=vexact_recipes \
    trainer.experiment_name="$RECIPE" \
    trainer.default_local_dir="$RUN_DIR/checkpoints/$RECIPE" \
    hydra.run.dir="$RUN_DIR/hydra/$RECIPE" \
    "$@"
}

# the vexact rollout (invariant kernels) and the invariant actor (`actor.strategy=vexact`): engine and trainer logprobs bitwise equal
VEXACT=(
  actor_rollout_ref.rollout.name=vexact
  actor_rollout_ref.actor.strategy=vexact
  +actor_rollout_ref.rollout.engine_kwargs.vexact.backend=invariant
)
