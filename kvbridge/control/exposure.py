"""The side channel's settings that weaken security, refused in one place for every entry point.

The connector, the CLI and ``ControlPlane`` all call ``refuse_weak_settings`` before anything
binds a port: an empty secret (which would turn authentication off), a port outside 1-65535
for any TP rank (``port + rank``), and a side channel reachable from other hosts without a
secret, unless the caller says ``insecure`` on purpose.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

from kvbridge.core.errors import KvbridgeError


class WeakSettingError(KvbridgeError, ValueError):
    """A side-channel setting that would weaken security or cannot work; the message says how
    to fix it."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this host only (127.0.0.0/8, ::1, ``localhost``)."""
    name = host.strip("[]")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def refuse_weak_settings(
    host: str,
    ports: Sequence[int],
    secret: bytes | str | None,
    *,
    insecure: bool = False,
    where: str = "kvbridge",
) -> None:
    """Raise ``WeakSettingError`` for settings that must not start; ``where`` names the entry
    point in the message (an option prefix, a CLI flag).

    ``ports``: every port the engine binds (one per TP rank; 0 means any free port). A secret of
    ``None`` means none: allowed on a loopback ``host`` only, or with ``insecure``.
    """
    if secret is not None and len(secret) == 0:
        raise WeakSettingError(
            f"{where}: the secret is empty, which would turn authentication off; give a "
            "non-empty secret (e.g. `openssl rand -hex 32`), or none at all on a loopback host"
        )
    for rank, port in enumerate(ports):
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
            which = f"port + rank ({ports[0]} + {rank})" if rank else "port"
            raise WeakSettingError(
                f"{where}: side-channel {which} = {port!r} is outside 1-65535; lower the port so "
                f"that port..port+{len(ports) - 1} fit (TP rank r binds port + r)"
            )
    if secret is None and not insecure and not is_loopback(host):
        raise WeakSettingError(
            f"{where}: the side channel on {host} is reachable from other hosts but has no "
            "secret, so any of them could claim, abort or push requests; set a secret (the same "
            "on every instance, e.g. KVBRIDGE_SECRET_FILE), or say insecure: true to run an "
            "isolated test network without one"
        )
