# Sourced by the verl checks (resume_gpu.sh, recipes_gpu.sh, async_gpu.sh), from the repository root: what they share.
#
#   verl_job_setup NAME   sets CPU (1 under VERL_PLATFORM=cpu, else 0), GPU (its name), TAG (file-name prefix: the
#                         GPU kind, e.g. h100, or cpu; TAG in the environment wins), COMMIT, CPU_EXTRA (the Hydra
#                         overrides a verl run on CPU needs, Ray's GPU count GPUS (default 1) among them; empty on a
#                         GPU) and RAY_TMP (/tmp/ray-NAME-TAG). On a
#                         GPU it puts the monorepo and the staged verl stack on PYTHONPATH
#                         (scripts/staging/device_env.sh, scripts/staging/rl_stack_wheels.sh path vexact).
#   reap                  stops the Ray processes a job left under RAY_TMP
#
# RAY_TMP is the job's Ray temp dir (ray.init's _temp_dir): every Ray process of the job names it, so what a stopped
# job leaves behind is found by it and no other job's Ray on the host is touched.
verl_job_setup() {
  CPU=0
  [ "${VERL_PLATFORM:-}" = cpu ] && CPU=1
  if [ "$CPU" = 1 ]; then
    GPU="cpu (VERL_PLATFORM=cpu)"
    TAG=${TAG:-cpu}
    CPU_EXTRA=(+ray_kwargs.ray_init.num_gpus="${GPUS:-1}" +ray_kwargs.ray_init.num_cpus=16 reward.num_workers=1
               actor_rollout_ref.rollout.agent.num_workers=1
               transfer_queue.backend.SimpleStorage.num_data_storage_units=1)
  else
    source scripts/staging/device_env.sh
    local stack
    stack=$(bash scripts/staging/rl_stack_wheels.sh path vexact)
    export PYTHONPATH="$stack${PYTHONPATH:+:$PYTHONPATH}"
    GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader -i "${CUDA_VISIBLE_DEVICES:-0}" 2> /dev/null | head -1)
    GPU=${GPU:-$(python3 -c "import torch; print(torch.cuda.get_device_name())")}
    TAG=${TAG:-$(echo "$GPU" | grep -oiE 'h100|h200|b200|a100' | head -1 | tr 'A-Z' 'a-z')}
    TAG=${TAG:-gpu}
    CPU_EXTRA=()
  fi
  COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2> /dev/null || echo unknown)}
  RAY_TMP=/tmp/ray-$1-$TAG
}

reap() {
  local pids
  pids=$(pgrep -f -- "$RAY_TMP/" | tr '\n' ' ')
  [ -z "$pids" ] && return
  echo "== stopping Ray processes left by the job under $RAY_TMP: $pids"
  kill $pids 2> /dev/null
  sleep 3
  kill -9 $pids 2> /dev/null
}
