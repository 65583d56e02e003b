"""Registration: only registered memory moves, on either side.

Local ranges outside the registration are refused at submit, registering again is a no-op,
deregistering takes a range back, and remote ranges outside the peer's registration fail without
a byte written.
"""

# mypy: disable-error-code="arg-type"

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.core.errors import RegistrationError, TransferError
from kvbridge.core.memory import MemoryRange
from kvbridge.testing.conformance.base import (
    READ,
    WRITE,
    ConformanceBase,
    MakeAgent,
    MiB,
    PeerBytes,
    SpawnPeer,
    assert_same_bytes,
    at,
    check_write,
    connected_pair,
)
from kvbridge.testing.peer import random_bytes


class RegistrationTests(ConformanceBase, abstract=True):
    """Registered memory only: local refusals at submit, remote refusals as failed batches."""

    @pytest.mark.timeout(60)
    def test_registration(
        self, make_agent: MakeAgent, spawn_peer: SpawnPeer, peer_bytes: PeerBytes
    ) -> None:
        agent, peer = connected_pair(make_agent, spawn_peer, peer_seed=24)
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
        agent, peer = connected_pair(
            make_agent, spawn_peer, peer_seed=25, agent_seed=26, options=self.fault_options
        )
        limit = agent.transport.timeout + self.fault_margin
        end = peer.addr + peer.size
        cases = [(WRITE, end), (WRITE, end - 100), (READ, end + 4096), (READ, peer.addr - 4096)]
        for op, remote in cases:
            case = f"remote out of range ({op.value})"
            with self._fault_surfaces(case, limit, (TransferError, RegistrationError)):
                agent.transport.transfer(op, "p", agent.at([0]), [remote], [4096])
        # Nothing was written, the transport still works with the same peer.
        expected = random_bytes(25, peer.size)
        what = "peer buffer after refused transfers"
        check_write(agent, peer, peer_bytes, expected, ([0], [0], [4096]), what)
