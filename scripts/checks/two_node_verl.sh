#!/usr/bin/env bash
# A verl GRPO job on two Ray nodes started on one host: the multi-node path of the recipes (trainer.nnodes=2).
#
#   bash scripts/checks/two_node_verl.sh RESULTS_DIR [GPUS_PER_NODE] [STEPS]     # defaults: 1 GPU a node, 3 steps
#
# Starts its own cluster: `ray start --head --block` on the first GPUS_PER_NODE devices and `ray start --address=HEAD
# --block` on the next GPUS_PER_NODE (CUDA_VISIBLE_DEVICES per raylet; the devices are those of the caller's
# CUDA_VISIBLE_DEVICES, else 0, 1, ...), with free ports picked here, a temp dir of its own
# (/tmp/ray2n-PID) and a token of its own (RAY_AUTH_MODE=token), so it never joins or disturbs another Ray cluster on
# the host. Then runs
# examples/verl_grpo/run_grpo.sh with RAY_ADDRESS at that head and trainer.nnodes=2
# trainer.n_gpus_per_node=GPUS_PER_NODE, actor strategy vexact, once per arm of ARMS (env, default "invariant fast":
# the rollout backend), on a random-weights Qwen3 made by examples/verl_grpo/make_model.py. Checks:
# - nodes: both raylets alive in the cluster, each with GPUS_PER_NODE GPUs (Ray's node list is logged);
# - placement: verl's worker-group actors (the FSDP ranks and their rollout) ran on both nodes, GPUS_PER_NODE on each
#   (read from the GCS actor table after each job; logged per node);
# - exact: examples/verify/compare.py --expect-exact invariant (K3 KL and the largest probability gap exactly 0.0 at
#   every step for invariant, above 0 at every step for fast); with ARMS=invariant, compare.py's expect_exact on the
#   one run.
# Stops only its own nodes: SIGTERM to its two `ray start --block` processes, which stop the processes of their node
# (`ray stop` would stop every Ray cluster on the host). Logs, JSONL and the verdicts land in RESULTS_DIR; the last
# line is `two-node verl: PASS` or `two-node verl: FAIL (...)`; exit status 0 only on PASS.
#
# The verl stack must be importable (on the air-gapped GPU machine: PYTHONPATH=$(bash scripts/staging/rl_stack_wheels.sh
# path vexact):$PYTHONPATH after `source scripts/staging/device_env.sh`). No GPU: VERL_PLATFORM=cpu runs the same job
# on CPU processes over gloo (packages/vexact-verl/README.md, "verl on CPU") with a tiny model and batch, one slot a
# node. Env: LR (3e-6), HIDDEN and LAYERS (the model: 1024 and 8 on GPU, 64 and 2 on CPU), TAG (file names).
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
RESULTS=${1:?usage: two_node_verl.sh RESULTS_DIR [GPUS_PER_NODE] [STEPS]}
K=${2:-1}
STEPS=${3:-3}
ARMS=${ARMS:-invariant fast}
LR=${LR:-3e-6}
TAG=${TAG:-twonode}
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
case "$K" in '' | *[!0-9]* | 0) echo "GPUS_PER_NODE must be a positive integer, got '$K'" >&2; exit 2 ;; esac
for arm in $ARMS; do
  case "$arm" in invariant | fast) ;; *) echo "ARMS: unknown arm '$arm' (invariant, fast)" >&2; exit 2 ;; esac
done
case " $ARMS " in *" invariant "*) ;; *) echo "ARMS must include invariant, got '$ARMS'" >&2; exit 2 ;; esac

CPU=0
if [ "${VERL_PLATFORM:-}" = cpu ]; then CPU=1; fi
if [ "$CPU" = 1 ]; then
  HEAD_ENV=(env -u CUDA_VISIBLE_DEVICES) WORKER_ENV=(env -u CUDA_VISIBLE_DEVICES)
  SLOTS=(--num-cpus 8)
  HIDDEN=${HIDDEN:-64} LAYERS=${LAYERS:-2}
  SIZE=(data.train_batch_size=4 data.max_response_length=16 actor_rollout_ref.rollout.n=2
        actor_rollout_ref.actor.ppo_mini_batch_size=4 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2
        actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2 reward.num_workers=1
        actor_rollout_ref.rollout.agent.num_workers=1 transfer_queue.backend.SimpleStorage.num_data_storage_units=1
        data.dataloader_num_workers=0)
