"""The ``cma`` transport (Linux cross-memory attach) against the conformance suite, plus its
refusals: peers of another host, PID namespace or a reused pid, remote ranges outside the peer's
registration, memory the peer freed or deregistered, and the ptrace permission message."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import msgspec
import numpy as np
import pytest

import kvbridge
from kvbridge.core.errors import (
    PeerError,
    RegistrationError,
    TransferError,
    TransportUnavailableError,
)
from kvbridge.core.memory import MemoryRange
from kvbridge.core.registry import load_transport_class
from kvbridge.core.transport import Transport, TransportMetadata
from kvbridge.testing import (
    READ,
    WRITE,
    Capabilities,
    TransportConformance,
)
from kvbridge.transports.cma import transport as cma
from kvbridge.transports.cma.transport import CmaMetadata, CmaTransport


class TestCma(TransportConformance):
    name = "cma"
    options: ClassVar[dict[str, Any]] = {"timeout": 30}
    fault_options: ClassVar[dict[str, Any]] = {"timeout": 8}
    # The kernel copies into the stopped peer's memory, with no connection to set up: a batch to
    # a frozen peer completes, also the first one.
    capabilities: ClassVar[Capabilities] = Capabilities(
        frozen_peer_stalls=False, first_contact_stalls=False
    )


# -- cma specifics: the test process is its own peer (the kernel allows a process itself) -------


@pytest.fixture
def transport() -> Iterator[Transport]:
    try:
        load_transport_class("cma")
    except TransportUnavailableError as err:
        pytest.skip(str(err))
    t = kvbridge.load_transport("cma", timeout=10)
    yield t
    t.close()


def _self_peer(t: Transport, size: int = 1 << 16) -> tuple[np.ndarray, np.ndarray]:
    """Register a local and a 'remote' buffer in this process and connect to itself as 'p'."""
    local, remote = np.zeros(size, np.uint8), np.zeros(size, np.uint8)
    t.register([MemoryRange(local.ctypes.data, size), MemoryRange(remote.ctypes.data, size)])
    t.connect("p", t.metadata())
    return local, remote


def _edited(metadata: bytes, **changes: Any) -> bytes:
    """The metadata with fields of its cma payload replaced."""
    envelope = msgspec.msgpack.decode(metadata, type=TransportMetadata)
    payload = msgspec.msgpack.decode(envelope.payload, type=CmaMetadata)
    payload = msgspec.structs.replace(payload, **changes)
    return msgspec.msgpack.encode(
        msgspec.structs.replace(envelope, payload=msgspec.msgpack.encode(payload))
    )


def test_self_transfer(transport: Transport) -> None:
    local, remote = _self_peer(transport)
    local[:] = np.arange(local.size) % 251
    transport.transfer(WRITE, "p", [local.ctypes.data], [remote.ctypes.data], [local.size])
    assert (remote == local).all()


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        (
            {"boot_id": "another-kernel", "host": "elsewhere"},
            r"another host \(elsewhere\): use mooncake or nixl",
        ),
        ({"pid_namespace": 1}, "another PID namespace"),
        ({"start_time": 1}, "pid .* now belongs to another process"),
        ({"table": "/dev/shm/kvbridge-cma-gone"}, "closed its transport"),
    ],
    ids=["other-host", "other-pid-namespace", "pid-reused", "closed-peer"],
)
def test_connect_refuses(transport: Transport, changes: dict[str, Any], match: str) -> None:
    with pytest.raises(PeerError, match=match):
        transport.connect("p", _edited(transport.metadata(), **changes))


def test_connect_refuses_an_exited_peer(transport: Transport) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    pid = child.pid
    child.wait()  # reaped: the pid names nothing now
    with pytest.raises(PeerError, match=f"peer process {pid} has exited"):
        transport.connect("p", _edited(transport.metadata(), pid=pid))


def test_remote_range_outside_registration_refused_before_any_byte(
    transport: Transport, monkeypatch: pytest.MonkeyPatch
) -> None:
    local, remote = _self_peer(transport)
    local[:] = 7
    outside = np.zeros(8192, np.uint8)  # mapped (the kernel would write it) but not registered
    with pytest.raises(RegistrationError, match=r"remote.*not inside registered memory"):
        transport.submit(WRITE, "p", [local.ctypes.data], [outside.ctypes.data], [4096])
    with pytest.raises(RegistrationError):  # straddles the end of the peer's range
        transport.submit(
            READ, "p", [local.ctypes.data], [remote.ctypes.data + remote.size - 8], [16]
        )
    # The lane checks again (a reconnect may change the peer between submit and copy).
    calls: list[int] = []
    monkeypatch.setattr(cma, "_copy", lambda *args: calls.append(1) or (0, 0))
    args = ([local.ctypes.data], [outside.ctypes.data], [4096])
    monkeypatch.setattr(transport, "engine_check_remote", lambda *args: None)  # no check at submit
    handle = transport.submit(WRITE, "p", *args)
    with pytest.raises(TransferError, match=r"not inside registered memory.*nothing was moved"):
        transport.wait(handle)
    assert not calls and not outside.any()


def test_peer_freed_memory_is_efault(transport: Transport) -> None:
    """The kernel copies up to the unmapped page (a short count), then answers EFAULT."""
    page = mmap.PAGESIZE
    local = np.full(2 * page, 3, np.uint8)
    area = mmap.mmap(-1, 2 * page)
    view = ctypes.c_char.from_buffer(area)
    addr = ctypes.addressof(view)
    del view
    transport.register([MemoryRange(local.ctypes.data, local.size), MemoryRange(addr, 2 * page)])
    transport.connect("p", transport.metadata())
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.munmap(ctypes.c_void_p(addr + page), ctypes.c_size_t(page)) == 0
    try:
        with pytest.raises(TransferError, match=r"at descriptor 1: memory is not mapped.*EFAULT"):
            transport.transfer(
                WRITE, "p", [local.ctypes.data] * 2, [addr, addr + page], [page, page]
            )
        assert area[:page] == b"\x03" * page  # the first descriptor landed
    finally:
        area.close()


def test_short_counts_resume_inside_a_descriptor(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call that copies less than asked is continued from the byte where it stopped."""
    calls = []

    def stingy(pid: int, lptr: int, n: int, rptr: int, m: int, flags: int) -> int:
        liov = np.ctypeslib.as_array((ctypes.c_uint64 * (2 * n)).from_address(lptr)).reshape(n, 2)
        riov = np.ctypeslib.as_array((ctypes.c_uint64 * (2 * m)).from_address(rptr)).reshape(m, 2)
        moved = 0
        budget = 1000  # bytes per call, splitting descriptors anywhere
        for (src, size), (dst, _) in zip(liov.tolist(), riov.tolist(), strict=True):
            step = min(size, budget - moved)
            ctypes.memmove(dst, src, step)
            moved += step
            if moved == budget:
                break
        calls.append(moved)
        return moved

    rng = np.random.default_rng(1)
    src, dst = rng.integers(0, 256, 20000, dtype=np.uint8), np.zeros(20000, np.uint8)
    lengths = np.array([1, 2999, 10, 4000, 3000], dtype=np.uint64)
    offsets = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.uint64)
    local = offsets * np.uint64(2) + np.uint64(src.ctypes.data)  # gaps between descriptors
    remote = offsets + np.uint64(dst.ctypes.data) + np.uint64(5)
    assert cma._copy(stingy, os.getpid(), local, remote, lengths) == (0, len(lengths))
    assert len(calls) == 11 and sum(calls) == lengths.sum()
    for lo, ro, n in zip(
        (offsets * 2).tolist(), (offsets + 5).tolist(), lengths.tolist(), strict=True
    ):
        assert (dst[ro : ro + n] == src[lo : lo + n]).all()


