#!/usr/bin/env bash
# P, D and a router on one host (one GPU each, or CPU cores apart): a complete P/D deployment.
#   MODEL=... ./one-host.sh [vLLM args for both instances...]      in the foreground
#   MODEL=... ./one-host.sh --wait [vLLM args...]   in the background; returns once P, D and the
#                                                   router answer /health and one completion
#                                                   through the router moved its KV cache from
#                                                   P to D (or fails, and stops)
#   ./one-host.sh --stop                            stops a deployment started with --wait
# Then send OpenAI requests to http://127.0.0.1:8000.
#   ROUTER                                             vllm-router (default: router.sh) or
#                                                      kvbridge-proxy (proxy.sh)
#   KVB_TRANSPORT, KVB_MODE, KVBRIDGE_SECRET_FILE, ...   as in common.sh, for both instances
#   PREFILL_PORT / DECODE_PORT / PROXY_PORT            HTTP ports (8100 / 8200 / 8000)
#   PREFILL_SIDE_PORT / DECODE_SIDE_PORT               side channels (5790 / 5800; TP rank r: +r)
#   PREFILL_GPUS / DECODE_GPUS                         CUDA_VISIBLE_DEVICES of each (e.g. 0 / 1)
#   PREFILL_CPUS / DECODE_CPUS                         vLLM CPU backend: VLLM_CPU_OMP_THREADS_BIND
#   LOG_DIR                                            prefill.log, decode.log, and with --wait
#                                                      one-host.log and one-host.pid (default .)
#   READY_TIMEOUT                                      --wait: seconds to wait (default 900)
# In the foreground the router logs to this terminal; the first of the three to exit stops the
# others.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
LOG_DIR=${LOG_DIR:-.}
mkdir -p "$LOG_DIR"
export HTTP_HOST=${HTTP_HOST:-127.0.0.1} KVBRIDGE_HOST=${KVBRIDGE_HOST:-127.0.0.1}
PYTHON=${PYTHON:-python3}
pidfile="$LOG_DIR/one-host.pid"

# stop: end the process group that --wait started (P, D, the router and their children)
stop() {
  [ -f "$pidfile" ] || { echo "one-host.sh: nothing to stop ($pidfile is missing)" >&2; return 1; }
  local pid i
  pid=$(cat "$pidfile")
  kill -TERM -- "-$pid" 2>/dev/null || true
  for i in $(seq 1 60); do
    kill -0 -- "-$pid" 2>/dev/null || break
    sleep 0.5
  done
  kill -KILL -- "-$pid" 2>/dev/null || true
  rm -f "$pidfile"
  echo "stopped prefill, decode and ${ROUTER:-vllm-router}" >&2
}

[ "${1:-}" = --stop ] && { stop; exit; }
# said on the terminal that started it (with --wait, the rest logs to one-host.log)
if [ -z "${KVBRIDGE_SECRET_FILE:-}${KVBRIDGE_SECRET:-}" ] && [ -z "${ONE_HOST_DETACHED:-}" ]; then
  echo "note: no KVBRIDGE_SECRET_FILE: the side channels listen on $KVBRIDGE_HOST only, without" \
       "authentication (docs: getting started, secrets)" >&2
fi

# every port it will listen on, free before anything starts (TP rank r's side channel, + r, is
# not checked: the TP size is in vLLM's arguments)
if [ -z "${ONE_HOST_DETACHED:-}" ] && ! taken=$("$PYTHON" -m kvbridge.deploy.readiness --free \
    "PREFILL_PORT=$HTTP_HOST:${PREFILL_PORT:-8100}" "DECODE_PORT=$HTTP_HOST:${DECODE_PORT:-8200}" \
    "PROXY_PORT=${PROXY_HOST:-127.0.0.1}:${PROXY_PORT:-8000}" \
    "PREFILL_SIDE_PORT=$KVBRIDGE_HOST:${PREFILL_SIDE_PORT:-5790}" \
    "DECODE_SIDE_PORT=$KVBRIDGE_HOST:${DECODE_SIDE_PORT:-5800}" 2>&1); then
  echo "one-host.sh: $taken; nothing started" >&2
  exit 1
fi

