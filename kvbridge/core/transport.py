"""The kit: ``Transport`` keeps the transport contract's guarantees once for every plugin.

Read ``kvbridge.core.contract`` first: what callers use, and what a plugin supplies. A plugin
subclasses ``Transport`` and implements engine hooks only (``kvbridge.core.engine_hooks``). This
module owns registration bookkeeping with rollback, peers, the metadata envelope and its version,
the checks every ``submit`` makes, handles and the closed check, and the life cycle; what differs
between blocking and polled engines is a driver (``kvbridge.core.drivers``) picked once, at
construction, from ``blocking_engine``. Descriptor helpers live in ``kvbridge.core.descriptors``.
A plugin imports what it needs from ``kvbridge.plugin``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from contextlib import suppress
from typing import Any, ClassVar, TypeVar

import msgspec

from kvbridge.core.batches import (
    AddrArray,
    Fence,
    TransferHandle,
    TransferOp,
    TransferState,
    TransferStatus,
    split_batch,
)
from kvbridge.core.contract import TransportContract, TransportLimits
from kvbridge.core.descriptors import (
    device_holding,
    prepare_batch,
    unknown_peer_error,
)
from kvbridge.core.drivers import BlockingDriver, EngineDriver, PolledDriver
from kvbridge.core.engine_hooks import EngineHooks, check_engine_hooks
from kvbridge.core.errors import (
    PeerError,
    RegistrationError,
    TransferError,
    TransferTimeoutError,
    TransportError,
    TransportUnavailableError,
)
from kvbridge.core.memory import DeviceKey, MemoryRange, RegisteredRanges, by_device

__all__ = ["Transport", "TransportMetadata"]

_Payload = TypeVar("_Payload")


class TransportMetadata(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What ``metadata()`` returns: the transport's name, metadata version and engine's part."""

    transport: str
    version: int
    payload: bytes


_encode_envelope = msgspec.msgpack.Encoder().encode
_decode_envelope = msgspec.msgpack.Decoder(TransportMetadata).decode


class Transport(TransportContract, EngineHooks):
    """A transport: the contract's methods (documented in ``TransportContract``), implemented
    once over a plugin's engine hooks (declared, with their duties, in ``EngineHooks``).

    Construction takes keyword options only (from ``load_transport(name, **options)``); a plugin's
    ``__init__`` calls ``super().__init__(timeout=..., retries=...)``, starts its engine, then
    ``self.open(limits)``. ``timeout`` (seconds) bounds every batch from ``submit``.
    """

    #: version of the plugin's metadata payload; peers with another version are refused
    metadata_version: ClassVar[int] = 1
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
        check_engine_hooks(type(self))  # a class without a name was not checked when defined
        self._closed = True  # until the plugin's engine runs (``open``)
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
        self._driver: EngineDriver = (
            BlockingDriver(self, self._lock)
            if self.blocking_engine
            else PolledDriver(self, self._lock)
        )

    def open(self, limits: TransportLimits) -> None:
        """Called by the plugin once its engine runs, with what the engine takes: the transport
        accepts calls from now on."""
        self._limits = limits
        self._closed = False
        self._driver.opened()

    # -- availability and limits --------------------------------------------------------------

    @classmethod
    def check_available(cls) -> None:
        cls.load_engine()

    @classmethod
    def load_engine(cls) -> Any:
        """The engine library (``engine_import``); ``TransportUnavailableError`` when missing.
        A plugin's ``__init__`` calls it before starting its engine."""
        try:
            return cls.engine_import()
        except ImportError as err:
            raise TransportUnavailableError(cls.engine_unavailable_message(err)) from err

    @property
    def closed(self) -> bool:
        """True until the plugin's engine runs (``open``), and after ``close``."""
        return self._closed

    @property
    def peer_count(self) -> int:
        """How many peer names are connected now."""
        return len(self._peers)

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

    @wide_listeners.setter
    def wide_listeners(self, listeners: list[str]) -> None:
        self._wide_listeners = list(listeners)

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
                    f"{sorted(k.value for k in kinds)} memory{self.engine_memory_hint()}"
                )
            self.engine_check_range(rng)
        with self._lock:
            self._check_open()
            new = self._ranges.add(ranges)
            done: list[MemoryRange] = []
            try:
                for device, group in by_device(new).items():
                    self.engine_register(device, group)
                    done.extend(group)
            except BaseException:
                for device, group in by_device(done).items():
                    with suppress(TransportError):
                        self.engine_deregister(device, group)
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
                    self.engine_deregister(device, group)
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
            payload = self.engine_metadata()
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
            state = self.engine_connect(peer, envelope.payload, old)
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
        self.engine_disconnect(peer, state)

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
            self.engine_check_remote(state, batch.remote, batch.lengths, peer)
            handle = TransferHandle(
                op,
                peer,
                batch.count,
                batch.nbytes,
                time.monotonic() + self.timeout,
                transport=self.name,
                where=self.engine_describe_peer(state),
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
                    self.engine_deregister(device, group)
            self._devices.clear()
            peers, self._peers = self._peers, {}
            for peer, state in peers.items():
                with suppress(TransportError):
                    self.engine_disconnect(peer, state)
            self.engine_close()

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
