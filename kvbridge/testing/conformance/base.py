"""What every part of the conformance suite stands on: the transport's declared settings, the
fixtures (``make_agent``, ``spawn_peer``, ``peer_bytes``) and the byte-for-byte reference.

``ConformanceBase`` holds the settings and fixtures and runs no test; each group of tests is a
mixin over it (``data_path``, ``registration``, ``peers``, ``faults``). The module-level helpers
are the reference a transfer is held to: ``copy_ranges`` does, one range at a time, what a
transfer must do, and ``check_write``/``check_read`` run a transfer and compare whole buffers
with that reference.
"""

# The suite passes descriptor arrays also as plain lists, on purpose: a transport's ``submit``
# must take any sequence (``kvbridge.core.descriptors.prepare_batch`` coerces them), wider than the
# ``AddrArray`` annotation of the contract.
# mypy: disable-error-code="arg-type"

from __future__ import annotations

import base64
import itertools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

import kvbridge
from kvbridge.core.batches import TransferOp
from kvbridge.core.errors import TransportError, TransportUnavailableError
from kvbridge.core.memory import MemoryRange
from kvbridge.core.registry import load_transport_class
from kvbridge.core.transport import Transport
from kvbridge.testing.peer import PeerProcess, random_bytes

MiB = 1 << 20
WRITE, READ = TransferOp.WRITE, TransferOp.READ

#: (transport, case, seconds until the error surfaced, allowed seconds), shown after the run.
FAULT_TIMINGS: list[tuple[str, str, float, float]] = []

U64 = np.uint64

#: ``(local offsets, remote offsets, lengths)`` of one batch, as ``scattered`` returns them.
Ranges = tuple[Any, Any, Any]


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
    """Fail, naming ``what`` and the first differing offset, unless the two are equal."""
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
    """Keep a fault's timing for the run's summary, and fail if it surfaced too late."""
    FAULT_TIMINGS.append((name, case, elapsed, limit))
    assert elapsed < limit, f"{case}: the error took {elapsed:.2f} s, more than {limit:.1f} s"


def connected_pair(
    make_agent: MakeAgent,
    spawn_peer: SpawnPeer,
    *,
    peer_seed: int | None = None,
    agent_seed: int | None = None,
    options: dict[str, Any] | None = None,
) -> tuple[Agent, PeerProcess]:
    """A new agent (with ``options``, else the ordinary ones) connected as ``"p"`` to a new peer.

    The peer's buffer is filled from ``peer_seed`` and the agent's from ``agent_seed``; a buffer
    without a seed stays zeros.
    """
    agent = make_agent(options)
    peer = spawn_peer(seed=peer_seed)
    agent.transport.connect("p", peer.metadata)
    if agent_seed is not None:
        agent.buf[:] = random_bytes(agent_seed, agent.buf.size)
    return agent, peer


def check_write(
    agent: Agent,
    peer: PeerProcess,
    peer_bytes: PeerBytes,
    expected: np.ndarray,
    ranges: Ranges,
    what: str,
    name: str = "p",
) -> None:
    """Write ``ranges`` from the agent to ``peer`` (connected as ``name``), apply them to
    ``expected`` (what the peer's buffer held) and compare the peer's whole buffer with it."""
    local, remote, lengths = ranges
    agent.transport.transfer(WRITE, name, agent.at(local), at(peer, remote), lengths)
    copy_ranges(expected, remote, agent.buf, local, lengths)
    assert_same_bytes(peer_bytes(peer), expected, what)


def check_read(
    agent: Agent, peer: PeerProcess, expected: np.ndarray, ranges: Ranges, what: str
) -> None:
    """Read ``ranges`` from ``peer`` (connected as ``"p"``, its buffer holding ``expected``) and
    compare the agent's whole buffer with what it held, those ranges replaced."""
    local, remote, lengths = ranges
    reference = agent.buf.copy()
    agent.transport.transfer(READ, "p", agent.at(local), at(peer, remote), lengths)
    copy_ranges(reference, local, expected, remote, lengths)
    assert_same_bytes(agent.buf, reference, what)


def connect_back(peer: PeerProcess, agent: Agent) -> None:
    """Connect ``peer`` to the agent, as its peer ``"test"``: transfers in the other direction."""
    metadata = base64.b64encode(agent.transport.metadata()).decode()
    peer.call(cmd="connect", peer="test", metadata=metadata)


def peer_transfer_command(
    op: TransferOp, agent: Agent, theirs: Any, ours: Any, lengths: Any
) -> dict[str, Any]:
    """The peer's ``transfer`` command (for ``PeerProcess.call`` or ``request``): ``op`` between
    its offsets ``theirs`` and the agent's offsets ``ours``, the agent being its peer ``"test"``
    (``connect_back``)."""
    return dict(
        cmd="transfer",
        op=op.value,
        peer="test",
        local=theirs,
        remote=agent.at(ours).tolist(),
        lengths=lengths,
    )


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


class ConformanceBase:
    """The settings and fixtures every conformance mixin uses; it runs no test itself.

    A test class subclasses ``TransportConformance`` (every test) or one or more of the mixins
    (a subset), sets ``name`` and may override the option dicts, ``capabilities`` and
    ``buffer_size`` (see ``kvbridge.testing.conformance``). A class that is itself a base for
    others, not a test class, passes ``abstract=True`` and need not set ``name``.
    """

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

    def __init_subclass__(cls, abstract: bool = False, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not abstract and not cls.name:
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

    # -- helpers ------------------------------------------------------------------------------

    @contextmanager
    def _fault_surfaces(
        self,
        case: str,
        limit: float,
        errors: type[Exception] | tuple[type[Exception], ...] = TransportError,
        start: float | None = None,
    ) -> Iterator[None]:
        """The block must raise one of ``errors`` within ``limit`` seconds of ``start`` (by
        default, of entering it); the time it took goes to the run's fault timings."""
        begun = time.monotonic() if start is None else start
        with pytest.raises(errors):
            yield
        record_fault(type(self).__name__, case, time.monotonic() - begun, limit)
