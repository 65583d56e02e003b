"""Two "hosts" on one machine: two network namespaces joined by a veth pair.

Each namespace has only ``lo`` and its end of the veth (named ``DEVICE`` in both), with its own
address in a private /24, so a process in one reaches the other only through the veth, and
127.0.0.1 in one namespace is not the other's. Needs root and the ``ip`` command (iproute2);
``NamespacesUnavailable`` says why when they cannot be made. Every command is bounded.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

_CLONE_NEWNET = 0x40000000
#: the veth's name inside both namespaces (never in the root namespace: no clash with its links)
DEVICE = "kvb0"
COMMAND_TIMEOUT_S = 10.0


class NamespacesUnavailable(RuntimeError):
    """The namespaces could not be made here (not root, no ``ip``, no permission...)."""


@dataclass(frozen=True)
class Host:
    """One simulated host: a network namespace and its address on the veth."""

    netns: str
    address: str

    def counters(self) -> tuple[int, int]:
        """(received, sent) bytes of this host's veth end so far."""
        out = _ip("-n", self.netns, "-s", "-j", "link", "show", DEVICE)
        stats = json.loads(out)[0]["stats64"]
        return int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"])


def _ip(*args: str) -> str:
    try:
        result = subprocess.run(
            ["ip", *args], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"`ip {' '.join(args)}` took over {COMMAND_TIMEOUT_S:g} s") from None
    if result.returncode != 0:
        raise RuntimeError(
            f"`ip {' '.join(args)}` failed ({result.returncode}): {result.stderr.strip()}"
        )
    return result.stdout


def _remove(netns: str) -> None:
    """Kill what still runs in ``netns`` (only processes this test started live there), drop it.

    Deleting the namespace removes its veth end, and with it the whole pair.
    """
    with contextlib.suppress(RuntimeError):
        for pid in _ip("netns", "pids", netns).split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    with contextlib.suppress(RuntimeError):
        _ip("netns", "delete", netns)


@contextlib.contextmanager
def two_hosts(tag: str = "kvb") -> Iterator[tuple[Host, Host]]:
    """Namespaces ``<tag>-p-<pid>`` and ``<tag>-d-<pid>``, 10.213.<x>.1 and .2, removed after."""
    if os.geteuid() != 0:
        raise NamespacesUnavailable("network namespaces need root")
    if shutil.which("ip") is None:
        raise NamespacesUnavailable("no `ip` command (iproute2)")
    pid = os.getpid()
    subnet = f"10.213.{pid % 254 + 1}"
    p = Host(f"{tag}-p-{pid}", f"{subnet}.1")
    d = Host(f"{tag}-d-{pid}", f"{subnet}.2")
    made: list[str] = []
    try:
        try:
            for host in (p, d):
                made.append(host.netns)  # removed even if `add` failed half way
                _ip("netns", "add", host.netns)
            _ip(
                "link",
                "add",
                DEVICE,
                "netns",
                p.netns,
                "type",
                "veth",
                "peer",
                "name",
                DEVICE,
                "netns",
                d.netns,
            )
            for host in (p, d):
                _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", DEVICE)
                _ip("-n", host.netns, "link", "set", "lo", "up")
                _ip("-n", host.netns, "link", "set", DEVICE, "up")
        except RuntimeError as err:
            raise NamespacesUnavailable(f"could not make two network namespaces: {err}") from err
        yield p, d
    finally:
        for netns in reversed(made):
            _remove(netns)


def leftovers(tag: str = "kvb") -> list[str]:
    """Namespaces of this process's pair that still exist (none after ``two_hosts``)."""
    pid = os.getpid()
    names = {f"{tag}-p-{pid}", f"{tag}-d-{pid}"}
    listed = [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]
    return [name for name in listed if name in names]


def run_in(netns: str, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
    """``fn(*args, **kwargs)`` in a thread that entered ``netns``: what it opens (sockets) and
    starts (subprocesses inherit the thread's namespace) lives there; the caller stays put.

    Linux keeps the network namespace per thread, so no other thread of this process moves.
    """

    def entered() -> T:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/var/run/netns/{netns}", os.O_RDONLY)
        try:
            if libc.setns(fd, _CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns into {netns}: {os.strerror(err)}")
        finally:
            os.close(fd)
        return fn(*args, **kwargs)

    # A thread of its own, ended after: it never goes back to the first namespace.
    with ThreadPoolExecutor(1, thread_name_prefix=f"netns-{netns}") as pool:
        return pool.submit(entered).result()
