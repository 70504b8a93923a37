#!/usr/bin/env bash
# Runs the built image as the chart and the operator run it (image/podrun.py: uid 10001, root
# filesystem read-only, only the pod's volumes writable), in a network namespace of its own:
#   1. the engine pod the operator builds for builtin://smollm2-135m-instruct answers the README's
#      curl (/models and /tmp writable, the operator's env);
#   2. `kvpilot router` (/tmp writable, as in the chart) starts and forwards that request to it;
#   3. `kvpilot operator --help` answers.
# Needs root and buildah; the image from image/build.sh.   image/run-checks.sh [IMAGE]
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE=${1:-localhost/kvpilot:dev}
PY=${PYTHON:-.venv/bin/python}
NETNS=kvpilot-image-$$
LOGS=$(mktemp -d)
pids=()
container=""
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  ip netns del "$NETNS" 2>/dev/null || true
  [ -z "$container" ] || buildah --storage-driver "${STORAGE_DRIVER:-vfs}" rm "$container" >/dev/null
  echo "logs: $LOGS"
}
trap cleanup EXIT
ip netns add "$NETNS"
ip netns exec "$NETNS" ip link set lo up
# One working container for every command: its rootfs is mounted read-only by each.
echo "copying the image's files into a working container (vfs: a full copy)"
start=$SECONDS
container=$(buildah --storage-driver "${STORAGE_DRIVER:-vfs}" from --pull-never "$IMAGE")
echo "$container in $((SECONDS - start)) s"
in_ns() { ip netns exec "$NETNS" "$@"; }
wait_for() {  # URL, seconds: the wait of a readiness probe
  local deadline=$((SECONDS + $2))
  until in_ns curl -sf -o /dev/null "$1"; do
    [ $SECONDS -lt $deadline ] || { echo "no answer from $1 in $2 s" >&2; return 1; }
    sleep 1
  done
}
request='{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 32}'

echo "== 1. the engine pod (the operator's container for builtin://smollm2-135m-instruct)"
start=$SECONDS
"$PY" image/podrun.py --image "$IMAGE" --container "$container" --netns "$NETNS" --engine builtin://smollm2-135m-instruct \
  >"$LOGS/engine.log" 2>&1 &
pids+=($!)
wait_for http://127.0.0.1:8000/ready 600 || { tail -30 "$LOGS/engine.log"; exit 1; }
echo "ready after $((SECONDS - start)) s"
ps -eo uid,gid,args | awk '$3 ~ /python|kvpilot/ && /kvpilot serve/ {print "process:", $0}'
in_ns curl -s http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \
  -d "$request" | tee "$LOGS/engine-answer.json"
echo
grep -q '"choices"' "$LOGS/engine-answer.json"

echo "== 2. the router (/tmp writable, HOME=/tmp, as the chart runs it)"
"$PY" image/podrun.py --image "$IMAGE" --container "$container" --netns "$NETNS" --writable /tmp --env HOME=/tmp -- \
  kvpilot router --static SmolLM2-135M-Instruct=http://127.0.0.1:8000 --port 8080 \
  >"$LOGS/router.log" 2>&1 &
pids+=($!)
wait_for http://127.0.0.1:8080/ready 300 || { tail -30 "$LOGS/router.log"; exit 1; }
in_ns curl -s http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \
  -d "$request" | tee "$LOGS/router-answer.json"
echo
grep -q '"choices"' "$LOGS/router-answer.json"

echo "== 3. the operator (/tmp writable, as the chart runs it)"
"$PY" image/podrun.py --image "$IMAGE" --container "$container" --writable /tmp -- kvpilot operator --help | head -5

echo "== stopped (SIGTERM); what they wrote, all of it in their writable volumes"
for pid in "${pids[@]}"; do kill "$pid"; done
wait || true
pids=()
grep -h "^podrun: wrote" "$LOGS/engine.log" "$LOGS/router.log"
echo "all checks passed"
