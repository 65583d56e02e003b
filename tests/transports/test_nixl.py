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

from kvbridge.core.errors import TransportError, TransportUnavailableError
from kvbridge.core.registry import load_transport_class
from kvbridge.testing import Capabilities, TransportConformance
from kvbridge.transports.nixl.transport import _nvidia_gpu_present, _tls_hint

# On a GPU host NIXL's UCX backend refuses a TLS list without a CUDA transport.
TCP_LOOPBACK = {"TLS": "tcp,cuda_copy" if _nvidia_gpu_present() else "tcp", "NET_DEVICES": "lo"}


class TestNixl(TransportConformance):
    name = "nixl"
    options: ClassVar[dict[str, Any]] = {"timeout": 30}
    fault_options: ClassVar[dict[str, Any]] = {"timeout": 8}
    # UCX picks cma between local processes: the kernel copies into the stopped peer's memory, so
    # a batch to a frozen peer completes instead of stalling (TestNixlTcp covers the stall).
    capabilities: ClassVar[Capabilities] = Capabilities(frozen_peer_stalls=False)


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


_MAKE = f"""
    import numpy as np
    import kvbridge
    from kvbridge.core.memory import MemoryRange
    t = kvbridge.load_transport("nixl", ucx={{"TLS": "{TCP_LOOPBACK["TLS"]}"}})
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
    tls = TCP_LOOPBACK["TLS"]
    transport = kvbridge.load_transport("nixl", ucx={"tls": tls, "UCX_NET_DEVICES": "lo"})
    try:
        env = transport.ucx_environment  # type: ignore[attr-defined]
        assert env["UCX_TLS"] == tls and env["UCX_NET_DEVICES"] == "lo"
        assert env.get("UCX_MODULES") in {"^efa", None}
        assert "UCX_TLS" not in os.environ and "UCX_MODULES" not in os.environ
    finally:
        transport.close()


@pytest.mark.timeout(60)
def test_tcp_only_tls_on_a_gpu_host_is_refused_with_the_fix(nixl: None) -> None:
    """NIXL's UCX backend refuses UCX_TLS=tcp where NVIDIA GPUs are present; the error says
    what to add instead of only NIXL's status code."""
    if not _nvidia_gpu_present():
        pytest.skip("needs an NVIDIA GPU host (NIXL accepts TLS=tcp without one)")
    import kvbridge

    with pytest.raises(TransportError, match="add cuda_copy"):
        kvbridge.load_transport("nixl", ucx={"TLS": "tcp"})


def test_tls_hint_names_cuda_copy_only_where_it_helps(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvbridge.transports.nixl.transport as nixl_transport

    monkeypatch.delenv("UCX_TLS", raising=False)
    monkeypatch.setattr(nixl_transport, "_nvidia_gpu_present", lambda: True)
    assert "tcp,cuda_copy" in _tls_hint({"UCX_TLS": "tcp"})
    assert _tls_hint({"UCX_TLS": "tcp,cuda_copy"}) == ""
    assert _tls_hint({}) == ""  # UCX picks its own transports, CUDA included
    monkeypatch.setattr(nixl_transport, "_nvidia_gpu_present", lambda: False)
    assert _tls_hint({"UCX_TLS": "tcp"}) == ""


@pytest.mark.timeout(60)
def test_idle_agent_does_not_spin_a_core(nixl: None) -> None:
    """NIXL's Python API starts the progress thread with no idle wait (a busy loop); the
    transport sets one, so an idle agent leaves the CPU to the engine (0.97 CPU-s/s before)."""
    import resource
    import time

    import kvbridge

    transport = kvbridge.load_transport("nixl", ucx=TCP_LOOPBACK)
    try:
        before, start = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        time.sleep(1.5)
        after, wall = resource.getrusage(resource.RUSAGE_SELF), time.monotonic() - start
        used = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        assert used / wall < 0.5, f"the idle agent used {used / wall:.2f} CPU-seconds per second"
    finally:
        transport.close()
