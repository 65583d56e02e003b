"""``kvbridge.testing.LoopbackTransport``: the kit's contract over in-process memmove copies."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

import kvbridge
from kvbridge.core import (
    Fence,
    MemoryKind,
    MemoryRange,
    PeerError,
    RegistrationError,
    TransferError,
    TransferOp,
    TransferState,
    TransportError,
)
from kvbridge.core.batches import Chunk
from kvbridge.testing import LoopbackTransport, random_bytes

N = 1 << 16


def _u64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.uint64)


class Side:
    """A loopback transport with one registered buffer of random bytes."""

    def __init__(self, seed: int, **options) -> None:
        self.buf = random_bytes(seed, N)
        self.addr = self.buf.ctypes.data
        self.range = MemoryRange(self.addr, N)
        self.t = LoopbackTransport(timeout=5.0, **options)
        self.t.register([self.range])


@pytest.fixture
def pair() -> Iterator[tuple[Side, Side]]:
    a, b = Side(1), Side(2)
    a.t.connect("b", b.t.metadata())
    yield a, b
    a.t.close()
    b.t.close()


def test_read_and_write_move_exactly_the_described_bytes(pair):
    a, b = pair
    want_a, want_b = a.buf.copy(), b.buf.copy()
    # READ: b's [100, 1100) and [5000, 5010) into a's [0, 1000) and [20000, 20010)
    a.t.transfer(
        TransferOp.READ,
        "b",
        _u64(a.addr, a.addr + 20000),
        _u64(b.addr + 100, b.addr + 5000),
        _u64(1000, 10),
    )
    want_a[0:1000], want_a[20000:20010] = want_b[100:1100], want_b[5000:5010]
    assert np.array_equal(a.buf, want_a) and np.array_equal(b.buf, want_b)
    # WRITE: a's last 4 KiB to b's first 4 KiB
    a.t.transfer(TransferOp.WRITE, "b", _u64(a.addr + N - 4096), _u64(b.addr), _u64(4096))
    want_b[:4096] = want_a[N - 4096 :]
    assert np.array_equal(a.buf, want_a) and np.array_equal(b.buf, want_b)


def test_the_kit_refuses_unregistered_memory_and_unknown_peers(pair):
    a, b = pair
    outside = np.zeros(16, dtype=np.uint8)
    with pytest.raises(RegistrationError, match="local"):
        a.t.submit(TransferOp.READ, "b", _u64(outside.ctypes.data), _u64(b.addr), _u64(16))
    with pytest.raises(RegistrationError, match="remote"):
        a.t.submit(TransferOp.READ, "b", _u64(a.addr), _u64(b.addr + N - 8), _u64(16))
    with pytest.raises(PeerError, match="unknown peer 'c'"):
        a.t.submit(TransferOp.READ, "c", _u64(a.addr), _u64(b.addr), _u64(16))
    with pytest.raises(RegistrationError, match=r"\['dram'\]"):
        a.t.register([MemoryRange(outside.ctypes.data, 16, MemoryKind.VRAM, 0)])


def test_a_peer_that_deregistered_or_closed_is_not_touched(pair):
    a, b = pair
    b.t.deregister([b.range])
    with pytest.raises(RegistrationError, match="remote"):
        a.t.submit(TransferOp.WRITE, "b", _u64(a.addr), _u64(b.addr), _u64(64))
    b.t.register([b.range])
    b.t.close()
    before = b.buf.copy()
    with pytest.raises(PeerError, match="closed; nothing was moved"):
        a.t.transfer(TransferOp.WRITE, "b", _u64(a.addr), _u64(b.addr), _u64(64))
    assert np.array_equal(b.buf, before)
    with pytest.raises(PeerError, match="closed"):
        a.t.connect("b2", _closed_metadata())


def _closed_metadata() -> bytes:
    t = LoopbackTransport()
    meta = t.metadata()
    t.close()
    return meta


def test_the_fault_hook_fails_its_chunk_as_an_engine_failure():
    seen: list[tuple[str, int, int]] = []

    def fault(chunk: Chunk) -> None:
        seen.append((chunk.op.value, chunk.index, len(chunk.lengths)))
        if chunk.index == 1:
            raise ConnectionResetError("injected reset")

    a, b = Side(1, max_batch=2, fault=fault), Side(2)
    try:
        a.t.connect("b", b.t.metadata())
        want_a = a.buf.copy()
        offsets = [0, 1000, 2000, 3000, 4000]  # 5 descriptors: chunks of 2, 2 and 1
        handle = a.t.submit(
            TransferOp.READ,
            "b",
            _u64(*(a.addr + o for o in offsets)),
            _u64(*(b.addr + o for o in offsets)),
            _u64(*[100] * 5),
        )
        assert seen == [("read", 0, 2), ("read", 1, 2), ("read", 2, 1)]
        with pytest.raises(TransferError) as err:
            a.t.wait(handle)
        message = str(err.value)
        assert "loopback read of 5 descriptors (500 bytes) from peer 'b'" in message
        assert "injected fault in chunk 2/3" in message
        assert "ConnectionResetError: injected reset" in message
        status = a.t.poll(handle)
        assert status.state is TransferState.FAILED and "injected reset" in (status.reason or "")
        assert a.t.fence(handle, 1.0) is Fence.DRAINED  # nothing stays in the "engine"
        # The failed chunk moved no byte; the chunks around it did.
        for o in (0, 1000, 4000):
            want_a[o : o + 100] = b.buf[o : o + 100]
        assert np.array_equal(a.buf, want_a)
    finally:
        a.t.close()
        b.t.close()


def test_registered_by_name_with_options_through_load_transport():
    calls: list[int] = []
    kvbridge.register_transport("loopback", LoopbackTransport)
    try:
        t = kvbridge.load_transport("loopback", timeout=2.0, fault=lambda c: calls.append(c.index))
        u = kvbridge.load_transport("loopback")
        src = np.arange(32, dtype=np.uint8)
        dst = np.zeros(32, dtype=np.uint8)
        t.register([MemoryRange(dst.ctypes.data, 32)])
        u.register([MemoryRange(src.ctypes.data, 32)])
        t.connect("u", u.metadata())
        t.transfer(TransferOp.READ, "u", _u64(dst.ctypes.data), _u64(src.ctypes.data), _u64(32))
        assert dst.tolist() == list(range(32)) and calls == [0]
        t.close()
        u.close()
    finally:
        kvbridge.unregister_transport("loopback")


def test_closed_transport_and_bad_options_are_refused():
    with pytest.raises(ValueError, match="max_batch"):
        LoopbackTransport(max_batch=0)
    with pytest.raises(TypeError, match="fault must be callable"):
        LoopbackTransport(fault="boom")
    t = LoopbackTransport()
    t.close()
    with pytest.raises(TransportError, match="closed"):
        t.metadata()


def test_memory_taken_back_during_a_chunk_is_not_written():
    # The hook runs before the copy and may call any transport: here the peer deregisters the
    # destination just before the copy, which then must not touch it.
    b = Side(2)
    a = Side(1, fault=lambda chunk: b.t.deregister([b.range]))
    try:
        a.t.connect("b", b.t.metadata())
        before = b.buf.copy()
        with pytest.raises(TransferError, match="deregistered the memory or closed"):
            a.t.transfer(TransferOp.WRITE, "b", _u64(a.addr), _u64(b.addr), _u64(N))
        assert np.array_equal(b.buf, before)
    finally:
        a.t.close()
        b.t.close()
