"""The kit: ``Transport`` keeps the transport contract's guarantees once for every plugin.

Read ``kvbridge.core.contract`` first: what callers use, and what a plugin supplies. A plugin
subclasses ``Transport`` and implements engine hooks only (``kvbridge.core.engine_hooks``). This
module owns registration bookkeeping with rollback, peers, the metadata envelope and its version,
the checks every ``submit`` makes, handles and the closed check, and the life cycle; what differs
between blocking and polled engines is a driver (``kvbridge.core.drivers``) picked once, at
construction, from ``blocking_engine``. Descriptor helpers live in ``kvbridge.core.descriptors``;
the names this module always exported are re-exported from here.
"""

from __future__ import annotations

import abc
import threading
import time
from collections.abc import Hashable, Sequence
from contextlib import suppress
from typing import Any, ClassVar, TypeVar

import msgspec

from kvbridge.core.batches import (
    CHUNK_OK,
    DONE,
    PENDING,
    AddrArray,
    Chunk,
    ChunkResult,
    Fence,
    TransferHandle,
    TransferOp,
    TransferState,
    TransferStatus,
    split_batch,
)
from kvbridge.core.contract import MemoryAccess, TransportContract, TransportLimits
from kvbridge.core.descriptors import (
    Batch,
    as_addr_array,
    check_descriptors,
    device_holding,
    prepare_batch,
    unknown_peer_error,
)
from kvbridge.core.drivers import BlockingDriver, EngineDriver, PolledDriver
from kvbridge.core.errors import (
    PeerError,
    RegistrationError,
    TransferError,
    TransferTimeoutError,
    TransportError,
    TransportUnavailableError,
)
from kvbridge.core.memory import DeviceKey, MemoryKind, MemoryRange, RegisteredRanges, by_device

__all__ = [
    "CHUNK_OK",
    "DONE",
    "PENDING",
    "AddrArray",
    "Batch",
    "Chunk",
    "ChunkResult",
    "DeviceKey",
    "Fence",
    "MemoryAccess",
    "MemoryKind",
    "MemoryRange",
    "TransferHandle",
    "TransferOp",
    "TransferState",
    "TransferStatus",
    "Transport",
    "TransportContract",
    "TransportLimits",
    "TransportMetadata",
    "as_addr_array",
    "check_descriptors",
    "device_holding",
    "prepare_batch",
    "unknown_peer_error",
]

_Payload = TypeVar("_Payload")


