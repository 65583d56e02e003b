"""vLLM general plugin: registers kvbridge's connectors and asks for AMX tile permission.

vLLM runs every ``vllm.general_plugins`` entry point in each of its processes (engine core and
workers), which is where both things must happen.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys

log = logging.getLogger("kvbridge.vllm")

#: The generic connector name; the transport comes from ``kv_connector_extra_config``.
CONNECTOR_NAME = "KVBridgeConnector"
_MODULE = "kvbridge.adapters.vllm.connector"

_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18
_SYS_ARCH_PRCTL = 158  # x86-64


def request_amx_permission() -> bool:
    """Ask Linux for AMX tile data, which vLLM's bf16 CPU attention uses without asking.

    Without it, the first AMX instruction in a process that oneDNN did not already enable
    dies with SIGILL. The grant does not survive exec, hence once per process. A no-op (False)
    off x86-64 Linux or where the CPU has no AMX.
    """
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)) == 0
    except (OSError, AttributeError):
        return False


#: The name of the handler ``configure_logging`` adds (and replaces when called again).
_HANDLER_NAME = "kvbridge"


class _ToVllmLogger(logging.Handler):
    """Hands kvbridge's records to vLLM's ``vllm`` logger: they come out through vLLM's own
    handlers, format and stream (a JSON formatter or ``VLLM_LOGGING_CONFIG_PATH`` included).

    vLLM configures that logger in each process at its own time, possibly after the plugins
    load, so where it goes is looked up per record; where vLLM configured nothing
    (``VLLM_CONFIGURE_LOGGING=0``), records go to the root logger, as without this handler.
    """

    def emit(self, record: logging.LogRecord) -> None:
        vllm_logger = logging.getLogger("vllm")
        (vllm_logger if vllm_logger.handlers else logging.getLogger()).handle(record)


def configure_logging() -> None:
    """Make kvbridge's log lines appear under vLLM's logging setup, in every process.

    vLLM configures only its own ``vllm`` logger, so without this kvbridge's lines below
    WARNING would go nowhere and the rest would come out bare on stderr. By default they go
    through vLLM's handlers at vLLM's level (``VLLM_LOGGING_LEVEL``, INFO unless set).
    ``KVBRIDGE_LOG_LEVEL`` (e.g. ``DEBUG``) instead gives them a handler of their own at that
    level, with millisecond timestamps and the process id.
    """
    logger = logging.getLogger("kvbridge")
    for old in [h for h in logger.handlers if h.get_name() == _HANDLER_NAME]:
        logger.removeHandler(old)
    level = os.environ.get("KVBRIDGE_LOG_LEVEL", "").strip().upper()
    handler: logging.Handler
    if level:
        handler = logging.StreamHandler()
        fmt = "%(asctime)s.%(msecs)03d %(process)d %(name)s %(levelname)s %(message)s"
        handler.setFormatter(logging.Formatter(fmt, "%H:%M:%S"))
    else:
        handler = _ToVllmLogger()
        level = os.environ.get("VLLM_LOGGING_LEVEL", "").strip().upper() or "INFO"
    handler.set_name(_HANDLER_NAME)
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(level)


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
