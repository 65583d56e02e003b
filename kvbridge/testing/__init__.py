"""The transport conformance suite and its helpers, for kvbridge's transports and third-party ones.

A plugin's tests subclass ``TransportConformance`` (see ``kvbridge.testing.conformance`` for what
to write) and run under pytest with pytest-timeout (``pip install 'kvbridge[testing]'``). The
suite's parts, ``DataPathTests``, ``RegistrationTests``, ``PeerLifecycleTests`` and
``FaultAndFenceTests`` (mixins over ``ConformanceBase``), each run alone or in any combination.

``LoopbackTransport`` is an in-process transport for tests of code above the transport (see
``kvbridge.testing.loopback``).

Names load on first use, so ``python -m kvbridge.testing.peer`` (a peer process) and the pytest
plugin do not import the suite, numpy or pytest until they need them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvbridge.testing.conformance import (
        READ,
        WRITE,
        Agent,
        Capabilities,
        ConformanceBase,
        DataPathTests,
        FaultAndFenceTests,
        MakeAgent,
        MiB,
        PeerBytes,
        PeerLifecycleTests,
        RegistrationTests,
        SpawnPeer,
        TransportConformance,
        assert_same_bytes,
        at,
        check_read,
        check_write,
        connected_pair,
        copy_ranges,
        record_fault,
        scattered,
    )
    from kvbridge.testing.loopback import LoopbackTransport
    from kvbridge.testing.peer import PeerProcess, PeerProcessError, random_bytes

__all__ = [
    "READ",
    "WRITE",
    "Agent",
    "Capabilities",
    "ConformanceBase",
    "DataPathTests",
    "FaultAndFenceTests",
    "LoopbackTransport",
    "MakeAgent",
    "MiB",
    "PeerBytes",
    "PeerLifecycleTests",
    "PeerProcess",
    "PeerProcessError",
    "RegistrationTests",
    "SpawnPeer",
    "TransportConformance",
    "assert_same_bytes",
    "at",
    "check_read",
    "check_write",
    "connected_pair",
    "copy_ranges",
    "random_bytes",
    "record_fault",
    "scattered",
]

#: the module of each public name
_PEER = {"PeerProcess", "PeerProcessError", "random_bytes"}
_LOOPBACK = {"LoopbackTransport"}
_SOURCES = {
    name: "peer" if name in _PEER else "loopback" if name in _LOOPBACK else "conformance"
    for name in __all__
}


def __getattr__(name: str) -> Any:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{source}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
