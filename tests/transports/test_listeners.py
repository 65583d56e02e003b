"""What each engine listens on (issue 28), and the helpers that find it out.

The namespace tests make one host with two interfaces: namespace P holds veth A (``kvb0``) and
veth B (``kvb1``), each with its own subnet, joined to namespace D. A transport started in P with
``host`` = A's address must listen on A only: nothing on B's address, nothing on ``0.0.0.0`` or
``::``. The listening sockets are read from the kernel (``/proc/<pid>/net/tcp*`` and the process's
socket inodes) and cross-checked with ``ss``. Mooncake cannot bind its listeners (the engine binds
``INADDR_ANY`` and ``[::]`` with no setting), so its test asserts instead that the transport's
WARNING names every such port. Both get ``port_range`` and must take their ports from it.
"""

from __future__ import annotations

import base64
import contextlib
import ipaddress
import logging
import os
import re
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvbridge
from kvbridge.core.registry import load_transport_class
from kvbridge.testing.peer import PeerProcess, random_bytes
from kvbridge.transports import listeners
from kvbridge.transports.listeners import Listener
from tests.netns import Host, NamespacesUnavailable, _ip, leftovers, two_hosts

pytestmark = pytest.mark.timeout(120)

USABLE = {t.name for t in kvbridge.available_transports() if t.usable}
ENGINES = [
    pytest.param(name, marks=pytest.mark.skipif(name not in USABLE, reason=f"{name} missing"))
    for name in ("mooncake", "nixl")
]
#: below the ephemeral range (32768-60999), so no outgoing connection holds one of them
PORTS = (24100, 24199)
SIZE = 1 << 20
TAG = "kvbl"


# -- pure helpers ---------------------------------------------------------------------------------


def test_decode_reads_proc_net_addresses() -> None:
    assert listeners._decode("0100007F:1F90") == ("127.0.0.1", 8080)
    assert listeners._decode("00000000:3E82") == ("0.0.0.0", 16002)
    assert listeners._decode("00000000000000000000000000000000:0050") == ("::", 80)
    # an IPv4-mapped IPv6 address is reported as the IPv4 address
    assert listeners._decode("0000000000000000FFFF00000200000A:0050") == ("10.0.0.2", 80)
    assert listeners._decode("00000000000000000000000001000000:0016") == ("::1", 22)


def test_listening_sockets_finds_our_own() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        found = [lst for lst in listeners.listening_sockets() if lst.port == port]
        assert [(lst.protocol, lst.address) for lst in found] == [("tcp", "127.0.0.1")]
        assert not found[0].wildcard and str(found[0]) == f"tcp 127.0.0.1:{port}"
    assert all(lst.port != port for lst in listeners.listening_sockets())


def test_interface_of_maps_addresses_to_names() -> None:
    assert listeners.interface_of("127.0.0.1") == "lo"
    assert listeners.interface_of("203.0.113.77") is None  # TEST-NET-3: held by nobody here
    for name, address in listeners.interface_addresses():
        assert listeners.interface_of(address) is not None, (name, address)
        assert name in {n for _, n in socket.if_nameindex()}


def test_host_helpers() -> None:
    assert listeners.host_part("10.0.0.1:1234") == "10.0.0.1"
    assert listeners.host_part("[fd00::1]:1234") == "fd00::1"
    assert listeners.host_part("fd00::1") == "fd00::1"
    assert listeners.resolve_host("localhost") in {"127.0.0.1", "::1"}
    assert listeners.resolve_host("[::1]") == "::1"
    assert listeners.is_wildcard("0.0.0.0") and listeners.is_wildcard("::")
    assert not listeners.is_wildcard("127.0.0.1") and not listeners.is_wildcard("name")


def test_wider_than() -> None:
    a, b = Listener("tcp", "10.0.0.1", 1, 1), Listener("tcp", "10.0.0.2", 2, 2)
    anyv4, anyv6 = Listener("tcp", "0.0.0.0", 3, 3), Listener("tcp", "::", 4, 4)
    every = [a, b, anyv4, anyv6]
    assert listeners.wider_than(every, "10.0.0.1") == [b, anyv4, anyv6]
    assert listeners.wider_than(every, "0.0.0.0") == []
    assert listeners.wider_than(every, None) == every


def test_check_port_range() -> None:
    assert listeners.check_port_range(None) is None
    assert listeners.check_port_range([20000, 20010]) == (20000, 20010)  # type: ignore[arg-type]
    for bad in ((2, 1), (0, 10), (1, 70000), ("a", 2), (1,)):
        with pytest.raises(ValueError, match="port_range"):
            listeners.check_port_range(bad)  # type: ignore[arg-type]


