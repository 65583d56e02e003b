"""Transport between processes of one host over Linux cross-memory attach (``process_vm_*v``).

Kernel facts this module is built around (``process_vm_readv(2)``, Linux 3.2 and later):

* ``process_vm_writev(pid, local_iov, n, remote_iov, m, 0)`` copies straight into another
  process's address space inside the syscall. The peer need not run (a SIGSTOPped peer does not
  stall it), and once the call returns no byte of it can move any more.
* Access is a ptrace check (``PTRACE_MODE_ATTACH_REALCREDS``): the same user, and with Yama's
  ``kernel.yama.ptrace_scope`` at 1 only an ancestor or a process the target allowed with
  ``PR_SET_PTRACER``; otherwise ``CAP_SYS_PTRACE``. Refused: ``EPERM``.
* The kernel checks nothing else: any mapped address of the peer can be written, also after the
  peer deregistered it or closed. So the peer publishes the ranges it registered *now*
  (``kvbridge.transports.host_access``) and every chunk is copied under a shared lock of that
  table after checking its descriptors against it; the peer's ``deregister`` and ``close`` take
  the lock exclusively, so once they return no byte moves into what they took back.
* At most ``IOV_MAX`` (1024) iovecs per side; a call may copy less than asked (it stops at an
  unmapped page, or after about 2 GiB) and returns the bytes copied, so the rest is sent again
  from there. Nothing mapped at the first byte: ``EFAULT``; the peer is gone: ``ESRCH``. Each
  remote iovec costs about 1 µs (its pages are pinned one iovec at a time): merged plans matter.
* ``struct iovec`` is two machine words, so an ``(n, 2)`` ``uint64`` array is a ``struct
  iovec[n]``; ctypes releases the GIL around the call.
* A pid names a process only inside its PID namespace and only while it lives; the boot id
  (``/proc/sys/kernel/random/boot_id``) names the running kernel, so it tells hosts apart.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import select
import sys
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import msgspec
import numpy as np

from kvbridge.plugin import (
    CHUNK_OK,
    AddrArray,
    Chunk,
    ChunkResult,
    MemoryAccess,
    MemoryKind,
    MemoryRange,
    PeerError,
    PeerRanges,
    PublishedRanges,
    TransferError,
    TransferOp,
    Transport,
    TransportError,
    TransportLimits,
)

IOV_MAX = 1024
#: Chunks of at least this many bytes are copied in two halves at once (``_copy_chunk``).
SPLIT_BYTES = 4 << 20
_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value
_OTHER_TRANSPORTS = "use mooncake or nixl"


class CmaMetadata(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Which process this agent is, and the memory peers may move, when ``metadata()`` ran."""

    host: str  # for messages only
    boot_id: str
    pid_namespace: int  # inode of /proc/self/ns/pid; 0 when unknown
    pid: int
    start_time: int  # /proc/<pid>/stat field 22: a reused pid has another one
    table: str  # where it publishes the ranges peers may move now (see the module docstring)


@dataclass(frozen=True)
class _Libc:
    readv: Any
    writev: Any
    prctl: Any


@functools.cache
def _load_libc() -> _Libc:
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        readv, writev, prctl = libc.process_vm_readv, libc.process_vm_writev, libc.prctl
    except AttributeError as err:
        raise ImportError(f"the C library lacks process_vm_readv/writev ({err})") from None
    for call in (readv, writev):
        # (pid, local_iov, liovcnt, remote_iov, riovcnt, flags)
        ptr, count = ctypes.c_void_p, ctypes.c_ulong
        call.argtypes = [ctypes.c_int, ptr, count, ptr, count, ctypes.c_ulong]
        call.restype = ctypes.c_ssize_t
    return _Libc(readv, writev, prctl)


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def _start_time(pid: int) -> int | None:
    stat = _read(f"/proc/{pid}/stat")  # the command name in (...) may hold spaces
    return int(stat.rsplit(")", 1)[1].split()[19]) if stat else None


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _gone(pid: int, start_time: int) -> str | None:
    """Why ``pid`` is no longer the process that announced ``start_time``, or None."""
    started = _start_time(pid)
    if started is None:
        return f"peer process {pid} has exited"
    if started != start_time:
        return f"pid {pid} now belongs to another process (the peer exited, its pid was reused)"
    return None


