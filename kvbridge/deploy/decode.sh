#!/usr/bin/env bash
# The decode instance (kv_consumer): loads each request's KV from the prefill side and decodes.
#   MODEL=... KVBRIDGE_HOST=10.0.0.2 KVBRIDGE_SECRET_FILE=/etc/kvbridge/secret ./decode.sh
# Variables: see common.sh. HTTP_PORT defaults to 8200. A load that fails (P gone, timeout) is
# recomputed here (kv_load_failure_policy "recompute"), so the answer stays right.
#   KVB_CHECK_PREFILL=1   before starting, run `kvbridge check` against each of KVB_PREFILL_PEERS
#                         (side channel, secret, versions, a few KiB through the transport both
#                         ways) and stop here if one fails; off by default
HTTP_PORT=${HTTP_PORT:-8200}
. "$(dirname "$0")/common.sh"
if [ "${KVB_CHECK_PREFILL:-0}" = 1 ]; then
  : "${KVB_PREFILL_PEERS:?KVB_CHECK_PREFILL=1 checks KVB_PREFILL_PEERS: set it (host:port,...)}"
  for peer in ${KVB_PREFILL_PEERS//,/ }; do
    echo "kvbridge check tcp://$peer:" >&2
    "$PYTHON" -m kvbridge.cli check "tcp://$peer" --host "$KVBRIDGE_HOST" \
      --transport-options "$KVB_TRANSPORT_OPTIONS" >&2 || {
      echo "kvbridge: the prefill engine at $peer failed the check; not starting" >&2
      exit 1
    }
  done
fi
serve kv_consumer ', "kv_load_failure_policy": "recompute"' "$@"
