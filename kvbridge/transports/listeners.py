"""What an engine listens on, and the interface that holds an address (Linux, stdlib only).

Transfer engines open their own listening sockets (Mooncake's RPC and data ports, UCX's TCP
interfaces). Whoever reaches such a port may read or write the memory an agent registered, so a
transport binds them to its configured host where the engine allows it, and reports the ones it
cannot bind (``Transport.wide_listeners``). This module reads the facts from the kernel:

* ``listening_sockets`` lists the listening TCP sockets (and bound, unconnected UDP sockets) a
  process owns, from ``/proc/<pid>/net/{tcp,tcp6,udp,udp6}`` and the socket inodes of
  ``/proc/<pid>/fd``. Compare two snapshots taken around an engine's start to learn its sockets.
* ``interface_of`` maps an IP address to the network interface that holds it (UCX takes interface
  names, not addresses), from ``SIOCGIFCONF`` (IPv4, secondary addresses included) and
  ``/proc/net/if_inet6``.
"""

from __future__ import annotations

import array
import fcntl
import ipaddress
import logging
import os
import socket
import struct
from collections.abc import Iterable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

_SIOCGIFCONF = 0x8912
_IFREQ_SIZE = 40  # struct ifreq on 64-bit Linux
_TCP_LISTEN = "0A"
_UDP_UNCONNECTED = "07"
#: ``/proc/<pid>/net`` tables and the state that means "accepts peers" in each
_TABLES = (
    ("tcp", _TCP_LISTEN),
    ("tcp6", _TCP_LISTEN),
    ("udp", _UDP_UNCONNECTED),
    ("udp6", _UDP_UNCONNECTED),
)