else
  if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    IFS=, read -r -a DEVS <<< "$CUDA_VISIBLE_DEVICES"
  else
    n=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
    DEVS=()
    for ((i = 0; i < n; i++)); do DEVS+=("$i"); done
  fi
  if [ "${#DEVS[@]}" -lt $((2 * K)) ]; then
    echo "two nodes of $K GPUs need $((2 * K)) GPUs; ${#DEVS[@]} visible (${DEVS[*]})" >&2
    exit 2
  fi
  HEAD_DEVS=$(IFS=,; echo "${DEVS[*]:0:K}")
  WORKER_DEVS=$(IFS=,; echo "${DEVS[*]:K:K}")
  HEAD_ENV=(env CUDA_VISIBLE_DEVICES="$HEAD_DEVS") WORKER_ENV=(env CUDA_VISIBLE_DEVICES="$WORKER_DEVS")
  SLOTS=()
  HIDDEN=${HIDDEN:-1024} LAYERS=${LAYERS:-8}
  SIZE=()
fi

echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
DIRTY=""
git rev-parse HEAD > /dev/null 2>&1 && ! git diff --quiet HEAD && DIRTY=" (uncommitted changes)"
echo "commit: ${COMMIT:-$(git rev-parse --short HEAD 2> /dev/null || echo unknown)}$DIRTY"
if [ "$CPU" = 1 ]; then echo "device: CPU (VERL_PLATFORM=cpu)"; else
  echo "device: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1);" \
       "head GPUs $HEAD_DEVS, worker GPUs $WORKER_DEVS"
fi
echo "command: bash scripts/checks/two_node_verl.sh $* (ARMS='$ARMS' LR=$LR HIDDEN=$HIDDEN LAYERS=$LAYERS)"
python3 -c "from importlib.metadata import version as v; print('verl', v('verl'), 'ray', v('ray'))" || exit 1

RAYTMP=/tmp/ray2n-$$  # short: Ray's Unix socket paths live under it
# free ports for everything Ray would otherwise take at a fixed default (GCS 6379, client 10001, agent 52365, ...)
read -r GCS CLIENT DASH PORTS_HEAD PORTS_WORKER < <(python3 - <<'EOF'
import socket
socks = [socket.socket() for _ in range(13)]
for s in socks:
    s.bind(("", 0))
p = [s.getsockname()[1] for s in socks]
for s in socks:
    s.close()
print(p[0], p[1], p[2], ",".join(map(str, p[3:8])), ",".join(map(str, p[8:13])))
EOF
)
node_ports() {  # agent listen, agent grpc, runtime env agent, metrics, node manager
  local a b c d e
  IFS=, read -r a b c d e <<< "$1"
  echo "--dashboard-agent-listen-port $a --dashboard-agent-grpc-port $b --runtime-env-agent-port $c"\
       "--metrics-export-port $d --node-manager-port $e"
}
unset RAY_ADDRESS
export RAY_USAGE_STATS_ENABLED=0
# the raylets' workers inherit the raylet's environment, not the driver's: what verl's workers need is set here
export VERL_USE_EXTERNAL_MODULES=vexact_verl.plugin PYTHONUNBUFFERED=1
# a token of this cluster's own: a client of another cluster on the host (or a stray token file) cannot join it
RAY_AUTH_TOKEN=$(python3 -c "import secrets; print(secrets.token_hex(32))")
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN
# Ray's CLI through the interpreter: a `pip install --target` of the staged stack puts no `ray` on PATH
RAY=(python3 -m ray.scripts.scripts)
COMMON=(--block --temp-dir "$RAYTMP" --num-gpus "$K" "${SLOTS[@]}"
        --object-store-memory "${OBJECT_STORE_BYTES:-4000000000}" --disable-usage-stats)
