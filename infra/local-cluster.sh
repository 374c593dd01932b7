#!/usr/bin/env bash
# A 2-node Ray cluster on this machine: a head node and a worker node, each with its own
# resources and temp dir, with token authentication on (Ray >= 2.52).
#
#   infra/local-cluster.sh up        # head :6380 (dashboard :8265) + worker node with resource worker_node
#   infra/local-cluster.sh status
#   raypai submit pipelines/toy.py --address http://127.0.0.1:8265
#   infra/local-cluster.sh down      # stops these two nodes only (never `ray stop`, which kills every Ray here)
#
# Settings (environment): RAY (ray executable; default .venv/bin/ray), RAYPAI_CLUSTER_DIR (state,
# logs, temp dirs, token; default ${RAYPAI_HOME:-.raypai}/local-cluster), RAYPAI_CLUSTER_PORT (GCS, 6380),
# RAYPAI_DASHBOARD_PORT (8265), RAYPAI_CLIENT_PORT (10001), RAYPAI_AGENT_PORT (52365; the worker node
# uses +1), HEAD_CPUS (2), WORKER_CPUS (2), WORKER_RESOURCES ('{"worker_node": 2}'),
# RAYPAI_CLUSTER_AUTH (token | disabled; default token).
#
# Each node runs as `ray start --block` in its own session; its pid goes to a pid file and
# `down` sends it SIGTERM, on which Ray stops that node's processes (raylet, GCS, dashboard...).
set -euo pipefail

if [[ -z "${RAY:-}" ]]; then
  if [[ -x .venv/bin/ray ]]; then RAY=.venv/bin/ray; else RAY=ray; fi
fi
RAY=$(command -v "$RAY")
RAY="$(cd "$(dirname "$RAY")" && pwd)/$(basename "$RAY")"  # absolute: jobs run in other folders
DIR=${RAYPAI_CLUSTER_DIR:-${RAYPAI_HOME:-.raypai}/local-cluster}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
PORT=${RAYPAI_CLUSTER_PORT:-6380}
DASH=${RAYPAI_DASHBOARD_PORT:-8265}
CLIENT=${RAYPAI_CLIENT_PORT:-10001}
AGENT=${RAYPAI_AGENT_PORT:-52365}
AUTH=${RAYPAI_CLUSTER_AUTH:-token}
WORKER_RESOURCES=${WORKER_RESOURCES:-'{"worker_node": 2}'}
# Jobs run `python ...`: make it the interpreter that has ray (the venv's), on every node.
export PATH="$(dirname "$RAY"):$PATH"
export RAY_USAGE_STATS_ENABLED=0
if [[ "$AUTH" == token ]]; then
  export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$DIR/auth_token"
else
  export RAY_AUTH_MODE=disabled
fi

# wait_started NAME PID: until the node's log says it started (or the process died).
wait_started() {
  local name=$1 pid=$2
  for _ in $(seq 1 240); do
    if grep -q "Ray runtime started" "$DIR/$name.log" 2>/dev/null; then return 0; fi
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "the $name node exited during start-up; its log ($DIR/$name.log) ends with:" >&2
      tail -n 20 "$DIR/$name.log" >&2
      return 1
    fi
    sleep 0.5
  done
  echo "the $name node did not start within 120s; see $DIR/$name.log" >&2
  return 1
}

# start_node NAME ARGS...: `ray start --block ARGS` in its own session, pid in NAME.pid.
start_node() {
  local name=$1; shift
  if [[ -f "$DIR/$name.pid" ]] && kill -0 "$(cat "$DIR/$name.pid")" 2>/dev/null; then
    echo "the $name node is already running (pid $(cat "$DIR/$name.pid")); run '$0 down' first" >&2
    return 1
  fi
  setsid "$RAY" start --block --disable-usage-stats --temp-dir "$DIR/tmp-$name" "$@" >"$DIR/$name.log" 2>&1 &
  echo $! >"$DIR/$name.pid"
  wait_started "$name" "$!"
}

# stop_node NAME: SIGTERM to the node's `ray start --block`, SIGKILL after 30 s.
stop_node() {
  local name=$1 pid
  [[ -f "$DIR/$name.pid" ]] || return 0
  pid=$(cat "$DIR/$name.pid")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid"
    for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid"; fi
  fi
  rm -f "$DIR/$name.pid"
}

case "${1:-}" in
  up)
    if [[ "$AUTH" == token && ! -s "$DIR/auth_token" ]]; then
      (umask 077; head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$DIR/auth_token")
    fi
    start_node head --head --node-ip-address 127.0.0.1 --port "$PORT" --num-cpus "${HEAD_CPUS:-2}" \
      --dashboard-host 127.0.0.1 --dashboard-port "$DASH" --ray-client-server-port "$CLIENT" \
      --dashboard-agent-listen-port "$AGENT"
    if ! start_node worker --address "127.0.0.1:$PORT" --node-ip-address 127.0.0.1 --num-cpus "${WORKER_CPUS:-2}" \
        --resources "$WORKER_RESOURCES" --dashboard-agent-listen-port "$((AGENT + 1))"; then
      stop_node head
      exit 1
    fi
    echo "Ray cluster up: 2 nodes, GCS 127.0.0.1:$PORT, dashboard http://127.0.0.1:$DASH"
    echo "  export RAY_ADDRESS=127.0.0.1:$PORT RAY_API_SERVER_ADDRESS=http://127.0.0.1:$DASH"
    if [[ "$AUTH" == token ]]; then
      echo "  export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$DIR/auth_token"
    fi
    ;;
  down)
    stop_node worker
    stop_node head
    echo "Ray cluster in $DIR stopped"
    ;;
  status)
    for name in head worker; do
      if [[ -f "$DIR/$name.pid" ]] && kill -0 "$(cat "$DIR/$name.pid")" 2>/dev/null; then
        echo "$name: running (pid $(cat "$DIR/$name.pid"))"
      else
        echo "$name: stopped"
      fi
    done
    if [[ -f "$DIR/head.pid" ]] && kill -0 "$(cat "$DIR/head.pid")" 2>/dev/null; then
      "$RAY" status --address "127.0.0.1:$PORT"
    fi
    ;;
  *)
    echo "usage: $0 up|down|status   (settings: see the comments at the top of this file)" >&2
    exit 2
    ;;
esac
