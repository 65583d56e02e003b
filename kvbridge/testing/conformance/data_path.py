"""The data path: bytes moved exactly, in every shape a KV-cache transfer takes.

Whole buffers, thousands of small scattered descriptors, batches far above an engine's queue,
empty batches, many batches in flight to one peer and to two, transfers the peer starts, and
CUDA memory on both sides. Every case compares whole buffers, local and remote, byte for byte.
"""

# mypy: disable-error-code="arg-type"

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.core.batches import TransferHandle, TransferOp, TransferState
from kvbridge.core.errors import RegistrationError
from kvbridge.core.memory import MemoryKind, MemoryRange
from kvbridge.testing.conformance.base import (
    READ,
    U64,
    WRITE,
    Agent,
    ConformanceBase,
    MakeAgent,
    MiB,
    PeerBytes,
    Ranges,
    SpawnPeer,
    assert_same_bytes,
    at,
    check_read,
    check_write,
    connect_back,
    connected_pair,
    copy_ranges,
    peer_transfer_command,
    scattered,
)
from kvbridge.testing.peer import PeerProcess, random_bytes


def _submit_expecting(
    agent: Agent,
    name: str,
    peer: PeerProcess,
    op: TransferOp,
    ranges: Ranges,
    local: np.ndarray,
    remote: np.ndarray,
) -> TransferHandle:
    """Submit ``op`` of ``ranges`` to ``peer`` (connected as ``name``) and apply it to ``local``
    and ``remote``, the bytes the two buffers must hold once every batch has ended."""
    ours, theirs, lengths = ranges
    handle = agent.transport.submit(op, name, agent.at(ours), at(peer, theirs), lengths)
    if op is WRITE:
        copy_ranges(remote, theirs, local, ours, lengths)
    else:
        copy_ranges(local, ours, remote, theirs, lengths)
    return handle


def _wait_and_compare(
    agent: Agent,
    handles: list[TransferHandle],
    peer_bytes: PeerBytes,
    peers: list[tuple[PeerProcess, np.ndarray, str]],
    local: np.ndarray,
    when: str,
) -> None:
    """Wait for every batch, then compare each peer's whole buffer with its expected bytes
    (``(peer, expected, what)``) and the agent's with ``local``."""
    for handle in handles:
        agent.transport.wait(handle)
    for peer, expected, what in peers:
        assert_same_bytes(peer_bytes(peer), expected, what)
    assert_same_bytes(agent.buf, local, f"local buffer {when}")


class DataPathTests(ConformanceBase, abstract=True):
    """Bytes moved exactly: writes and reads of every shape, concurrency, GPU memory."""

    @pytest.mark.timeout(60)
    def test_write_then_read(
        self, make_agent: MakeAgent, spawn_peer: SpawnPeer, peer_bytes: PeerBytes
    ) -> None:
        agent, peer = connected_pair(make_agent, spawn_peer, peer_seed=1, agent_seed=2)
        expected = random_bytes(1, peer.size)
        local = [0, 5 * MiB, 9 * MiB + 3]
        remote = [7 * MiB + 1, 1 * MiB, 20 * MiB]
        lengths = [MiB, 3 * MiB + 5, 4097]
        writes = (local, remote, lengths)
        check_write(agent, peer, peer_bytes, expected, writes, "peer buffer after write")

        local = [30 * MiB, 40 * MiB + 7]
        remote = [30 * MiB, 2 * MiB + 1]  # one freshly written range, one untouched
        lengths = [2 * MiB, 65536]
        check_read(agent, peer, expected, (local, remote, lengths), "local buffer after read")

    @pytest.mark.timeout(60)
    def test_large_region(
        self, make_agent: MakeAgent, spawn_peer: SpawnPeer, peer_bytes: PeerBytes
    ) -> None:
        agent, peer = connected_pair(make_agent, spawn_peer, peer_seed=3, agent_seed=4)
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
        agent, peer = connected_pair(make_agent, spawn_peer, peer_seed=6, agent_seed=7)
        rng = np.random.default_rng(8)
        writes = scattered(rng, 5000, 1024, 4096, self.buffer_size)
        expected = random_bytes(6, peer.size)
        check_write(
            agent, peer, peer_bytes, expected, writes, "peer buffer after 5000 scattered writes"
        )
        reads = scattered(rng, 5000, 1, 4096, self.buffer_size)
        check_read(agent, peer, expected, reads, "local buffer after 5000 scattered reads")

    @pytest.mark.timeout(90)
    def test_batch_far_above_engine_queue(
        self, make_agent: MakeAgent, spawn_peer: SpawnPeer, peer_bytes: PeerBytes
    ) -> None:
        """20000 descriptors in one submit: the transport must split and pace them itself."""
        agent, peer = connected_pair(make_agent, spawn_peer, peer_seed=9, agent_seed=10)
        local, remote, lengths = scattered(
            np.random.default_rng(11), 20000, 256, 2048, self.buffer_size
        )
        expected = random_bytes(9, peer.size)
        writes = (local, remote, lengths)
        check_write(agent, peer, peer_bytes, expected, writes, "peer buffer after 20000 writes")
        reads = (remote, local, lengths)
        check_read(agent, peer, expected, reads, "local buffer after 20000 reads")

    @pytest.mark.timeout(30)
    def test_empty_batch(self, make_agent: MakeAgent, spawn_peer: SpawnPeer) -> None:
        agent, _ = connected_pair(make_agent, spawn_peer)
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
        agent, peer = connected_pair(make_agent, spawn_peer, peer_seed=12, agent_seed=13)
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
            ranges = (local + k * slot, remote + k * slot, lengths)
            handles.append(_submit_expecting(agent, "p", peer, op, ranges, reference, expected))
        writes = (peer, expected, "peer buffer after concurrent writes")
        _wait_and_compare(agent, handles, peer_bytes, [writes], reference, "after concurrent reads")

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
            for op, ours, theirs in ((WRITE, base, 0), (READ, half + base, half)):
                local, remote, lengths = scattered(rng, 2500, 512, 4096, half // 2)
                ranges = (local + ours, remote + theirs, lengths)
                handles.append(
                    _submit_expecting(agent, name, peer, op, ranges, reference, expected[name])
                )
        both = [(peer, expected[name], f"peer {name} buffer") for name, peer in peers.items()]
        _wait_and_compare(agent, handles, peer_bytes, both, reference, "after reads from two peers")

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
        connect_back(peer, agent)

        theirs, ours, lengths = [0, 3 * MiB], [1 * MiB + 5, 10 * MiB], [MiB, 4096]
        peer.call(**peer_transfer_command(WRITE, agent, theirs, ours, lengths))
        copy_ranges(reference, ours, expected, theirs, lengths)
        assert_same_bytes(agent.buf, reference, "local buffer after the peer's write")

        theirs, ours, lengths = [20 * MiB], [30 * MiB], [2 * MiB]
        peer.call(**peer_transfer_command(READ, agent, theirs, ours, lengths))
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
        vram = MemoryRange(int(local.data_ptr()), size, MemoryKind.VRAM, local.device.index or 0)
        if MemoryKind.VRAM not in agent.transport.limits.memory_kinds:
            # Declared through ``limits``: this build moves host memory only, and says so.
            with pytest.raises(RegistrationError):
                agent.transport.register([vram])
            return
        agent.transport.register([vram])
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
        agent.transport.deregister([vram])