@dataclass(frozen=True, order=True)
class Listener:
    """A socket that accepts peers: protocol, local address and port, socket inode."""

    protocol: str  #: ``"tcp"`` or ``"udp"``
    address: str  #: the local IP address, ``0.0.0.0`` or ``::`` for every interface
    port: int
    inode: int

    @property
    def wildcard(self) -> bool:
        """True when it accepts on every interface (``0.0.0.0`` or ``::``)."""
        return ipaddress.ip_address(self.address).is_unspecified

    def __str__(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{self.protocol} {host}:{self.port}"


def _decode(field: str) -> tuple[str, int]:
    """``/proc/net/tcp``'s ``ADDR:PORT`` in hex (addresses in host byte order per 32-bit word)."""
    hex_addr, hex_port = field.split(":")
    # Each 32-bit word is printed as a native integer: its native bytes are the network order.
    packed = b"".join(
        struct.pack("=I", int(hex_addr[i : i + 8], 16)) for i in range(0, len(hex_addr), 8)
    )
    address = ipaddress.ip_address(packed)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return str(address), int(hex_port, 16)


def socket_inodes(pid: int | str = "self") -> set[int]:
    """Inodes of the sockets process ``pid`` holds open (``/proc/<pid>/fd``)."""
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    with suppress(OSError):
        for fd in os.listdir(fd_dir):
            with suppress(OSError):
                target = os.readlink(f"{fd_dir}/{fd}")
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
    return inodes


def listening_sockets(pid: int | str = "self") -> list[Listener]:
    """The sockets of process ``pid`` that accept peers, as its network namespace sees them."""
    owned = socket_inodes(pid)
    found = set()
    for table, state in _TABLES:
        with suppress(OSError):
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
            for line in lines:
                fields = line.split()
                if len(fields) < 10 or fields[3] != state:
                    continue
                inode = int(fields[9])
                if inode in owned:
                    address, port = _decode(fields[1])
                    found.add(Listener(table.rstrip("6"), address, port, inode))
    return sorted(found)


def resolve_host(host: str) -> str | None:
    """``host`` as an IP address: itself if it is one, else its first address (None: unknown)."""
    text = host.strip("[]")
    with suppress(ValueError):
        return str(ipaddress.ip_address(text))
    with suppress(OSError):
        infos = socket.getaddrinfo(text, None, type=socket.SOCK_STREAM)
        if infos:
            return str(ipaddress.ip_address(infos[0][4][0]))
    return None


def host_part(hostname: str) -> str:
    """``hostname`` without a ``:port`` suffix (``[v6]:port`` and bare IPv6 addresses kept)."""
    if hostname.startswith("[") and "]" in hostname:
        return hostname[1 : hostname.index("]")]
    if hostname.count(":") == 1:
        return hostname.rsplit(":", 1)[0]
    return hostname


def is_wildcard(address: str) -> bool:
    """True for ``0.0.0.0`` and ``::`` (listen everywhere)."""
    with suppress(ValueError):
        return ipaddress.ip_address(address.strip("[]")).is_unspecified
    return False


def wider_than(listeners: Iterable[Listener], address: str | None) -> list[Listener]:
    """The listeners that accept on more, or other, than ``address`` (None: anything but it)."""
    if address is not None and is_wildcard(address):
        return []  # every interface was asked for
    want = ipaddress.ip_address(address) if address is not None else None
    return [lst for lst in listeners if ipaddress.ip_address(lst.address) != want]


def _ipv4_addresses() -> list[tuple[str, str]]:
    """(interface, address) of every IPv4 address, secondary ones included (``SIOCGIFCONF``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        size = 64 * _IFREQ_SIZE
        while True:
            buf = array.array("B", bytes(size))
            addr, _ = buf.buffer_info()
            ifconf = struct.pack("iL", size, addr)
            used = struct.unpack("iL", fcntl.ioctl(sock.fileno(), _SIOCGIFCONF, ifconf))[0]
            if used < size:  # the kernel filled less than the buffer: it holds every entry
                break
            size *= 2
    raw = buf.tobytes()
    out = []
    for offset in range(0, used, _IFREQ_SIZE):
        name = raw[offset : offset + 16].split(b"\0", 1)[0].decode()
        address = socket.inet_ntoa(raw[offset + 20 : offset + 24])  # sockaddr_in.sin_addr
        out.append((name.split(":", 1)[0], address))  # "eth0:1" labels an address of eth0
    return out


def _ipv6_addresses() -> list[tuple[str, str]]:
    """(interface, address) of every IPv6 address (``/proc/net/if_inet6``)."""
    out = []
    with suppress(OSError):
        for line in Path("/proc/net/if_inet6").read_text().splitlines():
            fields = line.split()
            if len(fields) >= 6:
                out.append((fields[5], str(ipaddress.IPv6Address(bytes.fromhex(fields[0])))))
    return out


def interface_addresses() -> list[tuple[str, str]]:
    """(interface, address) of every address of this network namespace."""
    return _ipv4_addresses() + _ipv6_addresses()


def interface_of(address: str) -> str | None:
    """The name of the interface that holds ``address`` (None: no interface has it)."""
    want = ipaddress.ip_address(address)
    for name, held in interface_addresses():
        if ipaddress.ip_address(held) == want:
            return name
    return None


def check_port_range(port_range: tuple[int, int] | None) -> tuple[int, int] | None:
    """``port_range`` as ``(lo, hi)``, checked: 1 <= lo <= hi <= 65535."""
    if port_range is None:
        return None
    try:
        lo, hi = (int(p) for p in port_range)
    except (TypeError, ValueError):
        raise ValueError(f"port_range must be (lo, hi), got {port_range!r}") from None
    if not 1 <= lo <= hi <= 65535:
        raise ValueError(f"port_range must satisfy 1 <= lo <= hi <= 65535, got {port_range!r}")
    return lo, hi


def settings_not_set(
    ours: dict[str, str], user: dict[str, str], log: logging.Logger, engine: str
) -> dict[str, str]:
    """``ours`` less what the user already set (in ``user`` or the environment), logged.

    ``ours`` are the variables a transport derives from its options (bind to the host, pin the
    ports); a user's explicit setting of the same variable wins, and a log line says so.
    """
    kept = {}
    for name, value in ours.items():
        theirs = user.get(name, os.environ.get(name))
        if theirs is None:
            kept[name] = value
        elif theirs != value:
            log.info(
                "kvbridge %s: %s=%s set by the user wins over the %s kvbridge derived from "
                "its options",
                engine,
                name,
                theirs,
                value,
            )
    return kept


def report_wide(
    engine: str,
    host: str,
    listeners: Iterable[Listener],
    log: logging.Logger,
    labels: dict[int, str] | None = None,
    why: str = "",
) -> list[str]:
    """Describe (and log as a WARNING) the engine listeners that accept beyond ``host``."""
    labels = labels or {}
    wide = [
        f"{lst}" + (f" ({labels[lst.port]})" if lst.port in labels else "")
        for lst in wider_than(listeners, resolve_host(host))
    ]
    if wide:
        log.warning(
            "kvbridge %s: configured host %s, but the engine listens wider: %s%s; whoever "
            "reaches these ports can reach this agent's registered memory (firewall them)",
            engine,
            host,
            ", ".join(wide),
            f" ({why})" if why else "",
        )
    return wide
