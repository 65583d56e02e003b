"""The transport contract, and the kit that keeps its guarantees once for every plugin.

A transport knows bytes and peers, nothing else: it never sees cache groups, layers or block ids.
Plugins are found through the entry-point group ``kvbridge.transports`` (see ``registry``).

A plugin subclasses ``Transport`` and implements engine hooks only: register and deregister a
group of ranges, its metadata payload, load a peer's payload, start a chunk of descriptors, and
either wait for a chunk (engines whose completion call blocks: ``blocking_engine = True``, one lane
thread per peer runs the calls) or check and release it (engines that can be asked without
blocking). The base owns handles and their deadlines, ``poll``/``wait``/``release``/``fence``,
splitting by ``limits.max_batch``, the in-flight window, retries within the deadline,
registration bookkeeping with rollback, the metadata envelope and its version, and the closed
check.
"""

from __future__ import annotations

import abc
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterable, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import msgspec
import numpy as np

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
from kvbridge.core.errors import (
    PeerError,
    RegistrationError,
    TransferError,
    TransferTimeoutError,
    TransportError,
    TransportUnavailableError,
)
from kvbridge.core.lanes import Lane
from kvbridge.core.memory import MemoryKind, MemoryRange, RegisteredRanges, by_device

__all__ = [
    "CHUNK_OK",
    "DONE",
    "PENDING",
    "AddrArray",
    "Chunk",
    "ChunkResult",
    "Fence",
    "MemoryKind",
    "MemoryRange",
    "TransferHandle",
    "TransferOp",
    "TransferState",
    "TransferStatus",
    "Transport",
    "TransportLimits",
    "TransportMetadata",
]

_Payload = TypeVar("_Payload")
DeviceKey = tuple[MemoryKind, int]


@dataclass(frozen=True)
class TransportLimits:
    """What a transport declares about itself.

    ``max_batch`` is the most descriptors the engine takes in one call (``None``: no limit) and
    ``max_in_flight`` the most it holds for one peer at once (blocking engines only); the base
    splits and paces batches by them, callers never need to.
    """

    max_batch: int | None = None
    max_in_flight: int | None = None
    memory_kinds: frozenset[MemoryKind] = field(
        default_factory=lambda: frozenset({MemoryKind.DRAM})
    )


