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

``vllm serve`` without the scripts gets the same check from ``check_vllm_config``, which the
connector calls from the class methods vLLM asks while it builds its config in the API server
process, before any engine starts: ``kv_cache_access`` (vLLM 0.34, always) and
``requires_piecewise_for_cudagraph`` (0.32 and 0.33 with CUDA graphs). There a wrong setting
ends ``vllm serve`` with the same one line and exit 2, seconds after it started.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from kvbridge.adapters.vllm.options import Options
from kvbridge.adapters.vllm.plugin import connector_transport
from kvbridge.core.errors import TransportError


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


#: configurations ``check_vllm_config`` passed, with their options (vLLM asks more than once
#: per process)
_PASSED: dict[str, Options | None] = {}


def _vllm_command_line() -> bool:
    """Whether this process is vLLM's command line (``vllm serve``, ``python -m
    vllm.entrypoints...``), where a wrong setting ends the process; not a program that builds
    vLLM's config itself (``LLM(...)``), which gets an exception."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    main = str(getattr(spec, "name", "") or "")
    return main.startswith("vllm.entrypoints") or os.path.basename(sys.argv[0]) == "vllm"


def check_vllm_config(kv_transfer_config: Any) -> Options | None:
    """``preflight`` of vLLM's ``KVTransferConfig``, from inside vLLM's config validation: the
    options (``None`` for another connector).

    On vLLM's command line a wrong setting prints ``kvbridge: <what is wrong>`` and exits 2:
    any exception raised there would reach the user inside pydantic's report and a traceback.
    Elsewhere it raises ``ValueError`` with that line. Checked once per configuration.
    """
    config = {
        "kv_connector": getattr(kv_transfer_config, "kv_connector", None),
        "kv_connector_extra_config": getattr(kv_transfer_config, "kv_connector_extra_config", {}),
    }
    key = json.dumps(config, sort_keys=True, default=repr)
    if key in _PASSED:
        return _PASSED[key]
    try:
        options = preflight(config)
    except (ValueError, TransportError) as err:
        line = str(err) if str(err).startswith("kvbridge") else f"kvbridge: {err}"
        if _vllm_command_line():
            print(line, file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        raise ValueError(line) from None
    _PASSED[key] = options
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
