#!/usr/bin/env bash
# vllm-router in its P/D mode in front of prefill and decode: what clients talk to.
#   PREFILL_URLS="http://10.0.0.1:8100" DECODE_URLS="http://10.0.0.2:8200" ./router.sh
# The router sends P the request with max_tokens 1 and {"do_remote_decode": true}, then D the
# request with P's kv_transfer_params (its default, nixl-style P/D mode; kvbridge needs no
# --kv-connector setting). It replaces the client's kv_transfer_params, so pull or push is
# P's `mode` option (KVB_MODE), not a per-request choice.
# PREFILL_URLS / DECODE_URLS: space-separated servers (defaults: this host's 8100 and 8200);
# ROUTER_HOST (default 0.0.0.0), ROUTER_PORT (default 8000), ROUTER_POLICY (round_robin);
# VLLM_ROUTER the command (default vllm-router: `pip install vllm-router==0.1.17`, or
# kvbridge's `router` extra). Further arguments go to the router.
set -euo pipefail
VLLM_ROUTER=${VLLM_ROUTER:-vllm-router}
if ! command -v "$VLLM_ROUTER" >/dev/null; then
  echo "router.sh: $VLLM_ROUTER not found: pip install vllm-router==0.1.17 (or use proxy.sh)" >&2
  exit 1
fi
PREFILL_URLS=${PREFILL_URLS:-http://127.0.0.1:8100}
DECODE_URLS=${DECODE_URLS:-http://127.0.0.1:8200}
args=()
for url in $PREFILL_URLS; do args+=(--prefill "$url"); done
for url in $DECODE_URLS; do args+=(--decode "$url"); done
exec "$VLLM_ROUTER" --vllm-pd-disaggregation "${args[@]}" \
  --policy "${ROUTER_POLICY:-round_robin}" --host "${ROUTER_HOST:-0.0.0.0}" \
  --port "${ROUTER_PORT:-8000}" "$@"
