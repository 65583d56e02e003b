"""procmem: a kvbridge transport that copies between processes of one host via /proc/<pid>/mem.

An example of a third-party transport: this module and a ``kvbridge.transports`` entry point in
``pyproject.toml``. kvbridge's ``Transport`` base keeps the contract (handles and deadlines,
poll/wait/release/fence, chunking, one lane thread per peer, retries, registration bookkeeping,
the metadata envelope and its version); a plugin is its engine's calls. Here the "engine" is the
kernel: ``pread``/``pwrite`` on the peer's ``/proc/<pid>/mem`` copy straight into its memory, which
needs the same user and ptrace permission (Yama ``ptrace_scope`` 0, or CAP_SYS_PTRACE). Simple,
not fast: one system call per descriptor.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

import msgspec

from kvbridge.plugin import (
    CHUNK_OK,
    Chunk,
    ChunkResult,
    MemoryAccess,
    MemoryRange,
    PeerError,
    PeerRanges,
    PublishedRanges,
    TransferOp,
    Transport,
    TransportError,
    TransportLimits,
)


class ProcMemMetadata(msgspec.Struct, frozen=True):
    """What a peer needs: which process, proof it is the same one, and where it may copy."""

    pid: int
    started: int  # start time of the process: tells a reused pid apart
    boot_id: str  # the host's boot id: a peer on another host is refused
    table: str  # the file publishing the ranges peers may copy into and out of now


def _started(pid: int) -> int:
    """Start time of a process (field 22 of /proc/<pid>/stat), in clock ticks since boot."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[19])


def _boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


class _Peer:
    """A connected peer process and the memory it publishes."""

    def __init__(self, meta: ProcMemMetadata, timeout: float) -> None:
        self.meta = meta
        self.ranges = PeerRanges(meta.table, timeout)


class ProcMemTransport(Transport):
    """Copies through ``/proc/<pid>/mem``. Options: ``timeout`` (s), ``retries``."""

    name = "procmem"
    install_hint = "pip install kvbridge-procmem (Linux only)"
    blocking_engine = True  # the copies block: the base runs them on a lane thread per peer
    # pread/pwrite on /proc/<pid>/mem reach the peer's pages by virtual address in the kernel:
    # nothing is registered, pinned beyond the call or exported (and it moves host memory only)
    memory_access = MemoryAccess.BY_ADDRESS

    def __init__(self, *, timeout: float = 30.0, retries: int = 0) -> None:
        super().__init__(timeout=timeout, retries=retries)
        self.load_engine()
        self._published = PublishedRanges("kvbridge-procmem", self.timeout)
        self.open(TransportLimits(max_batch=1024, max_in_flight=4096))

    @classmethod
    def engine_import(cls) -> Any:
        if not Path("/proc/self/mem").exists():
            raise ImportError("this system has no /proc/<pid>/mem (procmem needs Linux)")
        return None

    # The kernel copies anywhere it is allowed to: what peers may touch is what is published.
    def engine_register(self, device: Any, ranges: list[MemoryRange]) -> None:
        self._published.publish(self.registered)

    def engine_deregister(self, device: Any, ranges: list[MemoryRange]) -> None:
        self._published.publish(self.registered)  # returns once no peer copies into them

    def engine_close(self) -> None:
        self._published.close()

    def engine_metadata(self) -> bytes:
        pid = os.getpid()
        table = str(self._published.path)
        return msgspec.msgpack.encode(ProcMemMetadata(pid, _started(pid), _boot_id(), table))

    def engine_connect(self, peer: str, payload: bytes, old: Any) -> _Peer:
        meta = self.decode_payload(peer, payload, ProcMemMetadata)
        if meta.boot_id != _boot_id():
            raise PeerError(
                f"peer {peer!r} runs on another host; procmem copies between processes of one "
                "host: use a network transport (mooncake, nixl)"
            )
        return old if old is not None and old.meta == meta else _Peer(meta, self.timeout)

    def engine_describe_peer(self, state: Any) -> str:
        return f"pid {state.meta.pid}"

    def engine_check_remote(self, state: Any, remote: Any, lengths: Any, peer: str) -> None:
        state.ranges.check(remote, lengths, f"remote (peer {peer!r})")  # early answer at submit

    def engine_start_chunk(self, state: Any, chunk: Chunk) -> Any:
        return state  # the copy runs in engine_wait_chunk, on the peer's lane thread

    def engine_wait_chunk(self, chunk: Chunk) -> ChunkResult:
        peer = chunk.token
        try:
            if _started(peer.meta.pid) != peer.meta.started:
                raise ProcessLookupError(f"process {peer.meta.pid} is another one now")
            fd = os.open(f"/proc/{peer.meta.pid}/mem", os.O_RDWR)
        except OSError as err:
            return ChunkResult(False, f"the peer process is gone ({err})", retry=False)
        try:
            with peer.ranges.access(chunk.remote, chunk.lengths, f"peer {chunk.handle.peer!r}"):
                return self._copy(fd, chunk)
        except TransportError as err:
            return ChunkResult(False, str(err), retry=False)
        finally:
            os.close(fd)

    def _copy(self, fd: int, chunk: Chunk) -> ChunkResult:
        try:
            descriptors = zip(
                chunk.local.tolist(), chunk.remote.tolist(), chunk.lengths.tolist(), strict=False
            )
            for local, remote, size in descriptors:
                buffer = (ctypes.c_char * size).from_address(local)
                if chunk.op is TransferOp.READ:
                    moved = os.preadv(fd, [buffer], remote)
                else:
                    moved = os.pwrite(fd, buffer, remote)
                if moved != size:
                    return ChunkResult(False, f"copied {moved} of {size} bytes at {remote:#x}")
        except OSError as err:  # EIO: the peer unmapped the memory
            return ChunkResult(False, f"copy failed: {err}", retry=False)
        return CHUNK_OK
