"""A submitted batch and its chunks: the state every transport keeps the same way.

A batch (``TransferHandle``) is split into chunks of at most ``limits.max_batch`` descriptors,
each handed to the engine in one call. The handle counts finished chunks and chunks the engine
holds, so ``poll`` reads Python state only and ``fence`` knows when no byte of the batch can move
any more. Handles are compared and hashed by identity.
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

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
    """Whether bytes of a finished (or released) batch can still land; see ``Transport.fence``.

    A fence is a proof, never a timer: ``DRAINED`` rests on what the engine guarantees (every part
    came back from the engine at its real end, or the engine's own copy returned), not on how long
    anyone waited or on the peer answering.
    """

    #: Proven: every part of the batch came back from the engine at its real end (completed, or
    #: failed in a way after which the engine writes nothing more); no byte of it can move.
    DRAINED = "drained"
    #: The engine still holds part of the batch (a frozen peer holds it as long as it is frozen):
    #: keep the memory out of use and ask again.
    PENDING = "pending"
    #: The engine gave a part up and nothing it guarantees shows that part's bytes stopped (a
    #: batch the engine failed while other parts of it may still move): the memory must stay out
    #: of use for good; callers hold it (visible, counted), never hand it back on a timer.
    UNPROVEN = "unproven"


@dataclass(eq=False)
class TransferHandle:
    """A submitted batch: its chunks, how many finished, what the engine holds, the failure."""

    op: TransferOp
    peer: str
    count: int
    nbytes: int
    deadline: float
    #: the transport's name and its name of the peer, shown in messages
    transport: str = ""
    where: str = ""
    chunks: int = 0
    error: str | None = None
    #: set when the batch failed because its deadline passed
    timed_out: bool = False
    _done: int = field(default=0, repr=False)
    _finished: threading.Event = field(default_factory=threading.Event, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    #: chunks handed to the engine that it has not given back yet
    _in_engine: int = field(default=0, repr=False)
    #: set once the batch finished and the engine holds none of its chunks
    _drained: threading.Event = field(default_factory=threading.Event, repr=False)
    #: a chunk came back without proof that its bytes stopped moving
    _unproven: bool = field(default=False, repr=False)
    #: chunks in a polled engine (transports whose engine does not block), for poll and cancel
    _active: list[Chunk] = field(default_factory=list, repr=False)

    __eq__ = object.__eq__
    __hash__ = object.__hash__

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    @property
    def status(self) -> TransferStatus:
        if not self.finished:
            return PENDING
        return DONE if self.error is None else TransferStatus(TransferState.FAILED, self.error)

    @property
    def fence(self) -> Fence:
        if not self._drained.is_set():
            return Fence.PENDING
        return Fence.UNPROVEN if self._unproven else Fence.DRAINED

    def describe(self) -> str:
        """``nixl write of 3 descriptors (12 bytes) to peer 'p' (agent x)``."""
        direction = "to" if self.op is TransferOp.WRITE else "from"
        where = f" ({self.where})" if self.where else ""
        return (
            f"{self.transport} {self.op.value} of {self.count} descriptors ({self.nbytes} bytes) "
            f"{direction} peer {self.peer!r}{where}"
        )

    def enter_engine(self) -> bool:
        """Count a chunk as handed to the engine, unless the batch already finished.

        Checked and counted atomically with ``fail``: a released batch never reaches the engine,
        and its fence waits for every chunk that did.
        """
        with self._lock:
            if self._finished.is_set():
                return False
            self._in_engine += 1
            return True

    def leave_engine(self, *, unproven: bool = False) -> None:
        """The engine gave a chunk back; ``unproven`` when nothing shows its bytes stopped."""
        with self._lock:
            self._in_engine -= 1
            self._unproven |= unproven
            self._check_drained()

    def chunk_done(self) -> None:
        with self._lock:
            self._done += 1
            if self._done >= self.chunks:
                self._finished.set()
                self._check_drained()

    def fail(self, reason: str, *, timed_out: bool = False) -> bool:
        """Finish the batch as failed (first failure wins); True when this call failed it."""
        with self._lock:
            if self._finished.is_set():
                return False
            self.error = reason
            self.timed_out = timed_out
            self._finished.set()
            self._check_drained()
            return True

    def expire(self, timeout: float) -> bool:
        """Fail the batch when its deadline has passed; True when it did now."""
        if self.finished or time.monotonic() < self.deadline:
            return False
        return self.fail(
            f"{self.describe()} did not finish within {timeout:g} s (peer frozen, overloaded or "
            "unreachable); the batch was abandoned",
            timed_out=True,
        )

    # -- what the kit's engine drivers ask of a handle (``kvbridge.core.drivers``) -------------
    # The active chunks are guarded by the transport's lock (polled engines), not the handle's.

    @property
    def drained(self) -> bool:
        """The batch finished and the engine holds none of its chunks (see ``fence``)."""
        return self._drained.is_set()

    def finish_empty(self) -> None:
        """Finish a batch with nothing to move: done and drained at once."""
        self._finished.set()
        self._drained.set()

    def wait_finished(self, timeout: float) -> bool:
        """Block up to ``timeout`` s until the batch finishes; True when it has."""
        return self._finished.wait(timeout)

    def wait_drained(self, timeout: float) -> bool:
        """Block up to ``timeout`` s until the batch is drained; True when it is."""
        return self._drained.wait(timeout)

    @property
    def active(self) -> list[Chunk]:
        """A copy of the chunks a polled engine still holds (to untrack while iterating)."""
        return list(self._active)

    @property
    def has_active(self) -> bool:
        return bool(self._active)

    def track(self, chunk: Chunk) -> None:
        """A polled engine took ``chunk`` and has not ended it yet."""
        self._active.append(chunk)

    def untrack(self, chunk: Chunk) -> None:
        """A polled engine ended ``chunk``."""
        self._active.remove(chunk)

    def take_active(self) -> list[Chunk]:
        """Stop tracking every chunk a polled engine holds; return them (to release them)."""
        active, self._active = self._active, []
        return active

    def _check_drained(self) -> None:  # lock held
        if self._finished.is_set() and self._in_engine == 0:
            self._drained.set()


@dataclass(eq=False)
class Chunk:
    """At most ``max_batch`` descriptors of one batch, handed to the engine in one call."""

    handle: TransferHandle
    index: int
    local: AddrArray
    remote: AddrArray
    lengths: AddrArray
    attempts: int = 0
    #: when the engine took it (monotonic)
    started: float = 0.0
    #: the engine's handle of it while the engine holds it
    token: Any = None

    @property
    def op(self) -> TransferOp:
        return self.handle.op

    def describe(self) -> str:
        return (
            f"chunk {self.index + 1}/{self.handle.chunks} ({len(self.lengths)} descriptors, "
            f"{int(self.lengths.sum(dtype=np.uint64))} bytes, {self.attempts + 1} attempt(s))"
        )


@dataclass(frozen=True)
class ChunkResult:
    """How a chunk came back from the engine."""

    ok: bool
    reason: str = ""
    #: the engine gave it up and nothing shows its bytes stopped (part of it may still move)
    unproven: bool = False
    #: the failure may go away on a second attempt (and moving the same bytes again is harmless)
    retry: bool = True


CHUNK_OK = ChunkResult(True)


def split_batch(
    handle: TransferHandle,
    local: AddrArray,
    remote: AddrArray,
    lengths: AddrArray,
    max_batch: int | None,
) -> list[Chunk]:
    """The chunks of a batch: zero-length descriptors dropped, at most ``max_batch`` each."""
    keep = lengths > 0
    if not keep.all():
        local, remote, lengths = local[keep], remote[keep], lengths[keep]
    step = max_batch or max(1, len(lengths))
    return [
        Chunk(handle, i, local[s : s + step], remote[s : s + step], lengths[s : s + step])
        for i, s in enumerate(range(0, len(lengths), step))
    ]
