#!/usr/bin/env bash
# The whole study on one or more GPUs of one host, one command, resumable:
#
#   GPUS=0 PROCS=8 bash examples/tim_study/run_gpu.sh [DIR]          # DIR default outputs/tim_study/gpu
#
# 1. fit the policy (fit_policy.py --preset small) unless DIR/policy holds one; 2. calibrate the noise (sweep.py
# --calibrate) unless DIR/calibration.json exists; 3. the lr probe: the exact arm at lr 3e-5, 1e-4 and 3e-4, seeds
# 0, 1, 2; 4. the rate report.py --pick-lr picks from it (DIR/lr.txt); 5. the mismatched arms (k3:1.5e-4, k3:1.5e-3,
# fast) x corrections (none, tis, mis) x seeds at that rate; 6. report.py over the exact arm's runs at that rate and
# step 5's runs -> DIR/study.{md,png,jsonl}.
#
# Every run (one cell: arm, correction, seed, lr) is its own sweep.py process writing DIR/cells/<cell>.jsonl; a cell
# is claimed by creating DIR/claims/<cell> (mkdir is atomic), so several invocations of this script share the work:
# start one per GPU, at any time, each with its own GPUS and PROCS (runs at once on that GPU). A later invocation
# joins the current phase; the fit, the calibration, the pick and the report run once. A cell whose process failed
# or was killed leaves its claim: run again with RECLAIM=1 (no other invocation running) to retry incomplete cells.
#
# STEPS (default 300), SEEDS (default 0,1,2), LRS (default 3e-5,1e-4,3e-4), ARMS (default k3:1.5e-4,k3:1.5e-3,fast),
# CORRECTIONS (default none,tis,mis) are environment variables; DEVICE=cpu PRESET=tiny for a CPU check (FIT_ARGS: more
# fit_policy.py options, PICK_ARGS: more report.py --pick-lr options, e.g. --stall).
set -uo pipefail
cd "$(dirname "$0")/../.."
DIR=${1:-outputs/tim_study/gpu}
GPUS=${GPUS:-0}
PROCS=${PROCS:-8}
STEPS=${STEPS:-300}
SEEDS=${SEEDS:-0,1,2}
LRS=${LRS:-3e-5,1e-4,3e-4}
ARMS=${ARMS:-k3:1.5e-4,k3:1.5e-3,fast}
CORRECTIONS=${CORRECTIONS:-none,tis,mis}
DEVICE=${DEVICE:-cuda}
PRESET=${PRESET:-small}
FIT_ARGS=${FIT_ARGS:-}
SWEEP=examples/tim_study/sweep.py
REPORT=examples/tim_study/report.py
# one spelling per rate (as report.py --pick-lr prints it), so a cell's file name is the same in every phase
LRS=$(python3 -c "import sys; print(','.join(f'{float(x):g}' for x in sys.argv[1].split(',')))" "$LRS") || exit 2
if [ "$DEVICE" = cuda ] && ! python3 -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
  echo "run_gpu.sh: --device cuda: this machine has no CUDA device (torch.cuda.is_available() is False); use DEVICE=cpu" >&2
  exit 2
fi
mkdir -p "$DIR/cells" "$DIR/claims" "$DIR/logs"
[[ "$PROCS" =~ ^[1-9][0-9]*$ ]] || { echo "run_gpu.sh: PROCS must be a positive integer, got '$PROCS'" >&2; exit 2; }
IFS=, read -r -a gpus <<< "$GPUS"
log() { echo "[$(date +%T) gpus $GPUS] $*"; }

# once NAME CMD...: run CMD in the first invocation that gets here; the others wait until it is done
once() {
  local name=$1
  shift
  if mkdir "$DIR/claims/once-$name" 2> /dev/null; then
    log "$name: $*"
    if "$@" > "$DIR/logs/$name.log" 2>&1; then touch "$DIR/claims/once-$name/done"; else
      log "$name failed (log $DIR/logs/$name.log):"
      tail -20 "$DIR/logs/$name.log"
      touch "$DIR/claims/once-$name/failed"
      return 1
    fi
  else
    while [ ! -e "$DIR/claims/once-$name/done" ]; do
      [ -e "$DIR/claims/once-$name/failed" ] && { log "$name failed in another invocation"; return 1; }
      sleep 5
    done
  fi
}

# complete CELL: its JSONL holds STEPS rows
complete() {
  [ -f "$DIR/cells/$1.jsonl" ] && [ "$(grep -c . "$DIR/cells/$1.jsonl")" -ge "$STEPS" ]
}

