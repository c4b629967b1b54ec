#!/usr/bin/env bash
# Background jobs on a GPU machine: a job started here (setsid, detached from the shell that started it) keeps
# running after that shell exits (an ssh connection that drops, a CI step that ends), while later commands copy
# wheels or read its progress.
#
#   bash scripts/checks/gpu_bg.sh start NAME CMD...   # snapshot the checkout (without the staged wheel dirs .whl*) to
#                                              # /tmp/vxbg/NAME/repo, then run CMD there, detached, with
#                                              # scripts/staging/device_env.sh sourced and OUT=/tmp/vxbg/NAME/out; the
#                                              # exit status lands in /tmp/vxbg/NAME/rc
#   bash scripts/checks/gpu_bg.sh wait SECONDS [quiet] # until every job has an rc or SECONDS pass; prints each job's state
#                                              # and the tail of its log (quiet: the states only, one line a job)
#   bash scripts/checks/gpu_bg.sh collect [NAME...]   # $OUT/bg-NAME.tgz for each job (its out/ and log), one file a job
#
# e.g. bash scripts/checks/gpu_bg.sh start contracts bash scripts/checks/gpu_checks.sh h100 golden contracts
# The snapshot keeps a job's files apart from the checkout, which may change while the job runs (a pull, a new
# copy of the working tree); fixtures written by `golden` stay in the job's copy: unpack the collected tarball in
# the checkout and commit them.
set -uo pipefail
cd "$(dirname "$0")/../.."
BG=/tmp/vxbg
verb=${1:?usage: gpu_bg.sh start NAME CMD... | wait SECONDS | collect [NAME...]}
shift

case "$verb" in
  start)
    name=${1:?job name}
    shift
    [ $# -gt 0 ] || { echo "gpu_bg.sh start $name: no command" >&2; exit 2; }
    job=$BG/$name
    [ -e "$job" ] && { echo "job $name exists already ($job)" >&2; exit 2; }
    mkdir -p "$job/repo" "$job/out"
    tar --exclude='./.whl*' --exclude='./.git' -cf - . | tar -xf - -C "$job/repo"
    printf '%q ' "$@" > "$job/cmd"
    # setsid: detached, so the job outlives the shell that started it
    date +%s > "$job/t0"
    setsid nohup bash -c "cd '$job/repo' || exit 1; source scripts/staging/device_env.sh; export OUT='$job/out'; \
      $(cat "$job/cmd"); echo \$? > '$job/rc'; date +%s > '$job/t1'" \
      > "$job/log" 2>&1 < /dev/null &
    echo "started $name (pid $!): $(cat "$job/cmd")"
    ;;
  wait)
    limit=${1:?seconds}
    quiet=${2:-}
    start=$(date +%s)
    while :; do
      pending=0
      for job in "$BG"/*/; do [ -f "$job/rc" ] || pending=$((pending + 1)); done
      [ "$pending" -eq 0 ] && break
      [ $(($(date +%s) - start)) -ge "$limit" ] && break
      sleep 5
    done
    for job in "$BG"/*/; do
      name=$(basename "$job")
      if [ -f "$job/rc" ]; then
        echo "=== $name: rc $(cat "$job/rc") after $(($(cat "$job/t1") - $(cat "$job/t0"))) s"
      else
        echo "=== $name: running for $(($(date +%s) - $(cat "$job/t0" 2>/dev/null || date +%s))) s"
      fi
      [ "$quiet" = quiet ] && continue
      grep -E "^=== |passed|failed|error|Error|FAILED" "$job/log" | grep -v "it/s" | tail -25
      tail -5 "$job/log"
    done
    ;;
  collect)
    names=("$@")
    [ ${#names[@]} -gt 0 ] || mapfile -t names < <(ls "$BG")
    for name in "${names[@]}"; do
      tar -czf "${OUT:?OUT}/bg-$name.tgz" -C "$BG/$name" log out $(cd "$BG/$name" && ls rc cmd 2>/dev/null)
    done
    ls -la "$OUT"
    ;;
  *) echo "unknown verb $verb" >&2; exit 2 ;;
esac