def _allow_any_ptracer(libc: _Libc) -> None:
    if libc.prctl(_PR_SET_PTRACER, ctypes.c_ulong(_PR_SET_PTRACER_ANY), 0, 0, 0) != 0:
        why = os.strerror(ctypes.get_errno())
        raise TransportError(f"prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY) failed: {why}")


def _iovecs(addrs: AddrArray, lengths: AddrArray) -> np.ndarray:
    iov = np.empty((len(addrs), 2), dtype=np.uint64)
    iov[:, 0], iov[:, 1] = addrs, lengths
    return iov


def _copy(
    call: Any, pid: int, local: AddrArray, remote: AddrArray, lengths: AddrArray
) -> tuple[int, int]:
    """Copy every descriptor, calling again after a short count; (errno or 0, descriptor)."""
    liov, riov = _iovecs(local, lengths), _iovecs(remote, lengths)
    ends = np.cumsum(lengths, dtype=np.uint64)
    total, done, first = int(ends[-1]), 0, 0
    while done < total:
        n = len(lengths) - first
        got = call(pid, liov[first:].ctypes.data, n, riov[first:].ctypes.data, n, 0)
        if got <= 0:
            return (ctypes.get_errno() if got < 0 else errno.EIO), first
        done += got
        first = int(np.searchsorted(ends, done, side="right"))
        if done < total:  # resume inside descriptor ``first``
            skip = np.uint64(done - (int(ends[first - 1]) if first else 0))
            liov[first] = (local[first] + skip, lengths[first] - skip)
            riov[first] = (remote[first] + skip, lengths[first] - skip)
    return 0, first


class _ExitWatch:
    """Whether a process exited, from a pidfd (readable once it did): one ``poll`` per chunk
    instead of reading ``/proc/<pid>/stat`` (which cost a sixth of a small read's CPU). Opened
    before the start time is checked, so it names the process checked; closed when dropped."""

    def __init__(self, pid: int) -> None:
        self._fd = os.pidfd_open(pid)
        self._poll = select.poll()
        self._poll.register(self._fd, select.POLLIN)
        self._close = weakref.finalize(self, os.close, self._fd)

    @classmethod
    def open(cls, pid: int) -> _ExitWatch | None:
        """A watch on ``pid``, or None (no pidfd on this kernel, or no such process)."""
        try:
            return cls(pid)
        except (AttributeError, OSError):
            return None

    def exited(self) -> bool:
        return bool(self._poll.poll(0))


@dataclass(eq=False)
class _Peer:
    meta: CmaMetadata
    ranges: PeerRanges
    #: the peer process's exit, watched (None: read its start time from /proc instead)
    watch: _ExitWatch | None = None

    def gone(self) -> str | None:
        """Why the peer process is not there any more, or None."""
        if self.watch is None:
            return _gone(self.meta.pid, self.meta.start_time)
        return f"peer process {self.meta.pid} has exited" if self.watch.exited() else None