def test_user_settings_win_with_a_log_line(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UCX_TCP_PORT_RANGE", "1-2")
    ours = {"UCX_NET_DEVICES": "eth0", "UCX_TCP_PORT_RANGE": "3-4", "UCX_X": "5"}
    with caplog.at_level(logging.INFO, "kvbridge.transports"):
        kept = listeners.settings_not_set(ours, {"UCX_NET_DEVICES": "all"}, log(), "nixl")
    assert kept == {"UCX_X": "5"}
    assert "UCX_NET_DEVICES=all set by the user wins" in caplog.text
    assert "UCX_TCP_PORT_RANGE=1-2 set by the user wins" in caplog.text


def log() -> logging.Logger:
    return logging.getLogger("kvbridge.transports")


# -- one host with two interfaces -------------------------------------------------------------


@dataclass(frozen=True)
class Net:
    p: Host  # P's namespace, address on interface A (kvb0)
    d: Host  # D's namespace, address on A's subnet
    p_b: str  # P's address on interface B (kvb1)
    d_b: str


@pytest.fixture(scope="module")
def net() -> Iterator[Net]:
    with contextlib.ExitStack() as stack:
        try:
            p, d = stack.enter_context(two_hosts(TAG))
            subnet = f"10.214.{os.getpid() % 254 + 1}"
            veth = ["link", "add", "kvb1", "netns", p.netns, "type", "veth", "peer", "name"]
            _ip(*veth, "kvb1", "netns", d.netns)
            for host, address in ((p, f"{subnet}.1"), (d, f"{subnet}.2")):
                _ip("-n", host.netns, "addr", "add", f"{address}/24", "dev", "kvb1")
                _ip("-n", host.netns, "link", "set", "kvb1", "up")
        except NamespacesUnavailable as err:
            pytest.skip(str(err))
        yield Net(p, d, f"{subnet}.1", f"{subnet}.2")
    assert leftovers(TAG) == [], "network namespaces left behind"


def start(where: Host, transport: str, tmp_path: Path, **options: Any) -> PeerProcess:
    """A conformance peer (transport + one registered buffer) run in ``where``'s namespace."""
    # ``ip netns exec`` (not a thread's setns): it also mounts the namespace's /sys, where UCX
    # looks for network devices; it runs the peer in place, so the pid is the peer's.
    log_path = tmp_path / f"{where.netns}.log"
    prefix = ["ip", "netns", "exec", where.netns]
    peer = PeerProcess(transport, options, SIZE, log_path, start_timeout=90, prefix=prefix)
    assert peer.pid == peer.proc.pid
    return peer


def options(transport: str, address: str, **extra: Any) -> dict[str, Any]:
    name = load_transport_class(transport).host_option
    assert name is not None, f"{transport} has no host option"
    return {"timeout": 10, name: address, "port_range": PORTS, **extra}


def ss_listeners(netns: str, pid: int) -> list[tuple[str, int]]:
    """(address, port) of ``pid``'s listening TCP sockets, as ``ss`` in ``netns`` reports them."""
    out = subprocess.run(
        ["ip", "netns", "exec", netns, "ss", "-ltnpH"],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    ).stdout
    found = []
    for line in out.splitlines():
        if f"pid={pid}," in line:
            host, port = line.split()[3].rsplit(":", 1)
            host = host.strip("[]").split("%")[0]
            found.append(("::" if host == "*" else str(ipaddress.ip_address(host)), int(port)))
    return sorted(found)


@pytest.mark.parametrize("transport", ENGINES)
def test_engine_listens_only_on_the_configured_interface(
    net: Net, tmp_path: Path, transport: str
) -> None:
    """NIXL/UCX: bound to A (``UCX_NET_DEVICES``), nothing on B or a wildcard.

    Mooncake cannot be bound (its RPC and data ports are ``0.0.0.0`` and ``[::]`` by the
    engine's code): the test asserts that its WARNING names each of those ports instead.
    Both take their ports from ``port_range``.
    """
    peer = start(net.p, transport, tmp_path, **options(transport, net.p.address))
    try:
        found = listeners.listening_sockets(peer.pid)
        tcp = sorted((lst.address, lst.port) for lst in found if lst.protocol == "tcp")
        assert tcp == ss_listeners(net.p.netns, peer.pid), found
        assert found, "the engine opened no listener"
        assert all(PORTS[0] <= lst.port <= PORTS[1] for lst in found), found
        assert not any(lst.address == net.p_b for lst in found), found
        log_text = peer.log_path.read_text(errors="replace")
        if transport == "mooncake":
            assert {lst.address for lst in found} <= {"0.0.0.0", "::"}, found
            warning = [line for line in log_text.splitlines() if "listens wider" in line]
            assert len(warning) == 1, log_text[-3000:]
            for lst in found:
                assert str(lst) in warning[0], (lst, warning)
            assert "(RPC)" in warning[0] and "(data)" in warning[0], warning
        else:
            assert {lst.address for lst in found} == {net.p.address}, found
            assert "listens wider" not in log_text, log_text[-3000:]
    finally:
        peer.close()


@pytest.mark.parametrize("transport", ENGINES)
def test_bound_engines_still_move_bytes_between_hosts(
    net: Net, tmp_path: Path, transport: str
) -> None:
    extra = {"ucx": {"TLS": "tcp"}} if transport == "nixl" else {}  # not cma: take the veth
    p = start(net.p, transport, tmp_path, **options(transport, net.p.address, **extra))
    d = start(net.d, transport, tmp_path, **options(transport, net.d.address, **extra))
    try:
        p.call(cmd="fill", seed=5)
        d.call(cmd="fill", seed=6)
        for me, other, name in ((p, d, "d"), (d, p, "p")):
            reply = me.call(cmd="connect", peer=name, metadata=_b64(other.metadata))
            assert reply["ok"], reply
        half = SIZE // 2
        # D reads P's first half into its first half, then writes its second half into P's.
        for op, offset in (("read", 0), ("write", half)):
            reply = d.call(
                cmd="transfer",
                op=op,
                peer="p",
                local=[offset],
                remote=[p.addr + offset],
                lengths=[half],
                timeout=60,
            )
            assert reply["ok"], (op, reply, d.log_tail())
        p_bytes, d_bytes = dump(p, tmp_path / "p.bin"), dump(d, tmp_path / "d.bin")
        p_seed, d_seed = random_bytes(5, SIZE), random_bytes(6, SIZE)
        assert np.array_equal(d_bytes[:half], p_seed[:half])
        assert np.array_equal(p_bytes[half:], d_seed[half:])
        assert np.array_equal(p_bytes[:half], p_seed[:half])  # P's other half untouched
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("transport", ENGINES)
def test_loopback_host_moves_bytes_on_one_host(tmp_path: Path, transport: str) -> None:
    """host = 127.0.0.1 (the connector's default side channel): NIXL is bound to ``lo`` (and
    may still use cma); both engines move bytes between two processes of this host."""
    peers = [
        PeerProcess(transport, options(transport, "127.0.0.1"), SIZE, tmp_path / f"{i}.log")
        for i in range(2)
    ]
    p, d = peers
    try:
        p.call(cmd="fill", seed=7)
        assert d.call(cmd="connect", peer="p", metadata=_b64(p.metadata))["ok"]
        assert p.call(cmd="connect", peer="d", metadata=_b64(d.metadata))["ok"]
        reply = d.call(
            cmd="transfer", op="read", peer="p", local=[0], remote=[p.addr], lengths=[SIZE]
        )
        assert reply["ok"], reply
        assert np.array_equal(dump(d, tmp_path / "d.bin"), random_bytes(7, SIZE))
        if transport == "nixl":
            assert all(lst.address == "127.0.0.1" for lst in listeners.listening_sockets(p.pid))
    finally:
        for peer in peers:
            peer.close()


def dump(peer: PeerProcess, path: Path) -> np.ndarray:
    assert peer.call(cmd="dump", path=str(path))["ok"]
    return np.fromfile(path, dtype=np.uint8)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_warning_names_ports_in_process(caplog: pytest.LogCaptureFixture) -> None:
    """Without namespaces: a Mooncake transport on 127.0.0.1 lists its wide ports."""
    if "mooncake" not in USABLE:
        pytest.skip("mooncake missing")
    with caplog.at_level(logging.WARNING, "kvbridge.transports"):
        transport = kvbridge.load_transport("mooncake", hostname="127.0.0.1")
    try:
        wide = transport.wide_listeners
        assert len(wide) == 2 and any("(RPC)" in w for w in wide), wide
        for item in wide:
            assert re.match(r"tcp (0\.0\.0\.0|\[::\]):\d+ \((RPC|data)\)$", item), item
            assert item.split(" (")[0] in caplog.text
    finally:
        transport.close()
