#!/usr/bin/env bash
# The verify pair: the same verl GRPO run (examples/verl_grpo/run_grpo.sh: same data, seed, steps) once with the
# invariant rollout backend and once with the fast one, then compare verl's logged rollout-correction metrics.
#
#   MODEL=/path/to/Qwen3-0.6B bash examples/verify/run_pair.sh          # both runs, then compare.py
#
# What should differ: rollout_corr/k3_kl (verl's K3 KL between rollout and actor), rollout_corr/kl and the
# log-ppl differences are 0.0 at every step for the invariant run *when the actor runs in invariant mode* (the actor
# recomputes old_log_prob with the same model code and kernels: see packages/vexact-verl/README.md, status), and
# clearly above 0 for the fast run (cuBLAS/SDPA rollout against the actor). Until the actor's invariant mode lands,
# both runs compare the rollout against verl's stock HF actor, so both show a small nonzero mismatch.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-outputs/verify}
for backend in invariant fast; do
  BACKEND=$backend NAME=verify-$backend OUT=$OUT bash examples/verl_grpo/run_grpo.sh "$@"
done
python3 examples/verify/compare.py "$OUT/verify-invariant.jsonl" "$OUT/verify-fast.jsonl" --plot "$OUT/verify.png"
