#!/usr/bin/env bash
# P, D and a router on one host (one GPU each, or CPU cores apart): a complete P/D deployment.
#   MODEL=... ./one-host.sh [vLLM args for both instances...]
# Then send OpenAI requests to http://127.0.0.1:8000 once its /health answers 200.
#   ROUTER                                             vllm-router (default: router.sh) or
#                                                      kvbridge-proxy (proxy.sh)
#   KVB_TRANSPORT, KVB_MODE, KVBRIDGE_SECRET_FILE, ...   as in common.sh, for both instances
#   PREFILL_PORT / DECODE_PORT / PROXY_PORT            HTTP ports (8100 / 8200 / 8000)
#   PREFILL_SIDE_PORT / DECODE_SIDE_PORT               side channels (5790 / 5800; TP rank r: +r)
#   PREFILL_GPUS / DECODE_GPUS                         CUDA_VISIBLE_DEVICES of each (e.g. 0 / 1)
#   PREFILL_CPUS / DECODE_CPUS                         vLLM CPU backend: VLLM_CPU_OMP_THREADS_BIND
#   LOG_DIR                                            prefill.log and decode.log (default .)
# The router logs to this terminal; the first of the three to exit stops the others.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
LOG_DIR=${LOG_DIR:-.}
mkdir -p "$LOG_DIR"
export HTTP_HOST=${HTTP_HOST:-127.0.0.1} KVBRIDGE_HOST=${KVBRIDGE_HOST:-127.0.0.1}

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