class TransportMetadata(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What ``metadata()`` returns: the transport's name, metadata version and engine's part."""

    transport: str
    version: int
    payload: bytes


_encode_envelope = msgspec.msgpack.Encoder().encode
_decode_envelope = msgspec.msgpack.Decoder(TransportMetadata).decode


class Transport(TransportContract):
    """A transport: the contract's methods (documented in ``TransportContract``), implemented
    once over a plugin's engine hooks.

    Construction takes keyword options only (from ``load_transport(name, **options)``); a plugin's
    ``__init__`` calls ``super().__init__(timeout=..., retries=...)``, starts its engine, then
    ``self._open(limits)``. ``timeout`` (seconds) bounds every batch from ``submit``.
    """

    name: ClassVar[str] = "abstract"
    #: how to install the engine, shown when it cannot be imported
    install_hint: ClassVar[str] = ""
    #: where the engine's own reason for a failure goes, appended to failure messages
    log_hint: ClassVar[str] = ""
    #: version of the plugin's metadata payload; peers with another version are refused
    metadata_version: ClassVar[int] = 1
    #: True when the engine's completion call blocks (``_wait_chunk``, run on one lane thread per
    #: peer); False when chunks are checked without blocking (``_check_chunk``) from ``poll``.
    #: Read once, at construction, to pick the driver.
    blocking_engine: ClassVar[bool] = False
    #: Polled engines: True only when releasing a chunk the engine still moves (``_release_chunk``)
    #: stops it for good, so once the release returns no byte of it moves (the engine's code
    #: guarantees it). False: a released or timed-out batch's chunks stay in the engine, watched
    #: by ``fence``, until the engine ends them itself.
    cancel_is_fence: ClassVar[bool] = False
    #: the keyword option naming the address this agent announces to peers, if the engine
    #: announces one; adapters fill it from their own configured host when it is not given
    host_option: ClassVar[str | None] = None

    def __init__(self, *, timeout: float = 30.0, retries: int = 0) -> None:
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        if retries < 0:
            raise ValueError(f"retries must not be negative, got {retries}")
        self.timeout = float(timeout)
        self.retries = int(retries)
        self._closed = True  # until the plugin's engine runs (``_open``)
        # Guards the bookkeeping below, and every engine call of a non-blocking engine (such
        # engines are rarely thread-safe). Reentrant: hooks may call back into the base.
        self._lock = threading.RLock()
        self._limits = TransportLimits()
        self._ranges = RegisteredRanges()
        self._devices: dict[DeviceKey, RegisteredRanges] = {}
        self._peers: dict[str, Any] = {}  # peer name -> the plugin's peer state
        #: batches per peer that may not be drained yet (pruned at each submit to the peer)
        self._batches: dict[str, list[TransferHandle]] = {}
        self._wide_listeners: list[str] = []  # set by plugins whose engine listens
        # The engine model, chosen once: no method of the kit asks which it is.
        self._driver: EngineDriver[Any] = (
            BlockingDriver(self, self._lock)
            if self.blocking_engine
            else PolledDriver(self, self._lock)
        )

    def _open(self, limits: TransportLimits) -> None:
        """Called by the plugin once its engine runs: the transport accepts calls from now on."""
        self._limits = limits
        self._closed = False
        self._driver.opened()

    # -- engine hooks: required (abstract) ones, and the defaults of the others --------------
    # What each one must do is documented once, in ``kvbridge.core.engine_hooks``.

    @classmethod
    def _import_engine(cls) -> Any:
        return None  # no engine library to import

    @classmethod
    def _unavailable_message(cls, err: ImportError) -> str:
        return (
            f"the {cls.name} engine cannot be imported ({err}); install it with {cls.install_hint}"
        )

    @abc.abstractmethod
    def _register_group(self, device: DeviceKey, ranges: list[MemoryRange]) -> None: ...

    @abc.abstractmethod
    def _deregister_group(self, device: DeviceKey, ranges: list[MemoryRange]) -> None: ...

    def _check_range(self, rng: MemoryRange) -> None:
        pass  # any range

    def _memory_hint(self) -> str:
        return ""

    @abc.abstractmethod
    def _engine_metadata(self) -> bytes: ...

    @abc.abstractmethod
    def _connect_engine(self, peer: str, payload: bytes, old: Any) -> Any: ...

    def _disconnect_engine(self, peer: str, state: Any) -> None:
        pass

    def _describe_peer(self, state: Any) -> str:
        return ""

    def _check_remote(self, state: Any, remote: AddrArray, lengths: AddrArray, peer: str) -> None:
        pass  # the engine checks remote descriptors itself

    def _lane_key(self, state: Any) -> Hashable:
        return id(state)  # one lane per peer state

    def _reach_peer(self, state: Any) -> str | None:
        return None  # reachable without asking

    @abc.abstractmethod
    def _start_chunk(self, state: Any, chunk: Chunk) -> Any: ...

    def _wait_chunk(self, chunk: Chunk) -> ChunkResult:
        raise NotImplementedError(
            f"{type(self).__name__} sets blocking_engine but has no _wait_chunk"
        )

    def _check_chunk(self, chunk: Chunk) -> ChunkResult | None:
        raise NotImplementedError(f"{type(self).__name__} must implement _check_chunk")

    def _release_chunk(self, chunk: Chunk) -> bool:
        return True  # nothing to free

    def _close_engine(self) -> None:
        pass

    # -- availability and limits --------------------------------------------------------------

    @classmethod
    def check_available(cls) -> None:
        cls._load_engine()

    @classmethod
    def _load_engine(cls) -> Any:
        try:
            return cls._import_engine()
        except ImportError as err:
            raise TransportUnavailableError(cls._unavailable_message(err)) from err

    @property
    def limits(self) -> TransportLimits:
        return self._limits

    @property
    def registered(self) -> list[MemoryRange]:
        return list(self._ranges)

    @property
    def wide_listeners(self) -> list[str]:
        """The engine's listening sockets that accept on more than the configured host, e.g.
        ``["tcp 0.0.0.0:16421 (RPC)"]``: whoever reaches them may reach registered memory.
        Empty when the engine listens only where configured, or opens no listener; a plugin
        fills it at construction (and logs a warning) when its engine cannot be bound."""
        return list(self._wide_listeners)

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"the {self.name} transport is closed ({self!r})")

    # -- memory -------------------------------------------------------------------------------

    def register(self, ranges: Sequence[MemoryRange]) -> None:
        self._check_open()
        kinds = self.limits.memory_kinds
        for rng in ranges:
            if rng.kind not in kinds:
                raise RegistrationError(
                    f"cannot register {rng}: the {self.name} transport moves only "
                    f"{sorted(k.value for k in kinds)} memory{self._memory_hint()}"
                )
            self._check_range(rng)
        with self._lock:
            self._check_open()
            new = self._ranges.add(ranges)
            done: list[MemoryRange] = []
            try:
                for device, group in by_device(new).items():
                    self._register_group(device, group)
                    done.extend(group)
            except BaseException:
                for device, group in by_device(done).items():
                    with suppress(TransportError):
                        self._deregister_group(device, group)
                self._ranges.remove(new)
                raise
            for device, group in by_device(new).items():
                self._devices.setdefault(device, RegisteredRanges()).add(group)

    def deregister(self, ranges: Sequence[MemoryRange]) -> None:
        failures: list[str] = []
        with self._lock:
            if self._closed:
                return
            gone = self._ranges.remove(ranges)
            for device, group in by_device(gone).items():
                self._devices[device].remove(group)
                if not len(self._devices[device]):
                    del self._devices[device]
                try:
                    self._deregister_group(device, group)
                except TransportError as err:  # keep going: the other groups still go
                    failures.append(str(err))
        if failures:
            raise RegistrationError("; ".join(failures))

    def device_of(self, addrs: AddrArray, lengths: AddrArray, what: str) -> DeviceKey:
        """The (kind, device) whose registrations hold every descriptor of one side of a batch."""
        return device_holding(self._devices, self._ranges, addrs, lengths, what)

    # -- peers --------------------------------------------------------------------------------

    def metadata(self) -> bytes:
        self._check_open()
        with self._lock:
            payload = self._engine_metadata()
        return _encode_envelope(TransportMetadata(self.name, self.metadata_version, payload))

    def connect(self, peer: str, metadata: bytes) -> None:
        self._check_open()
        try:
            envelope = _decode_envelope(metadata)
        except (msgspec.DecodeError, TypeError, ValueError) as err:
            raise PeerError(
                f"metadata for peer {peer!r} is not kvbridge transport metadata ({err}); pass "
                f"the bytes that peer's {self.name} transport metadata() returned"
            ) from None
        if envelope.transport != self.name:
            raise PeerError(
                f"peer {peer!r} sent {envelope.transport!r} transport metadata, this agent uses "
                f"{self.name!r}; configure the same transport on both sides"
            )
        if envelope.version != self.metadata_version:
            raise PeerError(
                f"peer {peer!r} sent {self.name} metadata version {envelope.version}, this agent "
                f"understands version {self.metadata_version}; run the same kvbridge on both sides"
            )
        with self._lock:
            self._check_open()
            old = self._peers.get(peer)
            state = self._connect_engine(peer, envelope.payload, old)
            if old is not None and state is old:
                return
            if peer in self._peers:
                self._forget(peer, f"peer {peer!r} reconnected")
            self._peers[peer] = state
            self._driver.connected(state)

    def decode_payload(self, peer: str, payload: bytes, kind: type[_Payload]) -> _Payload:
        """A peer's payload as the plugin's msgspec struct; ``PeerError`` when it is not one."""
        try:
            return msgspec.msgpack.decode(payload, type=kind)
        except (msgspec.DecodeError, TypeError, ValueError) as err:
            raise PeerError(
                f"metadata for peer {peer!r} is not {self.name} transport metadata ({err}); pass "
                f"the bytes that peer's {self.name} transport metadata() returned"
            ) from None

    def disconnect(self, peer: str) -> None:
        with self._lock:
            if not self._closed and peer in self._peers:
                self._forget(peer, f"peer {peer!r} was disconnected")

    def disconnect_idle(self, peer: str) -> bool:
        with self._lock:
            if self._closed or peer not in self._peers:
                return True
            if self._undrained(peer):
                return False
            self._forget(peer, f"peer {peer!r} was released while idle")
            return True

    def _undrained(self, peer: str) -> list[TransferHandle]:
        """The batches to ``peer`` not drained yet (lock held); forgets the drained ones."""
        live = [h for h in self._batches.get(peer, ()) if not h.drained]
        if live:
            self._batches[peer] = live
        else:
            self._batches.pop(peer, None)
        return live

    def _forget(self, peer: str, reason: str) -> None:
        """Drop a peer name (lock held): fail its batches, then forget it in the engine."""
        self._batches.pop(peer, None)
        state = self._peers.pop(peer)
        self._driver.forget(peer, state, self._peers.values(), reason)
        self._disconnect_engine(peer, state)

    # -- transfers ----------------------------------------------------------------------------

    def submit(
        self,
        op: TransferOp,
        peer: str,
        local: AddrArray,
        remote: AddrArray,
        lengths: AddrArray,
    ) -> TransferHandle:
        self._check_open()
        batch = prepare_batch(op, local, remote, lengths)
        with self._lock:
            self._check_open()
            state = self._peers.get(peer)
            if state is None:
                raise unknown_peer_error(peer, self._peers)
            self._ranges.require_covered(batch.local, batch.lengths, "local")
            self._check_remote(state, batch.remote, batch.lengths, peer)
            handle = TransferHandle(
                op,
                peer,
                batch.count,
                batch.nbytes,
                time.monotonic() + self.timeout,
                transport=self.name,
                where=self._describe_peer(state),
            )
            chunks = split_batch(
                handle, batch.local, batch.remote, batch.lengths, self.limits.max_batch
            )
            handle.chunks = len(chunks)
            if not chunks:  # nothing to move
                handle.finish_empty()
                return handle
            live = self._undrained(peer)
            live.append(handle)
            self._batches[peer] = live
            after = self._driver.start(state, handle, chunks)
        if after is not None:
            after()
        return handle

    def poll(self, handle: TransferHandle) -> TransferStatus:
        h = self._own(handle)
        if not h.finished:
            self._driver.poll(h)
        return h.status

    def release(self, handle: TransferHandle) -> None:
        h = self._own(handle)
        self._driver.release(h, f"{h.describe()} was released before it finished")

    def fence(self, handle: TransferHandle, timeout: float) -> Fence:
        h = self._own(handle)
        self.release(h)
        self._driver.wait_drained(h, timeout)
        return h.fence

    def fence_state(self, handle: TransferHandle) -> Fence:
        return self._own(handle).fence

    def wait(self, handle: TransferHandle, timeout: float | None = None) -> None:
        h = self._own(handle)
        limit = h.deadline if timeout is None else min(h.deadline, time.monotonic() + timeout)
        self._driver.wait_finished(h, limit)
        status = self.poll(h)
        if status.state is TransferState.DONE:
            return
        if status.state is TransferState.FAILED:
            error = TransferTimeoutError if h.timed_out else TransferError
            raise error(status.reason or "transfer failed")
        self.release(h)
        raise TransferTimeoutError(
            f"{h.describe()} did not finish within the {timeout} s wait; the batch was released"
        )

    def transfer(
        self,
        op: TransferOp,
        peer: str,
        local: AddrArray,
        remote: AddrArray,
        lengths: AddrArray,
    ) -> None:
        self.wait(self.submit(op, peer, local, remote, lengths))

    def _own(self, handle: TransferHandle) -> TransferHandle:
        if not isinstance(handle, TransferHandle) or handle.transport != self.name:
            raise TypeError(f"not a handle of the {self.name} transport: {handle!r}")
        return handle

    # -- life cycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """Fail pending batches, stop the engine's work, deregister every range. Safe twice.

        The order matters: transfers end before the memory they point into is deregistered,
        and the engine goes last. Waits at most ``timeout`` s for chunks a blocking engine
        holds, so registered buffers may be freed once it returns (unless a peer was frozen).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._driver.close()
        self._driver.join(self.timeout)
        with self._lock:
            for device, group in by_device(self._ranges.clear()).items():
                with suppress(TransportError):
                    self._deregister_group(device, group)
            self._devices.clear()
            peers, self._peers = self._peers, {}
            for peer, state in peers.items():
                with suppress(TransportError):
                    self._disconnect_engine(peer, state)
            self._close_engine()

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
