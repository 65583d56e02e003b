"""Mooncake's no-progress limits follow kvbridge's timeout (issue 45, item 4).

A Mooncake TCP session that makes no progress is dropped by the engine only after
``MC_TCP_STATUS_TIMEOUT_SEC`` / ``MC_TCP_PROGRESS_TIMEOUT_SEC`` (30 s each by default); until then
its task is not terminal and the batch's fence holds. A pull that stalled past kvbridge's 10 s
deadline thus held D's blocks to about 30 s, and the request answered after 32-50 s. The transport
sets both limits to ``stall_bound(timeout)``.
"""

from __future__ import annotations

import pathlib
import time
from typing import Any

import numpy as np
import pytest

from kvbridge.core.batches import Fence, TransferOp
from kvbridge.core.errors import TransferError
from kvbridge.core.memory import MemoryRange
from kvbridge.transports.mooncake import transport as mc


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """STALL_ENV unset for the test and restored after it; kvbridge's memory of its value too."""
    for name in mc.STALL_ENV:
        monkeypatch.setenv(name, "x")  # recorded, so the variable is removed again afterwards
        monkeypatch.delenv(name)
    monkeypatch.setattr(mc, "_stall_set", None)
    return monkeypatch


@pytest.mark.parametrize(
    ("timeout", "bound"), [(10, 5), (6, 5), (0.1, 5), (12, 6), (30, 15), (300, 30)]
)
def test_stall_bound(timeout: float, bound: int) -> None:
    assert mc.stall_bound(timeout) == bound


def test_sets_both_limits_and_keeps_the_smallest(clean_env: pytest.MonkeyPatch) -> None:
    import os

    mc.bound_stalls(30)
    assert [os.environ[n] for n in mc.STALL_ENV] == ["15", "15"]
    mc.bound_stalls(60)  # a transport with a longer timeout does not loosen an earlier one's bound
    assert [os.environ[n] for n in mc.STALL_ENV] == ["15", "15"]
    mc.bound_stalls(12)
    assert [os.environ[n] for n in mc.STALL_ENV] == ["6", "6"]


def test_the_users_setting_wins(clean_env: pytest.MonkeyPatch, caplog: Any) -> None:
    import os

    clean_env.setenv("MC_TCP_PROGRESS_TIMEOUT_SEC", "45")
    with caplog.at_level("INFO", logger="kvbridge.transports"):
        mc.bound_stalls(10)
    assert os.environ["MC_TCP_PROGRESS_TIMEOUT_SEC"] == "45"
    assert os.environ["MC_TCP_STATUS_TIMEOUT_SEC"] == "5"
    assert "MC_TCP_PROGRESS_TIMEOUT_SEC=45 set by the user wins" in caplog.text


@pytest.mark.timeout(240)
def test_frozen_peer_releases_the_fence_soon_after_the_deadline(
    clean_env: pytest.MonkeyPatch, tmp_path: pathlib.Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A read of 9 descriptors (an MLA prompt's) from a peer frozen after the lanes were up: the
    batch fails at its deadline and the engine drops its stalled sessions at kvbridge's bound
    (its own log says the seconds), so the fence drains, not 30 s per round of sessions later
    (measured here with the engine's default: 97.7 s; with the bound about 15 s)."""
    pytest.importorskip("mooncake.engine")
    import kvbridge
    from kvbridge.testing.peer import PeerProcess

    options = {"protocol": "tcp", "timeout": 4}
    size = 1 << 20
    peer = PeerProcess("mooncake", options, size, tmp_path / "peer.log")
    agent = kvbridge.load_transport("mooncake", **options)
    buf = np.zeros(size, dtype=np.uint8)
    base = int(buf.ctypes.data)
    try:
        agent.register([MemoryRange(base, size)])
        agent.connect("p", peer.metadata)
        offsets = np.arange(9, dtype=np.uint64) * np.uint64(36864)
        lengths = np.full(9, 18432, dtype=np.uint64)
        local, remote = offsets + np.uint64(base), offsets + np.uint64(peer.addr)
        agent.transfer(TransferOp.READ, "p", local, remote, lengths)  # the engine's lanes are up
        peer.freeze()
        t0 = time.monotonic()
        handle = agent.submit(TransferOp.READ, "p", local, remote, lengths)
        with pytest.raises(TransferError):
            agent.wait(handle)  # the deadline (4 s) passes with the chunk in the engine
        fence = agent.fence(handle, 150)
        took = time.monotonic() - t0
        assert fence is Fence.DRAINED
        # The engine's word (glog, on this process's stderr) on why it let go: kvbridge's bound
        # (stall_bound(4) = 5 s), not its 30 s default. The time is reported, not asserted.
        said = capfd.readouterr().err
        bound = mc.stall_bound(options["timeout"])
        assert f"no transfer progress within {bound}s" in said, said[-2000:]
        assert "within 30s" not in said, said[-2000:]
        print(f"fence drained {took:.1f} s after the submit (deadline 4 s, bound {bound} s)")
    finally:
        peer.thaw()
        peer.kill()
        agent.close()
