#!/usr/bin/env bash
# The multi-GPU checks of one host (2, 4 or 8 GPUs), each with its log in RESULTS_DIR and one PASS / FAIL / SKIP line
# in RESULTS_DIR/summary.txt (after a header: date, GPU, GPU count, commit, command).
#
#   bash scripts/checks/multi_gpu.sh RESULTS_DIR [fsdp] [pp] [twonode]     # default: fsdp pp (torch only)
#
# - fsdp:    contracts/test_fsdp.py's world-size tests at the GPU shapes (Qwen3-0.6B-shaped, the tiny Qwen3-MoE and
#            DeepSeek-V3 checkpoints): world size 1, then 2, 4 and 8 up to the visible GPUs (a larger one skips,
#            naming the count) == world size 1 == the engine after updates, torch.equal.
# - pp:      scripts/checks/pp_check.py at 4 stages (>= 4 GPUs; PP_SHAPE, default 0.6b at its 28 layers, 7 a stage;
#            PP_PROMPTS, default 48): == one GPU, the perturbed boundary caught, sleep / wake / update_weights
#            through every stage.
# - twonode: scripts/checks/two_node_verl.sh: a verl GRPO job on two Ray nodes started on this host, 2 GPUs a node
#            with >= 4 GPUs, else 1 (TWONODE_STEPS, default 3). Needs the verl stack: its PYTHONPATH comes from
#            `bash scripts/staging/rl_stack_wheels.sh path vexact` (staged with `... install`).
# fsdp and pp need only torch, so they can run before the verl stack is staged. The script sources
# scripts/staging/device_env.sh (the monorepo on PYTHONPATH). GPUs: those of CUDA_VISIBLE_DEVICES, else all. Exit
# status 0 only if every item asked for passed (SKIP counts as not passed).
set -uo pipefail
cd "$(dirname "$0")/../.."
RESULTS=${1:?usage: multi_gpu.sh RESULTS_DIR [fsdp] [pp] [twonode]}
shift
WHAT=("$@")
[ ${#WHAT[@]} -gt 0 ] || WHAT=(fsdp pp)
for w in "${WHAT[@]}"; do
  case "$w" in fsdp | pp | twonode) ;; *) echo "unknown item '$w' (fsdp, pp, twonode)" >&2; exit 2 ;; esac
done
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
SUMMARY=$RESULTS/summary.txt
# shellcheck disable=SC1091
source scripts/staging/device_env.sh
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
case "$GPU" in
  *H100*) TARGET=h100 ;; *H200*) TARGET=h200 ;; *B200*) TARGET=b200 ;;
  *) echo "no contract target for GPU '$GPU' (H100, H200, B200)" >&2; exit 2 ;;
esac
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "GPU: $GPU x $NGPU"
  dirty=""
  git rev-parse HEAD > /dev/null 2>&1 && ! git diff --quiet HEAD && dirty=" (uncommitted changes)"
  echo "commit: ${COMMIT:-$(git rev-parse --short HEAD 2> /dev/null || echo unknown)}$dirty"
  echo "command: bash scripts/checks/multi_gpu.sh $RESULTS ${WHAT[*]}"
} | tee -a "$SUMMARY"
status=0
result() {  # result ITEM VERDICT DETAIL: one summary line
  echo "$1: $2 ($3)" | tee -a "$SUMMARY"
  [ "$2" = PASS ] || status=1
}

fsdp() {
  local log=$RESULTS/fsdp.log rc
  python3 -m pytest -q -rA -p no:cacheprovider contracts/test_fsdp.py -k wsn --target "$TARGET" > "$log" 2>&1
  rc=$?
  local passed skipped
  passed=$(grep -c "^PASSED" "$log")
  skipped=$(grep -c "^SKIPPED" "$log")
  local want=0 n
  for n in 2 4 8; do [ "$NGPU" -ge "$n" ] && want=$((want + 3)); done  # 3 families a world size
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)" "$log"
  if [ "$rc" = 0 ] && [ "$passed" = "$want" ] && [ "$want" -gt 0 ]; then
    result fsdp PASS "$passed world-size tests passed on $NGPU GPUs, $skipped skipped (more GPUs than visible)"
  else
    result fsdp FAIL "pytest exit $rc, $passed passed of $want, $skipped skipped; see $log"
  fi
}

pp() {
  local log=$RESULTS/pp.log rc shape=${PP_SHAPE:-0.6b} prompts=${PP_PROMPTS:-48}
  if [ "$NGPU" -lt 4 ]; then
    result pp SKIP "a 4-stage pipeline needs 4 GPUs; $NGPU visible"
    return
  fi
  local t0=$SECONDS
  python3 -m torch.distributed.run --standalone --nproc_per_node 4 scripts/checks/pp_check.py --shape "$shape" \
    --prompts "$prompts" > "$log" 2>&1
  rc=$?
  grep -E "^(pipeline|one device|perturbed|after)" "$log"
  if [ "$rc" = 0 ]; then
    result pp PASS "4 stages, shape $shape, $prompts prompts, $((SECONDS - t0)) s"
  else
    result pp FAIL "exit $rc after $((SECONDS - t0)) s; see $log"
  fi
}

twonode() {
  local log=$RESULTS/twonode.log rc site k=1
  site=$(bash scripts/staging/rl_stack_wheels.sh path vexact)
  if [ ! -f "$site/.complete" ]; then
    result twonode FAIL "the verl stack is not staged in $site (bash scripts/staging/rl_stack_wheels.sh install)"
    return
  fi
  if [ "$NGPU" -ge 4 ]; then k=2; elif [ "$NGPU" -lt 2 ]; then
    result twonode SKIP "two nodes need 2 GPUs; $NGPU visible"
    return
  fi
  local t0=$SECONDS
  PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} bash scripts/checks/two_node_verl.sh "$RESULTS/twonode" "$k" \
    "${TWONODE_STEPS:-3}" > "$log" 2>&1
  rc=$?
  grep -E "^(ray node|  node|placement|expect-exact|  invariant|  fast|verl job|  exit)" "$log"
  local verdict
  verdict=$(tail -1 "$log")
  if [ "$rc" = 0 ]; then
    result twonode PASS "$k GPUs a node, $((SECONDS - t0)) s; $verdict"
  else
    result twonode FAIL "exit $rc after $((SECONDS - t0)) s; $verdict; see $log"
  fi
}

for w in "${WHAT[@]}"; do "$w"; done
echo "summary ($SUMMARY):"
tail -n "${#WHAT[@]}" "$SUMMARY"
exit "$status"
