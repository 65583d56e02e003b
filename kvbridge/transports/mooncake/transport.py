"""Transport over the Mooncake Transfer Engine (``mooncake.engine.TransferEngine``).

Engine facts this module is built around (measured with mooncake-transfer-engine 0.3.13, TCP):

* Engine calls never raise: they return a negative number (``batch_transfer_async_*`` also 0) and
  the reason goes only to the engine's log on stderr.
* ``transfer_check_status(batch_id)`` looks at the *first task only* and frees the batch id once it
  reports a result, so it cannot tell when a multi-descriptor batch is done. The only whole-batch
  status call, ``get_batch_transfer_status``, blocks (it spins, GIL released) until the batch
  finishes or ``MC_TRANSFER_TIMEOUT`` (at least 5 s) passes.
* The first transfer to a peer performs a handshake under an engine-wide lock; a peer that is
  frozen at that moment blocks it for about 60 s, stalling every other peer. ``send_probe`` blocks
  as long but without that lock, so a peer is probed before its first transfer.
* One peer accepts about 2048 descriptors in flight (TCP lane queue plus pending admissions);
  more is refused ("TCP lane queue-full") and the lane keeps refusing until it drains.
* The TCP transport does not check that local addresses are registered, and it does not support
  overlapping registrations (error -7). A remote range outside the peer's registrations is refused
  by the peer.

Hence the design: every engine call that moves bytes runs on a per-peer *lane* thread. ``submit``
only validates, splits the batch into chunks of ``max_batch`` descriptors and queues them; the lane
keeps at most ``max_in_flight`` descriptors in the engine for its peer and waits for chunks in
order. ``poll`` reads Python state only, so it never blocks, and a batch past its deadline is
reported ``FAILED`` whatever the engine is doing.
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar

import msgspec

from kvbridge.core.environment import environment_overrides
from kvbridge.core.errors import (
    PeerError,
    RegistrationError,
    TransferError,
    TransferTimeoutError,
    TransportError,
    TransportUnavailableError,
)
from kvbridge.core.memory import RegisteredRanges
from kvbridge.core.transport import (
    DONE,
    PENDING,
    AddrArray,
    Fence,
    MemoryKind,
    MemoryRange,
    TransferHandle,
    TransferOp,
    TransferState,
    TransferStatus,
    Transport,
    TransportLimits,
    prepare_batch,
    unknown_peer_error,
)

#: ``metadata_server`` value that makes engines exchange metadata peer to peer (no server).
P2P_HANDSHAKE = "P2PHANDSHAKE"
#: Descriptors one peer accepts in flight with the engine's default TCP queue settings.
DEFAULT_MAX_IN_FLIGHT = 2048
#: Lower bound the engine applies to ``MC_TRANSFER_TIMEOUT``.
ENGINE_MIN_TIMEOUT_S = 5

_INSTALL_HINT = (
    "pip install 'kvbridge[mooncake]' (package mooncake-transfer-engine-non-cuda; "
    "on a CUDA machine install mooncake-transfer-engine instead)"
)
_LOG_HINT = "the Mooncake engine log (stderr) has the reason"
_METADATA_VERSION = 1
_ENGINE_ERRORS = {-7: "the range overlaps one already registered (Mooncake forbids overlaps)"}


class MooncakeMetadata(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="kvbridge.mooncake"
):
    """What a peer needs to reach this agent: the engine's session (segment) name."""

    version: int
    #: ``"host:rpc_port"`` with the peer-to-peer handshake, else the name given to the server.
    session: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
    protocol: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]


_encode_metadata = msgspec.msgpack.Encoder().encode
_decode_metadata = msgspec.msgpack.Decoder(MooncakeMetadata).decode


