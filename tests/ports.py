"""Loopback ports for tests."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A loopback port nothing listens on (bound once, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
