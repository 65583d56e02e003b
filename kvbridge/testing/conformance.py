"""The conformance suite every transport must pass, written once (fsspec abstract-test style).

For a transport plugin author: install ``kvbridge[testing]`` (pytest and pytest-timeout) and your
package, whose ``kvbridge.transports`` entry point names the transport, then write in your own
tests, e.g. ``tests/test_conformance.py``::

    from typing import Any, ClassVar

    from kvbridge.testing import Capabilities, TransportConformance


    class TestMyTransport(TransportConformance):
        # the entry-point name: kvbridge.load_transport(name, **options) must build it
        name = "mytransport"
        # options for every ordinary case (the suite's agent and its peer processes)
        options: ClassVar[dict[str, Any]] = {"timeout": 30}
        # options for the fault cases (dead, killed, frozen peers): a short ``timeout`` keeps
        # them fast; each fault must surface within ``timeout + fault_margin`` seconds of
        # the submit (or within ``fault_margin`` of the wait, when the suite waits later)
        fault_options: ClassVar[dict[str, Any]] = {"timeout": 8}
        # what the transport cannot do, declared; the defaults are the strict behaviour
        capabilities: ClassVar[Capabilities] = Capabilities(
            frozen_peer_stalls=True, first_contact_stalls=True
        )
        # bytes of every buffer, local and in each peer; 64 MiB or more (the cases place fixed
        # ranges and descriptor sets sized for 64 MiB)
        buffer_size: ClassVar[int] = 64 * MiB

and run ``pytest``. Only ``name`` is required; every other attribute has the default shown above
(``options`` defaults to ``{}``). A test that does not apply to your transport is declared through
``capabilities``, never skipped: the test then checks the other behaviour instead (see
``Capabilities``). Test methods can be overridden like any pytest method, e.g. to add a marker.
The tests skip, with the reason, only where the transport's engine is not installed
(``TransportUnavailableError`` from ``check_available``) or, for ``test_gpu_memory``, where torch
sees no CUDA GPU. Transport-specific tests go in the same class; they can use the fixtures
``make_agent``, ``spawn_peer`` and ``peer_bytes`` and the helpers exported by ``kvbridge.testing``.
The suite passes descriptor arrays to ``submit``/``transfer`` also as plain lists: coerce them
with ``kvbridge.core.transport.prepare_batch``, as kvbridge's transports do.
The ``kvbridge`` pytest plugin (installed with kvbridge) prints how long each injected fault took
to surface after the run.

Everything here goes through ``kvbridge.load_transport`` and the ``Transport`` API, never through
an engine. The test process is one agent; peers are real OS processes on 127.0.0.1
(``python -m kvbridge.testing.peer``, see ``peer.py``), started with the test's interpreter and
environment, so the transport must load there as it does in the test. Data is random bytes from
known seeds, so the suite keeps the exact expected contents of every buffer and compares whole
buffers byte for byte: a wrong byte anywhere, also outside the transferred ranges, fails.
"""

# The suite passes descriptor arrays also as plain lists, on purpose: a transport's ``submit``
# must take any sequence (``kvbridge.core.transport.prepare_batch`` coerces them), wider than the
# ``AddrArray`` annotation of the contract.
# mypy: disable-error-code="arg-type"

from __future__ import annotations

import base64
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

import kvbridge
from kvbridge.core.batches import Fence, TransferOp, TransferState
from kvbridge.core.errors import (
    PeerError,
    RegistrationError,
    TransferError,
    TransportError,
    TransportUnavailableError,
)
from kvbridge.core.memory import MemoryKind, MemoryRange
from kvbridge.core.registry import load_transport_class
from kvbridge.core.transport import Transport
from kvbridge.testing.peer import PeerProcess, random_bytes

MiB = 1 << 20
WRITE, READ = TransferOp.WRITE, TransferOp.READ

#: (transport, case, seconds until the error surfaced, allowed seconds), shown after the run.
FAULT_TIMINGS: list[tuple[str, str, float, float]] = []

U64 = np.uint64


@dataclass
class Agent:
    """The test process's side: a transport and one registered host buffer."""

    transport: Transport
    buf: np.ndarray

    @property
    def addr(self) -> int:
        return int(self.buf.ctypes.data)

    def at(self, offsets: Any) -> np.ndarray:
        addrs: np.ndarray = np.asarray(offsets, dtype=U64) + U64(self.addr)
        return addrs


#: The suite's fixtures, as test methods (also a subclass's own) receive them.
MakeAgent = Callable[..., Agent]
SpawnPeer = Callable[..., PeerProcess]
PeerBytes = Callable[[PeerProcess], np.ndarray]


def at(peer: PeerProcess, offsets: Any) -> np.ndarray:
    """Absolute addresses in a peer's buffer."""
    addrs: np.ndarray = np.asarray(offsets, dtype=U64) + U64(peer.addr)
    return addrs


def copy_ranges(dst: np.ndarray, dst_off: Any, src: np.ndarray, src_off: Any, lengths: Any) -> None:
    """The reference: what a transfer must do, one range at a time."""
    for d, s, n in zip(dst_off, src_off, lengths, strict=True):
        dst[int(d) : int(d) + int(n)] = src[int(s) : int(s) + int(n)]


