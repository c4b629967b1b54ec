#!/usr/bin/env bash
# The verify pairs and the RL step benchmark on one GPU machine, after `bash scripts/staging/rl_stack_wheels.sh install`:
#
#   bash scripts/checks/verify_gpu.sh RESULTS_DIR [STEPS]
#
# runs examples/verify/run_pair.sh for the Qwen3-1.7B shape and the Qwen3-30B-A3B shape (arms vllm and vexact), then
# benchmarks/rl_step.py over the four runs (benchmarks/results-style Markdown in RESULTS_DIR/rl-step-<gpu>.md), then,
# while FAST=1, the `fast` arm of each shape. Each stack runs from its own folder of wheels (rl_stack_wheels.sh).
# It can run in the background (nohup); RESULTS_DIR/progress.log shows how far it is. SHAPES (env, default
# "qwen3-1.7b qwen3-30b-a3b") picks the shapes.
set -uo pipefail
cd "$(dirname "$0")/../.."
RESULTS=${1:?usage: verify_gpu.sh RESULTS_DIR [STEPS]}
export STEPS=${2:-10}
mkdir -p "$RESULTS"
exec > >(tee -a "$RESULTS/progress.log") 2>&1
source scripts/staging/device_env.sh
PYTHONPATH_VLLM=$(bash scripts/staging/rl_stack_wheels.sh path vllm)
PYTHONPATH_VEXACT=$(bash scripts/staging/rl_stack_wheels.sh path vexact)
export PYTHONPATH_VLLM PYTHONPATH_VEXACT
export TAG=${TAG:-$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oiE 'h100|h200|b200' | tr 'A-Z' 'a-z')}
date
SHAPES=${SHAPES:-qwen3-1.7b qwen3-30b-a3b}
for shape in $SHAPES; do
  SHAPE=$shape bash examples/verify/run_pair.sh "$RESULTS" vllm vexact
  date
done
runs=()
for shape in $SHAPES; do runs+=("$RESULTS/$TAG-$shape-vllm.jsonl" "$RESULTS/$TAG-$shape-vexact.jsonl"); done
python3 benchmarks/rl_step.py "${runs[@]}" --out "$RESULTS/rl-step-$TAG.md"
if [ "${FAST:-1}" = 1 ]; then
  for shape in $SHAPES; do
    SHAPE=$shape bash examples/verify/run_pair.sh "$RESULTS" fast
    python3 examples/verify/compare.py "$RESULTS/$TAG-$shape-"{vllm,vexact,fast}.jsonl --plot "$RESULTS/$TAG-$shape.png" \
      --expect-exact vexact
  done
fi
date
echo "verify_gpu done"
