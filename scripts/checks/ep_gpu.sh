#!/usr/bin/env bash
# The expert-parallel contracts on GPUs, NCCL (NVLink multicast off), one rank per GPU, with one PASS / FAIL / SKIP
# line a case in RESULTS_DIR/summary.txt (after a header: date, GPU, GPU count, commit, command):
#
#   bash scripts/checks/ep_gpu.sh RESULTS_DIR
#
# For EP = 2 (and 4 where 4 GPUs are visible), each of the tiny qwen3_moe, deepseek_v3 and qwen3_moe_top8 checkpoints:
# contracts/ep_check.py (ExpertParallelLLM == one GPU == the trainer, torch.equal; qwen3_moe and deepseek_v3 also after
# sleep(2), wake and update_weights), eager steps (--eager), then the same with decode steps as CUDA graphs (--graphs:
# padded to sizes 2 and 3, every rank to one size, the NCCL collectives captured inside; each rank must capture without
# an eager fallback) and a rank with no request (--idle-rank); then the perturbations: the combine in arrival order on
# qwen3_moe_top8 at EP = 2, and a graph's pad mark covering a real row (pad_rows), must be caught; then verl-ep2 (its
# replica takes the engine defaults: decode graphs on): verl's LLMServerManager builds a vexact replica with
# rollout.expert_parallel_size=2 over two GPUs (packages/vexact-verl/tests/test_verl_rollout_expert_parallel.py, its
# cuda case): tokens and logprobs through verl's client == one GPU == the trainer, before and after verl's weight sync.
# The script sources scripts/staging/device_env.sh (the monorepo on PYTHONPATH). GPUs: those of CUDA_VISIBLE_DEVICES,
# else all. Exit status 0 only if every case passed and every perturbation was caught.
set -uo pipefail
cd "$(dirname "$0")/../.."
RESULTS=${1:?usage: ep_gpu.sh RESULTS_DIR}
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
SUMMARY=$RESULTS/summary.txt
# shellcheck disable=SC1091
source scripts/staging/device_env.sh
export NCCL_NVLS_ENABLE=0
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "GPU: $GPU x $NGPU"
  dirty=""
  git rev-parse HEAD > /dev/null 2>&1 && ! git diff --quiet HEAD && dirty=" (uncommitted changes)"
  echo "commit: ${COMMIT:-$(git rev-parse --short HEAD 2> /dev/null || echo unknown)}$dirty"
  echo "command: bash scripts/checks/ep_gpu.sh $RESULTS"
} | tee -a "$SUMMARY"
status=0
result() {  # result CASE VERDICT DETAIL: one summary line
  echo "$1: $2 ($3)" | tee -a "$SUMMARY"
  [ "$2" = PASS ] || status=1
}

check() {  # check NAME WORLD EXPECT ARGS...: EXPECT pass (exit 0) or caught (exit 0 of a perturbed run)
  local name=$1 world=$2 expect=$3 log
  shift 3
  log=$RESULTS/$name.log
  if [ "$NGPU" -lt "$world" ]; then
    result "$name" SKIP "EP=$world needs $world GPUs; $NGPU visible"
    return
  fi
  local t0=$SECONDS
  # a bound per case: ranks whose collectives stop matching (in a captured graph above all) wait forever
  timeout 900 python3 -m torch.distributed.run --standalone --nproc_per_node "$world" -m contracts.ep_check \
    --device cuda "$@" > "$log" 2>&1
  local rc=$?
  grep -E '^\{' "$log" | tail -1
  if [ "$rc" = 0 ]; then
    result "$name" PASS "EP=$world, $expect, $((SECONDS - t0)) s"
  else
    result "$name" FAIL "exit $rc after $((SECONDS - t0)) s; see $log"
  fi
}

for world in 2 4; do
  check "qwen3_moe-ep$world" "$world" "== one GPU == trainer" --checkpoint qwen3_moe --weights --eager
  check "deepseek_v3-ep$world" "$world" "== one GPU == trainer" --checkpoint deepseek_v3 --weights --eager
  check "qwen3_moe_top8-ep$world" "$world" "== one GPU == trainer" --checkpoint qwen3_moe_top8 --long --eager
done
for world in 2 4; do
  check "graphs-qwen3_moe-ep$world" "$world" "graphs == one GPU == trainer" --checkpoint qwen3_moe --weights --graphs
  check "graphs-deepseek_v3-ep$world" "$world" "graphs == one GPU == trainer" --checkpoint deepseek_v3 --weights \
    --graphs
  check "graphs-qwen3_moe_top8-ep$world" "$world" "graphs == one GPU == trainer" --checkpoint qwen3_moe_top8 --long \
    --graphs
  check "graphs-idle-rank-ep$world" "$world" "graphs, a rank with no request" --checkpoint qwen3_moe --graphs \
    --idle-rank
done
check "graphs-driven-ep2" 2 "graphs, driven, == one GPU" --checkpoint qwen3_moe --weights --graphs --driven
check "arrival-order-caught-ep2" 2 "arrival-order combine caught" --checkpoint qwen3_moe_top8 --long --perturb arrival
check "graphs-pad-rows-caught-ep2" 2 "pad mark over a real row caught" --checkpoint qwen3_moe --graphs \
  --perturb pad_rows

if [ "$NGPU" -lt 2 ]; then
  result verl-ep2 SKIP "a verl EP=2 replica needs 2 GPUs; $NGPU visible"
else
  t0=$SECONDS
  python3 -m pytest -q -x -p no:cacheprovider -k cuda packages/vexact-verl/tests/test_verl_rollout_expert_parallel.py \
    > "$RESULTS/verl-ep2.log" 2>&1
  rc=$?
  tail -1 "$RESULTS/verl-ep2.log"
  if [ "$rc" = 0 ] && grep -q " passed" "$RESULTS/verl-ep2.log" && ! grep -q "skipped" "$RESULTS/verl-ep2.log"; then
    result verl-ep2 PASS "verl replica EP=2 == one GPU == trainer, through a weight sync, $((SECONDS - t0)) s"
  else
    result verl-ep2 FAIL "exit $rc after $((SECONDS - t0)) s; see $RESULTS/verl-ep2.log"
  fi
fi
exit "$status"
