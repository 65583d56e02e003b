"""Mooncake Transfer Engine (TCP on 127.0.0.1) against the transport conformance suite."""

from __future__ import annotations

import time
from typing import Any, ClassVar

import numpy as np
import pytest

from kvbridge.core.batches import Fence
from kvbridge.testing import (
    WRITE,
    MiB,
    TransportConformance,
    assert_same_bytes,
    at,
    random_bytes,
)


class TestMooncake(TransportConformance):
    name = "mooncake"
    options: ClassVar[dict[str, Any]] = {"protocol": "tcp", "timeout": 30}
    # The engine's own transfer timeout cannot go below 5 s; 6 s keeps the fault cases short.
    fault_options: ClassVar[dict[str, Any]] = {"protocol": "tcp", "timeout": 6}

    @pytest.mark.timeout(90)
    def test_released_chunks_never_reach_the_engine(self, make_agent, spawn_peer, peer_bytes):
        """Released while its first chunk is stuck at a frozen peer: the later chunks never
        start, and the fence waits for the first one to come back from the engine."""
        options = {**self.fault_options, "max_batch": 1, "max_in_flight": 1}
        agent = make_agent(options)
        peer = spawn_peer()  # zeros
        agent.transport.connect("p", peer.metadata)
        agent.transport.transfer(WRITE, "p", agent.at([0]), at(peer, [0]), [4096])
        agent.buf[: 4 * MiB] = random_bytes(3, 4 * MiB)
        peer.freeze()
        offsets = [0, MiB, 2 * MiB, 3 * MiB]
        handle = agent.transport.submit(WRITE, "p", agent.at(offsets), at(peer, offsets), [MiB] * 4)
        time.sleep(0.3)
        assert agent.transport.fence(handle, 0.2) is Fence.PENDING  # chunk 1 is in the engine
        peer.thaw()
        assert agent.transport.fence(handle, agent.transport.timeout + 5) is Fence.DRAINED
        landed = peer_bytes(peer)[: 4 * MiB]
        expected = np.zeros(4 * MiB, dtype=np.uint8)
        expected[:MiB] = agent.buf[:MiB]  # only the chunk that was in the engine
        assert_same_bytes(landed, expected, "the peer after a released batch")
