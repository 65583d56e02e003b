#!/usr/bin/env bash
# The proxy clients talk to: prefill on P, then decode on D with P's kv_transfer_params.
#   PREFILL_URLS="http://10.0.0.1:8100" DECODE_URLS="http://10.0.0.2:8200" ./proxy.sh
# PREFILL_URLS / DECODE_URLS: space-separated servers, used round-robin (defaults: this host's
# 8100 and 8200); PROXY_HOST (default 0.0.0.0), PROXY_PORT (default 8000); PYTHON the
# interpreter with kvbridge[proxy]. Further arguments go to the proxy (--timeout, --log-level).
set -euo pipefail
PYTHON=${PYTHON:-python3}
PREFILL_URLS=${PREFILL_URLS:-http://127.0.0.1:8100}
DECODE_URLS=${DECODE_URLS:-http://127.0.0.1:8200}
args=()
for url in $PREFILL_URLS; do args+=(--prefill "$url"); done
for url in $DECODE_URLS; do args+=(--decode "$url"); done
exec "$PYTHON" -m kvbridge.router "${args[@]}" \
  --host "${PROXY_HOST:-0.0.0.0}" --port "${PROXY_PORT:-8000}" "$@"
