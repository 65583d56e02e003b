"""The transport contract: what a plugin must provide to move KV bytes between two agents.

A transport knows bytes and peers, nothing else: it never sees cache groups, layers or block ids.
Plugins are found through the entry-point group ``kvbridge.transports`` (see ``registry``).
"""

from __future__ import annotations

import abc
import enum
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from kvbridge.core.errors import PeerError, TransferError, TransferTimeoutError

AddrArray = npt.NDArray[np.uint64]


class TransferOp(enum.Enum):
    """Direction of a transfer, seen from the agent that submits it."""

    READ = "read"  # remote -> local
    WRITE = "write"  # local -> remote


class TransferState(enum.Enum):
    """Life cycle of one submitted batch."""

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class TransferStatus:
    """Outcome of ``Transport.poll``; ``reason`` is set when the state is ``FAILED``."""

    state: TransferState
    reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.state is not TransferState.PENDING


PENDING = TransferStatus(TransferState.PENDING)
DONE = TransferStatus(TransferState.DONE)


class Fence(enum.Enum):
    """Whether bytes of a finished (or released) batch can still land; see ``Transport.fence``."""

    #: Nothing of the batch is in the engine: no byte of it can move any more.
    DRAINED = "drained"
    #: The engine still holds part of the batch (it will come back, at the latest after the
    #: engine's own timeout): keep the memory out of use and ask again.
    PENDING = "pending"
    #: The engine gave a part up without knowing whether the peer got it (the engine's own
    #: timeout on a frozen peer, or a cancelled transfer): bytes the peer already holds may
    #: still be applied when it resumes. Confirm with the peer before reusing the memory.
    UNCONFIRMED = "unconfirmed"


class MemoryKind(enum.Enum):
    """Where a registered range lives."""

    DRAM = "dram"
    VRAM = "vram"


@dataclass(frozen=True, order=True)
class MemoryRange:
    """A contiguous range of memory to register: ``[addr, addr + size)``."""

    addr: int
    size: int
    kind: MemoryKind = MemoryKind.DRAM
    device_id: int = 0

    @property
    def end(self) -> int:
        return self.addr + self.size


@dataclass(frozen=True)
class TransportLimits:
    """What a transport declares about itself.

    ``max_batch`` is the most descriptors the engine accepts in one call (``None``: no limit);
    the transport splits larger batches itself, callers never need to.
    """

    max_batch: int | None = None
    memory_kinds: frozenset[MemoryKind] = field(
        default_factory=lambda: frozenset({MemoryKind.DRAM})
    )


@dataclass
class TransferHandle:
    """A submitted batch. Transports subclass it to keep their engine's state."""

    op: TransferOp
    peer: str
    count: int
    nbytes: int
    deadline: float
    extra: dict[str, Any] = field(default_factory=dict)
    #: set by the transport when the batch failed because its deadline passed
    timed_out: bool = False


class Transport(abc.ABC):
    """Abstract transport. Subclasses implement the abstract methods and set ``name``.

    Construction takes keyword options only (from ``load_transport(name, **options)``).
    ``timeout`` (seconds) bounds every transfer; an engine call that could block forever must be
    bounded by it.
    """

    name: ClassVar[str] = "abstract"
    #: pip requirement that brings the engine, shown when the engine library is missing.
    install_hint: ClassVar[str] = ""

    def __init__(self, *, timeout: float = 30.0) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self.timeout = float(timeout)

    @classmethod
    def check_available(cls) -> None:
        """Raise ``TransportUnavailableError`` when the engine library cannot be loaded."""

    @property
    @abc.abstractmethod
    def limits(self) -> TransportLimits: ...

    @abc.abstractmethod
    def register(self, ranges: Sequence[MemoryRange]) -> None:
        """Register memory; registering a range already registered is a no-op."""

    @abc.abstractmethod
    def deregister(self, ranges: Sequence[MemoryRange]) -> None:
        """Release ranges registered before; unknown ranges are ignored."""

    @abc.abstractmethod
    def metadata(self) -> bytes:
        """What a peer needs to reach this agent (passed to the peer's ``connect``)."""

    @abc.abstractmethod
    def connect(self, peer: str, metadata: bytes) -> None:
        """Make ``peer`` reachable under the given name; reconnecting replaces the old entry."""

    @abc.abstractmethod
    def disconnect(self, peer: str) -> None:
        """Forget ``peer``; unknown peers are ignored."""

    @abc.abstractmethod
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

    @abc.abstractmethod
    def poll(self, handle: TransferHandle) -> TransferStatus:
        """State of a batch; a batch past its deadline is released and reported ``FAILED``."""

    def release(self, handle: TransferHandle) -> None:
        """Abandon a batch: it ends ``FAILED`` unless it finished; no further part of it starts.

        Parts the engine already holds may still move afterwards: ``fence`` tells when they no
        longer can.
        """

    def fence(self, handle: TransferHandle, timeout: float) -> Fence:
        """Release the batch if unfinished, then wait up to ``timeout`` s for its ``Fence``.

        After a failed, timed-out or abandoned transfer the memory it touched may be reused
        only once this returns ``DRAINED`` (or the peer confirmed, for ``UNCONFIRMED``).
        The default suits engines whose release cancels at once: a finished batch is drained.
        """
        self.release(handle)
        deadline = time.monotonic() + timeout
        delay = 1e-4
        while (state := self.fence_state(handle)) is Fence.PENDING:
            if time.monotonic() >= deadline:
                break
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        return state

    def fence_state(self, handle: TransferHandle) -> Fence:
        """``Fence`` of a batch now, without waiting (``PENDING`` while it is unfinished)."""
        return Fence.DRAINED if self.poll(handle).finished else Fence.PENDING

    @abc.abstractmethod
    def close(self) -> None:
        """Disconnect every peer and deregister every range. Safe to call twice."""

    def wait(self, handle: TransferHandle, timeout: float | None = None) -> None:
        """Poll until the batch finishes; raise ``TransferError`` on failure or timeout.

        The wait is bounded by the handle's deadline and by ``timeout`` when given.
        """
        limit = (
            handle.deadline if timeout is None else min(handle.deadline, time.monotonic() + timeout)
        )
        delay = 1e-5
        while True:
            status = self.poll(handle)
            if status.state is TransferState.DONE:
                return
            if status.state is TransferState.FAILED:
                error = TransferTimeoutError if handle.timed_out else TransferError
                raise error(status.reason or "transfer failed")
            if time.monotonic() >= limit:
                self.release(handle)
                raise TransferTimeoutError(
                    f"{handle.op.value} of {handle.count} descriptors ({handle.nbytes} bytes) "
                    f"to peer {handle.peer!r} did not finish in time; the batch was released"
                )
            time.sleep(delay)
            delay = min(delay * 2, 2e-3)

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

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
