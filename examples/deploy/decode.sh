#!/usr/bin/env bash
# The decode instance (kv_consumer): loads each request's KV from the prefill side and decodes.
#   MODEL=... KVBRIDGE_HOST=10.0.0.2 KVBRIDGE_SECRET_FILE=/etc/kvbridge/secret ./decode.sh
# Variables: see common.sh. HTTP_PORT defaults to 8200. A load that fails (P gone, timeout) is
# recomputed here (kv_load_failure_policy "recompute"), so the answer stays right.
HTTP_PORT=${HTTP_PORT:-8200}
. "$(dirname "$0")/common.sh"
serve kv_consumer ', "kv_load_failure_policy": "recompute"' "$@"
