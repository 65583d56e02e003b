"""Mooncake transport logic against a fake engine: pacing, retries, deadlines, messages.

The conformance suite (``kvbridge.testing``, run by ``test_mooncake.py``) covers the real engine
between processes; these tests pin down what is hard to provoke there, in milliseconds and without
the engine installed.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
import threading
import time
from collections import deque
from typing import Any

import msgspec
import numpy as np
import pytest

from kvbridge.core.batches import TransferOp, TransferState
from kvbridge.core.errors import (
    PeerError,
    RegistrationError,
    TransferError,
    TransferTimeoutError,
    TransportError,
    TransportUnavailableError,
)
from kvbridge.core.memory import MemoryRange
from kvbridge.core.transport import TransportMetadata
from kvbridge.transports.mooncake import transport as mc
from kvbridge.transports.mooncake.transport import MooncakeMetadata, MooncakeTransport

WRITE, READ = TransferOp.WRITE, TransferOp.READ
BASE = 0x10000000
SIZE = 1 << 20


class FakeEngine:
    """Records what the transport asks of the engine; answers like the real one."""

    def __init__(self) -> None:
        self.env_timeout = os.environ.get("MC_TRANSFER_TIMEOUT")
        self.lock = threading.Lock()
        self.batches: dict[int, int] = {}
        self.next_id = 1000
        self.in_flight = 0
        self.max_in_flight = 0
        self.submitted: list[tuple[str, str, list[int], list[int], list[int]]] = []
        self.status_rcs: deque[int] = deque()  # next results of get_batch_transfer_status
        self.submit_rcs: deque[int] = deque()  # next results of batch_transfer_async_*
        self.release = threading.Event()
        self.release.set()  # cleared: get_batch_transfer_status blocks (a frozen peer)
        self.probe_rc = 0
        self.register_rc = 0
        self.registered: list[int] = []
        self.unregistered: list[int] = []

    def initialize(self, *args: str) -> int:
        self.init_args = args
        return 0

    def get_rpc_port(self) -> int:
        return 15000

    def send_probe(self, session: str) -> int:
        return self.probe_rc

    def batch_register_memory(self, addrs: list[int], sizes: list[int], location: str) -> int:
        if self.register_rc == 0:
            self.registered += addrs
        return self.register_rc

    def batch_unregister_memory(self, addrs: list[int]) -> int:
        self.unregistered += addrs
        return 0

    def _submit(self, op: str, session: str, local: Any, remote: Any, lengths: Any) -> int:
        with self.lock:
            if self.submit_rcs:
                return self.submit_rcs.popleft()
            self.submitted.append((op, session, list(local), list(remote), list(lengths)))
            self.in_flight += len(local)
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.next_id += 1
            self.batches[self.next_id] = len(local)
            return self.next_id

    def batch_transfer_async_write(self, *args: Any) -> int:
        return self._submit("write", *args)

    def batch_transfer_async_read(self, *args: Any) -> int:
        return self._submit("read", *args)

    def get_batch_transfer_status(self, ids: list[int]) -> int:
        self.release.wait(30)
        time.sleep(0.001)  # let the lane's other chunks pile up if the window allows it
        with self.lock:
            self.in_flight -= self.batches.pop(ids[0])
            return self.status_rcs.popleft() if self.status_rcs else 0


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> FakeEngine:
    fake = FakeEngine()

    def construct() -> FakeEngine:
        fake.env_timeout = os.environ.get("MC_TRANSFER_TIMEOUT")  # what the real one reads
        return fake

    monkeypatch.setattr(mc, "engine_import", lambda: construct)
    return fake


@pytest.fixture
def make(engine: FakeEngine) -> Any:
    made: list[MooncakeTransport] = []

    def make(**options: Any) -> MooncakeTransport:
        t = MooncakeTransport(**options)
        made.append(t)
        t.register([MemoryRange(BASE, SIZE)])
        t.connect("p", _meta("127.0.0.1:16000"))
        return t

    yield make
    engine.release.set()
    for t in made:
        t.close()


def _meta(session: str, protocol: str = "tcp", version: int = 2, name: str = "mooncake") -> bytes:
    payload = msgspec.msgpack.encode(MooncakeMetadata(session, protocol))
    return msgspec.msgpack.encode(TransportMetadata(name, version, payload))


def _descs(n: int, length: int = 16) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    offsets = np.arange(n, dtype=np.uint64) * np.uint64(length)
    return offsets + np.uint64(BASE), offsets + np.uint64(0x7000), np.full(n, length, np.uint64)


@pytest.mark.timeout(10)
def test_engine_setup_and_metadata(make: Any, engine: FakeEngine) -> None:
    before = os.environ.get("MC_TRANSFER_TIMEOUT")
    t = make(timeout=2.5, hostname="10.0.0.7")
    # The binding's own wait is set beyond any transfer while the engine is built: it never
    # gives a chunk up while its sessions may still move bytes (the deadline is kvbridge's).
    assert engine.env_timeout == str(mc.ENGINE_WAIT_S)
    assert os.environ.get("MC_TRANSFER_TIMEOUT") == before  # and restored after
    assert engine.init_args == ("10.0.0.7", "P2PHANDSHAKE", "tcp", "")
    envelope = msgspec.msgpack.decode(t.metadata(), type=TransportMetadata)
    assert (envelope.transport, envelope.version) == ("mooncake", 2)
    meta = msgspec.msgpack.decode(envelope.payload, type=MooncakeMetadata)
    assert meta.session == "10.0.0.7:15000" and meta.protocol == "tcp"
    assert t.limits.max_batch == 1024


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("metadata", "match"),
    [
        (b"", "not kvbridge transport metadata"),
        (b"\x92\x01\x02", "not kvbridge transport metadata"),
        (msgspec.msgpack.encode({"session": "h:1"}), "not kvbridge transport metadata"),
        (_meta("127.0.0.1:1", name="nixl"), "sent 'nixl' transport metadata"),
        (_meta("127.0.0.1:1", protocol="rdma"), "protocol 'rdma'"),
        (_meta("127.0.0.1:1", version=9), "version 9"),
        (_meta(""), "not mooncake transport metadata"),
    ],
)
def test_bad_metadata(make: Any, metadata: bytes, match: str) -> None:
    t = make()
    with pytest.raises(PeerError, match=match):
        t.connect("q", metadata)


@pytest.mark.timeout(10)
def test_chunks_and_in_flight_window(make: Any, engine: FakeEngine) -> None:
    t = make(max_batch=100, max_in_flight=250)
    local, remote, lengths = _descs(1050)
    handles = [t.submit(WRITE, "p", local, remote, lengths) for _ in range(3)]
    for h in handles:
        t.wait(h)
    sizes = [len(s[2]) for s in engine.submitted]
    assert sizes == ([100] * 10 + [50]) * 3
    assert 200 <= engine.max_in_flight <= 250  # chunks overlap, never beyond the window
    first = engine.submitted[: len(sizes) // 3]
    # every descriptor exactly once, in order
    assert [a for s in first for a in s[2]] == local.tolist()
    assert [a for s in first for a in s[3]] == remote.tolist()


@pytest.mark.timeout(10)
def test_zero_length_descriptors_are_dropped_and_empty_batch_is_done(
    make: Any, engine: FakeEngine
) -> None:
    t = make()
    h = t.submit(READ, "p", [BASE, BASE + 16], [0x7000, 0x8000], [0, 16])
    t.wait(h)
    assert engine.submitted == [("read", "127.0.0.1:16000", [BASE + 16], [0x8000], [16])]
    assert h.count == 2 and h.nbytes == 16
    empty = t.submit(WRITE, "p", [], [], [])
    assert t.poll(empty).state is TransferState.DONE


@pytest.mark.timeout(10)
def test_failed_chunk_is_retried_once(make: Any, engine: FakeEngine) -> None:
    t = make()
    engine.status_rcs.extend([-1])
    t.transfer(WRITE, "p", *_descs(10))
    assert len(engine.submitted) == 2

    engine.submitted.clear()
    engine.status_rcs.extend([-1, -1])
    with pytest.raises(TransferError) as err:
        t.transfer(WRITE, "p", *_descs(10))
    assert len(engine.submitted) == 2
    message = str(err.value)
    for part in ("write of 10 descriptors (160 bytes)", "'p'", "127.0.0.1:16000", "stderr"):
        assert part in message


@pytest.mark.timeout(10)
def test_failed_submit_names_op_peer_count_and_bytes(make: Any, engine: FakeEngine) -> None:
    t = make(retries=0, max_batch=4)
    engine.submit_rcs.extend([-1])
    h = t.submit(READ, "p", *_descs(10))
    with pytest.raises(TransferError) as err:
        t.wait(h)
    message = str(err.value)
    for part in (
        "read of 10 descriptors (160 bytes) from peer 'p'",
        "batch_transfer_async_read returned -1",
        "chunk 1/3",
        "engine log (stderr)",
    ):
        assert part in message
    assert t.poll(h).state is TransferState.FAILED
    assert engine.submitted == []  # the other chunks of the failed batch were skipped


@pytest.mark.timeout(10)
def test_probe_failure_fails_the_batch(make: Any, engine: FakeEngine) -> None:
    engine.probe_rc = -102
    t = make()
    with pytest.raises(TransferError, match="probe"):
        t.transfer(WRITE, "p", *_descs(1))
    engine.probe_rc = 0
    t.transfer(WRITE, "p", *_descs(1))  # probed again before the next batch


@pytest.mark.timeout(10)
def test_blocked_engine_poll_stays_fast_and_deadline_fails(make: Any, engine: FakeEngine) -> None:
    t = make(timeout=0.4)
    engine.release.clear()  # the peer is frozen: the engine's status call blocks
    start = time.monotonic()
    h = t.submit(WRITE, "p", *_descs(3000))
    queued = t.submit(WRITE, "p", *_descs(5))
    polls = [t.poll(h).state for _ in range(100)]
    assert set(polls) == {TransferState.PENDING}
    assert time.monotonic() - start < 0.3
    with pytest.raises(TransferTimeoutError, match=r"did not finish within 0\.4 s"):
        t.wait(h)
    assert 0.4 <= time.monotonic() - start < 1.0
    assert t.poll(h).state is TransferState.FAILED
    with pytest.raises(TransferTimeoutError):
        t.wait(queued)
    before = len(engine.submitted)
    engine.release.set()
    time.sleep(0.1)
    assert len(engine.submitted) == before  # chunks of expired batches are never submitted


@pytest.mark.timeout(10)
def test_wait_with_short_timeout_releases(make: Any, engine: FakeEngine) -> None:
    t = make()
    engine.release.clear()
    h = t.submit(WRITE, "p", *_descs(1))
    with pytest.raises(TransferTimeoutError, match="released"):
        t.wait(h, timeout=0.05)
    assert t.poll(h).state is TransferState.FAILED


@pytest.mark.timeout(10)
def test_registration(make: Any, engine: FakeEngine) -> None:
    t = make()
    t.register([MemoryRange(BASE, SIZE)])  # same range again: nothing asked of the engine
    assert engine.registered == [BASE]
    with pytest.raises(RegistrationError, match="not inside registered memory"):
        t.submit(WRITE, "p", [BASE + SIZE - 8], [0], [16])
    engine.register_rc = -7
    with pytest.raises(RegistrationError, match="overlaps"):
        t.register([MemoryRange(BASE + 4096, 4096)])
    assert t.registered == [MemoryRange(BASE, SIZE)]  # bookkeeping rolled back
    t.deregister([MemoryRange(BASE, SIZE), MemoryRange(1, 1)])
    assert engine.unregistered == [BASE] and t.registered == []


@pytest.mark.timeout(10)
def test_disconnect_fails_queued_work_and_close_releases_everything(
    make: Any, engine: FakeEngine
) -> None:
    t = make(timeout=5)
    engine.release.clear()
    first = t.submit(WRITE, "p", *_descs(3000))  # two chunks in the engine, one queued
    time.sleep(0.05)
    t.disconnect("p")
    with pytest.raises(PeerError, match="unknown peer 'p'"):
        t.submit(WRITE, "p", *_descs(1))
    assert t.poll(first).state is TransferState.FAILED
    assert "disconnected" in (first.error or "")
    engine.release.set()

    t.connect("p", _meta("127.0.0.1:16001"))
    t.transfer(WRITE, "p", *_descs(1))
    assert engine.submitted[-1][1] == "127.0.0.1:16001"
    t.close()
    t.close()
    assert engine.unregistered == [BASE] and t.registered == []
    for call in (
        lambda: t.submit(WRITE, "p", *_descs(1)),
        lambda: t.register([MemoryRange(BASE, SIZE)]),
        lambda: t.connect("q", _meta("h:1")),
        t.metadata,
    ):
        with pytest.raises(TransportError, match="closed"):
            call()


@pytest.mark.timeout(10)
def test_options_are_checked(engine: FakeEngine) -> None:
    with pytest.raises(ValueError, match="max_in_flight"):
        MooncakeTransport(max_batch=4096)
    with pytest.raises(ValueError, match="timeout"):
        MooncakeTransport(timeout=0)


class _Refuse(importlib.abc.MetaPathFinder):
    def __init__(self, message: str) -> None:
        self.message = message

    def find_spec(self, name: str, *args: Any) -> None:
        if name == "mooncake.engine":
            raise ImportError(self.message)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("message", "apt"),
    [("No module named 'mooncake'", False), ("libibverbs.so.1: cannot open shared object", True)],
)
def test_missing_engine_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, message: str, apt: bool
) -> None:
    monkeypatch.delitem(sys.modules, "mooncake.engine", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_Refuse(message), *sys.meta_path])
    with pytest.raises(TransportUnavailableError) as err:
        MooncakeTransport.check_available()
    text = str(err.value)
    assert "pip install 'kvbridge[mooncake]'" in text
    assert "mooncake-transfer-engine-non-cuda" in text
    assert ("apt-get install -y libibverbs1" in text) is apt
