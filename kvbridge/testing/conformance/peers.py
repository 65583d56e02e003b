"""The peer lifecycle: connect, disconnect, release and close, as a control plane drives them.

Unknown peers and bad metadata are refused, a restarted peer is connected again under its name,
an idle release never forgets a peer with bytes in flight, and a closed transport refuses every
call and lets no peer write into its memory.
"""

# mypy: disable-error-code="arg-type"

from __future__ import annotations

import time

import pytest

from kvbridge.core.errors import PeerError, TransportError
from kvbridge.core.memory import MemoryRange
from kvbridge.testing.conformance.base import (
    WRITE,
    ConformanceBase,
    MakeAgent,
    MiB,
    PeerBytes,
    SpawnPeer,
    assert_same_bytes,
    at,
    check_write,
    connect_back,
    connected_pair,
    copy_ranges,
    peer_transfer_command,
    record_fault,
)
from kvbridge.testing.peer import random_bytes


class PeerLifecycleTests(ConformanceBase, abstract=True):
    """Peers coming and going: bad metadata, restarts, idle release, close."""

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
        agent, first = connected_pair(make_agent, spawn_peer, peer_seed=28, agent_seed=27)
        agent.transport.transfer(WRITE, "p", agent.at([0]), at(first, [0]), [MiB])

        agent.transport.disconnect("p")
        agent.transport.disconnect("p")  # unknown now: ignored
        with pytest.raises(PeerError):
            agent.transport.submit(WRITE, "p", agent.at([0]), at(first, [0]), [MiB])
        assert first.exit() == 0

        second = spawn_peer(seed=29)  # the "same" peer restarted: new process, new metadata
        agent.transport.connect("p", second.metadata)
        second_expected = random_bytes(29, second.size)
        ranges = ([MiB], [2 * MiB], [MiB])
        check_write(agent, second, peer_bytes, second_expected, ranges, "restarted peer's buffer")

        third = spawn_peer(seed=30)  # connect under a used name replaces the entry
        agent.transport.connect("p", third.metadata)
        expected = random_bytes(30, third.size)
        check_write(agent, third, peer_bytes, expected, ([0], [0], [4096]), "third peer's buffer")
        assert_same_bytes(peer_bytes(second), second_expected, "the replaced peer's buffer")

    @pytest.mark.timeout(90)
    def test_idle_peer_released_then_connected_again(
        self, make_agent: MakeAgent, spawn_peer: SpawnPeer, peer_bytes: PeerBytes
    ) -> None:
        """``disconnect_idle`` (a control plane's release of a quiet peer) never forgets a peer
        while a batch to it may still move a byte; after it, ``connect`` with the same metadata
        moves bytes again."""
        agent, peer = connected_pair(make_agent, spawn_peer, peer_seed=33, agent_seed=32)
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
        expected = random_bytes(33, peer.size)
        copy_ranges(expected, [0], agent.buf, [0], [8 * MiB])  # the batch before the release
        what = "peer buffer after release and reconnect"
        check_write(agent, peer, peer_bytes, expected, ([9 * MiB], [9 * MiB], [MiB]), what)

    @pytest.mark.timeout(60)
    def test_close_releases_everything(self, make_agent: MakeAgent, spawn_peer: SpawnPeer) -> None:
        agent = make_agent()
        peer = spawn_peer(options=self.fault_options, seed=31)
        agent.transport.connect("p", peer.metadata)
        connect_back(peer, agent)
        # reaches us while open
        peer.call(**peer_transfer_command(WRITE, agent, [0], [0], [4096]))

        agent.transport.close()
        agent.transport.close()  # twice is fine
        with pytest.raises(TransportError):
            agent.transport.submit(WRITE, "p", agent.at([0]), at(peer, [0]), [16])
        with pytest.raises(TransportError):
            agent.transport.register([MemoryRange(agent.addr, 4096)])
        with pytest.raises(TransportError):
            agent.transport.connect("q", peer.metadata)

        start = time.monotonic()
        answer = peer.request(**peer_transfer_command(WRITE, agent, [0], [4096], [4096]))
        assert not answer["ok"], "a peer could still write into a closed transport's memory"
        assert answer["kind"] in {"TransferError", "TransferTimeoutError", "RegistrationError"}
        limit = self.fault_options.get("timeout", 30) + self.fault_margin
        record_fault(
            type(self).__name__, "write into a closed transport", time.monotonic() - start, limit
        )
        assert not agent.buf[4096:8192].any()