HEAD_PID="" WORKER_PID=""
stop_nodes() {
  local pid
  for pid in $WORKER_PID $HEAD_PID; do
    kill -TERM "$pid" 2> /dev/null || continue
    for _ in $(seq 60); do kill -0 "$pid" 2> /dev/null || break; sleep 0.5; done
    kill -KILL "$pid" 2> /dev/null && echo "ray node (pid $pid) did not stop in 30 s: killed"
  done
  WORKER_PID="" HEAD_PID=""
}
trap stop_nodes EXIT

# shellcheck disable=SC2046
"${HEAD_ENV[@]}" "${RAY[@]}" start --head --port "$GCS" --ray-client-server-port "$CLIENT" \
  --include-dashboard false --dashboard-port "$DASH" $(node_ports "$PORTS_HEAD") "${COMMON[@]}" \
  > "$RESULTS/$TAG-ray-head.log" 2>&1 &
HEAD_PID=$!
# the head writes its GCS address (node IP and port) into its temp dir
for _ in $(seq 120); do
  [ -s "$RAYTMP/ray_current_cluster" ] && break
  kill -0 "$HEAD_PID" 2> /dev/null || { echo "ray head failed:"; tail -5 "$RESULTS/$TAG-ray-head.log"; exit 1; }
  sleep 0.5
done
RAY_ADDRESS=$(cat "$RAYTMP/ray_current_cluster" 2> /dev/null)
[ -n "$RAY_ADDRESS" ] || { echo "ray head wrote no address in 60 s"; tail -5 "$RESULTS/$TAG-ray-head.log"; exit 1; }
export RAY_ADDRESS

wait_nodes() {  # wait_nodes N: until N nodes are alive (120 s at most); logs Ray's node list
  timeout 180 python3 - "$1" <<'EOF'
import sys, time
import ray
want, deadline = int(sys.argv[1]), time.time() + 120
while True:
    try:
        ray.init(logging_level="ERROR", log_to_driver=False)
        nodes = [n for n in ray.nodes() if n["Alive"]]
        if len(nodes) >= want or time.time() > deadline:
            break
        ray.shutdown()
    except Exception as e:  # the GCS is not up yet
        if time.time() > deadline:
            sys.exit(f"no Ray cluster at the head after 120 s: {e}")
    time.sleep(2)
for n in nodes:
    print(f"ray node {n['NodeID']} {n['NodeManagerAddress']}:{n['NodeManagerPort']} GPU={n['Resources'].get('GPU', 0)}"
          f" CPU={n['Resources'].get('CPU', 0)}")
sys.exit(0 if len(nodes) >= want else f"{len(nodes)} Ray nodes alive after 120 s; want {want}")
EOF
}
wait_nodes 1 || exit 1
# shellcheck disable=SC2046
"${WORKER_ENV[@]}" "${RAY[@]}" start --address "$RAY_ADDRESS" $(node_ports "$PORTS_WORKER") "${COMMON[@]}" \
  > "$RESULTS/$TAG-ray-worker.log" 2>&1 &
WORKER_PID=$!
NODES=PASS
echo "Ray nodes of this job (head at $RAY_ADDRESS, temp dir $RAYTMP):"
wait_nodes 2 || NODES=FAIL

MODEL=/tmp/$TAG-model-$$ DATA=/tmp/$TAG-data-$$
python3 examples/verl_grpo/make_model.py --out "$MODEL" --hidden "$HIDDEN" --layers "$LAYERS" > /dev/null || exit 1
python3 examples/verl_grpo/make_dataset.py --out "$DATA" > /dev/null || exit 1