class CmaTransport(Transport):
    """Moves host memory between processes of one host with ``process_vm_readv``/``writev``.

    No engine and no connection: a chunk is one syscall (or a few) on the peer's lane thread, so
    when it comes back it is over, also with a stopped peer. Peers on another host or in another
    PID namespace are refused at ``connect``; what a peer may touch follows its registrations
    as they are now, not as they were when its metadata was taken.

    Options (keyword only):
        timeout: seconds a batch may take from ``submit``.
        retries: times a chunk that failed for want of kernel memory (``ENOMEM``) starts again.
        allow_peers: where ``kernel.yama.ptrace_scope`` is 1, let every process of this user
            (not only this process's ancestors) read and write this process's memory, which
            peers need to move bytes here: ``prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)`` at
            start. The trade-off: for the rest of the process's life (Linux cannot restore the
            previous setting, so ``close`` leaves it) any program of this user, not only kvbridge
            peers, may attach to it as Yama scope 0 allows. Set False where only this process's
            ancestors (or holders of ``CAP_SYS_PTRACE``) move its memory.
    """

    name: ClassVar[str] = "cma"
    install_hint: ClassVar[str] = "nothing (it needs Linux)"
    blocking_engine: ClassVar[bool] = True
    # process_vm_readv/writev copy the peer's host pages by virtual address inside the kernel;
    # nothing is pinned beyond the call, registered or exported, and it moves DRAM only.
    memory_access: ClassVar[MemoryAccess] = MemoryAccess.BY_ADDRESS

    def __init__(
        self, *, timeout: float = 30.0, retries: int = 0, allow_peers: bool = True
    ) -> None:
        super().__init__(timeout=timeout, retries=retries)
        self._libc: _Libc = self.load_engine()
        self.allow_peers = bool(allow_peers)
        if self.allow_peers and _read("/proc/sys/kernel/yama/ptrace_scope") == "1":
            _allow_any_ptracer(self._libc)
        self._host = os.uname().nodename
        self._boot_id = _read("/proc/sys/kernel/random/boot_id") or f"host {self._host}"
        self._pid_namespace = _pid_namespace()
        self._helper: ThreadPoolExecutor | None = None  # copies a large chunk's first half
        self._helper_lock = threading.Lock()  # lanes of two peers may start it at once
        self._published = PublishedRanges("kvbridge-cma", self.timeout)
        # Revoked on close, or when the transport is dropped: peers then refuse to move bytes.
        self._revoke = weakref.finalize(self, self._published.close)
        self.open(TransportLimits(IOV_MAX, IOV_MAX, frozenset({MemoryKind.DRAM})))

    @classmethod
    def engine_import(cls) -> _Libc:
        if not sys.platform.startswith("linux"):
            raise ImportError(f"cross-memory attach is Linux only, this is {sys.platform}")
        return _load_libc()

    @classmethod
    def engine_unavailable_message(cls, err: ImportError) -> str:
        return f"the cma transport cannot run here: {err}; {_OTHER_TRANSPORTS}"

    # -- memory: the kernel needs no registration; peers read what is published now ---------

    def engine_memory_hint(self) -> str:
        return f" (host memory only; for GPU memory {_OTHER_TRANSPORTS})"

    def engine_register(self, device: tuple[MemoryKind, int], ranges: list[MemoryRange]) -> None:
        self._published.publish(self.registered)

    def engine_deregister(self, device: tuple[MemoryKind, int], ranges: list[MemoryRange]) -> None:
        self._published.publish(self.registered)  # returns once no peer copies into them

    # -- peers ------------------------------------------------------------------------------

    def engine_metadata(self) -> bytes:
        pid = os.getpid()
        return msgspec.msgpack.encode(
            CmaMetadata(
                self._host,
                self._boot_id,
                self._pid_namespace,
                pid,
                _start_time(pid) or 0,
                str(self._published.path),
            )
        )

    def engine_connect(self, peer: str, payload: bytes, old: Any) -> _Peer:
        meta = self.decode_payload(peer, payload, CmaMetadata)
        if old is not None and old.meta == meta:
            return old  # type: ignore[no-any-return]
        if meta.boot_id != self._boot_id:
            raise PeerError(
                f"cma moves memory between processes of one host; peer {peer!r} is on another "
                f"host ({meta.host}): {_OTHER_TRANSPORTS}"
            )
        if meta.pid_namespace != self._pid_namespace and meta.pid_namespace and self._pid_namespace:
            raise PeerError(
                f"peer {peer!r} is in another PID namespace (container) of this host, where its "
                f"pid {meta.pid} means nothing: share one PID namespace or {_OTHER_TRANSPORTS}"
            )
        watch = _ExitWatch.open(meta.pid)  # before the check: it names the process checked
        gone = _gone(meta.pid, meta.start_time)
        if gone:
            raise PeerError(f"peer {peer!r}: {gone}; connect with its running process's metadata")
        ranges = PeerRanges(meta.table, self.timeout)
        try:
            none = np.empty(0, dtype=np.uint64)
            ranges.check(none, none, f"peer {peer!r}")  # is its transport still open?
        except TransferError as err:
            raise PeerError(f"{err}; connect with its running transport's metadata") from None
        return _Peer(meta, ranges, watch)

    def engine_describe_peer(self, state: Any) -> str:
        return f"pid {state.meta.pid}"

    # -- transfers --------------------------------------------------------------------------

    def engine_check_remote(
        self, state: Any, remote: AddrArray, lengths: AddrArray, peer: str
    ) -> None:
        state.ranges.check(remote, lengths, f"remote (peer {peer!r})")

    def engine_start_chunk(self, state: Any, chunk: Chunk) -> _Peer:
        return state  # type: ignore[no-any-return]  # the copy runs in engine_wait_chunk, on the lane

    def engine_wait_chunk(self, chunk: Chunk) -> ChunkResult:
        peer: _Peer = chunk.token
        if chunk.handle.finished:  # released or failed while queued: none of it moves
            return ChunkResult(False, "the batch ended before this chunk moved", retry=False)
        gone = peer.gone()
        if gone:
            return ChunkResult(False, f"{gone}; reconnect it with its new metadata", retry=False)
        try:
            with peer.ranges.access(chunk.remote, chunk.lengths, f"peer {chunk.handle.peer!r}"):
                write = chunk.op is TransferOp.WRITE
                call = self._libc.writev if write else self._libc.readv
                code, index = self._copy_chunk(call, peer.meta.pid, chunk)
        except TransportError as err:  # outside what the peer publishes, or it closed
            return ChunkResult(False, f"{err}; nothing was moved", retry=False)
        if not code:
            return CHUNK_OK
        what = f"process_vm_{'writev' if write else 'readv'} at descriptor {index}"
        return ChunkResult(False, _explain(code, what, peer.meta), retry=code == errno.ENOMEM)

    def _copy_chunk(self, call: Any, pid: int, chunk: Chunk) -> tuple[int, int]:
        """Copy a chunk's descriptors; a large one in two halves at once (one on the helper
        thread): the kernel's copy of one thread reached 0.55 of memcpy in the transfer
        benchmark, two together reach it. (errno or 0, the first failed descriptor)."""
        lengths = chunk.lengths
        if len(lengths) < 2 or int(lengths.sum()) < SPLIT_BYTES:
            return _copy(call, pid, chunk.local, chunk.remote, lengths)
        half = len(lengths) // 2
        with self._helper_lock:
            if self._helper is None:
                self._helper = ThreadPoolExecutor(1, thread_name_prefix="kvbridge-cma-copy")
            helper = self._helper
        first = helper.submit(_copy, call, pid, chunk.local[:half], chunk.remote[:half],
                              lengths[:half])  # fmt: skip
        second = _copy(call, pid, chunk.local[half:], chunk.remote[half:], lengths[half:])
        code, index = first.result()  # the chunk ends only once both halves did
        if code:
            return code, index
        return (second[0], half + second[1]) if second[0] else (0, 0)

    def engine_close(self) -> None:
        self._revoke()
        if self._helper is not None:
            self._helper.shutdown(wait=False)

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.peer_count} peers"
        return f"<CmaTransport pid {os.getpid()} {state}>"


def _explain(err: int, what: str, meta: CmaMetadata) -> str:
    """One line on a failed syscall: what happened and what to do."""
    name = errno.errorcode.get(err, str(err))
    if err == errno.ESRCH:
        return f"peer process {meta.pid} has exited ({name}); reconnect it with its new metadata"
    if err in (errno.EPERM, errno.EACCES):
        return (
            f"{what}: the kernel refused access to pid {meta.pid} ({name}): cma needs ptrace "
            "permission over the peer: run both as one user with kernel.yama.ptrace_scope <= 1 "
            "(at 1 the peer's transport keeps allow_peers=True), or grant CAP_SYS_PTRACE "
            "(containers: also allow process_vm_readv/writev in seccomp); or "
            f"{_OTHER_TRANSPORTS}"
        )
    if err == errno.EFAULT:
        return (
            f"{what}: memory is not mapped ({name}): the peer (or this process) freed a buffer "
            "it had registered"
        )
    return f"{what} failed: {os.strerror(err)} ({name})"