# cells PHASE: the cell names of a phase, one per line: ARM~CORRECTION~SEED~LR (every name a file name)
cells() {
  local arm corr seed lr
  IFS=, read -r -a seeds <<< "$SEEDS"
  if [ "$1" = probe ]; then
    IFS=, read -r -a lrs <<< "$LRS"
    for lr in "${lrs[@]}"; do for seed in "${seeds[@]}"; do echo "exact~none~$seed~$lr"; done; done
  else
    local pick
    pick=$(tail -1 "$DIR/lr.txt")
    IFS=, read -r -a arms <<< "$ARMS"
    IFS=, read -r -a corrs <<< "$CORRECTIONS"
    for arm in "${arms[@]}"; do for corr in "${corrs[@]}"; do for seed in "${seeds[@]}"; do
      echo "$arm~$corr~$seed~$pick"
    done; done; done
  fi
}

# run_phase PHASE: claim and run the phase's cells, PROCS at a time on this invocation's GPUs (round robin)
run_phase() {
  local cell arm corr seed lr n=0 running=0 gpu
  [ "${RECLAIM:-0}" = 1 ] && for cell in $(cells "$1"); do complete "$cell" || rmdir "$DIR/claims/$cell" 2> /dev/null; done
  for cell in $(cells "$1"); do
    complete "$cell" && continue
    mkdir "$DIR/claims/$cell" 2> /dev/null || continue
    IFS='~' read -r arm corr seed lr <<< "$cell"
    gpu=${gpus[$((n % ${#gpus[@]}))]}
    n=$((n + 1))
    log "$cell on GPU $gpu"
    CUDA_VISIBLE_DEVICES=$gpu python3 "$SWEEP" --device "$DEVICE" --from-fitted "$DIR/policy" \
      --calibration "$DIR/calibration.json" --arms "$arm" --corrections "$corr" --seeds "$seed" --lr "$lr" \
      --steps "$STEPS" --out "$DIR/cells/$cell.jsonl" > "$DIR/logs/$cell.log" 2>&1 &
    running=$((running + 1))
    if [ "$running" -ge "$PROCS" ]; then
      wait -n
      running=$((running - 1))
    fi
  done
  wait
  # then wait for the cells other invocations claimed
  for cell in $(cells "$1"); do
    until complete "$cell"; do
      if [ -d "$DIR/claims/$cell" ] && ! pgrep -f -- "--out $DIR/cells/$cell.jsonl" > /dev/null; then
        log "$cell: claimed but no process runs it and it is incomplete (RECLAIM=1 retries it)"
        tail -5 "$DIR/logs/$cell.log" 2> /dev/null
        return 1
      fi
      sleep 5
    done
  done
  log "phase $1: every cell complete"
}

fit() {
  [ -f "$DIR/policy/fit.json" ] && { echo "$DIR/policy holds a fitted policy: kept"; return 0; }
  python3 examples/tim_study/fit_policy.py --device "$DEVICE" --preset "$PRESET" $FIT_ARGS --out "$DIR/policy"
}
calibrate() {
  [ -f "$DIR/calibration.json" ] && { echo "$DIR/calibration.json exists: kept"; return 0; }
  python3 "$SWEEP" --device "$DEVICE" --from-fitted "$DIR/policy" --calibrate --calibration "$DIR/calibration.json"
}
pick() {
  python3 "$REPORT" "$DIR"/cells/exact~*.jsonl --pick-lr ${PICK_ARGS:-} > "$DIR/lr.txt"
  cat "$DIR/lr.txt"
  [ "$(tail -1 "$DIR/lr.txt")" != none ]
}
study_report() {
  local pick files=()
  pick=$(tail -1 "$DIR/lr.txt")
  files=("$DIR"/cells/exact~none~*~"$pick".jsonl)
  for cell in $(cells main); do files+=("$DIR/cells/$cell.jsonl"); done
  python3 "$REPORT" "${files[@]}" --out "$DIR/study"
  python3 "$REPORT" "$DIR"/cells/exact~*.jsonl --out "$DIR/lr-probe"
}

export CUDA_VISIBLE_DEVICES=${gpus[0]}
once fit fit || exit 1
once calibrate calibrate || exit 1
run_phase probe || exit 1
once pick pick || { log "no learning rate passes the probe (see $DIR/lr.txt); the sweep does not run"; exit 1; }
log "lr: $(tail -1 "$DIR/lr.txt")"
run_phase main || exit 1
once report study_report || exit 1
log "done: $DIR/study.md"
