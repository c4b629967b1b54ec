#!/usr/bin/env bash
# Every GPU check of the repo, on a GPU machine, one step or several per command:
#   source scripts/staging/device_env.sh && bash scripts/checks/gpu_checks.sh <h100|h200|b200> <step>...
# Results land in $OUT (default /tmp/vexact-out), a few files per step.
#
# Steps without extra wheels:
#   golden          record contracts/fixtures/<target>/<name> for $FAMILIES (default: every tiny checkpoint of
#                   contracts.golden, the families' and the variants') -> $OUT/golden-<target>.tgz (one file; unpack
#                   in the repo root and commit)
#   golden-check    golden, then one line per family: the fixture's sha256 and kernels version before and after,
#                   and whether the tensors changed (after a version bump without a numerics change they must not)
#                   -> $OUT/golden-<target>.tgz and $OUT/golden-check-<target>.txt
#   contracts       the whole contract suite for the target -> $OUT/contracts-<target>.log
#   kernels         every GPU test of vexact-kernels (matmul incl. the fp32-precision test, MoE, moe_route and
#                   moe_route_grouped, logprobs, attention, ...) -> $OUT/kernels-<target>.log
#   packages        the GPU tests of vexact-models, -engine and -trainer (weight sync over CUDA IPC between two
#                   processes on one GPU, padded decode, ...) -> $OUT/packages-<target>.log
#   bench-weight-sync   benchmarks/weight_sync.py (host path, CUDA IPC buckets, the single-copy ipc-direct rows, copy
#                   bound) -> $OUT/weight-sync-<target>.md
#   weight-sync     the weight sync contracts alone (CUDA IPC buckets and the single-copy path between two processes,
#                   awake and after a level-2 sleep) -> $OUT/weight-sync-contracts-<target>.log
#   bench-mla       benchmarks/mla.py, Moonlight and DeepSeek-V3 layer shapes -> $OUT/mla-<target>.md, mla-v3-...
#   bench-grpo      benchmarks/throughput.py --grpo-only (prefix caching on/off) -> $OUT/throughput-grpo-<target>.md
#   bench-moe       benchmarks/moe.py -> $OUT/moe-<target>.md
#   bench-moe-train benchmarks/moe_train.py: forward+backward of 4 layers of the Qwen3-30B-A3B and Moonlight shapes,
#                   ours (invariant) vs the torch._grouped_mm anchor (fast), MFU and ours' kernels (about 3-4 minutes)
#                   -> $OUT/moe-train-<target>.md (the run's output in $OUT/moe-train-<target>.log)
#   profile         scripts/profiling/profile_decode.py: decode steps at batch 1/64/256 (graph replay) and steps with prompt
#                   tokens (64 decoding + a 1024-token chunk, 256 + 2048; eager, then as CUDA graphs)
#                   -> $OUT/profile-{decode,mixed}-<target>.txt
#   bench-trainer   benchmarks/trainer.py --profile 2 (FSDP2, Qwen3-1.7B shape): tokens/s, MFU and the kernels of a step
#                   -> $OUT/trainer-<target>.md (host-side profile tables in $OUT/trainer-<target>.log)
#   bench-moonlight benchmarks/throughput.py --models moonlight (invariant vs fast) -> $OUT/throughput-moonlight-...
#   capture         scripts/profiling/profile_capture.py: CUDA graph re-capture at wake_up, eager against lazy
#                   (graph_recapture), wake_up + a GRPO-sized rollout per sleep/wake cycle -> $OUT/capture-<target>.txt
#   tim             scripts/checks/tim_gpu.py: `vexact tim` on fast and invariant GPU rollouts + attribution -> $OUT/tim/
#   tim-study       examples/tim_study/sweep.py on the GPU preset -> $OUT/tim-study-<target>.jsonl and its .png
# Steps that need staged wheels (scripts/staging/, installed earlier on the same machine):
#   fa4-probe | fa4-kernels | fa4-contracts | fa4-golden | fa4-bench
#                   FlashAttention 4 (scripts/staging/fa4_device_wheels.sh): the probe, its kernel tests, the contracts and
#                   golden fixtures with VEXACT_ATTENTION=fa4 (fixtures/<target>-fa4: of $FAMILIES the checkpoints
#                   FA4 runs, qwen3_hd64; -> $OUT/golden-<target>-fa4.tgz), benchmarks/attention.py
#   bench-throughput    the peer table: VeXact vs vLLM default / batch-invariant / HF generate
#                   (scripts/staging/vllm_device_wheels.sh puts vLLM in /tmp/vllmsite) -> $OUT/throughput-<target>.md
#   bench-moe-peers the MoE peer table at full depth: benchmarks/throughput.py --models qwen3-30b-a3b (48 layers, 57 GiB
#                   of bf16 weights: an H200) then moonlight (27 layers), VeXact invariant vs vLLM default / batch-
#                   invariant, one run per model; the HF checkpoint vLLM reads goes to $PEERS_CKPT_DIR (default
#                   /tmp/peers-moe; it needs the model's size free, and is removed after each model) -> $OUT/throughput-
#                   moe-<target>.md (both tables) and a .log. Long: on an H200 with THROUGHPUT_ARGS="--modes
#                   invariant,vllm" (two vLLM starts), about 9 minutes for qwen3-30b-a3b and 7 for moonlight after the
#                   checkpoint (about 3 minutes; `throughput.py --ckpt-only` writes it ahead); vllm-bi adds two starts
#   tim-vllm        vLLM's rollouts (default, VLLM_BATCH_INVARIANT=1) rescored by `vexact tim` -> $OUT/tim-vllm/
#   verl-rollout    the verl rollout GPU test (weight sync through CUDA IPC); verl + Ray wheels
#                   (scripts/staging/verl_device_wheels.sh). The GRPO runs are scripts/checks/verl_gpu.sh.
# Two GPUs:
#   nccl            benchmarks/weight_sync.py --mode nccl under torchrun --nproc_per_node 2
#   pp              scripts/checks/pp_check.py under torchrun --nproc_per_node 2 (pipeline replica == one GPU, lifecycle)
set -uo pipefail
cd "$(dirname "$0")/../.."
TARGET=${1:?target: h100 | h200 | b200}
shift
OUT=${OUT:-/tmp/vexact-out}
mkdir -p "$OUT"
# FA4 compiles each kernel variant on first use; keep them on disk for later steps on the same machine
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/tmp/fa4-jit-cache
# WORKERS (env): pytest-xdist workers on the one GPU for the test steps (default 4; 0 runs in one process). Most of a
# contract's time is Triton compilation and Python, so workers sharing the GPU finish the suite sooner.
WORKERS=${WORKERS:-4}
# The attention implementation is `auto` by default (FA4 where it is installed): the checks and fixtures without the
# fa4- prefix are the Triton kernel's, so they pin it unless the caller chose; the fa4-* steps set fa4
export VEXACT_ATTENTION=${VEXACT_ATTENTION:-triton}
# -n 0, not -p no:xdist: one process, and xdist still reads the --dist of the root pyproject's addopts
if [ "$WORKERS" -gt 0 ]; then PYTEST=(python3 -m pytest -q -rs --durations=10 -n "$WORKERS")
else PYTEST=(python3 -m pytest -q -rs --durations=10 -n 0); fi
SERIAL=(python3 -m pytest -q -rs -n 0)
# vLLM's folders: scripts/staging/vllm_device_wheels.sh installs vLLM and every package it needs in /tmp/vllmsite;
# scripts/staging/rl_stack_wheels.sh keeps one copy of the packages verl and vLLM share (pydantic, pyzmq, msgspec,
# transformers, ...) in verl's /tmp/site, so vLLM needs that folder behind its own
VLLM_SITE=/tmp/vllmsite
[ -f /tmp/site/.complete ] && [ -f /tmp/vllmsite/.complete ] && VLLM_SITE=$(bash scripts/staging/rl_stack_wheels.sh path vllm)
status=0
# vLLM's steps run without FA4's site on the path: both carry apache-tvm-ffi, in different versions (bench-throughput
# keeps it: its invariant-fa4 mode needs FA4, and benchmarks/peers.py takes it off each vLLM subprocess's path)
NO_FA4_PATH=$(tr ':' '\n' <<< "${PYTHONPATH:-}" | grep -v fa4site | paste -sd: -)

