#!/usr/bin/env bash
# The prefill instance (kv_producer): prefills each request and holds its KV for the decode side.
#   MODEL=... KVBRIDGE_HOST=10.0.0.1 KVBRIDGE_SECRET_FILE=/etc/kvbridge/secret ./prefill.sh
# Variables: see common.sh. HTTP_PORT defaults to 8100.
HTTP_PORT=${HTTP_PORT:-8100}
. "$(dirname "$0")/common.sh"
serve kv_producer "" "$@"
