"""What a transport plugin imports: the one public surface for writing a kvbridge transport.

A transport is a ``Transport`` subclass in its own package plus one entry point in the group
``kvbridge.transports``; it implements its engine's calls as the ``engine_*`` hooks (declared once,
with their duties, in ``kvbridge.core.engine_hooks``; the required ones are checked when the
class is defined) and the base class keeps the contract: handles and deadlines, chunking, retries,
registration bookkeeping, peers, the metadata envelope. From the base class a plugin calls
``open(limits)`` once its engine runs and ``load_engine()`` before, and reads ``registered``,
``closed``, ``peer_count``. Import what a plugin needs from here, not from the modules behind it,
which may move::

    from kvbridge.plugin import CHUNK_OK, Chunk, ChunkResult, TransferOp, Transport, TransportLimits

What each name is:

* the base class and what it is built with: ``Transport``, ``TransportLimits`` (what the engine
  can take at once), ``MemoryAccess`` (how the engine reaches registered memory);
* what the hooks take and return: ``Chunk`` (a piece of a batch: ``op``, ``local``, ``remote``,
  ``lengths`` as ``AddrArray``), ``ChunkResult`` and ``CHUNK_OK``, ``TransferOp``,
  ``MemoryRange``/``MemoryKind``/``DeviceKey`` (what is registered, on which device);
* the errors a hook raises: ``RegistrationError``, ``PeerError``, ``ChunkRefused`` (nothing of
  the chunk was sent: the kit may start it again), ``TransferError``, ``TransportError``,
  ``TransportUnavailableError``;
* for engines that copy by address within one host (the kernel's ``process_vm_*``,
  ``/proc/<pid>/mem``): ``PublishedRanges`` (this process's table of the ranges peers may
  copy into and out of, revoked at deregistration) and ``PeerRanges`` (a peer's table, read).

``tests/test_plugin_surface.py`` holds this list: a name added or removed here is a decision.
"""

from __future__ import annotations

from kvbridge.core.batches import CHUNK_OK, AddrArray, Chunk, ChunkResult, TransferOp
from kvbridge.core.contract import MemoryAccess, TransportLimits
from kvbridge.core.errors import (
    ChunkRefused,
    PeerError,
    RegistrationError,
    TransferError,
    TransportError,
    TransportUnavailableError,
)
from kvbridge.core.memory import DeviceKey, MemoryKind, MemoryRange
from kvbridge.core.transport import Transport
from kvbridge.transports.host_access import PeerRanges, PublishedRanges

__all__ = [
    "CHUNK_OK",
    "AddrArray",
    "Chunk",
    "ChunkRefused",
    "ChunkResult",
    "DeviceKey",
    "MemoryAccess",
    "MemoryKind",
    "MemoryRange",
    "PeerError",
    "PeerRanges",
    "PublishedRanges",
    "RegistrationError",
    "TransferError",
    "TransferOp",
    "Transport",
    "TransportError",
    "TransportLimits",
    "TransportUnavailableError",
]
