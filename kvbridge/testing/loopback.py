"""An in-process transport for tests: peers are other ``LoopbackTransport`` objects of this process.

Like httpx's ``MockTransport``: the whole ``Transport`` contract (registration, metadata and
``connect``, ``submit``/``poll``/``wait``/``fence``, splitting by ``max_batch``, deadlines, close)
comes from the kit in ``kvbridge.core.transport``; the engine hooks here copy bytes with
``ctypes.memmove`` between memory registered with two transports of this process. No engine, no
thread, no syscall: a chunk is copied inside ``submit``.

``fault`` injects failures: called with each chunk (``kvbridge.core.batches.Chunk``: its ``op``,
``index``, ``local``, ``remote``, ``lengths``, ``handle.peer``) just before it is copied, it may
raise any exception; that chunk then moves no byte and its batch fails as an engine failure does
(``poll`` reports ``FAILED`` with the exception's text, ``wait``/``transfer`` raise
``TransferError``). It may also sleep, to make a chunk slow. Chunks after a failed one of the
same batch are still copied (they were handed to the "engine" together), as a real engine does.

Use it by class, or by name after registering it::

    kvbridge.register_transport("loopback", LoopbackTransport)
    transport = kvbridge.load_transport("loopback", fault=my_fault)
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

import msgspec

from kvbridge.core.batches import AddrArray, Chunk, ChunkResult, TransferOp
from kvbridge.core.contract import TransportLimits
from kvbridge.core.errors import PeerError
from kvbridge.core.memory import MemoryKind, MemoryRange, RegisteredRanges
from kvbridge.core.transport import Transport

__all__ = ["Fault", "LoopbackMetadata", "LoopbackTransport"]

#: A per-chunk fault hook: raise to fail the chunk before any byte of it moves.
Fault = Callable[[Chunk], None]


class LoopbackMetadata(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Which loopback transport of which process a peer is."""

    pid: int
    agent: int


#: Every open loopback transport of this process, by agent number.
_agents: weakref.WeakValueDictionary[int, LoopbackTransport] = weakref.WeakValueDictionary()
_numbers = itertools.count(1)
#: Held around every copy and every change of what a transport lets peers touch, so that once a
#: ``deregister`` or ``close`` returns no byte moves into what it took back. Taken after a
#: transport's own lock, never before one: no lock order can cycle.
_copying = threading.Lock()


def _snapshot(ranges: list[MemoryRange]) -> RegisteredRanges:
    copy = RegisteredRanges()
    copy.add(ranges)
    return copy


class LoopbackTransport(Transport):
    """Moves host memory between transports of this process with ``ctypes.memmove``.

    Options (keyword only):
        timeout: seconds a batch may take from ``submit``.
        retries: accepted for the contract's sake (a copy does not fail on its own).
        max_batch: the most descriptors per chunk (``None``: one chunk per batch); the kit splits
            batches by it, so a ``fault`` sees each chunk.
        fault: the per-chunk fault hook (see the module's docstring).
    """

    name: ClassVar[str] = "loopback"
    install_hint: ClassVar[str] = "nothing (it is part of kvbridge.testing)"

    def __init__(
        self,
        *,
        timeout: float = 30.0,
        retries: int = 0,
        max_batch: int | None = None,
        fault: Fault | None = None,
    ) -> None:
        super().__init__(timeout=timeout, retries=retries)
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"max_batch must be at least 1 (or None), got {max_batch}")
        if fault is not None and not callable(fault):
            raise TypeError(f"fault must be callable (it gets each chunk), got {fault!r}")
        self.fault = fault
        self.agent = next(_numbers)
        #: what peers may touch now: a snapshot of the registrations, swapped under ``_copying``
        self._published = RegisteredRanges()
        _agents[self.agent] = self
        self.open(TransportLimits(max_batch, None, frozenset({MemoryKind.DRAM})))

    # -- memory -------------------------------------------------------------------------------

    def engine_memory_hint(self) -> str:
        return " (it copies host memory of this process with ctypes.memmove)"

    def _publish(self) -> None:
        snapshot = _snapshot(self.registered)
        with _copying:  # waits for a copy into what is taken back
            self._published = snapshot

    def engine_register(self, device: tuple[MemoryKind, int], ranges: list[MemoryRange]) -> None:
        self._publish()

    def engine_deregister(self, device: tuple[MemoryKind, int], ranges: list[MemoryRange]) -> None:
        self._publish()

    # -- peers --------------------------------------------------------------------------------

    def engine_metadata(self) -> bytes:
        return msgspec.msgpack.encode(LoopbackMetadata(os.getpid(), self.agent))

    def engine_connect(self, peer: str, payload: bytes, old: Any) -> Any:
        meta = self.decode_payload(peer, payload, LoopbackMetadata)
        if meta.pid != os.getpid():
            raise PeerError(
                f"peer {peer!r} is a loopback transport of process {meta.pid}; loopback moves "
                f"bytes only within one process (this is {os.getpid()})"
            )
        other = _agents.get(meta.agent)
        if other is None or other._closed:
            raise PeerError(
                f"peer {peer!r}: loopback transport {meta.agent} of this process is closed; "
                "connect with an open transport's metadata"
            )
        if old is other:
            return old
        return other

    def engine_describe_peer(self, state: Any) -> str:
        return f"loopback {state.agent}"

    # -- transfers ----------------------------------------------------------------------------

    def engine_check_remote(
        self, state: Any, remote: AddrArray, lengths: AddrArray, peer: str
    ) -> None:
        if state._closed:
            raise PeerError(
                f"peer {peer!r}: its loopback transport {state.agent} is closed; nothing was "
                "moved (reconnect it with an open transport's metadata)"
            )
        state._published.require_covered(remote, lengths, f"remote (peer {peer!r})")

    def engine_start_chunk(self, state: Any, chunk: Chunk) -> Any:
        """Copy the chunk now (``None``: done inside the call), or return its failure."""
        if self.fault is not None:  # outside ``_copying``: the hook may call any transport
            try:
                self.fault(chunk)
            except Exception as err:
                reason = f"injected fault in {chunk.describe()}: {type(err).__name__}: {err}"
                return ChunkResult(False, reason, retry=False)
        with _copying:
            if state._closed or state._published.find_uncovered(chunk.remote, chunk.lengths) >= 0:
                return ChunkResult(
                    False,
                    f"peer {chunk.handle.peer!r} deregistered the memory or closed; nothing "
                    "was moved",
                    retry=False,
                )
            read = chunk.op is TransferOp.READ
            for local, remote, size in zip(
                chunk.local.tolist(), chunk.remote.tolist(), chunk.lengths.tolist(), strict=True
            ):
                src, dst = (remote, local) if read else (local, remote)
                ctypes.memmove(dst, src, size)
        return None

    def engine_check_chunk(self, chunk: Chunk) -> ChunkResult | None:
        result: ChunkResult = chunk.token  # only failed chunks stay with a token
        return result

    def engine_close(self) -> None:
        with _copying:
            self._published = RegisteredRanges()
        _agents.pop(self.agent, None)

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.peer_count} peers"
        return f"<LoopbackTransport {self.agent} {state}>"
