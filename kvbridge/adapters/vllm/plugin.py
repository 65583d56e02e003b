"""vLLM general plugin: registers kvbridge's connector names with vLLM's connector factory.

vLLM runs every ``vllm.general_plugins`` entry point in each of its processes (engine core and
workers), so ``register`` is also where each process asks for AMX permission (``amx``) and
routes kvbridge's log lines through vLLM's logging (``logs``); those live in modules of their own.
"""

from __future__ import annotations

import logging

from kvbridge.adapters.vllm.amx import request_amx_permission
from kvbridge.adapters.vllm.logs import configure_logging

log = logging.getLogger("kvbridge.vllm")

#: The generic connector name; the transport comes from ``kv_connector_extra_config``.
CONNECTOR_NAME = "KVBridgeConnector"
_MODULE = "kvbridge.adapters.vllm.connector"


def connector_name(transport: str | None) -> str:
    """The connector name vLLM knows for ``transport`` fixed (``None``: the generic one)."""
    return CONNECTOR_NAME if transport is None else f"{CONNECTOR_NAME}-{transport}"


def connector_transport(connector: str) -> tuple[bool, str | None]:
    """Whether ``connector`` is kvbridge's, and the transport its name fixes (``None``: the
    generic ``KVBridgeConnector``, whose options choose it); ``connector_name`` reversed."""
    if connector == CONNECTOR_NAME:
        return True, None
    prefix = connector_name("")
    return (True, connector[len(prefix) :]) if connector.startswith(prefix) else (False, None)


def connector_names() -> dict[str, str | None]:
    """Connector name → fixed transport (None: chosen by ``kv_connector_extra_config``)."""
    from importlib.metadata import entry_points

    # Names only: importing the transports (and their engines) in every vLLM process at
    # plugin load would cost seconds; the chosen one is imported when a worker starts.
    names: dict[str, str | None] = {CONNECTOR_NAME: None}
    for ep in sorted(entry_points(group="kvbridge.transports"), key=lambda e: e.name):
        names[connector_name(ep.name)] = ep.name
    return names


def transport_connector(transport: str) -> type:
    """A subclass of the connector with its transport fixed (what ``-<name>`` connectors load)."""
    from kvbridge.adapters.vllm.connector import KVBridgeConnector

    return type(
        f"KVBridgeConnector_{transport}",
        (KVBridgeConnector,),
        {"default_transport": transport, "__module__": _MODULE},
    )


def __getattr__(name: str) -> type:
    # The factory loads classes lazily by module attribute: `KVBridgeConnector_<transport>`.
    prefix = "KVBridgeConnector_"
    if name.startswith(prefix):
        return transport_connector(name[len(prefix) :])
    raise AttributeError(name)


def register() -> None:
    """The entry point: register every connector name with vLLM's factory (idempotent)."""
    request_amx_permission()
    configure_logging()
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        from kvbridge.adapters.vllm.versions import registered_connectors
    except ImportError:  # vLLM absent or too old: nothing to register with
        return
    import vllm

    from kvbridge.adapters.vllm.versions import untested_release

    untested = untested_release(str(getattr(vllm, "__version__", "")))
    if untested is not None:
        log.warning(untested)
    known = set(registered_connectors())
    for name, transport in connector_names().items():
        if name in known:
            continue
        if transport is None:
            KVConnectorFactory.register_connector(name, _MODULE, "KVBridgeConnector")
        else:
            KVConnectorFactory.register_connector(name, __name__, f"KVBridgeConnector_{transport}")
