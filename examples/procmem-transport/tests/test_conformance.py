"""The whole kvbridge transport conformance suite, run against the example plugin."""

from __future__ import annotations

from typing import Any, ClassVar

from kvbridge.testing import Capabilities, TransportConformance


class TestProcMem(TransportConformance):
    name = "procmem"
    options: ClassVar[dict[str, Any]] = {"timeout": 30}
    fault_options: ClassVar[dict[str, Any]] = {"timeout": 8}
    # The kernel copies into a stopped process, with no connection to set up: a frozen peer
    # does not stall a transfer, not even the first one.
    capabilities: ClassVar[Capabilities] = Capabilities(
        frozen_peer_stalls=False, first_contact_stalls=False
    )


def test_the_plugin_is_found_and_loads() -> None:
    """The suite skips a transport that is not installed or cannot be imported; this fails
    instead, so a broken install of the example cannot pass as skips."""
    from kvbridge.core.registry import load_transport_class

    cls = load_transport_class("procmem")
    assert cls.__module__ == "procmem_transport" and cls.name == "procmem"