def test_deregistered_or_closed_peer_is_refused(transport: Transport) -> None:
    """What a peer may touch follows the owner's registrations now, not its old metadata."""
    local, remote = _self_peer(transport)
    extra = np.zeros(4096, np.uint8)
    transport.register([MemoryRange(extra.ctypes.data, extra.size)])  # after the metadata
    transport.transfer(WRITE, "p", [local.ctypes.data], [extra.ctypes.data], [16])
    transport.deregister([MemoryRange(extra.ctypes.data, extra.size)])
    extra[:] = 0
    with pytest.raises(RegistrationError, match="not inside registered memory"):
        transport.submit(WRITE, "p", [local.ctypes.data], [extra.ctypes.data], [16])
    assert not extra.any()
    transport.transfer(WRITE, "p", [local.ctypes.data], [remote.ctypes.data], [16])

    other = kvbridge.load_transport("cma", timeout=10)
    try:
        other.register([MemoryRange(local.ctypes.data, local.size)])
        other.connect("p", transport.metadata())
        transport.close()
        with pytest.raises(TransferError, match="closed its transport"):
            other.transfer(WRITE, "p", [local.ctypes.data], [remote.ctypes.data], [16])
    finally:
        other.close()


def test_permission_refusal_says_what_to_do(
    transport: Transport, monkeypatch: pytest.MonkeyPatch
) -> None:
    local, remote = _self_peer(transport)

    def refused(*args: Any) -> int:
        ctypes.set_errno(errno.EPERM)
        return -1

    # Root here, and a process may always access itself: the kernel cannot refuse on demand.
    monkeypatch.setattr(transport, "_libc", cma._Libc(transport._libc.readv, refused, None))  # type: ignore[attr-defined]
    with pytest.raises(TransferError) as info:
        transport.transfer(WRITE, "p", [local.ctypes.data], [remote.ctypes.data], [16])
    message = str(info.value)
    assert "EPERM" in message and "ptrace" in message and "kernel.yama.ptrace_scope" in message
    assert "CAP_SYS_PTRACE" in message and "\n" not in message


