"""Faults and fences: peers that exit, are killed or stop, and what a fence must prove after.

Every fault must surface as an error within the transport's timeout (plus ``fault_margin``) and
leave the transport working with other peers. A fence (``Transport.fence``) must never say
``DRAINED`` while a byte of the batch may still land: once it does, neither whole buffer changes
any more, also for a peer that stops, runs for a few milliseconds and stops again.
"""

# mypy: disable-error-code="arg-type"

from __future__ import annotations

import time
from collections.abc import Collection
from typing import Any, ClassVar

import numpy as np
import pytest

from kvbridge.core.batches import Fence, TransferHandle, TransferOp, TransferState
from kvbridge.testing.conformance.base import (
    READ,
    U64,
    WRITE,
    Agent,
    ConformanceBase,
    MakeAgent,
    MiB,
    PeerBytes,
    SpawnPeer,
    assert_same_bytes,
    at,
    check_write,
    connected_pair,
    copy_ranges,
)
from kvbridge.testing.peer import PeerProcess, random_bytes


def even_pieces(size: int, pieces: int) -> tuple[np.ndarray, np.ndarray]:
    """``(offsets, lengths)`` of ``pieces`` equal descriptors covering ``size`` bytes: engines
    move separate descriptors as separate tasks, so a fault meets some of them mid-way."""
    offsets = np.arange(pieces, dtype=U64) * U64(size // pieces)
    lengths = np.full(pieces, size // pieces, dtype=U64)
    return offsets, lengths


#: a case run once for each direction, its ids ``write`` and ``read``
BY_OP = pytest.mark.parametrize("op", [WRITE, READ], ids=["write", "read"])


class FaultAndFenceTests(ConformanceBase, abstract=True):
    """Dead, killed and frozen peers (errors in time, other peers unharmed) and fences."""

    #: bytes moved by the stuttering-peer cases (large, so batches are in flight when it stops)
    stutter_size: ClassVar[int] = 256 * MiB
    #: options of the stuttering-peer cases: a short ``timeout``, so the batch fails while the
    #: peer is still stopped
    stutter_options: ClassVar[dict[str, Any] | None] = None

    # -- helpers ------------------------------------------------------------------------------

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
        expected = random_bytes(40, other.size)
        what = "another peer after a fault"
        check_write(agent, other, peer_bytes, expected, ([0], [MiB], [2 * MiB]), what, "other")

    def _warm_pair(
        self, make_agent: MakeAgent, spawn_peer: SpawnPeer, seed: int | None = None
    ) -> tuple[Agent, PeerProcess]:
        """An agent with the fault options connected to a new peer (its buffer filled from
        ``seed``), after one 1 MiB write: the connection is set up before the fault."""
        agent, peer = connected_pair(
            make_agent, spawn_peer, peer_seed=seed, options=self.fault_options
        )
        agent.transport.transfer(WRITE, "p", agent.at([0]), at(peer, [0]), [MiB])
        return agent, peer

    def _submit_to_frozen(
        self,
        agent: Agent,
        frozen: PeerProcess,
        local: int,
        remote: int,
        states: Collection[TransferState],
    ) -> tuple[TransferHandle, float]:
        """Stop ``frozen`` and submit 8 MiB to it: ``poll`` answers at once with one of
        ``states``. Returns the handle and when the submit began."""
        frozen.freeze()
        start = time.monotonic()
        handle = agent.transport.submit(
            WRITE, "p", agent.at([local]), at(frozen, [remote]), [8 * MiB]
        )
        t0 = time.monotonic()
        status = agent.transport.poll(handle)
        assert status.state in states, (status, f"submit took {t0 - start:.3f} s")
        assert time.monotonic() - t0 < 0.5, "poll blocked on a frozen peer"
        return handle, start

    def _first_contact(
        self, agent: Agent, frozen: PeerProcess, remote: int
    ) -> tuple[TransferHandle, float]:
        """Connect to the stopped ``frozen`` and submit 1 MiB to it: both return at once.
        Returns the handle and when the connect began."""
        start = time.monotonic()
        agent.transport.connect("p", frozen.metadata)
        handle = agent.transport.submit(WRITE, "p", agent.at([0]), at(frozen, [remote]), [MiB])
        assert time.monotonic() - start < 1.0, "connect/submit blocked on a frozen peer"
        return handle, start

    def _drained(self, agent: Agent, handle: Any) -> None:
        """The peer runs again: the engine must end what it holds and prove it (``DRAINED``)."""
        fence = agent.transport.fence(handle, agent.transport.timeout + self.fault_margin)
        assert fence is Fence.DRAINED, (
            f"the fence of a batch to a peer that runs again is {fence.name}, not DRAINED"
        )

    def _nothing_moves_once_drained(
        self,
        agent: Agent,
        peer: PeerProcess,
        peer_bytes: PeerBytes,
        handle: Any,
        settle: float,
        when: str,
        early: np.ndarray | None = None,
    ) -> None:
        """``peer`` runs again and the batch is fenced ``DRAINED``: then no byte of either whole
        buffer changes in ``settle`` seconds (nor, where ``early`` is given, since the local
        buffer was ``early``)."""
        peer.thaw()
        self._drained(agent, handle)
        remote, local = peer_bytes(peer).copy(), agent.buf.copy()
        if early is not None:  # said DRAINED while the peer was stopped: nothing moved since
            assert_same_bytes(local, early, f"{when}: the local buffer")
        time.sleep(settle)
        assert_same_bytes(peer_bytes(peer), remote, f"{when}: the peer's buffer")
        assert_same_bytes(agent.buf, local, f"{when}: the local buffer")

    # -- faults -------------------------------------------------------------------------------

    @pytest.mark.timeout(60)
    def test_peer_exited(
        self, make_agent: MakeAgent, spawn_peer: SpawnPeer, peer_bytes: PeerBytes
    ) -> None:
        agent, peer = self._warm_pair(make_agent, spawn_peer)
        assert peer.exit() == 0
        limit = agent.transport.timeout + self.fault_margin
        for op in (WRITE, READ):
            with self._fault_surfaces(f"peer exited ({op.value})", limit):
                agent.transport.transfer(op, "p", agent.at([0]), at(peer, [0]), [MiB])
        self._still_works(agent, spawn_peer, peer_bytes)

    @pytest.mark.timeout(60)
    @BY_OP
    def test_peer_killed_mid_transfer(
        self, make_agent: MakeAgent, spawn_peer: SpawnPeer, peer_bytes: PeerBytes, op: TransferOp
    ) -> None:
        """The batch fails within the timeout, and its fence proves its end (``DRAINED``): the
        engine ends every part of a batch to a peer that is gone, also of many descriptors."""
        agent, peer = self._warm_pair(make_agent, spawn_peer)
        offsets, lengths = even_pieces(self.buffer_size, 16)

        def submit() -> Any:
            return agent.transport.submit(op, "p", agent.at(offsets), at(peer, offsets), lengths)

        handle = submit()
        peer.proc.kill()  # SIGKILL while the batch is moving
        limit = agent.transport.timeout + self.fault_margin
        with self._fault_surfaces(f"peer SIGKILLed mid-{op.value}", limit):
            for _ in range(20):  # the first batch may have landed before the kill
                agent.transport.wait(handle)
                handle = submit()
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
        agent, frozen = self._warm_pair(make_agent, spawn_peer)
        handle, start = self._submit_to_frozen(agent, frozen, 0, 0, {TransferState.PENDING})

        self._still_works(agent, spawn_peer, peer_bytes)  # while the frozen batch is pending
        limit = self._fault_limit(agent, time.monotonic() - start)
        with self._fault_surfaces("peer frozen (SIGSTOP)", limit, start=start):
            agent.transport.wait(handle)
        assert agent.transport.poll(handle).state is TransferState.FAILED
        frozen.kill()
        self._still_works(agent, spawn_peer, peer_bytes)

    def _frozen_peer_completes(
        self, make_agent: MakeAgent, spawn_peer: SpawnPeer, peer_bytes: PeerBytes
    ) -> None:
        """``test_peer_frozen`` for a transport whose data path does not stall on a stopped peer."""
        agent, frozen = connected_pair(
            make_agent, spawn_peer, peer_seed=42, options=self.fault_options
        )
        agent.buf[: 12 * MiB] = random_bytes(43, 12 * MiB)
        expected = random_bytes(42, frozen.size)
        agent.transport.transfer(WRITE, "p", agent.at([0]), at(frozen, [0]), [MiB])
        copy_ranges(expected, [0], agent.buf, [0], [MiB])
        local, remote = 4 * MiB, 16 * MiB + 3  # _still_works uses the first 2 MiB
        in_flight = {TransferState.PENDING, TransferState.DONE}
        handle, start = self._submit_to_frozen(agent, frozen, local, remote, in_flight)

        self._still_works(agent, spawn_peer, peer_bytes)  # while the frozen batch is in flight
        asked = time.monotonic()
        agent.transport.wait(handle)  # declared: completes although the peer is stopped
        elapsed = time.monotonic() - start
        limit = self._fault_limit(agent, asked - start)
        assert elapsed < limit, f"the batch to a frozen peer took {elapsed:.2f} s"
        assert agent.transport.poll(handle).state is TransferState.DONE
        assert frozen.stopped is not False, "the peer ran again before its batch completed"
        copy_ranges(expected, [remote], agent.buf, [local], [8 * MiB])
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
        handle, start = self._first_contact(agent, frozen, 0)
        self._still_works(agent, spawn_peer, peer_bytes)
        limit = self._fault_limit(agent, time.monotonic() - start)
        with self._fault_surfaces("peer frozen before first contact", limit, start=start):
            agent.transport.wait(handle)
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
        handle, start = self._first_contact(agent, frozen, MiB)
        agent.transport.wait(handle)  # declared: completes although the peer never ran
        limit = agent.transport.timeout + self.fault_margin
        assert time.monotonic() - start < limit
        assert frozen.stopped is not False, "the peer ran again before its batch completed"
        frozen.thaw()
        expected = random_bytes(44, frozen.size)
        copy_ranges(expected, [MiB], agent.buf, [0], [MiB])
        assert_same_bytes(peer_bytes(frozen), expected, "the frozen peer's buffer")

    # -- fences -------------------------------------------------------------------------------

    @pytest.mark.timeout(120)
    @BY_OP
    def test_nothing_lands_after_the_fence(
        self, make_agent: MakeAgent, spawn_peer: SpawnPeer, peer_bytes: PeerBytes, op: TransferOp
    ) -> None:
        """A batch given up while the peer is frozen: once fenced, no byte of it lands."""
        agent, peer = connected_pair(
            make_agent, spawn_peer, peer_seed=11, options=self.fault_options
        )
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
        self._nothing_moves_once_drained(agent, peer, peer_bytes, handle, 2.0, "after the fence")
        self._still_works(agent, spawn_peer, peer_bytes)

    @pytest.mark.timeout(240)
    @BY_OP
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
        offsets, lengths = even_pieces(size, 64)
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
        when = f"{window_ms} ms window"
        self._nothing_moves_once_drained(agent, peer, peer_bytes, handle, 1.5, when, early)