def scattered(
    rng: np.random.Generator, count: int, lo: int, hi: int, region: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``count`` descriptors of ``lo..hi`` bytes at random non-overlapping offsets.

    Local and remote placements are independent permutations with random gaps, so neither side's
    addresses follow the descriptor order. Returns ``(local_offsets, remote_offsets, lengths)``.
    """
    lengths = rng.integers(lo, hi + 1, count).astype(np.int64)
    free = region - int(lengths.sum())
    assert free >= 0, "region too small for the descriptors"

    def place() -> np.ndarray:
        order = rng.permutation(count)
        cuts = np.sort(rng.integers(0, free + 1, count))
        gaps = np.diff(cuts, prepend=0)  # gaps before each placed descriptor, summing <= free
        starts = np.cumsum(gaps + np.concatenate(([0], lengths[order][:-1])))
        offsets = np.empty(count, dtype=np.int64)
        offsets[order] = starts
        return offsets

    return place(), place(), lengths


def assert_same_bytes(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: size {actual.shape} != {expected.shape}"
    bad = np.flatnonzero(actual != expected)
    if bad.size:
        first = int(bad[0])
        got, want = actual[first : first + 8].tolist(), expected[first : first + 8].tolist()
        pytest.fail(
            f"{what}: {bad.size} bytes differ, first at offset {first:#x} "
            f"(got {got}, expected {want})"
        )


def record_fault(name: str, case: str, elapsed: float, limit: float) -> None:
    FAULT_TIMINGS.append((name, case, elapsed, limit))
    assert elapsed < limit, f"{case}: the error took {elapsed:.2f} s, more than {limit:.1f} s"


@dataclass(frozen=True)
class Capabilities:
    """What a transport declares it does differently; the defaults are the strict behaviour.

    A flag set to False does not skip the affected test: the test asserts the declared behaviour
    instead, so a transport that does not do what it declares still fails.
    """

    #: True: a transfer to a stopped (SIGSTOPped) peer stalls and fails within the timeout
    #: (``test_peer_frozen``). False: the data path does not need the peer's process to run (a
    #: kernel copy such as UCX's ``cma``/``process_vm_writev``, or RDMA into pinned memory), so
    #: the transfer to the stopped peer completes, within the timeout, and its bytes are exact.
    frozen_peer_stalls: bool = True
    #: True: the first transfer to a peer that was stopped before any contact stalls and fails
    #: within the timeout (``test_peer_frozen_before_first_contact``): the engine's connection
    #: setup needs the peer to run (UCX's wire-up, also when its data path is ``cma``). False: no
    #: connection is set up (kernel copies), so that batch completes with exact bytes.
    first_contact_stalls: bool = True


class TransportConformance:
    """All conformance tests. Subclasses set ``name`` and may override the option dicts,
    ``capabilities`` and ``buffer_size`` (see the module's docstring)."""

    #: entry-point name of the transport under test
    name: ClassVar[str] = ""
    #: options for ordinary cases
    options: ClassVar[dict[str, Any]] = {}
    #: options for fault cases: a short ``timeout`` keeps them fast
    fault_options: ClassVar[dict[str, Any]] = {"timeout": 8}
    #: seconds a fault may take to surface beyond the transport's timeout
    fault_margin: ClassVar[float] = 5.0
    #: size of every buffer (local and peers)
    buffer_size: ClassVar[int] = 64 * MiB
    #: what the transport declares it does differently (see ``Capabilities``)
    capabilities: ClassVar[Capabilities] = Capabilities()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.name:
            raise TypeError(f"{cls.__name__} must set the transport entry-point name")

    # -- fixtures -----------------------------------------------------------------------------

    @pytest.fixture(autouse=True)
    def _available(self) -> None:
        try:
            load_transport_class(self.name)
        except TransportUnavailableError as err:
            pytest.skip(str(err))

    @pytest.fixture
    def make_agent(self) -> Iterator[MakeAgent]:
        """Factory of local agents; every transport made is closed at teardown."""
        made: list[Transport] = []

        def make(options: dict[str, Any] | None = None, size: int | None = None) -> Agent:
            transport = kvbridge.load_transport(
                self.name, **(self.options if options is None else options)
            )
            made.append(transport)
            buf = np.zeros(size or self.buffer_size, dtype=np.uint8)
            transport.register([MemoryRange(int(buf.ctypes.data), buf.nbytes)])
            return Agent(transport, buf)

        yield make
        for transport in reversed(made):
            transport.close()

    @pytest.fixture
    def spawn_peer(self, make_agent: MakeAgent, tmp_path: Path) -> Iterator[SpawnPeer]:
        """Factory of peer processes, reaped at teardown (before local agents are closed)."""
        peers: list[PeerProcess] = []
        count = itertools.count()

        def spawn(
            options: dict[str, Any] | None = None,
            seed: int | None = None,
            device: str = "cpu",
            size: int | None = None,
        ) -> PeerProcess:
            peer = PeerProcess(
                self.name,
                self.options if options is None else options,
                size or self.buffer_size,
                tmp_path / f"peer-{next(count)}.log",
                device=device,
            )
            peers.append(peer)
            if seed is not None:
                peer.call(cmd="fill", seed=seed)
            return peer

        yield spawn
        for peer in peers:
            peer.close()

    @pytest.fixture
    def peer_bytes(self, tmp_path: Path) -> PeerBytes:
        """Read a peer's whole buffer (through a file, so 64 MiB is cheap)."""
        count = itertools.count()

        def read(peer: PeerProcess) -> np.ndarray:
            path = tmp_path / f"dump-{next(count)}.bin"
            peer.call(cmd="dump", path=str(path))
            data = np.fromfile(path, dtype=np.uint8)
            path.unlink()
            return data

        return read

    # -- data movement ------------------------------------------------------------------------

    @pytest.mark.timeout(60)
    def test_write_then_read(
        self, make_agent: MakeAgent, spawn_peer: SpawnPeer, peer_bytes: PeerBytes
    ) -> None:
        agent = make_agent()
        peer = spawn_peer(seed=1)
        agent.transport.connect("p", peer.metadata)
        agent.buf[:] = random_bytes(2, agent.buf.size)
        expected = random_bytes(1, peer.size)

        local = [0, 5 * MiB, 9 * MiB + 3]
        remote = [7 * MiB + 1, 1 * MiB, 20 * MiB]
        lengths = [MiB, 3 * MiB + 5, 4097]
        agent.transport.transfer(WRITE, "p", agent.at(local), at(peer, remote), lengths)
        copy_ranges(expected, remote, agent.buf, local, lengths)
        assert_same_bytes(peer_bytes(peer), expected, "peer buffer after write")

        before = agent.buf.copy()
        local = [30 * MiB, 40 * MiB + 7]
        remote = [30 * MiB, 2 * MiB + 1]  # one freshly written range, one untouched
        lengths = [2 * MiB, 65536]
        agent.transport.transfer(READ, "p", agent.at(local), at(peer, remote), lengths)
        copy_ranges(before, local, expected, remote, lengths)
        assert_same_bytes(agent.buf, before, "local buffer after read")

    @pytest.mark.timeout(60)
    def test_large_region(
        self, make_agent: MakeAgent, spawn_peer: SpawnPeer, peer_bytes: PeerBytes
    ) -> None:
        agent = make_agent()
        peer = spawn_peer(seed=3)
        agent.transport.connect("p", peer.metadata)
        agent.buf[:] = random_bytes(4, agent.buf.size)
        size = self.buffer_size
        agent.transport.transfer(WRITE, "p", agent.at([0]), at(peer, [0]), [size])
        assert_same_bytes(peer_bytes(peer), agent.buf, "peer buffer after a whole-buffer write")

        peer.call(cmd="fill", seed=5)
        agent.transport.transfer(READ, "p", agent.at([0]), at(peer, [0]), [size])
        assert_same_bytes(agent.buf, random_bytes(5, size), "local buffer after whole read")

    @pytest.mark.timeout(90)
    def test_scattered_small_descriptors(
        self, make_agent: MakeAgent, spawn_peer: SpawnPeer, peer_bytes: PeerBytes
    ) -> None:
        agent = make_agent()
        peer = spawn_peer(seed=6)
        agent.transport.connect("p", peer.metadata)
        agent.buf[:] = random_bytes(7, agent.buf.size)
        rng = np.random.default_rng(8)
        local, remote, lengths = scattered(rng, 5000, 1024, 4096, self.buffer_size)

        expected = random_bytes(6, peer.size)
        agent.transport.transfer(WRITE, "p", agent.at(local), at(peer, remote), lengths)
        copy_ranges(expected, remote, agent.buf, local, lengths)
        assert_same_bytes(peer_bytes(peer), expected, "peer buffer after 5000 scattered writes")

        local, remote, lengths = scattered(rng, 5000, 1, 4096, self.buffer_size)
        reference = agent.buf.copy()
        agent.transport.transfer(READ, "p", agent.at(local), at(peer, remote), lengths)
        copy_ranges(reference, local, expected, remote, lengths)
        assert_same_bytes(agent.buf, reference, "local buffer after 5000 scattered reads")

    @pytest.mark.timeout(90)
    def test_batch_far_above_engine_queue(
        self, make_agent: MakeAgent, spawn_peer: SpawnPeer, peer_bytes: PeerBytes
    ) -> None:
        """20000 descriptors in one submit: the transport must split and pace them itself."""
        agent = make_agent()
        peer = spawn_peer(seed=9)
        agent.transport.connect("p", peer.metadata)
        agent.buf[:] = random_bytes(10, agent.buf.size)
        local, remote, lengths = scattered(
            np.random.default_rng(11), 20000, 256, 2048, self.buffer_size
        )
        expected = random_bytes(9, peer.size)
        agent.transport.transfer(WRITE, "p", agent.at(local), at(peer, remote), lengths)
        copy_ranges(expected, remote, agent.buf, local, lengths)
        assert_same_bytes(peer_bytes(peer), expected, "peer buffer after 20000 writes")

        reference = agent.buf.copy()
        agent.transport.transfer(READ, "p", agent.at(remote), at(peer, local), lengths)
        copy_ranges(reference, remote, expected, local, lengths)
        assert_same_bytes(agent.buf, reference, "local buffer after 20000 reads")

    @pytest.mark.timeout(30)
    def test_empty_batch(self, make_agent: MakeAgent, spawn_peer: SpawnPeer) -> None:
        agent = make_agent()
        peer = spawn_peer()
        agent.transport.connect("p", peer.metadata)
        empty = np.empty(0, dtype=U64)
        for op in (WRITE, READ):
            handle = agent.transport.submit(op, "p", empty, empty, empty)
            assert agent.transport.poll(handle).state is TransferState.DONE
            agent.transport.wait(handle)
            assert handle.count == 0 and handle.nbytes == 0
        agent.transport.transfer(WRITE, "p", [], [], [])

    @pytest.mark.timeout(90)
    def test_many_in_flight_to_one_peer(
        self, make_agent: MakeAgent, spawn_peer: SpawnPeer, peer_bytes: PeerBytes
    ) -> None:
        agent = make_agent()
        peer = spawn_peer(seed=12)
        agent.transport.connect("p", peer.metadata)
        agent.buf[:] = random_bytes(13, agent.buf.size)
        expected = random_bytes(12, peer.size)
        reference = agent.buf.copy()
        slot = self.buffer_size // 8
        rng = np.random.default_rng(14)
        handles = []
        for k in range(8):  # six writes (slots 0-5) and two reads (slots 6, 7) at once
            op = WRITE if k < 6 else READ
            if k % 2:  # many small descriptors, together far above the engine's queue
                local, remote, lengths = scattered(rng, 1500, 512, 4096, slot)
            else:  # a few large ones
                local, remote, lengths = scattered(rng, 3, 256 << 10, 2 * MiB, slot)
            local, remote = local + k * slot, remote + k * slot
            handles.append(
                agent.transport.submit(op, "p", agent.at(local), at(peer, remote), lengths)
            )
            if op is WRITE:
                copy_ranges(expected, remote, reference, local, lengths)
            else:
                copy_ranges(reference, local, expected, remote, lengths)
        for handle in handles:
            agent.transport.wait(handle)
        assert_same_bytes(peer_bytes(peer), expected, "peer buffer after concurrent writes")
        assert_same_bytes(agent.buf, reference, "local buffer after concurrent reads")

    @pytest.mark.timeout(90)
    def test_in_flight_to_two_peers(
        self, make_agent: MakeAgent, spawn_peer: SpawnPeer, peer_bytes: PeerBytes
    ) -> None:
        agent = make_agent()
        peers = {"a": spawn_peer(seed=15), "b": spawn_peer(seed=16)}
        expected = {
            "a": random_bytes(15, self.buffer_size),
            "b": random_bytes(16, self.buffer_size),
        }
        for name, peer in peers.items():
            agent.transport.connect(name, peer.metadata)
        agent.buf[:] = random_bytes(17, agent.buf.size)
        reference = agent.buf.copy()
        half = self.buffer_size // 2
        rng = np.random.default_rng(18)
        handles = []
        for i, (name, peer) in enumerate(peers.items()):
            base = i * (half // 2)  # a: local quarter 0 (write), 2 (read); b: 1 and 3
            local, remote, lengths = scattered(rng, 2500, 512, 4096, half // 2)
            handles.append(
                agent.transport.submit(
                    WRITE, name, agent.at(local + base), at(peer, remote), lengths
                )
            )
            copy_ranges(expected[name], remote, reference, local + base, lengths)
            local, remote, lengths = scattered(rng, 2500, 512, 4096, half // 2)
            handles.append(
                agent.transport.submit(
                    READ, name, agent.at(local + half + base), at(peer, remote + half), lengths
                )
            )
            copy_ranges(reference, local + half + base, expected[name], remote + half, lengths)
        for handle in handles:
            agent.transport.wait(handle)
        for name, peer in peers.items():
            assert_same_bytes(peer_bytes(peer), expected[name], f"peer {name} buffer")
        assert_same_bytes(agent.buf, reference, "local buffer after reads from two peers")

    @pytest.mark.timeout(60)
    def test_peer_initiated_transfers(
        self, make_agent: MakeAgent, spawn_peer: SpawnPeer, peer_bytes: PeerBytes
    ) -> None:
        """The other direction: a peer connects with this agent's metadata and moves bytes."""
        agent = make_agent()
        agent.buf[:] = random_bytes(19, agent.buf.size)
        reference = agent.buf.copy()
        peer = spawn_peer(seed=20)
        expected = random_bytes(20, peer.size)
        metadata = base64.b64encode(agent.transport.metadata()).decode()
        peer.call(cmd="connect", peer="test", metadata=metadata)

        theirs, ours, lengths = [0, 3 * MiB], [1 * MiB + 5, 10 * MiB], [MiB, 4096]
        peer.call(
            cmd="transfer",
            op="write",
            peer="test",
            local=theirs,
            remote=agent.at(ours).tolist(),
            lengths=lengths,
        )
        copy_ranges(reference, ours, expected, theirs, lengths)
        assert_same_bytes(agent.buf, reference, "local buffer after the peer's write")

        theirs, ours, lengths = [20 * MiB], [30 * MiB], [2 * MiB]
        peer.call(
            cmd="transfer",
            op="read",
            peer="test",
            local=theirs,
            remote=agent.at(ours).tolist(),
            lengths=lengths,
        )
        copy_ranges(expected, theirs, reference, ours, lengths)
        assert_same_bytes(peer_bytes(peer), expected, "peer buffer after its read")

    @pytest.mark.timeout(120)
    def test_gpu_memory(
        self, make_agent: MakeAgent, spawn_peer: SpawnPeer, peer_bytes: PeerBytes
    ) -> None:
        """CUDA tensors on both sides (runs where torch sees a CUDA GPU)."""
        try:
            import torch
        except ImportError:
            pytest.skip("needs a CUDA GPU")
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU")
        agent = make_agent()
        size = self.buffer_size
        local = torch.from_numpy(random_bytes(21, size)).to("cuda:0")
        torch.cuda.synchronize()
        if MemoryKind.VRAM not in agent.transport.limits.memory_kinds:
            # Declared through ``limits``: this build moves host memory only, and says so.
            vram = MemoryRange(
                int(local.data_ptr()), size, MemoryKind.VRAM, local.device.index or 0
            )
            with pytest.raises(RegistrationError):
                agent.transport.register([vram])
            return
        agent.transport.register(
            [MemoryRange(int(local.data_ptr()), size, MemoryKind.VRAM, local.device.index or 0)]
        )
        peer = spawn_peer(seed=22, device="cuda:0")
        agent.transport.connect("p", peer.metadata)
        expected = random_bytes(22, size)
        src = random_bytes(21, size)
        base = U64(local.data_ptr())
        ours, theirs, lengths = scattered(np.random.default_rng(23), 500, 4096, 65536, size)
        agent.transport.transfer(WRITE, "p", ours.astype(U64) + base, at(peer, theirs), lengths)
        copy_ranges(expected, theirs, src, ours, lengths)
        assert_same_bytes(peer_bytes(peer), expected, "peer GPU buffer after write")

        agent.transport.transfer(READ, "p", [int(base)], at(peer, [0]), [size])
        torch.cuda.synchronize()
        assert_same_bytes(local.cpu().numpy(), expected, "local GPU buffer after read")
        agent.transport.deregister(
            [MemoryRange(int(local.data_ptr()), size, MemoryKind.VRAM, local.device.index or 0)]
        )

    # -- registration and peers ---------------------------------------------------------------

    @pytest.mark.timeout(60)
    def test_registration(
        self, make_agent: MakeAgent, spawn_peer: SpawnPeer, peer_bytes: PeerBytes
    ) -> None:
        agent = make_agent()
        peer = spawn_peer(seed=24)
        agent.transport.connect("p", peer.metadata)
        whole = MemoryRange(agent.addr, agent.buf.nbytes)
        agent.transport.register([whole])  # again: a no-op
        agent.transport.transfer(WRITE, "p", agent.at([0]), at(peer, [0]), [4096])

        other = np.zeros(8192, dtype=np.uint8)
        with pytest.raises(RegistrationError, match="regist"):
            agent.transport.submit(WRITE, "p", [other.ctypes.data], at(peer, [0]), [4096])
        with pytest.raises(RegistrationError, match="regist"):  # straddles the buffer's end
            agent.transport.submit(
                READ, "p", agent.at([agent.buf.size - 100]), at(peer, [0]), [4096]
            )

        extra = MemoryRange(int(other.ctypes.data), other.nbytes)
        agent.transport.register([extra])
        agent.transport.transfer(READ, "p", [other.ctypes.data], at(peer, [MiB]), [8192])
        assert_same_bytes(other, random_bytes(24, peer.size)[MiB : MiB + 8192], "extra buffer")
        agent.transport.deregister([extra])
        agent.transport.deregister([extra])  # unknown now: ignored
        with pytest.raises(RegistrationError):
            agent.transport.submit(READ, "p", [other.ctypes.data], at(peer, [0]), [4096])
        agent.transport.transfer(WRITE, "p", agent.at([4096]), at(peer, [4096]), [4096])

    @pytest.mark.timeout(60)
    def test_remote_range_outside_peer_registration(
        self, make_agent: MakeAgent, spawn_peer: SpawnPeer, peer_bytes: PeerBytes
    ) -> None:
        agent = make_agent(self.fault_options)
        peer = spawn_peer(seed=25)
        agent.transport.connect("p", peer.metadata)
        agent.buf[:] = random_bytes(26, agent.buf.size)
        limit = agent.transport.timeout + self.fault_margin
        end = peer.addr + peer.size
        cases = [(WRITE, end), (WRITE, end - 100), (READ, end + 4096), (READ, peer.addr - 4096)]
        for op, remote in cases:
            start = time.monotonic()
            with pytest.raises((TransferError, RegistrationError)):
                agent.transport.transfer(op, "p", agent.at([0]), [remote], [4096])
            record_fault(
                type(self).__name__,
                f"remote out of range ({op.value})",
                time.monotonic() - start,
                limit,
            )
        # Nothing was written, the transport still works with the same peer.
        expected = random_bytes(25, peer.size)
        agent.transport.transfer(WRITE, "p", agent.at([0]), at(peer, [0]), [4096])
        copy_ranges(expected, [0], agent.buf, [0], [4096])
        assert_same_bytes(peer_bytes(peer), expected, "peer buffer after refused transfers")

    @pytest.mark.timeout(30)
    def test_unknown_peer_and_bad_metadata(self, make_agent: MakeAgent) -> None:
        agent = make_agent()
        with pytest.raises(PeerError, match="nobody"):
            agent.transport.submit(WRITE, "nobody", agent.at([0]), [0], [16])
        for junk in (b"", b"\x00garbage", b'{"session": "127.0.0.1:1"}'):
            with pytest.raises(PeerError):
                agent.transport.connect("p", junk)

    @pytest.mark.timeout(90)
    def test_disconnect_reconnect_restarted_peer(
        self, make_agent: MakeAgent, spawn_peer: SpawnPeer, peer_bytes: PeerBytes
    ) -> None:
        agent = make_agent()
        agent.buf[:] = random_bytes(27, agent.buf.size)
        first = spawn_peer(seed=28)
        agent.transport.connect("p", first.metadata)
        agent.transport.transfer(WRITE, "p", agent.at([0]), at(first, [0]), [MiB])

        agent.transport.disconnect("p")
        agent.transport.disconnect("p")  # unknown now: ignored
        with pytest.raises(PeerError):
            agent.transport.submit(WRITE, "p", agent.at([0]), at(first, [0]), [MiB])
        assert first.exit() == 0

        second = spawn_peer(seed=29)  # the "same" peer restarted: new process, new metadata
        agent.transport.connect("p", second.metadata)
        agent.transport.transfer(WRITE, "p", agent.at([MiB]), at(second, [2 * MiB]), [MiB])
        second_expected = random_bytes(29, second.size)
        copy_ranges(second_expected, [2 * MiB], agent.buf, [MiB], [MiB])
        assert_same_bytes(peer_bytes(second), second_expected, "restarted peer's buffer")

        third = spawn_peer(seed=30)  # connect under a used name replaces the entry
        agent.transport.connect("p", third.metadata)
        agent.transport.transfer(WRITE, "p", agent.at([0]), at(third, [0]), [4096])
        expected = random_bytes(30, third.size)
        copy_ranges(expected, [0], agent.buf, [0], [4096])
        assert_same_bytes(peer_bytes(third), expected, "third peer's buffer")
        assert_same_bytes(peer_bytes(second), second_expected, "the replaced peer's buffer")

    @pytest.mark.timeout(90)
    def test_idle_peer_released_then_connected_again(
        self, make_agent: MakeAgent, spawn_peer: SpawnPeer, peer_bytes: PeerBytes
    ) -> None:
        """``disconnect_idle`` (a control plane's release of a quiet peer) never forgets a peer
        while a batch to it may still move a byte; after it, ``connect`` with the same metadata
        moves bytes again."""
        agent = make_agent()
        agent.buf[:] = random_bytes(32, agent.buf.size)
        peer = spawn_peer(seed=33)
        agent.transport.connect("p", peer.metadata)
        handle = agent.transport.submit(WRITE, "p", agent.at([0]), at(peer, [0]), [8 * MiB])
        if agent.transport.disconnect_idle("p"):  # only possible once the batch drained
            assert handle.drained, "an idle release forgot a peer with a batch in flight"
        else:
            agent.transport.wait(handle)
            assert agent.transport.disconnect_idle("p")
        with pytest.raises(PeerError):
            agent.transport.submit(WRITE, "p", agent.at([0]), at(peer, [0]), [4096])
        assert agent.transport.disconnect_idle("p")  # unknown: nothing to keep
        agent.transport.connect("p", peer.metadata)
        agent.transport.transfer(WRITE, "p", agent.at([9 * MiB]), at(peer, [9 * MiB]), [MiB])
        expected = random_bytes(33, peer.size)
        copy_ranges(expected, [0, 9 * MiB], agent.buf, [0, 9 * MiB], [8 * MiB, MiB])
        assert_same_bytes(peer_bytes(peer), expected, "peer buffer after release and reconnect")

    @pytest.mark.timeout(60)
    def test_close_releases_everything(self, make_agent: MakeAgent, spawn_peer: SpawnPeer) -> None:
        agent = make_agent()
        peer = spawn_peer(options=self.fault_options, seed=31)
        agent.transport.connect("p", peer.metadata)
        metadata = base64.b64encode(agent.transport.metadata()).decode()
        peer.call(cmd="connect", peer="test", metadata=metadata)
        write: dict[str, Any] = dict(
            cmd="transfer", op="write", peer="test", local=[0], lengths=[4096]
        )
        peer.call(remote=agent.at([0]).tolist(), **write)  # reaches us while open

        agent.transport.close()
        agent.transport.close()  # twice is fine
        with pytest.raises(TransportError):
            agent.transport.submit(WRITE, "p", agent.at([0]), at(peer, [0]), [16])
        with pytest.raises(TransportError):
            agent.transport.register([MemoryRange(agent.addr, 4096)])
        with pytest.raises(TransportError):
            agent.transport.connect("q", peer.metadata)

        start = time.monotonic()
        answer = peer.request(remote=agent.at([4096]).tolist(), **write)
        assert not answer["ok"], "a peer could still write into a closed transport's memory"
        assert answer["kind"] in {"TransferError", "TransferTimeoutError", "RegistrationError"}
        limit = self.fault_options.get("timeout", 30) + self.fault_margin
        record_fault(
            type(self).__name__, "write into a closed transport", time.monotonic() - start, limit
        )
        assert not agent.buf[4096:8192].any()

    # -- faults -------------------------------------------------------------------------------

    def _fault_limit(self, agent: Agent, asked_after: float) -> float:
        """How long after its submit a batch to a faulty peer may take to end: its timeout, or
        at once if the test first asked later than that (``_still_works`` meanwhile spawns a
        peer process, which a loaded machine may take longer than the timeout to start), plus
        the margin."""
        return max(agent.transport.timeout, asked_after) + self.fault_margin

    def _still_works(self, agent: Agent, spawn_peer: SpawnPeer, peer_bytes: PeerBytes) -> None:
        """The transport keeps working with another peer."""
        other = spawn_peer(seed=40)
        agent.transport.connect("other", other.metadata)
        agent.buf[: 2 * MiB] = random_bytes(41, 2 * MiB)
        agent.transport.transfer(WRITE, "other", agent.at([0]), at(other, [MiB]), [2 * MiB])
        expected = random_bytes(40, other.size)
        copy_ranges(expected, [MiB], agent.buf, [0], [2 * MiB])
        assert_same_bytes(peer_bytes(other), expected, "another peer after a fault")

    @pytest.mark.timeout(60)
    def test_peer_exited(
        self, make_agent: MakeAgent, spawn_peer: SpawnPeer, peer_bytes: PeerBytes
    ) -> None:
        agent = make_agent(self.fault_options)
        peer = spawn_peer()
        agent.transport.connect("p", peer.metadata)
        agent.transport.transfer(WRITE, "p", agent.at([0]), at(peer, [0]), [MiB])
        assert peer.exit() == 0
        limit = agent.transport.timeout + self.fault_margin
        for op in (WRITE, READ):
            start = time.monotonic()
            with pytest.raises(TransportError):
                agent.transport.transfer(op, "p", agent.at([0]), at(peer, [0]), [MiB])
            record_fault(
                type(self).__name__, f"peer exited ({op.value})", time.monotonic() - start, limit
            )
        self._still_works(agent, spawn_peer, peer_bytes)

    @pytest.mark.timeout(60)
    @pytest.mark.parametrize("op", [WRITE, READ], ids=["write", "read"])
    def test_peer_killed_mid_transfer(
        self, make_agent: MakeAgent, spawn_peer: SpawnPeer, peer_bytes: PeerBytes, op: TransferOp
    ) -> None:
        """The batch fails within the timeout, and its fence proves its end (``DRAINED``): the
        engine ends every part of a batch to a peer that is gone, also of many descriptors."""
        agent = make_agent(self.fault_options)
        peer = spawn_peer()
        agent.transport.connect("p", peer.metadata)
        agent.transport.transfer(WRITE, "p", agent.at([0]), at(peer, [0]), [MiB])
        pieces = 16
        offsets = np.arange(pieces, dtype=U64) * U64(self.buffer_size // pieces)
        lengths = np.full(pieces, self.buffer_size // pieces, dtype=U64)

        def submit() -> Any:
            return agent.transport.submit(op, "p", agent.at(offsets), at(peer, offsets), lengths)

        handle = submit()
        peer.proc.kill()  # SIGKILL while the batch is moving
        start = time.monotonic()
        with pytest.raises(TransportError):
            for _ in range(20):  # the first batch may have landed before the kill
                agent.transport.wait(handle)
                handle = submit()
        limit = agent.transport.timeout + self.fault_margin
        record_fault(
            type(self).__name__, f"peer SIGKILLed mid-{op.value}", time.monotonic() - start, limit
        )
        fence = agent.transport.fence(handle, limit)
        assert fence is Fence.DRAINED, f"the fence of a batch to a killed peer is {fence.name}"
        peer.kill()
        self._still_works(agent, spawn_peer, peer_bytes)

    @pytest.mark.timeout(90)
    def test_peer_frozen(
        self, make_agent: MakeAgent, spawn_peer: SpawnPeer, peer_bytes: PeerBytes
    ) -> None:
        """A stopped peer (SIGSTOP) fails the batch within the timeout; others keep working.

        With ``capabilities.frozen_peer_stalls`` False the batch to the stopped peer must instead
        complete, while the peer is still stopped and within the timeout, with exact bytes."""
        if not self.capabilities.frozen_peer_stalls:
            self._frozen_peer_completes(make_agent, spawn_peer, peer_bytes)
            return
        agent = make_agent(self.fault_options)
        frozen = spawn_peer()
        agent.transport.connect("p", frozen.metadata)
        agent.transport.transfer(WRITE, "p", agent.at([0]), at(frozen, [0]), [MiB])
        frozen.freeze()
        start = time.monotonic()
        handle = agent.transport.submit(WRITE, "p", agent.at([0]), at(frozen, [0]), [8 * MiB])
        t0 = time.monotonic()
        status = agent.transport.poll(handle)
        assert status.state is TransferState.PENDING, (status, f"submit took {t0 - start:.3f} s")
        assert time.monotonic() - t0 < 0.5, "poll blocked on a frozen peer"

        self._still_works(agent, spawn_peer, peer_bytes)  # while the frozen batch is pending
        asked = time.monotonic()
        with pytest.raises(TransportError):
            agent.transport.wait(handle)
        limit = self._fault_limit(agent, asked - start)
        record_fault(type(self).__name__, "peer frozen (SIGSTOP)", time.monotonic() - start, limit)
        assert agent.transport.poll(handle).state is TransferState.FAILED
        frozen.kill()
        self._still_works(agent, spawn_peer, peer_bytes)

    def _frozen_peer_completes(
        self, make_agent: MakeAgent, spawn_peer: SpawnPeer, peer_bytes: PeerBytes
    ) -> None:
        """``test_peer_frozen`` for a transport whose data path does not stall on a stopped peer."""
        agent = make_agent(self.fault_options)
        frozen = spawn_peer(seed=42)
        agent.transport.connect("p", frozen.metadata)
        agent.buf[: 12 * MiB] = random_bytes(43, 12 * MiB)
        expected = random_bytes(42, frozen.size)
        agent.transport.transfer(WRITE, "p", agent.at([0]), at(frozen, [0]), [MiB])
        copy_ranges(expected, [0], agent.buf, [0], [MiB])
        frozen.freeze()
        start = time.monotonic()
        local, remote = [4 * MiB], [16 * MiB + 3]  # _still_works uses the first 2 MiB
        handle = agent.transport.submit(WRITE, "p", agent.at(local), at(frozen, remote), [8 * MiB])
        t0 = time.monotonic()
        assert agent.transport.poll(handle).state in (TransferState.PENDING, TransferState.DONE)
        assert time.monotonic() - t0 < 0.5, "poll blocked on a frozen peer"

        self._still_works(agent, spawn_peer, peer_bytes)  # while the frozen batch is in flight
        asked = time.monotonic()
        agent.transport.wait(handle)  # declared: completes although the peer is stopped
        elapsed = time.monotonic() - start
        limit = self._fault_limit(agent, asked - start)
        assert elapsed < limit, f"the batch to a frozen peer took {elapsed:.2f} s"
        assert agent.transport.poll(handle).state is TransferState.DONE
        assert frozen.stopped is not False, "the peer ran again before its batch completed"
        copy_ranges(expected, remote, agent.buf, local, [8 * MiB])
        frozen.thaw()
        assert_same_bytes(peer_bytes(frozen), expected, "the frozen peer's buffer")
        frozen.kill()
        self._still_works(agent, spawn_peer, peer_bytes)

    @pytest.mark.timeout(90)
    def test_peer_frozen_before_first_contact(
        self, make_agent: MakeAgent, spawn_peer: SpawnPeer, peer_bytes: PeerBytes
    ) -> None:
        """A peer stopped before the first transfer: connect and submit return at once, the batch
        fails within the timeout and others keep working (or, with
        ``capabilities.first_contact_stalls`` False, completes into the stopped peer)."""
        if not self.capabilities.first_contact_stalls:
            self._first_contact_completes(make_agent, spawn_peer, peer_bytes)
            return
        agent = make_agent(self.fault_options)
        frozen = spawn_peer()
        frozen.freeze()
        start = time.monotonic()
        agent.transport.connect("p", frozen.metadata)
        handle = agent.transport.submit(WRITE, "p", agent.at([0]), at(frozen, [0]), [MiB])
        assert time.monotonic() - start < 1.0, "connect/submit blocked on a frozen peer"
        self._still_works(agent, spawn_peer, peer_bytes)
        asked = time.monotonic()
        with pytest.raises(TransportError):
            agent.transport.wait(handle)
        limit = self._fault_limit(agent, asked - start)
        record_fault(
            type(self).__name__, "peer frozen before first contact", time.monotonic() - start, limit
        )
        frozen.kill()
        self._still_works(agent, spawn_peer, peer_bytes)

    def _first_contact_completes(
        self, make_agent: MakeAgent, spawn_peer: SpawnPeer, peer_bytes: PeerBytes
    ) -> None:
        agent = make_agent(self.fault_options)
        frozen = spawn_peer(seed=44)
        frozen.freeze()
        agent.buf[:MiB] = random_bytes(45, MiB)
        for _ in range(200):  # SIGSTOP takes effect once the peer is scheduled (a loaded host)
            if frozen.stopped is not False:
                break
            time.sleep(0.025)
        start = time.monotonic()
        agent.transport.connect("p", frozen.metadata)
        handle = agent.transport.submit(WRITE, "p", agent.at([0]), at(frozen, [MiB]), [MiB])
        assert time.monotonic() - start < 1.0, "connect/submit blocked on a frozen peer"
        agent.transport.wait(handle)  # declared: completes although the peer never ran
        limit = agent.transport.timeout + self.fault_margin
        assert time.monotonic() - start < limit
        assert frozen.stopped is not False, "the peer ran again before its batch completed"
        frozen.thaw()
        expected = random_bytes(44, frozen.size)
        copy_ranges(expected, [MiB], agent.buf, [0], [MiB])
        assert_same_bytes(peer_bytes(frozen), expected, "the frozen peer's buffer")

    # -- fences -------------------------------------------------------------------------------

    #: bytes moved by the stuttering-peer cases (large, so batches are in flight when it stops)
    stutter_size: ClassVar[int] = 256 * MiB
    #: options of the stuttering-peer cases: a short ``timeout``, so the batch fails while the
    #: peer is still stopped
    stutter_options: ClassVar[dict[str, Any] | None] = None

    def _drained(self, agent: Agent, handle: Any) -> None:
        """The peer runs again: the engine must end what it holds and prove it (``DRAINED``)."""
        fence = agent.transport.fence(handle, agent.transport.timeout + self.fault_margin)
        assert fence is Fence.DRAINED, (
            f"the fence of a batch to a peer that runs again is {fence.name}, not DRAINED"
        )

    @pytest.mark.timeout(120)
    @pytest.mark.parametrize("op", [WRITE, READ], ids=["write", "read"])
    def test_nothing_lands_after_the_fence(
        self, make_agent: MakeAgent, spawn_peer: SpawnPeer, peer_bytes: PeerBytes, op: TransferOp
    ) -> None:
        """A batch given up while the peer is frozen: once fenced, no byte of it lands."""
        agent = make_agent(self.fault_options)
        peer = spawn_peer(seed=11)
        agent.transport.connect("p", peer.metadata)
        agent.transport.transfer(WRITE, "p", agent.at([32 * MiB]), at(peer, [32 * MiB]), [MiB])
        size = 16 * MiB
        agent.buf[:size] = random_bytes(12, size)
        peer.freeze()
        handle = agent.transport.submit(op, "p", agent.at([0]), at(peer, [0]), [size])
        time.sleep(0.3)  # the engine takes it (or, through the kernel, even finishes it)
        before = agent.transport.poll(handle).state
        fence = agent.transport.fence(handle, 0.5)
        assert agent.transport.poll(handle).finished
        if before is TransferState.DONE:
            assert fence is Fence.DRAINED
        else:
            assert agent.transport.poll(handle).state is TransferState.FAILED
            assert fence is not Fence.DRAINED, "fenced while the peer is frozen"
        time.sleep(1.0)
        peer.thaw()
        self._drained(agent, handle)
        remote, local = peer_bytes(peer).copy(), agent.buf.copy()
        time.sleep(2.0)
        assert_same_bytes(peer_bytes(peer), remote, "the peer's buffer after the fence")
        assert_same_bytes(agent.buf, local, "the local buffer after the fence")
        self._still_works(agent, spawn_peer, peer_bytes)

    @pytest.mark.timeout(240)
    @pytest.mark.parametrize("op", [WRITE, READ], ids=["write", "read"])
    def test_stuttering_peer_fence(
        self, make_agent: MakeAgent, spawn_peer: SpawnPeer, peer_bytes: PeerBytes, op: TransferOp
    ) -> None:
        """The peer stops mid-batch, runs for 1, 10 or 100 ms, stops again past the timeout: the
        batch fails at its deadline, its fence is never ``UNPROVEN`` for a peer that only
        stopped, and once it is ``DRAINED`` not one byte of either whole buffer changes any more.

        An engine that answers in the short window, or whose own timer fires while the peer is
        stopped, has not shown that its bytes stopped: a fence resting on such a signal lets the
        rest land later, into memory the caller already reused.
        """
        options = self.stutter_options or {**self.fault_options, "timeout": 2}
        size = self.stutter_size
        agent = make_agent(options, size=size)
        peer = spawn_peer(options, size=size)
        agent.transport.connect("p", peer.metadata)
        agent.transport.transfer(WRITE, "p", agent.at([0]), at(peer, [0]), [MiB])  # warm up
        pieces = 64  # several descriptors: engines move them as separate tasks
        offsets = np.arange(pieces, dtype=U64) * U64(size // pieces)
        lengths = np.full(pieces, size // pieces, dtype=U64)
        for seed, window_ms in enumerate((1, 10, 100), start=61):
            # New source bytes each round, so that a late byte differs from what is there.
            if op is WRITE:
                agent.buf[:] = random_bytes(seed, size)
            else:
                peer.call(cmd="fill", seed=seed)
            self._stutter(agent, peer, peer_bytes, op, offsets, lengths, window_ms)

    def _stutter(
        self,
        agent: Agent,
        peer: PeerProcess,
        peer_bytes: PeerBytes,
        op: TransferOp,
        offsets: np.ndarray,
        lengths: np.ndarray,
        window_ms: int,
    ) -> None:
        handle = agent.transport.submit(op, "p", agent.at(offsets), at(peer, offsets), lengths)
        time.sleep(0.02)  # bytes are moving
        peer.freeze()
        while not agent.transport.poll(handle).finished:  # the deadline passes while stopped
            time.sleep(0.05)
        fences = [agent.transport.fence(handle, 0.5)]
        peer.thaw()
        time.sleep(window_ms / 1e3)
        peer.freeze()
        # Stopped again, past any engine timer of the transport's timeout's order.
        deadline = time.monotonic() + agent.transport.timeout + 1.0
        early: np.ndarray | None = None  # the local buffer when a fence first said DRAINED
        while time.monotonic() < deadline:
            fences.append(agent.transport.fence(handle, 0.25))
            if fences[-1] is Fence.DRAINED and early is None:
                early = agent.buf.copy()
        assert Fence.UNPROVEN not in fences, (
            f"{window_ms} ms window: a batch to a peer that only stopped was fenced UNPROVEN"
        )
        peer.thaw()
        self._drained(agent, handle)
        remote, local = peer_bytes(peer).copy(), agent.buf.copy()
        if early is not None:  # said DRAINED while the peer was stopped: nothing moved since
            assert_same_bytes(local, early, f"{window_ms} ms window: the local buffer")
        time.sleep(1.5)
        assert_same_bytes(peer_bytes(peer), remote, f"{window_ms} ms window: the peer's buffer")
        assert_same_bytes(agent.buf, local, f"{window_ms} ms window: the local buffer")