def _import_engine() -> Any:
    """The engine class, or ``TransportUnavailableError`` saying how to install it."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as err:
        msg = f"the Mooncake transfer engine cannot be imported ({err}); install it with "
        msg += _INSTALL_HINT
        if "libibverbs" in str(err):
            msg += "; its engine.so also needs libibverbs: apt-get install -y libibverbs1"
        raise TransportUnavailableError(msg) from err
    return TransferEngine


def _engine_supports_vram() -> bool:
    """False for the non-CUDA wheel, which can only move host memory."""
    from importlib import metadata

    try:
        metadata.distribution("mooncake-transfer-engine-non-cuda")
    except metadata.PackageNotFoundError:
        return True
    return False


@dataclass(eq=False)
class MooncakeHandle(TransferHandle):
    """A submitted batch: its chunks, how many finished, and the first failure."""

    session: str = ""
    chunks: int = 0
    error: str | None = None
    _done: int = field(default=0, repr=False)
    _finished: threading.Event = field(default_factory=threading.Event, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    #: chunks handed to the engine that it has not given back yet
    _in_engine: int = field(default=0, repr=False)
    #: set once the batch finished and the engine holds none of its chunks
    _drained: threading.Event = field(default_factory=threading.Event, repr=False)
    #: a chunk came back only because the engine's own timeout ran out (peer frozen)
    _unconfirmed: bool = field(default=False, repr=False)

    # Handles are compared and hashed by identity (usable as dict keys and in sets).
    __eq__ = object.__eq__
    __hash__ = object.__hash__

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    def describe(self) -> str:
        direction = "to" if self.op is TransferOp.WRITE else "from"
        return (
            f"{self.op.value} of {self.count} descriptors ({self.nbytes} bytes) {direction} "
            f"peer {self.peer!r} ({self.session})"
        )

    @property
    def fence(self) -> Fence:
        if not self._drained.is_set():
            return Fence.PENDING
        return Fence.UNCONFIRMED if self._unconfirmed else Fence.DRAINED

    def _enter_engine(self) -> bool:
        """Count a chunk as handed to the engine, unless the batch already finished."""
        with self._lock:
            if self._finished.is_set():
                return False
            self._in_engine += 1
            return True

    def _leave_engine(self, *, unconfirmed: bool = False) -> None:
        with self._lock:
            self._in_engine -= 1
            self._unconfirmed |= unconfirmed
            self._check_drained()

    def _check_drained(self) -> None:  # lock held
        if self._finished.is_set() and self._in_engine == 0:
            self._drained.set()

    def _chunk_done(self) -> None:
        with self._lock:
            self._done += 1
            if self._done >= self.chunks:
                self._finished.set()
                self._check_drained()

    def _fail(self, reason: str, *, timed_out: bool = False) -> None:
        with self._lock:
            if self._finished.is_set():
                return
            self.error = reason
            self.timed_out = timed_out
            self._finished.set()
            self._check_drained()

    def _expire(self, timeout: float) -> bool:
        """Fail the batch when its deadline has passed; True when it did."""
        if self.finished or time.monotonic() < self.deadline:
            return False
        self._fail(
            f"mooncake {self.describe()} did not finish within {timeout:g} s (peer frozen, "
            "overloaded or unreachable); the batch was abandoned",
            timed_out=True,
        )
        return True


@dataclass(eq=False)
class _Chunk:
    """At most ``max_batch`` descriptors of one handle, submitted to the engine in one call."""

    handle: MooncakeHandle
    index: int
    local: list[int]
    remote: list[int]
    lengths: list[int]
    attempts: int = 0
    #: when the engine took it (monotonic)
    started: float = 0.0


class _Lane:
    """One thread per peer session that makes every engine call moving bytes to that peer.

    It keeps at most ``max_in_flight`` descriptors in the engine, waits for chunks in the order
    they were submitted (``get_batch_transfer_status`` blocks), skips chunks of batches that
    already failed, timed out or were released, and resubmits a failed chunk ``retries`` times
    while its batch's deadline has not passed.
    """

    def __init__(
        self,
        engine: Any,
        session: str,
        max_in_flight: int,
        timeout: float,
        retries: int,
        engine_timeout: float,
    ) -> None:
        self.engine = engine  # the lane keeps the engine alive until its last wait returns
        self.session = session
        self.max_in_flight = max_in_flight
        self.timeout = timeout
        self.retries = retries
        self.engine_timeout = engine_timeout
        self._cond = threading.Condition()
        self._queue: deque[_Chunk] = deque()
        self._stopping = False
        self._probed = False
        self._thread = threading.Thread(
            target=self._run, name=f"kvbridge-mooncake[{session}]", daemon=True
        )
        self._thread.start()

    def put(self, chunks: list[_Chunk]) -> None:
        with self._cond:
            if self._stopping:
                raise PeerError(f"peer session {self.session} is being disconnected")
            self._queue.extend(chunks)
            self._cond.notify()

    def stop(self, reason: str) -> None:
        """Fail queued chunks, stop accepting work; chunks in the engine are still waited for."""
        with self._cond:
            self._stopping = True
            dropped, self._queue = self._queue, deque()
            self._cond.notify()
        for chunk in dropped:
            chunk.handle._fail(f"mooncake {chunk.handle.describe()} failed: {reason}")

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _probe(self) -> int:
        # Blocks (up to ~60 s) on a frozen peer but, unlike the handshake inside the first
        # transfer, holds no engine-wide lock: other peers keep moving meanwhile.
        rc = int(self.engine.send_probe(self.session))
        self._probed = rc == 0
        return rc

    def _run(self) -> None:
        inflight: deque[tuple[int, _Chunk]] = deque()
        count = 0  # descriptors handed to the engine and not yet waited for
        try:
            self._probe()  # warm-up at connect; failures are retried before the first chunk
            while True:
                start: list[_Chunk] = []
                with self._cond:
                    while not self._queue and not inflight and not self._stopping:
                        self._cond.wait()
                    if self._stopping and not inflight:
                        return
                    while self._queue:
                        size = len(self._queue[0].local)
                        if count and count + size > self.max_in_flight:
                            break
                        chunk = self._queue.popleft()
                        if chunk.handle.finished or chunk.handle._expire(self.timeout):
                            continue
                        start.append(chunk)
                        count += size
                for chunk in start:
                    # A chunk before it in this round may have failed its batch already.
                    batch_id = None if chunk.handle.finished else self._start(chunk)
                    if batch_id is None:
                        count -= len(chunk.local)
                    else:
                        inflight.append((batch_id, chunk))
                if inflight:
                    batch_id, chunk = inflight.popleft()
                    rc = self.engine.get_batch_transfer_status([batch_id])
                    count -= len(chunk.local)
                    if rc == 0:
                        chunk.handle._chunk_done()
                        chunk.handle._leave_engine()
                    else:
                        # Given up by the engine's own timeout: the peer (frozen) may still
                        # apply bytes it already received once it resumes.
                        waited = time.monotonic() - chunk.started
                        chunk.handle._leave_engine(unconfirmed=waited >= 0.9 * self.engine_timeout)
                        self._retry_or_fail(chunk, f"get_batch_transfer_status returned {rc}")
        except BaseException as err:  # never die silently: fail everything this lane holds
            with self._cond:
                self._stopping = True
                left = list(self._queue)
                self._queue.clear()
            for chunk in left:
                self._fail(chunk, f"the transfer lane stopped on {err!r}")
            for _, chunk in inflight:  # never waited for: nobody can say what the peer got
                self._fail(chunk, f"the transfer lane stopped on {err!r}")
                chunk.handle._leave_engine(unconfirmed=True)
            raise

    def _start(self, chunk: _Chunk) -> int | None:
        """Hand one chunk to the engine; its batch id, or None after failing the handle."""
        if not self._probed:
            rc = self._probe()
            if rc != 0:
                self._fail(chunk, f"the peer did not answer a probe (send_probe returned {rc})")
                return None
            if chunk.handle._expire(self.timeout):
                return None
        if chunk.handle.op is TransferOp.WRITE:
            submit, name = self.engine.batch_transfer_async_write, "batch_transfer_async_write"
        else:
            submit, name = self.engine.batch_transfer_async_read, "batch_transfer_async_read"
        # Checked and counted atomically with release(): a released batch never reaches the
        # engine, and its fence waits for every chunk that did.
        if not chunk.handle._enter_engine():
            return None
        chunk.started = time.monotonic()
        batch_id = int(submit(self.session, chunk.local, chunk.remote, chunk.lengths))
        if batch_id <= 0:  # -1: peer unreachable; 0: submission refused: nothing was sent
            chunk.handle._leave_engine()
            self._retry_or_fail(chunk, f"{name} returned {batch_id}")
            return None
        return batch_id

    def _retry_or_fail(self, chunk: _Chunk, what: str) -> None:
        # Moving the same bytes again is harmless, and after the peer refused a transfer the
        # engine fails the next one on that peer at once (no log line) while it reconnects.
        h = chunk.handle
        if chunk.attempts < self.retries and not h.finished and not h._expire(self.timeout):
            chunk.attempts += 1
            with self._cond:
                if not self._stopping:
                    self._queue.appendleft(chunk)
                    return
        self._fail(chunk, what)

    def _fail(self, chunk: _Chunk, what: str) -> None:
        h = chunk.handle
        h._fail(
            f"mooncake {h.describe()} failed: {what} on chunk {chunk.index + 1}/{h.chunks} "
            f"({len(chunk.local)} descriptors, {sum(chunk.lengths)} bytes, "
            f"{chunk.attempts + 1} attempt(s)); {_LOG_HINT}"
        )


def _stop_lanes(lanes: dict[str, _Lane]) -> None:
    for lane in list(lanes.values()):
        lane.stop("the transport was closed")
    lanes.clear()


class MooncakeTransport(Transport):
    """Moves bytes with the Mooncake Transfer Engine.

    Options (keyword only):
        protocol: engine protocol, ``"tcp"`` (default), ``"rdma"``, ... passed through.
        device_name: engine device filter, e.g. RDMA NIC names separated by commas.
        hostname: address this agent listens on and announces to peers.
        metadata_server: ``"P2PHANDSHAKE"`` (peers exchange metadata directly) or the address
            of a metadata server (``etcd://...``, ``http://...``).
        max_batch: most descriptors handed to the engine in one call; bigger batches are split.
        max_in_flight: most descriptors in the engine for one peer at once (the engine refuses
            more than about 2048 with its default queue settings); extra chunks wait their turn.
        retries: times a failed chunk is submitted again before its batch fails (only while
            the batch's deadline has not passed; reads and writes are idempotent).
        timeout: seconds a batch may take from ``submit``; also sets ``MC_TRANSFER_TIMEOUT``
            (at least 5 s) for the engine so its own waits end soon after.
    """

    name: ClassVar[str] = "mooncake"
    install_hint: ClassVar[str] = _INSTALL_HINT

    def __init__(
        self,
        *,
        protocol: str = "tcp",
        device_name: str = "",
        hostname: str = "127.0.0.1",
        metadata_server: str = P2P_HANDSHAKE,
        max_batch: int = 1024,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        retries: int = 1,
        timeout: float = 30.0,
    ) -> None:
        super().__init__(timeout=timeout)
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        if max_in_flight < max_batch:
            raise ValueError(
                f"max_in_flight ({max_in_flight}) must be at least max_batch ({max_batch})"
            )
        if retries < 0:
            raise ValueError(f"retries must not be negative, got {retries}")
        engine_cls = _import_engine()
        self.protocol = protocol
        self._retries = int(retries)
        self._max_batch = int(max_batch)
        self._max_in_flight = int(max_in_flight)
        engine_timeout = max(ENGINE_MIN_TIMEOUT_S, math.ceil(self.timeout))
        self._engine_timeout = float(engine_timeout)
        with environment_overrides({"MC_TRANSFER_TIMEOUT": str(engine_timeout)}):
            engine = engine_cls()
            rc = engine.initialize(hostname, metadata_server, protocol, device_name)
        if rc != 0:
            raise TransportError(
                f"the Mooncake engine did not start: initialize({hostname!r}, "
                f"{metadata_server!r}, {protocol!r}, {device_name!r}) returned {rc}; {_LOG_HINT}"
            )
        self._engine: Any = engine
        if metadata_server == P2P_HANDSHAKE:
            host = hostname.rsplit(":", 1)[0] if hostname.count(":") == 1 else hostname
            self._session = f"{host}:{int(engine.get_rpc_port())}"
        else:
            self._session = hostname
        kinds = {MemoryKind.DRAM}
        if _engine_supports_vram():
            kinds.add(MemoryKind.VRAM)
        self._limits = TransportLimits(max_batch=self._max_batch, memory_kinds=frozenset(kinds))
        self._ranges = RegisteredRanges()
        self._peers: dict[str, str] = {}  # peer name -> session
        self._lanes: dict[str, _Lane] = {}  # session -> lane
        self._lock = threading.Lock()
        self._closed = False
        # A transport dropped without close() must not leave its lane threads waiting forever.
        self._finalizer = weakref.finalize(self, _stop_lanes, self._lanes)

    @classmethod
    def check_available(cls) -> None:
        _import_engine()

    @property
    def limits(self) -> TransportLimits:
        return self._limits

    @property
    def session(self) -> str:
        """This agent's session name, as peers address it."""
        return self._session

    @property
    def registered(self) -> list[MemoryRange]:
        """Ranges registered now (empty after ``close``)."""
        return list(self._ranges)

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError("the mooncake transport is closed")

    # -- memory -------------------------------------------------------------------------------

    def register(self, ranges: Sequence[MemoryRange]) -> None:
        self._check_open()
        for rng in ranges:
            if rng.kind not in self._limits.memory_kinds:
                raise RegistrationError(
                    f"cannot register {rng}: this Mooncake build moves only "
                    f"{sorted(k.value for k in self._limits.memory_kinds)} memory; for GPU "
                    "memory install mooncake-transfer-engine (the CUDA build)"
                )
        with self._lock:
            new = self._ranges.add(ranges)
            done: list[MemoryRange] = []
            for location in dict.fromkeys(_location(r) for r in new):
                group = [r for r in new if _location(r) == location]
                rc = self._engine.batch_register_memory(
                    [r.addr for r in group], [r.size for r in group], location
                )
                if rc != 0:
                    if done:
                        self._engine.batch_unregister_memory([r.addr for r in done])
                    self._ranges.remove(new)
                    why = _ENGINE_ERRORS.get(rc, _LOG_HINT)
                    raise RegistrationError(
                        f"Mooncake could not register {len(group)} range(s) at {location!r}, "
                        f"first [{group[0].addr:#x}, +{group[0].size}): batch_register_memory "
                        f"returned {rc}; {why}"
                    )
                done.extend(group)

    def deregister(self, ranges: Sequence[MemoryRange]) -> None:
        if self._closed:
            return
        with self._lock:
            gone = self._ranges.remove(ranges)
            if not gone:
                return
            rc = self._engine.batch_unregister_memory([r.addr for r in gone])
        if rc != 0:
            raise RegistrationError(
                f"Mooncake could not deregister {len(gone)} range(s) (batch_unregister_memory "
                f"returned {rc}); {_LOG_HINT}"
            )

    # -- peers --------------------------------------------------------------------------------

    def metadata(self) -> bytes:
        self._check_open()
        return _encode_metadata(
            MooncakeMetadata(
                version=_METADATA_VERSION, session=self._session, protocol=self.protocol
            )
        )

    def connect(self, peer: str, metadata: bytes) -> None:
        self._check_open()
        try:
            meta = _decode_metadata(metadata)
        except (msgspec.DecodeError, TypeError) as err:
            raise PeerError(
                f"metadata for peer {peer!r} is not Mooncake transport metadata ({err}); pass "
                "the bytes that peer's mooncake transport metadata() returned"
            ) from None
        if meta.version != _METADATA_VERSION:
            raise PeerError(
                f"peer {peer!r} sent Mooncake metadata version {meta.version}, this agent "
                f"understands version {_METADATA_VERSION}; run the same kvbridge on both sides"
            )
        if meta.protocol != self.protocol:
            raise PeerError(
                f"peer {peer!r} uses Mooncake protocol {meta.protocol!r}, this agent "
                f"{self.protocol!r}; configure both with the same protocol"
            )
        with self._lock:
            old = self._peers.get(peer)
            self._peers[peer] = meta.session
            if old is not None and old != meta.session:
                self._drop_lane_if_unused(old, f"peer {peer!r} reconnected elsewhere")
            self._lane(meta.session)  # starts the lane, which probes the peer in the background

    def disconnect(self, peer: str) -> None:
        with self._lock:
            session = self._peers.pop(peer, None)
            if session is not None:
                self._drop_lane_if_unused(session, f"peer {peer!r} was disconnected")

    def _lane(self, session: str) -> _Lane:
        lane = self._lanes.get(session)
        if lane is None:
            lane = _Lane(
                self._engine, session, self._max_in_flight, self.timeout, self._retries,
                self._engine_timeout,
            )  # fmt: skip
            self._lanes[session] = lane
        return lane

    def _drop_lane_if_unused(self, session: str, reason: str) -> None:
        if session not in self._peers.values():
            lane = self._lanes.pop(session, None)
            if lane is not None:
                lane.stop(reason)

    # -- transfers ----------------------------------------------------------------------------

    def submit(
        self,
        op: TransferOp,
        peer: str,
        local: AddrArray,
        remote: AddrArray,
        lengths: AddrArray,
    ) -> MooncakeHandle:
        self._check_open()
        batch = prepare_batch(op, local, remote, lengths)
        local, remote, lengths = batch.local, batch.remote, batch.lengths
        count, nbytes = batch.count, batch.nbytes
        with self._lock:
            session = self._peers.get(peer)
            if session is None:
                raise unknown_peer_error(peer, self._peers)
            self._ranges.require_covered(local, lengths, "local")
            lane = self._lane(session)
        handle = MooncakeHandle(
            op, peer, count, nbytes, time.monotonic() + self.timeout, session=session
        )
        keep = lengths > 0
        if not keep.all():
            local, remote, lengths = local[keep], remote[keep], lengths[keep]
        step = self._max_batch
        chunks = [
            _Chunk(
                handle,
                i,
                local[s : s + step].tolist(),
                remote[s : s + step].tolist(),
                lengths[s : s + step].tolist(),
            )
            for i, s in enumerate(range(0, len(local), step))
        ]
        handle.chunks = len(chunks)
        if not chunks:
            handle._finished.set()  # nothing to move
            handle._drained.set()
        else:
            lane.put(chunks)
        return handle

    def poll(self, handle: TransferHandle) -> TransferStatus:
        h = self._own(handle)
        h._expire(self.timeout)
        if not h.finished:
            return PENDING
        if h.error is not None:
            return TransferStatus(TransferState.FAILED, h.error)
        return DONE

    def wait(self, handle: TransferHandle, timeout: float | None = None) -> None:
        """Block until the batch finishes; ``TransferTimeoutError`` past its deadline."""
        h = self._own(handle)
        limit = h.deadline if timeout is None else min(h.deadline, time.monotonic() + timeout)
        while not h.finished and (left := limit - time.monotonic()) > 0:
            h._finished.wait(left)
        status = self.poll(h)
        if status.state is TransferState.DONE:
            return
        if status.state is TransferState.FAILED:
            error = TransferTimeoutError if h.timed_out else TransferError
            raise error(status.reason or "transfer failed")
        self.release(h)
        raise TransferTimeoutError(
            f"mooncake {h.describe()} did not finish within the {timeout} s wait; "
            "the batch was released"
        )

    def release(self, handle: TransferHandle) -> None:
        """Abandon a batch: its queued chunks are dropped; chunks in the engine run out."""
        h = self._own(handle)
        h._fail(f"mooncake {h.describe()} was released before it finished")

    def fence(self, handle: TransferHandle, timeout: float) -> Fence:
        """Release the batch, then wait until the engine gave back every chunk it took.

        Mooncake has no cancel: a chunk in the engine comes back when the peer confirmed it, the
        peer failed, or ``MC_TRANSFER_TIMEOUT`` (this transport's ``timeout``) ran out; in the
        last case the answer is ``UNCONFIRMED``.
        """
        h = self._own(handle)
        self.release(h)
        h._drained.wait(max(0.0, timeout))
        return h.fence

    def fence_state(self, handle: TransferHandle) -> Fence:
        return self._own(handle).fence

    def _own(self, handle: TransferHandle) -> MooncakeHandle:
        if not isinstance(handle, MooncakeHandle):
            raise TypeError(f"not a handle of the mooncake transport: {handle!r}")
        return handle

    # -- life cycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """Fail pending batches, stop every lane, deregister every range. Safe to call twice.

        Waits at most ``timeout`` seconds for chunks already in the engine to finish or fail,
        so registered buffers may be freed once it returns (unless a peer was frozen longer).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            lanes = list(self._lanes.values())
            _stop_lanes(self._lanes)
            self._peers.clear()
        deadline = time.monotonic() + self.timeout
        for lane in lanes:
            lane.join(max(0.0, deadline - time.monotonic()))
        ranges = self._ranges.clear()
        if ranges:
            self._engine.batch_unregister_memory([r.addr for r in ranges])
        self._finalizer.detach()
        self._engine = None  # lanes still waiting keep their own reference

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._peers)} peers"
        return f"<MooncakeTransport {self.protocol} {self._session} {state}>"


def _location(rng: MemoryRange) -> str:
    """Mooncake location string of a range: any NUMA node for host memory, the GPU for VRAM."""
    return f"cuda:{rng.device_id}" if rng.kind is MemoryKind.VRAM else "*"
