"""NIXL (UCX backend) on 127.0.0.1 against the transport conformance suite, plus NIXL specifics.

Two parametrisations: UCX's own choice of transports (``cma``, a kernel copy straight into the
peer's memory, between processes on one host) and TCP over loopback.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Any, ClassVar

import pytest

from kvbridge.core.errors import TransportUnavailableError
from kvbridge.core.registry import load_transport_class
from tests.transports.conformance import TransportConformance

TCP_LOOPBACK = {"TLS": "tcp", "NET_DEVICES": "lo"}


class TestNixl(TransportConformance):
    name = "nixl"
    options: ClassVar[dict[str, Any]] = {"timeout": 30}
    fault_options: ClassVar[dict[str, Any]] = {"timeout": 8}

    @pytest.mark.xfail(
        strict=True,
        reason="UCX picks cma between local processes: the kernel copies into the stopped peer's "
        "memory, so the batch completes instead of stalling (TestNixlTcp covers a frozen peer)",
    )
    def test_peer_frozen(self, make_agent, spawn_peer, peer_bytes) -> None:
        super().test_peer_frozen(make_agent, spawn_peer, peer_bytes)


class TestNixlTcp(TransportConformance):
    name = "nixl"
    options: ClassVar[dict[str, Any]] = {"timeout": 30, "ucx": TCP_LOOPBACK}
    fault_options: ClassVar[dict[str, Any]] = {"timeout": 8, "ucx": TCP_LOOPBACK}


# -- NIXL specifics -------------------------------------------------------------------------------


@pytest.fixture
def nixl() -> None:
    try:
        load_transport_class("nixl")
    except TransportUnavailableError as err:
        pytest.skip(str(err))


def _run(code: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "UCX_MODULES"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


_MAKE = """
    import numpy as np
    import kvbridge
    from kvbridge.core.transport import MemoryRange
    t = kvbridge.load_transport("nixl", ucx={"TLS": "tcp"})
    buf = np.zeros(1 << 20, dtype=np.uint8)
    t.register([MemoryRange(int(buf.ctypes.data), buf.nbytes)])
    t.metadata()
"""


@pytest.mark.timeout(90)
def test_process_with_an_agent_exits_cleanly(nixl: None) -> None:
    """No segfault at interpreter exit, with close() and without (the UCX efa module is left out)."""
    for tail in ("t.close()", "pass"):
        done = _run(_MAKE + f"    {tail}\n    print('end')\n")
        assert (done.returncode, done.stdout.strip()) == (0, "end"), done.stderr[-2000:]


@pytest.mark.timeout(60)
def test_exit_cleanly(nixl: None) -> None:
    code = _MAKE + "    from kvbridge.transports.nixl import exit_cleanly\n    print('end')\n"
    done = _run(code + "    exit_cleanly(3)\n")
    assert (done.returncode, done.stdout.strip()) == (3, "end"), done.stderr[-2000:]


@pytest.mark.timeout(60)
def test_ucx_settings_apply_to_the_agent_only(nixl: None, monkeypatch: pytest.MonkeyPatch) -> None:
    import kvbridge

    monkeypatch.delenv("UCX_TLS", raising=False)
    monkeypatch.delenv("UCX_MODULES", raising=False)
    transport = kvbridge.load_transport("nixl", ucx={"tls": "tcp", "UCX_NET_DEVICES": "lo"})
    try:
        env = transport.ucx_environment  # type: ignore[attr-defined]
        assert env["UCX_TLS"] == "tcp" and env["UCX_NET_DEVICES"] == "lo"
        assert env.get("UCX_MODULES") in {"^efa", None}
        assert "UCX_TLS" not in os.environ and "UCX_MODULES" not in os.environ
    finally:
        transport.close()