class TransportMetadata(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What ``metadata()`` returns: the transport's name, metadata version and engine's part."""

    transport: str
    version: int
    payload: bytes


_encode_envelope = msgspec.msgpack.Encoder().encode
_decode_envelope = msgspec.msgpack.Decoder(TransportMetadata).decode


class Transport(abc.ABC):
    """A transport: the contract's methods, implemented once over a plugin's engine hooks.

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
    #: peer); False when chunks are checked without blocking (``_check_chunk``) from ``poll``
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
        self._lanes: dict[Hashable, Lane] = {}  # lane key -> lane (blocking engines)
        self._live: set[TransferHandle] = set()  # handles with chunks in a polled engine
        self._stuck: list[Chunk] = []  # chunks whose engine handle refused release; retried
        self._finalizer: weakref.finalize[Any, Any] | None = None

    def _open(self, limits: TransportLimits) -> None:
        """Called by the plugin once its engine runs: the transport accepts calls from now on."""
        self._limits = limits
        self._closed = False
        if self.blocking_engine:
            # A transport dropped without close() must not leave lane threads waiting forever.
            self._finalizer = weakref.finalize(self, _stop_lanes, self._lanes)

    # -- engine hooks (plugins implement these) -----------------------------------------------

    @classmethod
    def _import_engine(cls) -> Any:
        """Import and return the engine library; raise ``ImportError`` when it is missing."""
        return None

    @classmethod
    def _unavailable_message(cls, err: ImportError) -> str:
        return (
            f"the {cls.name} engine cannot be imported ({err}); install it with {cls.install_hint}"
        )

    @abc.abstractmethod
    def _register_group(self, device: DeviceKey, ranges: list[MemoryRange]) -> None:
        """Register ranges of one kind and device with the engine; raise ``RegistrationError``."""

    @abc.abstractmethod
    def _deregister_group(self, device: DeviceKey, ranges: list[MemoryRange]) -> None:
        """Deregister ranges of one kind and device; raise ``RegistrationError``."""

    def _check_range(self, rng: MemoryRange) -> None:
        """Refuse a range before anything is registered (``RegistrationError``); default: any."""

    def _memory_hint(self) -> str:
        """Appended to the error for a memory kind the engine cannot move."""
        return ""

    @abc.abstractmethod
    def _engine_metadata(self) -> bytes:
        """The engine's part of ``metadata()`` (lock held)."""

    @abc.abstractmethod
    def _connect_engine(self, peer: str, payload: bytes, old: Any) -> Any:
        """Load a peer's payload (lock held); return its peer state, or ``old`` when unchanged.

        Raise ``PeerError`` for unusable metadata. ``old`` is the peer's state before, if any;
        the base forgets it (``_forget``) after this returns a new state.
        """

    def _disconnect_engine(self, peer: str, state: Any) -> None:
        """Forget a peer in the engine (lock held); its batches were failed already."""

    def _describe_peer(self, state: Any) -> str:
        """How messages name a peer's engine side (a session, an agent name)."""
        return ""

    def _check_remote(self, state: Any, remote: AddrArray, lengths: AddrArray, peer: str) -> None:
        """Refuse remote descriptors outside the peer's memory before any byte moves (lock
        held); engines that do not check this themselves must (``RegistrationError``)."""

    def _lane_key(self, state: Any) -> Hashable:
        """Peers whose key is equal share one lane (blocking engines)."""
        return id(state)

    def _reach_peer(self, state: Any) -> str | None:
        """Blocking engines: make the peer reachable before its first chunk, on its lane thread.

        Return ``None`` when reached, else why not (the chunk that needed it fails).
        """
        return None

    @abc.abstractmethod
    def _start_chunk(self, state: Any, chunk: Chunk) -> Any:
        """Hand a chunk to the engine; return the engine's handle of it, or ``None`` when it
        finished inside the call. Raise ``ChunkRefused`` when nothing was sent (blocking
        engines retry it), or another ``TransportError`` (non-blocking engines: from submit)."""

    def _wait_chunk(self, chunk: Chunk) -> ChunkResult:
        """Blocking engines: wait until the engine gives the chunk back (lane thread)."""
        raise NotImplementedError(
            f"{type(self).__name__} sets blocking_engine but has no _wait_chunk"
        )

    def _check_chunk(self, chunk: Chunk) -> ChunkResult | None:
        """Non-blocking engines: the chunk's result, or ``None`` while it moves (lock held)."""
        raise NotImplementedError(f"{type(self).__name__} must implement _check_chunk")

    def _release_chunk(self, chunk: Chunk) -> bool:
        """Non-blocking engines: free the engine's handle of a chunk, cancelling it if it still
        moves (lock held). False when the engine refused: the base retries on ``close``."""
        return True

    def _close_engine(self) -> None:
        """Stop the engine (lock held); peers and registrations are gone already."""

    # -- availability and limits --------------------------------------------------------------

    @classmethod
    def check_available(cls) -> None:
        """Raise ``TransportUnavailableError`` when the engine library cannot be loaded."""
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
        """Ranges registered now (empty after ``close``)."""
        return list(self._ranges)

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"the {self.name} transport is closed ({self!r})")

    # -- memory -------------------------------------------------------------------------------

    def register(self, ranges: Sequence[MemoryRange]) -> None:
        """Register memory; registering a range already registered is a no-op.

        All or nothing: when the engine refuses a group, the groups registered before are
        deregistered again.
        """
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
        """Release ranges registered before; unknown ranges are ignored."""
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
        """What a peer needs to reach this agent (passed to the peer's ``connect``)."""
        self._check_open()
        with self._lock:
            payload = self._engine_metadata()
        return _encode_envelope(TransportMetadata(self.name, self.metadata_version, payload))

    def connect(self, peer: str, metadata: bytes) -> None:
        """Make ``peer`` reachable under the given name; reconnecting replaces the old entry."""
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
            if self.blocking_engine:
                self._lane(state)  # starts reaching the peer in the background

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
        """Forget ``peer``; unknown peers are ignored."""
        with self._lock:
            if not self._closed and peer in self._peers:
                self._forget(peer, f"peer {peer!r} was disconnected")

    def _forget(self, peer: str, reason: str) -> None:
        """Drop a peer name (lock held): fail its batches, stop its lane when no name uses it."""
        state = self._peers.pop(peer)
        if self.blocking_engine:
            key = self._lane_key(state)
            if all(self._lane_key(s) != key for s in self._peers.values()):
                lane = self._lanes.pop(key, None)
                if lane is not None:
                    lane.stop(reason)
        else:
            for handle in [h for h in self._live if h.peer == peer]:
                handle.fail(f"{handle.describe()} failed: {reason}")
                # Released with the peer: a proof only where a cancel is one.
                self._abandon(handle, unproven=not self.cancel_is_fence)
        self._disconnect_engine(peer, state)

    def _lane(self, state: Any) -> Lane:  # lock held
        key = self._lane_key(state)
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = Lane(self, state, self._describe_peer(state))
        return lane

    # -- transfers ----------------------------------------------------------------------------

    def submit(
        self,
        op: TransferOp,
        peer: str,
        local: AddrArray,
        remote: AddrArray,
        lengths: AddrArray,
    ) -> TransferHandle:
        """Start moving ``lengths[i]`` bytes between ``local[i]`` and ``remote[i]``.

        Never blocks for long: completion is observed with ``poll`` or ``wait``.
        """
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
                op, peer, batch.count, batch.nbytes, time.monotonic() + self.timeout,
                transport=self.name, where=self._describe_peer(state),
            )  # fmt: skip
            chunks = split_batch(
                handle, batch.local, batch.remote, batch.lengths, self.limits.max_batch
            )
            handle.chunks = len(chunks)
            if not chunks:  # nothing to move
                handle._finished.set()
                handle._drained.set()
                return handle
            if not self.blocking_engine:
                self._start_polled(state, handle, chunks)
                return handle
            lane = self._lane(state)
        lane.put(chunks)
        return handle

    def _start_polled(self, state: Any, handle: TransferHandle, chunks: list[Chunk]) -> None:
        """Hand every chunk to a non-blocking engine (lock held); errors reach the caller."""
        for chunk in chunks:
            if not handle.enter_engine():
                break
            try:
                chunk.token = self._start_chunk(state, chunk)
            except BaseException as err:
                handle.leave_engine()
                handle.fail(f"{handle.describe()} could not start: {err}")
                if handle._active:  # chunks started before it move on, watched by fence
                    self._live.add(handle)
                    self._settle(handle)
                raise
            if chunk.token is None:  # finished inside the call
                handle.leave_engine()
                handle.chunk_done()
            else:
                handle._active.append(chunk)
        if handle._active:
            self._live.add(handle)

    def poll(self, handle: TransferHandle) -> TransferStatus:
        """State of a batch; a batch past its deadline is released and reported ``FAILED``."""
        h = self._own(handle)
        if not h.finished:
            if self.blocking_engine:
                h.expire(self.timeout)
            else:
                self._poll_engine(h)
        return h.status

    def _poll_engine(self, h: TransferHandle) -> None:
        """Check a polled engine's chunks of a batch (also after the batch finished: chunks the
        engine still moves are watched until it ends them; see ``cancel_is_fence``)."""
        with self._lock:
            if not h._active:
                if not h.finished and self._closed:  # close() finished every handle of ours
                    h.fail(f"{h.describe()}: the transport is closed")
                return
            for chunk in list(h._active):
                result = self._check_chunk(chunk)
                if result is None:
                    continue
                h._active.remove(chunk)
                self._give_back(chunk, unproven=result.unproven)
                if result.ok:
                    h.chunk_done()
                else:
                    h.fail(f"{h.describe()} failed: {result.reason}")
            if not h.finished and time.monotonic() >= h.deadline:
                h.fail(
                    f"{h.describe()} did not finish within {self.timeout:g} s (peer frozen, "
                    "overloaded or unreachable); the batch was given up",
                    timed_out=True,
                )
            if h.finished:
                self._settle(h)

    def _settle(self, h: TransferHandle) -> None:
        """A finished batch's chunks still in a polled engine (lock held): cancel them where a
        cancel is a fence; otherwise they stay watched until the engine ends them."""
        if self.cancel_is_fence:
            self._abandon(h)
        elif not h._active:
            self._live.discard(h)

    def _give_back(self, chunk: Chunk, *, unproven: bool) -> None:
        """Free the engine's handle of a chunk (lock held); a refusal keeps it in the engine."""
        if self._release_chunk(chunk):
            chunk.token = None
            chunk.handle.leave_engine(unproven=unproven)
        else:
            self._stuck.append(chunk)

    def _abandon(self, h: TransferHandle, *, unproven: bool = False) -> None:
        """Release every chunk a batch has in a polled engine (lock held): for a peer forgotten
        in the engine, and on close, where the engine itself goes below."""
        active, h._active = h._active, []
        for chunk in active:
            self._give_back(chunk, unproven=unproven)
        self._live.discard(h)

    def release(self, handle: TransferHandle) -> None:
        """Abandon a batch: it ends ``FAILED`` unless it finished; no further part of it starts.

        Parts the engine already holds may still move afterwards: ``fence`` tells when they no
        longer can.
        """
        h = self._own(handle)
        reason = f"{h.describe()} was released before it finished"
        if self.blocking_engine:
            h.fail(reason)
            return
        with self._lock:
            h.fail(reason)
            self._settle(h)

    def fence(self, handle: TransferHandle, timeout: float) -> Fence:
        """Release the batch if unfinished, then wait up to ``timeout`` s for its ``Fence``.

        After a failed, timed-out or abandoned transfer the memory it touched may be reused only
        once this returns ``DRAINED``: every part of the batch came back from the engine at its
        real end (see ``Fence``). ``PENDING``: the engine still holds a part (a frozen peer keeps
        it there), ask again. ``UNPROVEN``: nothing proves the bytes stopped; keep the memory out
        of use for good.
        """
        h = self._own(handle)
        self.release(h)
        if self.blocking_engine:
            h._drained.wait(max(0.0, timeout))
            return h.fence

        def drained() -> bool:  # a polled engine moves (and ends) what it holds only when asked
            self._poll_engine(h)
            return h._drained.is_set()

        _poll_until(drained, time.monotonic() + max(0.0, timeout), 1e-4, 0.02)
        return h.fence

    def fence_state(self, handle: TransferHandle) -> Fence:
        """``Fence`` of a batch now, without waiting (``PENDING`` while it is unfinished)."""
        return self._own(handle).fence

    def wait(self, handle: TransferHandle, timeout: float | None = None) -> None:
        """Block until the batch finishes; raise ``TransferError`` on failure or timeout.

        The wait is bounded by the handle's deadline and by ``timeout`` when given.
        """
        h = self._own(handle)
        limit = h.deadline if timeout is None else min(h.deadline, time.monotonic() + timeout)
        if self.blocking_engine:
            while not h.finished and (left := limit - time.monotonic()) > 0:
                h._finished.wait(left)
        else:
            # Polled engines progress while asked: a short cap keeps the wait's overshoot small
            # (each check is a few microseconds).
            _poll_until(lambda: self.poll(h).finished, limit, 1e-5, 2e-4)
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
        """Submit and wait: the synchronous convenience over ``submit``/``wait``."""
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
            lanes = list(self._lanes.values())
            _stop_lanes(self._lanes)
            for h in list(self._live):
                h.fail(f"{h.describe()}: the transport was closed")
                self._abandon(h)
            stuck, self._stuck = self._stuck, []
            for chunk in stuck:  # the engine goes below: nothing of these can move after it
                with suppress(TransportError):
                    self._release_chunk(chunk)
                chunk.handle.leave_engine()
        deadline = time.monotonic() + self.timeout
        for lane in lanes:
            lane.join(max(0.0, deadline - time.monotonic()))
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
        if self._finalizer is not None:
            self._finalizer.detach()

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _poll_until(done: Callable[[], bool], limit: float, first: float, cap: float) -> None:
    """Call ``done`` until it returns True or the monotonic ``limit`` passes, sleeping between
    calls from ``first`` s, doubling up to ``cap`` s."""
    delay = first
    while not done() and (left := limit - time.monotonic()) > 0:
        time.sleep(min(delay, left))
        delay = min(delay * 2, cap)