case "${1:-}" in
  --wait)
    shift
    if [ -f "$pidfile" ] && kill -0 -- "-$(cat "$pidfile")" 2>/dev/null; then
      echo "one-host.sh: already running (process group $(cat "$pidfile")); $0 --stop first" >&2
      exit 1
    fi
    # the same script in the foreground, in a process group of its own, detached from this shell
    ONE_HOST_DETACHED=1 setsid bash "$here/one-host.sh" "$@" >"$LOG_DIR/one-host.log" 2>&1 </dev/null &
    echo $! >"$pidfile"
    echo "starting prefill, decode and ${ROUTER:-vllm-router} (logs in $LOG_DIR); waiting for" \
         "/health (up to ${READY_TIMEOUT:-900} s)" >&2
    # ready means able to transfer: every /health answers 200, then one completion through the
    # router makes decode load its KV cache from prefill
    front="http://${PROXY_HOST:-127.0.0.1}:${PROXY_PORT:-8000}"
    if ! { "$PYTHON" -m kvbridge.deploy.readiness --pid "$(cat "$pidfile")" \
        --timeout "${READY_TIMEOUT:-900}" \
        "http://$HTTP_HOST:${PREFILL_PORT:-8100}/health" \
        "http://$HTTP_HOST:${DECODE_PORT:-8200}/health" "$front/health" &&
      "$PYTHON" -m kvbridge.deploy.readiness --transfer "$front" \
        --decode "http://$HTTP_HOST:${DECODE_PORT:-8200}"; }; then
      for log in one-host prefill decode; do
        [ -f "$LOG_DIR/$log.log" ] && { echo "--- last lines of $LOG_DIR/$log.log" >&2; tail -n 5 "$LOG_DIR/$log.log" >&2; }
      done
      stop || true
      exit 1
    fi
    echo "ready: http://${PROXY_HOST:-127.0.0.1}:${PROXY_PORT:-8000} (stop with: $0 --stop)" >&2
    exit 0 ;;
esac

# side VAR_PREFIX: the per-instance environment (only what is set)
side() {
  local gpus="${1}_GPUS" cpus="${1}_CPUS"
  [ -n "${!gpus:-}" ] && printf 'CUDA_VISIBLE_DEVICES=%s\n' "${!gpus}"
  [ -n "${!cpus:-}" ] && printf 'VLLM_CPU_OMP_THREADS_BIND=%s\n' "${!cpus}"
  return 0
}

trap 'kill $(jobs -p) 2>/dev/null || true' EXIT
# shellcheck disable=SC2046  # one word per VAR=value line
env $(side PREFILL) HTTP_PORT="${PREFILL_PORT:-8100}" KVBRIDGE_PORT="${PREFILL_SIDE_PORT:-5790}" \
  "$here/prefill.sh" "$@" >"$LOG_DIR/prefill.log" 2>&1 &
# shellcheck disable=SC2046
env $(side DECODE) HTTP_PORT="${DECODE_PORT:-8200}" KVBRIDGE_PORT="${DECODE_SIDE_PORT:-5800}" \
  KVB_PREFILL_PEERS="${KVB_PREFILL_PEERS:-$KVBRIDGE_HOST:${PREFILL_SIDE_PORT:-5790}}" \
  "$here/decode.sh" "$@" >"$LOG_DIR/decode.log" 2>&1 &
case "${ROUTER:-vllm-router}" in
  vllm-router) front="$here/router.sh" ;;
  kvbridge-proxy) front="$here/proxy.sh" ;;
  *) echo "one-host.sh: ROUTER=$ROUTER: expected vllm-router or kvbridge-proxy" >&2; exit 2 ;;
esac
PREFILL_URLS="http://$HTTP_HOST:${PREFILL_PORT:-8100}" \
  DECODE_URLS="http://$HTTP_HOST:${DECODE_PORT:-8200}" \
  PROXY_HOST="${PROXY_HOST:-127.0.0.1}" PROXY_PORT="${PROXY_PORT:-8000}" \
  ROUTER_HOST="${PROXY_HOST:-127.0.0.1}" ROUTER_PORT="${PROXY_PORT:-8000}" "$front" &
echo "prefill and decode are starting (logs in $LOG_DIR); ${ROUTER:-vllm-router} on port" \
     "${PROXY_PORT:-8000}" >&2
wait -n
status=$?
echo "one of prefill, decode, ${ROUTER:-vllm-router} exited ($status): stopping the others" >&2
exit "$status"
