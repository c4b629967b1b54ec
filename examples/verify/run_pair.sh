#!/usr/bin/env bash
# The verify pair: the same verl GRPO run (examples/verl_grpo/run_grpo.sh: same data, seed, steps) once with the
# invariant rollout backend and once with the fast one, then compare verl's logged rollout-correction metrics.
#
#   MODEL=/path/to/Qwen3-0.6B bash examples/verify/run_pair.sh          # both runs, then compare.py
#
# What should differ: rollout_corr/k3_kl (verl's K3 KL between rollout and actor), rollout_corr/kl and the
# log-ppl differences are 0.0 at every step for the invariant run *when the actor runs in invariant mode* (the actor
# recomputes old_log_prob with the same model code and kernels: pass actor_rollout_ref.actor.strategy=vexact), and
# clearly above 0 for the fast run (cuBLAS/SDPA rollout against the same invariant actor). compare.py --expect-exact
# exits non-zero otherwise. With verl's stock actor (strategy fsdp) both runs show a small nonzero mismatch.
set -euo pipefail
cd "$(dirname "$0")/../.."
RUN_DIR=${RUN_DIR:-outputs/verify}
TAG=${TAG:-}  # appended to the run names, e.g. -2gpu
for backend in invariant fast; do
  BACKEND=$backend NAME=verify-$backend$TAG RUN_DIR=$RUN_DIR bash examples/verl_grpo/run_grpo.sh "$@"
done
python3 examples/verify/compare.py "$RUN_DIR/verify-invariant$TAG.jsonl" "$RUN_DIR/verify-fast$TAG.jsonl" \
  --plot "$RUN_DIR/verify$TAG.png" --expect-exact