def _stop_lanes(lanes: dict[Hashable, Lane]) -> None:
    for lane in list(lanes.values()):
        lane.stop("the transport was closed")
    lanes.clear()


def device_holding(
    devices: dict[DeviceKey, RegisteredRanges],
    everything: RegisteredRanges,
    addrs: AddrArray,
    lengths: AddrArray,
    what: str,
) -> DeviceKey:
    """The (kind, device) whose registrations hold every descriptor; engines that take one memory
    kind and device per side of a batch (NIXL) need it."""
    for device, ranges in devices.items():
        if ranges.find_uncovered(addrs, lengths) < 0:
            return device
    everything.require_covered(addrs, lengths, what)  # raises when a descriptor is unregistered
    raise RegistrationError(
        f"the {what} descriptors span memory of several kinds or devices "
        f"({', '.join(f'{k.value}:{d}' for k, d in devices)}); submit them as separate batches"
    )


def as_addr_array(values: Any) -> AddrArray:
    """Coerce a sequence or array to a contiguous 1-D ``uint64`` array."""
    arr = np.ascontiguousarray(values, dtype=np.uint64)
    if arr.ndim != 1:
        raise ValueError(f"descriptor arrays must be 1-D, got shape {arr.shape}")
    return arr


def check_descriptors(local: AddrArray, remote: AddrArray, lengths: AddrArray) -> tuple[int, int]:
    """Validate descriptor arrays; return ``(count, total bytes)``."""
    if not (local.shape == remote.shape == lengths.shape):
        raise ValueError(
            f"descriptor arrays differ in length: local {local.shape}, remote {remote.shape}, "
            f"lengths {lengths.shape}"
        )
    return int(local.shape[0]), int(lengths.sum(dtype=np.uint64))


@dataclass(frozen=True)
class Batch:
    """A ``submit`` call's descriptors, validated: three 1-D ``uint64`` arrays of one length."""

    op: TransferOp
    local: AddrArray
    remote: AddrArray
    lengths: AddrArray
    count: int
    nbytes: int


def prepare_batch(op: TransferOp, local: Any, remote: Any, lengths: Any) -> Batch:
    """Check and coerce what a transport's ``submit`` received, the same way for every engine."""
    if not isinstance(op, TransferOp):
        raise TypeError(f"op must be a TransferOp, got {op!r}")
    local, remote, lengths = as_addr_array(local), as_addr_array(remote), as_addr_array(lengths)
    count, nbytes = check_descriptors(local, remote, lengths)
    return Batch(op, local, remote, lengths, count, nbytes)


def unknown_peer_error(peer: str, connected: Iterable[str]) -> PeerError:
    """The error for a transfer to a peer that was never connected (or was disconnected)."""
    known = ", ".join(repr(p) for p in sorted(connected)) or "none"
    return PeerError(
        f"unknown peer {peer!r} (connected: {known}); call connect(peer, metadata) with the "
        "peer's metadata first"
    )
