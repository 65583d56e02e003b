"""Check a ``kv_transfer_config`` for kvbridge before vLLM starts: seconds, not after the model
loaded.

vLLM 0.32 and 0.33 build the connector only once the model is loaded and the KV cache sized
(minutes on a large model): a transport name typo or a missing engine stopped the engine only
then, among hundreds of log lines. This runs what the connector checks at start, without vLLM:
every option of ``kv_connector_extra_config`` (``Options.from_extra``: names, types, ranges,
the secret rules, the transport's own options), the transport's name and whether its engine
imports (``load_transport_class``)::

    python -m kvbridge.adapters.vllm.preflight '<the --kv-transfer-config JSON>'

Exit 0 when the connector would start; 2 with one line saying what is wrong and what to do.
The deploy scripts run it before they start vLLM. A config that names another connector is not
kvbridge's to check: exit 0.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from kvbridge.adapters.vllm.options import Options
from kvbridge.adapters.vllm.plugin import CONNECTOR_NAME
from kvbridge.core.errors import TransportError


def connector_transport(connector: str) -> tuple[bool, str | None]:
    """Whether ``connector`` is kvbridge's, and the transport its name fixes (``None``: the
    generic ``KVBridgeConnector``, whose options choose it)."""
    if connector == CONNECTOR_NAME:
        return True, None
    prefix = f"{CONNECTOR_NAME}-"
    return (True, connector[len(prefix) :]) if connector.startswith(prefix) else (False, None)


def preflight(kv_transfer_config: Mapping[str, Any]) -> Options | None:
    """The connector's options, checked as the connector checks them at start, and its
    transport's class loaded (its engine imported); ``None`` for another connector. Raises a
    ``ValueError`` or ``TransportError`` whose text is one line."""
    ours, transport = connector_transport(str(kv_transfer_config.get("kv_connector") or ""))
    if not ours:
        return None
    extra = kv_transfer_config.get("kv_connector_extra_config") or {}
    if not isinstance(extra, Mapping):
        raise ValueError(f"kv_connector_extra_config must be a JSON object, not {extra!r}")
    options = Options.from_extra(dict(extra), transport)
    from kvbridge.core.registry import load_transport_class

    load_transport_class(options.transport)  # its name, and whether its engine imports
    return options


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print(
            "usage: python -m kvbridge.adapters.vllm.preflight '<kv-transfer-config JSON>'",
            file=sys.stderr,
        )
        return 2
    try:
        config = json.loads(args[0])
        if not isinstance(config, dict):
            raise ValueError("the kv-transfer-config must be a JSON object")
        preflight(config)
    except json.JSONDecodeError as err:
        print(f"kvbridge: the kv-transfer-config is not JSON: {err}", file=sys.stderr)
        return 2
    except (ValueError, TransportError) as err:
        print(f"kvbridge: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
