"""The revocable table same-host kernel-copy transports (cma, the procmem example) copy under."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvbridge.core.errors import RegistrationError, TransferError
from kvbridge.core.memory import MemoryRange
from kvbridge.transports.host_access import PeerRanges, PublishedRanges

U64 = np.uint64


def _descs(addr: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    return np.array([addr], dtype=U64), np.array([size], dtype=U64)


@pytest.mark.timeout(30)
def test_deregister_waits_for_a_copy_in_progress_and_then_refuses() -> None:
    owner = PublishedRanges("kvbridge-test", timeout=10)
    try:
        owner.publish([MemoryRange(0x1000, 0x1000)])
        peer = PeerRanges(str(owner.path), timeout=10)
        events: list[str] = []
        with peer.access(*_descs(0x1000, 16), "copy"):
            revoker = threading.Thread(target=lambda: (owner.publish([]), events.append("revoked")))
            revoker.start()
            time.sleep(0.3)  # the owner must still be waiting for this copy
            events.append("copy done")
        revoker.join(10)
        assert events == ["copy done", "revoked"]
        with pytest.raises(RegistrationError, match="not inside registered memory"):
            peer.check(*_descs(0x1000, 16), "copy")
    finally:
        owner.close()


@pytest.mark.timeout(30)
def test_a_frozen_copy_bounds_the_owner_and_close_revokes() -> None:
    owner = PublishedRanges("kvbridge-test", timeout=0.3)
    owner.publish([MemoryRange(0x1000, 0x1000)])
    peer = PeerRanges(str(owner.path), timeout=0.3)
    frozen = peer.access(*_descs(0x1000, 16), "copy")  # a peer that never finishes its copy
    with frozen, pytest.raises(RegistrationError, match="do not free them yet"):
        owner.publish([])
    peer.check(*_descs(0x1000, 16), "copy")  # the ranges stayed published
    owner.close()
    owner.close()  # twice is fine
    with pytest.raises(TransferError, match="closed its transport"):
        peer.check(*_descs(0x1000, 16), "copy")
    with (
        pytest.raises(TransferError, match="closed its transport"),
        peer.access(*_descs(0x1000, 16), "copy"),
    ):
        pass