placement() {  # verl's worker-group actors per node (the last verl job's), from the GCS actor table
  timeout 120 python3 - "$K" <<'EOF'
import collections, sys
import ray
from ray._private import state
k = int(sys.argv[1])
ray.init(logging_level="ERROR", log_to_driver=False)
alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
start = {j["JobID"]: j.get("StartTime", 0) for j in state.jobs()}
by_job = collections.defaultdict(list)  # the verl job: the newest job with worker-group actors
for a in state.actors().values():
    if "WorkerDict" in a["ActorClassName"]:
        by_job[a["JobID"]].append(a)
last = max(by_job, key=lambda j: start.get(j, 0), default=None)
per_node = collections.defaultdict(list)
for a in by_job.get(last, []):
    per_node[a["Address"]["NodeID"]].append(a["ActorClassName"])
for node in sorted(alive):
    print(f"  node {node}: {len(per_node.get(node, []))} worker-group actors {sorted(set(per_node.get(node, [])))}")
ok = set(per_node) == alive and len(alive) == 2 and all(len(v) == k for v in per_node.values())
print(f"placement: {'PASS' if ok else 'FAIL'} (want {k} worker-group actors on each of the 2 nodes)")
sys.exit(0 if ok else 1)
EOF
}

ARGS=(trainer.nnodes=2 trainer.n_gpus_per_node="$K" actor_rollout_ref.actor.strategy=vexact
      reward.custom_reward_function.path="$ROOT/examples/verl_grpo/reward.py" "${SIZE[@]}")
PLACED=PASS RUNS=PASS
JSONL=()
for arm in $ARMS; do
  log=$RESULTS/$TAG-$arm.log
  echo "verl job, arm $arm: log $log"
  jsonl=$RESULTS/$TAG-$arm.jsonl
  # verl's file logger runs in a Ray worker, which inherits the raylet's environment, not this one's: the job's
  # runtime_env carries the path
  BACKEND=$arm NAME=$TAG-$arm MODEL=$MODEL DATA=$DATA STEPS=$STEPS LR=$LR RUN_DIR=$RESULTS \
    VERL_FILE_LOGGER_PATH=$jsonl bash examples/verl_grpo/run_grpo.sh "${ARGS[@]}" \
    +ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH="$jsonl" > "$log" 2>&1
  rc=$?
  echo "  exit status $rc"
  if [ "$rc" != 0 ]; then
    RUNS=FAIL
    sed 's/\x1b\[[0-9;]*m//g' "$log" | grep -E "Error|Traceback" | grep -v "UserWarning" | head -10
  fi
  placement | tee -a "$log"
  [ "${PIPESTATUS[0]}" = 0 ] || PLACED=FAIL
  JSONL+=("$jsonl")
done
stop_nodes

EXACT=FAIL
# every run logged each of its STEPS steps (an empty or short log must not pass as "exact at every step")
python3 - "$STEPS" "${JSONL[@]}" > "$RESULTS/$TAG-compare.txt" 2>&1 <<'EOF'
import sys
sys.path.insert(0, "examples/verify")
from compare import expect_exact
from runs import read_run
steps, runs = int(sys.argv[1]), [read_run(p) for p in sys.argv[2:]]
for r in runs:
    print(f"{r.path}: arm {r.arm}, steps {r.steps}")
ok = all(r.steps == list(range(1, steps + 1)) for r in runs) and runs[0].arm == "invariant"
if len(runs) == 1:  # compare.py takes 2 or 3 runs: its expect-exact verdict on the one run
    ok = expect_exact(runs, "invariant") and ok
sys.exit(0 if ok else 1)
EOF
STEPS_OK=$?
if [ "${#JSONL[@]}" -ge 2 ]; then
  # --warmup 0: the timing table is not the point here, and a short job has too few steps for the default 2
  python3 examples/verify/compare.py "${JSONL[@]}" --expect-exact invariant --warmup 0 >> "$RESULTS/$TAG-compare.txt" \
    2>&1 && [ "$STEPS_OK" = 0 ] && EXACT=PASS
elif [ "$STEPS_OK" = 0 ]; then
  EXACT=PASS
fi
cat "$RESULTS/$TAG-compare.txt"
VERDICT="nodes $NODES, jobs $RUNS, placement $PLACED, expect-exact $EXACT"
if [ "$NODES$RUNS$PLACED$EXACT" = PASSPASSPASSPASS ]; then
  echo "two-node verl: PASS ($VERDICT)"
  exit 0
fi
echo "two-node verl: FAIL ($VERDICT)"
exit 1
