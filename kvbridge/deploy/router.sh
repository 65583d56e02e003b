#!/usr/bin/env bash
# vllm-router in its P/D mode in front of prefill and decode: what clients talk to.
#   PREFILL_URLS="http://10.0.0.1:8100" DECODE_URLS="http://10.0.0.2:8200" ./router.sh
# The router sends P the request with max_tokens 1 and {"do_remote_decode": true}, then D the
# request with P's kv_transfer_params (its default, nixl-style P/D mode; kvbridge needs no
# --kv-connector setting). It replaces the client's kv_transfer_params, so pull or push is
# P's `mode` option (KVB_MODE), not a per-request choice.
# ROUTER_KV_CONNECTOR=mooncake: the router's mooncake mode instead: D's parameters come from P's
# bootstrap /query (each prefill's KVB_BOOTSTRAP_PORT, named in PREFILL_BOOTSTRAP_PORTS:
# space-separated, in PREFILL_URLS' order; the router asks each at start) and a transfer id of
# the router's. vllm-router 0.1.17 sends D the request after P answered, so D reads the KV
# whole; for layer-wise streaming (P and D at once) use proxy.sh --dispatch concurrent.
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
read -r -a boot <<<"${PREFILL_BOOTSTRAP_PORTS:-}"
i=0
for url in $PREFILL_URLS; do
  args+=(--prefill "$url" ${boot[$i]:+"${boot[$i]}"})
  i=$((i + 1))
done
for url in $DECODE_URLS; do args+=(--decode "$url"); done
if [ -n "${ROUTER_KV_CONNECTOR:-}" ]; then
  if [ "$ROUTER_KV_CONNECTOR" = mooncake ] && [ "${#boot[@]}" -ne "$i" ]; then
    echo "router.sh: ROUTER_KV_CONNECTOR=mooncake needs a bootstrap port per prefill in" \
         "PREFILL_BOOTSTRAP_PORTS (each P's KVB_BOOTSTRAP_PORT)" >&2
    exit 2
  fi
  args+=(--kv-connector "$ROUTER_KV_CONNECTOR")
fi
exec "$VLLM_ROUTER" --vllm-pd-disaggregation "${args[@]}" \
  --policy "${ROUTER_POLICY:-round_robin}" --host "${ROUTER_HOST:-0.0.0.0}" \
  --port "${ROUTER_PORT:-8000}" "$@"