def test_allow_peers_sets_the_ptracer_only_under_yama_scope_1(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[Any, ...]] = []
    real = cma._load_libc()
    fake = cma._Libc(real.readv, real.writev, lambda *a: calls.append(a) or 0)
    monkeypatch.setattr(CmaTransport, "engine_import", classmethod(lambda cls: fake))
    scope = {"/proc/sys/kernel/yama/ptrace_scope": "1"}
    read = cma._read
    monkeypatch.setattr(cma, "_read", lambda path: scope.get(path) or read(path))
    CmaTransport(allow_peers=False).close()
    assert calls == []
    CmaTransport().close()
    assert len(calls) == 1 and calls[0][0] == 0x59616D61


def test_unavailable_off_linux(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    with pytest.raises(TransportUnavailableError, match=r"Linux only.*use mooncake or nixl"):
        CmaTransport.check_available()


def test_idle_lane_gives_its_thread_back_and_the_next_batch_starts_one(
    transport: Transport, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer with nothing to move holds no thread: the lane's thread ends after
    ``IDLE_EXIT_S``, and the next batch to that peer starts another and moves every byte."""
    from kvbridge.core import lanes

    monkeypatch.setattr(lanes, "IDLE_EXIT_S", 0.2)

    def lane_threads() -> int:
        return sum(t.name.startswith("kvbridge-cma[") for t in threading.enumerate())

    local, remote = _self_peer(transport)
    for round_ in range(3):
        local[:] = (np.arange(local.size) + round_) % 251
        transport.transfer(WRITE, "p", [local.ctypes.data], [remote.ctypes.data], [local.size])
        assert (remote == local).all()
        assert lane_threads() == 1
        deadline = time.monotonic() + 10
        while lane_threads() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lane_threads() == 0, "the idle lane kept its thread"


def test_an_idle_peer_is_released_only_once_its_batches_are_drained(
    transport: Transport, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``disconnect_idle`` keeps a peer while a batch to it may still move bytes (here: a copy
    held inside the engine call), forgets it once every batch drained; ``connect`` brings it
    back and bytes move again."""
    local, remote = _self_peer(transport)
    local[:] = 3
    entered, go = threading.Event(), threading.Event()
    copy = cma._copy

    def held_copy(*args: Any) -> tuple[int, int]:
        entered.set()
        go.wait(10)
        return copy(*args)

    monkeypatch.setattr(cma, "_copy", held_copy)
    handle = transport.submit(WRITE, "p", [local.ctypes.data], [remote.ctypes.data], [local.size])
    assert entered.wait(10)
    assert transport.disconnect_idle("p") is False  # the copy is in the engine
    go.set()
    transport.wait(handle)
    assert (remote == 3).all()
    assert transport.disconnect_idle("p") is True
    with pytest.raises(PeerError, match=r"unknown peer 'p'"):
        transport.submit(WRITE, "p", [local.ctypes.data], [remote.ctypes.data], [local.size])
    assert transport.disconnect_idle("p") is True  # unknown: nothing kept
    transport.connect("p", transport.metadata())
    local[:] = 4
    transport.transfer(WRITE, "p", [local.ctypes.data], [remote.ctypes.data], [local.size])
    assert (remote == 4).all()


def test_a_large_chunk_is_copied_in_two_halves_at_once(
    transport: Transport, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk of ``SPLIT_BYTES`` or more moves as two halves at once (the helper thread takes
    the first): every byte lands; a failure in the second half names its descriptor in the
    whole chunk."""
    size = 8 * cma.SPLIT_BYTES
    local, remote = _self_peer(transport, size)
    local[:] = np.arange(size) % 241
    n = 8
    step = size // n
    offsets = [i * step for i in range(n)]
    args = (
        [local.ctypes.data + o for o in offsets],
        [remote.ctypes.data + o for o in reversed(offsets)],
        [step] * n,
    )
    transport.transfer(WRITE, "p", *args)
    for i, o in enumerate(offsets):
        got = remote[size - step - o : size - o]
        assert (got == local[o : o + step]).all(), f"descriptor {i}"
    assert any(t.name.startswith("kvbridge-cma-copy") for t in threading.enumerate())

    copy = cma._copy
    second_half = args[0][n // 2]

    def fail_in_second_half(call: Any, pid: int, loc: Any, rem: Any, lengths: Any) -> Any:
        if int(loc[0]) == second_half:
            return errno.EFAULT, 1  # its descriptor 1: the chunk's descriptor n/2 + 1
        return copy(call, pid, loc, rem, lengths)

    monkeypatch.setattr(cma, "_copy", fail_in_second_half)
    with pytest.raises(TransferError, match=rf"at descriptor {n // 2 + 1}: memory is not mapped"):
        transport.transfer(WRITE, "p", *args)
