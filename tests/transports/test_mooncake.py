"""Mooncake Transfer Engine (TCP on 127.0.0.1) against the transport conformance suite."""

from __future__ import annotations

from typing import Any, ClassVar

from tests.transports.conformance import TransportConformance


class TestMooncake(TransportConformance):
    name = "mooncake"
    options: ClassVar[dict[str, Any]] = {"protocol": "tcp", "timeout": 30}
    # The engine's own transfer timeout cannot go below 5 s; 6 s keeps the fault cases short.
    fault_options: ClassVar[dict[str, Any]] = {"protocol": "tcp", "timeout": 6}
