"""Which of a process's memory its same-host peers may copy into or out of, revocable at once.

Transports that copy with the kernel between processes of one host (``process_vm_writev``,
``/proc/<pid>/mem``) do not ask the target process: a peer holding stale metadata could write
into memory the target already deregistered, or after it closed. So the target publishes its
registered ranges in a small file on tmpfs (``/dev/shm``) and every copy runs under a shared
``flock`` of that file, after checking its descriptors against the ranges published *now*. The
target rewrites the table (register, deregister) and marks it closed (close) under an exclusive
lock, which waits for copies in progress: once ``publish`` or ``close`` returns, no byte moves
into or out of a range that is no longer published.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from kvbridge.core.batches import AddrArray
from kvbridge.core.errors import RegistrationError, TransferError
from kvbridge.core.memory import MemoryRange, RegisteredRanges

#: Where the tables live: tmpfs, so no disk is touched and a reboot clears them.
TABLE_DIR = Path("/dev/shm")
_CLOSED = np.empty(0, dtype=np.uint64)  # an empty table marks a closed owner
_POLL_S = 0.001


def _lock(fd: int, how: int, timeout: float, what: str) -> None:
    """``flock`` with a bound: engines must never wait without one."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{what} did not get its lock within {timeout:g} s") from None
            time.sleep(_POLL_S)


def _remove_orphans(prefix: str) -> None:
    """Remove tables of processes that died without closing (killed): tmpfs keeps them."""
    for path in TABLE_DIR.glob(f"{prefix}-*-*"):
        pid = path.name[len(prefix) + 1 :].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            with contextlib.suppress(OSError):
                path.unlink()


class PublishedRanges:
    """The owner's side: publishes its registered ranges; ``close`` revokes every one."""

    def __init__(self, prefix: str, timeout: float) -> None:
        self.timeout = timeout
        _remove_orphans(prefix)
        self.path = TABLE_DIR / f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.publish([])

    def publish(self, ranges: Iterable[MemoryRange]) -> None:
        """Replace the table; returns once no copy under the old table is still running."""
        if self._fd is None:
            return
        table = np.array([1, *[v for r in ranges for v in (r.addr, r.size)]], dtype=np.uint64)
        self._rewrite(table)

    def close(self) -> None:
        """Revoke everything (peers' copies fail from now on) and remove the file. Safe twice."""
        if self._fd is None:
            return
        with contextlib.suppress(TimeoutError):  # a peer frozen mid-copy: still revoke below
            self._rewrite(_CLOSED)
        with contextlib.suppress(OSError):
            self.path.unlink()
        os.close(self._fd)
        self._fd = None

    def _rewrite(self, table: np.ndarray) -> None:
        assert self._fd is not None
        try:
            _lock(self._fd, fcntl.LOCK_EX, self.timeout, "changing the published ranges")
        except TimeoutError as err:
            raise RegistrationError(
                f"{err}: a peer process holds a copy in progress (frozen?); the ranges stay "
                "published, so do not free them yet"
            ) from None
        try:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, table.tobytes(), 0)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)


class PeerRanges:
    """A peer's side: copies run inside ``access``, which checks the owner's table first."""

    def __init__(self, path: str, timeout: float) -> None:
        self.path = path
        self.timeout = timeout
        self._table = b""
        self._ranges = RegisteredRanges()

    def check(self, remote: AddrArray, lengths: AddrArray, what: str) -> None:
        """Refuse descriptors outside what the owner publishes now: the early answer ``submit``
        gives; ``access`` checks again, holding the lock for the copy."""
        fd = self._open(what)
        try:
            # Shared, briefly: an owner rewriting the table truncates it first (read as closed).
            _lock(fd, fcntl.LOCK_SH, self.timeout, "a check")
            self._current(fd, what).require_covered(remote, lengths, what)
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def access(self, remote: AddrArray, lengths: AddrArray, what: str) -> Iterator[None]:
        """Hold the owner's table shared while the caller copies; raise when it may not."""
        fd = self._open(what)
        try:
            _lock(fd, fcntl.LOCK_SH, self.timeout, "a copy")
            self._current(fd, what).require_covered(remote, lengths, what)
            yield
        finally:
            os.close(fd)  # drops the lock

    def _open(self, what: str) -> int:
        try:
            return os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise TransferError(f"{what}: the peer closed its transport (or exited)") from None

    def _current(self, fd: int, what: str) -> RegisteredRanges:
        raw = os.pread(fd, os.fstat(fd).st_size, 0)  # the table's size: no oversized buffer
        if not raw:
            raise TransferError(f"{what}: the peer closed its transport")
        if raw != self._table:  # parse only when the owner changed its registrations
            pairs = np.frombuffer(raw, dtype=np.uint64)[1:].reshape(-1, 2)
            ranges = RegisteredRanges()
            ranges.add([MemoryRange(int(a), int(n)) for a, n in pairs])
            self._ranges, self._table = ranges, raw
        return self._ranges