record_golden() {  # $1: fixture dir suffix ("" or "-fa4")
  local fams=${FAMILIES:-$(python3 -c "from contracts.golden import FAMILIES; print(' '.join(FAMILIES))")}
  if [ -n "$1" ]; then  # only the checkpoints the implementation runs (the others run, and are recorded by, Triton)
    fams=$(python3 -c "import sys; from contracts.golden import attention_impl as a; print(' '.join(f for f in sys.argv[2:] if a(sys.argv[1], f) not in (None, 'triton')))" "$TARGET" $fams)
  fi
  local pids=() fam
  for fam in $fams; do  # one process per family, side by side on the GPU
    python3 -m contracts.golden --target "$TARGET" --family "$fam" > "/tmp/golden-$TARGET$1-$fam.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  tail -n 3 /tmp/golden-"$TARGET$1"-*.log
  tar czf "$OUT/golden-$TARGET$1.tgz" "contracts/fixtures/$TARGET$1"
}

fixture_shas() {  # one line per family of the target's fixtures: path, sha256, the kernels version that made it
  local f
  for f in contracts/fixtures/"$TARGET"/*/golden.json; do
    python3 -c "import json, sys; d = json.load(open(sys.argv[1])); print(sys.argv[1], d['sha256'], d['versions']['vexact-kernels'])" "$f"
  done
}

contract_suite() {  # the contract suite in parallel, then the tests that read device-wide free memory, alone
  # (a function, not a { } group in the pipeline: a status set inside a pipeline's group is lost with its subshell)
  local rc=0
  # CONTRACT_FILES (env): a subset of the suite (default: all of contracts/), e.g. the files that run the engine
  local files=(${CONTRACT_FILES:-contracts})
  "${PYTEST[@]}" "${files[@]}" --target "$TARGET" -m "not gpu_exclusive" || rc=1
  "${SERIAL[@]}" "${files[@]}" --target "$TARGET" -m gpu_exclusive || rc=1
  return $rc
}

for step in "$@"; do
  echo "=== $step ($TARGET) $(date +%T)"
  case "$step" in
    golden) record_golden "" ;;
    golden-check)
      fixture_shas > "$OUT/golden-before.txt"
      record_golden ""
      fixture_shas | awk 'NR == FNR {sha[$1] = $2; ver[$1] = $3; next}
        {print $1, (!($1 in sha) ? "new fixture" : sha[$1] == $2 ? "same tensors" : "TENSORS CHANGED"), ver[$1], "->", $3}' \
        "$OUT/golden-before.txt" - | tee "$OUT/golden-check-$TARGET.txt"
      rm -f "$OUT/golden-before.txt" ;;
    contracts)
      contract_suite 2>&1 | tee "$OUT/contracts-$TARGET.log" || status=1 ;;
    kernels)
      "${PYTEST[@]}" -m gpu packages/vexact-kernels/tests 2>&1 | tee "$OUT/kernels-$TARGET.log" || status=1 ;;
    packages)
      "${PYTEST[@]}" -m gpu packages/vexact-models/tests packages/vexact-engine/tests packages/vexact-trainer/tests \
        2>&1 | tee "$OUT/packages-$TARGET.log" || status=1 ;;
    bench-weight-sync)
      python3 benchmarks/weight_sync.py --out "$OUT/weight-sync-$TARGET.md" || status=1 ;;
    weight-sync)
      "${SERIAL[@]}" contracts/test_weight_sync.py --target "$TARGET" 2>&1 \
        | tee "$OUT/weight-sync-contracts-$TARGET.log" || status=1 ;;
    bench-mla)
      python3 benchmarks/mla.py --out "$OUT/mla-$TARGET.md" || status=1
      python3 benchmarks/mla.py --shape deepseek-v3 --out "$OUT/mla-v3-$TARGET.md" || status=1 ;;
    bench-grpo)
      python3 benchmarks/throughput.py --grpo-only --modes invariant,fast --out "$OUT/throughput-grpo-$TARGET.md" \
        2>&1 | grep -v "it/s\]" || status=1 ;;
    bench-moonlight)  # engine throughput of the Moonlight-16B-A3B shape, invariant vs fast
      python3 benchmarks/throughput.py --models moonlight --modes invariant,fast --grpo-prompts 0 \
        --out "$OUT/throughput-moonlight-$TARGET.md" 2>&1 | grep -v "it/s\]" | tail -30 || status=1 ;;
    bench-trainer)  # trainer tokens/s and MFU, invariant vs plain PyTorch (fast); the kernels of 2 profiled
      # steps per backend go into the table, the host-side tables into the log
      python3 -m torch.distributed.run --standalone --nproc_per_node=1 benchmarks/trainer.py --profile 2 \
        --out "$OUT/trainer-$TARGET.md" > "$OUT/trainer-$TARGET.log" 2>&1 || status=1
      grep -A4 "| backend" "$OUT/trainer-$TARGET.log" ;;
    bench-moe)
      python3 benchmarks/moe.py --out "$OUT/moe-$TARGET.md" || status=1 ;;
    bench-moe-train)  # MoE training MFU, ours against the plain-PyTorch grouped-GEMM path, both shapes
      timeout 600 python3 benchmarks/moe_train.py --out "$OUT/moe-train-$TARGET.md" > "$OUT/moe-train-$TARGET.log" 2>&1 \
        || status=1
      grep -E "^## |^\| (ours|anchor)|tokens/s: " "$OUT/moe-train-$TARGET.log" ;;
    tim)
      python3 scripts/checks/tim_gpu.py --out "$OUT/tim" || status=1 ;;
    tim-study)  # the random-policy sweep: noise 0 / 0.1 / 1.0 x corrections none / tis / mis, small model, 60 steps;
      # TIM_ARGS (env): more sweep options. At lr 3e-3 (the default) the small policy collapses within 20 steps, e.g.
      # TIM_ARGS="--lr 1e-3 --seeds 0,1,2"
      python3 examples/tim_study/sweep.py --device cuda --model-size small --steps 60 ${TIM_ARGS:-} \
        --out "$OUT/tim-study-$TARGET.jsonl" \
        2>&1 | grep -v "it/s\]" | tail -40 || status=1
      python3 examples/tim_study/plot.py "$OUT/tim-study-$TARGET.jsonl" || status=1 ;;
    fa4-probe)
      python3 scripts/checks/fa4_probe.py 2>&1 | tee "$OUT/fa4-probe.txt" || status=1 ;;
    fa4-kernels)
      "${PYTEST[@]}" -m gpu packages/vexact-kernels/tests/test_fa4_attention.py 2>&1 \
        | tee "$OUT/fa4-kernels-$TARGET.log" || status=1 ;;
    fa4-contracts)
      (export VEXACT_ATTENTION=fa4; contract_suite) 2>&1 | tee "$OUT/fa4-contracts-$TARGET.log" || status=1 ;;
    fa4-golden) export VEXACT_ATTENTION=fa4; record_golden "-fa4"; unset VEXACT_ATTENTION ;;
    fa4-bench)
      python3 benchmarks/attention.py --out "$OUT/attention-$TARGET.md" || status=1 ;;
    capture)
      python3 scripts/profiling/profile_capture.py 2>&1 | grep -v "Warning\|warn" > "$OUT/capture-$TARGET.txt" || status=1 ;;
    profile)
      python3 scripts/profiling/profile_decode.py --batch 1,64,256 2>&1 | grep -v "Warning\|warn" > "$OUT/profile-decode-$TARGET.txt" || status=1
      python3 scripts/profiling/profile_decode.py --mixed 64:1024,256:2048 2>&1 | grep -v "Warning\|warn" \
        > "$OUT/profile-mixed-$TARGET.txt" || status=1 ;;
    bench-throughput)
      site=(); [ -d /tmp/vllmsite ] && site=(--vllm-site "$VLLM_SITE")
      python3 benchmarks/throughput.py "${site[@]}" ${THROUGHPUT_ARGS:-} --ckpt-dir /tmp/peers --out "$OUT/throughput-$TARGET.md" 2>&1 \
        | grep -v "it/s\]" | tee "$OUT/throughput-$TARGET.log" || status=1 ;;
    bench-moe-peers)  # MoE shapes at full depth against vLLM (where vLLM 0.26 ships tuned MoE configs: H200)
      site=(); [ -d /tmp/vllmsite ] && site=(--vllm-site "$VLLM_SITE")
      ckdir=${PEERS_CKPT_DIR:-/tmp/peers-moe}
      : > "$OUT/throughput-moe-$TARGET.md"
      for model in ${MOE_PEER_MODELS:-qwen3-30b-a3b moonlight}; do
        python3 benchmarks/throughput.py "${site[@]}" --models "$model" --modes invariant,vllm,vllm-bi --grpo-prompts 0 \
          --vllm-timeout 1200 ${THROUGHPUT_ARGS:-} --ckpt-dir "$ckdir" --out "$OUT/throughput-moe-$model-$TARGET.md" 2>&1 \
          | grep -v "it/s\]" | tee -a "$OUT/throughput-moe-$TARGET.log" || status=1
        cat "$OUT/throughput-moe-$model-$TARGET.md" >> "$OUT/throughput-moe-$TARGET.md" 2>/dev/null || status=1
        rm -rf "$ckdir"/*-"$model"  # the checkpoint (tens of GiB) before the next model's
      done ;;
    tim-vllm)  # vLLM's own rollouts (default and batch-invariant) rescored by our trainer; needs vLLM
      # (/tmp/vllmsite); the 1.7B checkpoint in /tmp/peers is bench-throughput's when it ran first, else written
      # here; FA4's site off the path; VLLM_GPU_MEM: vLLM's memory share (lower it when other jobs share the GPU:
      # vLLM refuses to start when that share is not free)
      ckpt=/tmp/peers/qwen3-1.7b
      mkdir -p "$OUT/tim-vllm"
      for mode in default batch-invariant; do
        flag=(); [ "$mode" = batch-invariant ] && flag=(--batch-invariant)
        PYTHONPATH=/tmp/vllmsite:$NO_FA4_PATH VLLM_USE_FLASHINFER_SAMPLER=0 python3 scripts/checks/tim_vllm_rollouts.py \
          "$ckpt" "/tmp/vllm-$mode.jsonl" "${flag[@]}" --make-checkpoint 1.7b \
          --gpu-memory-utilization "${VLLM_GPU_MEM:-0.9}" 2>&1 | tail -3 || status=1
        python3 -m vexact tim rescore "/tmp/vllm-$mode.jsonl" --model "$ckpt" --layout vllm --device cuda \
          --out "$OUT/tim-vllm/$mode" 2>&1 | grep -v "it/s\]" | tail -8 || status=1
      done ;;
    verl-rollout)
      "${PYTEST[@]}" packages/vexact-verl/tests/test_verl_rollout_gpu.py 2>&1 | tee "$OUT/verl-rollout-$TARGET.log" \
        || status=1 ;;
    pp)  # the pipeline replica on two GPUs (== one GPU, the perturbed boundary caught, sleep / wake /
      # update_weights through both stages)
      torchrun --standalone --nproc_per_node 2 scripts/checks/pp_check.py --shape 0.6b --prompts 32 2>&1 \
        | grep -v Warning | tee "$OUT/pp-$TARGET.log" || status=1 ;;
    nccl)
      torchrun --standalone --nproc_per_node 2 benchmarks/weight_sync.py --mode nccl \
        --out "$OUT/weight-sync-nccl-$TARGET.md" 2>&1 | tee "$OUT/weight-sync-nccl-$TARGET.log" || status=1 ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
exit $status
