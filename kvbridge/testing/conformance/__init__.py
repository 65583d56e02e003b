"""The conformance suite every transport must pass, written once (fsspec abstract-test style).

For a transport plugin author: install ``kvbridge[testing]`` (pytest and pytest-timeout) and your
package, whose ``kvbridge.transports`` entry point names the transport, then write in your own
tests, e.g. ``tests/test_conformance.py``::

    from typing import Any, ClassVar

    from kvbridge.testing import Capabilities, TransportConformance


    class TestMyTransport(TransportConformance):
        # the entry-point name: kvbridge.load_transport(name, **options) must build it
        name = "mytransport"
        # options for every ordinary case (the suite's agent and its peer processes)
        options: ClassVar[dict[str, Any]] = {"timeout": 30}
        # options for the fault cases (dead, killed, frozen peers): a short ``timeout`` keeps
        # them fast; each fault must surface within ``timeout + fault_margin`` seconds of
        # the submit (or within ``fault_margin`` of the wait, when the suite waits later)
        fault_options: ClassVar[dict[str, Any]] = {"timeout": 8}
        # what the transport cannot do, declared; the defaults are the strict behaviour
        capabilities: ClassVar[Capabilities] = Capabilities(
            frozen_peer_stalls=True, first_contact_stalls=True
        )
        # bytes of every buffer, local and in each peer; 64 MiB or more (the cases place fixed
        # ranges and descriptor sets sized for 64 MiB)
        buffer_size: ClassVar[int] = 64 * MiB

and run ``pytest``. Only ``name`` is required; every other attribute has the default shown above
(``options`` defaults to ``{}``). A test that does not apply to your transport is declared through
``capabilities``, never skipped: the test then checks the other behaviour instead (see
``Capabilities``). Test methods can be overridden like any pytest method, e.g. to add a marker.
The tests skip, with the reason, only where the transport's engine is not installed
(``TransportUnavailableError`` from ``check_available``) or, for ``test_gpu_memory``, where torch
sees no CUDA GPU. Transport-specific tests go in the same class; they can use the fixtures
``make_agent``, ``spawn_peer`` and ``peer_bytes`` and the helpers exported by ``kvbridge.testing``.
The suite passes descriptor arrays to ``submit``/``transfer`` also as plain lists: coerce them
with ``kvbridge.core.descriptors.prepare_batch``, as kvbridge's transports do.
The ``kvbridge`` pytest plugin (installed with kvbridge) prints how long each injected fault took
to surface after the run.

The suite is four mixins over ``ConformanceBase`` (its settings and fixtures), and
``TransportConformance`` is all four. To run a subset, subclass only the mixins you want, e.g.
while a transport's fault handling is still being written::

    from kvbridge.testing import DataPathTests, RegistrationTests


    class TestMyTransportData(DataPathTests, RegistrationTests):
        name = "mytransport"

- ``DataPathTests`` (``data_path.py``): writes and reads of every shape, byte for byte; many
  batches in flight; transfers the peer starts; CUDA memory.
- ``RegistrationTests`` (``registration.py``): only registered memory moves, on either side.
- ``PeerLifecycleTests`` (``peers.py``): bad metadata, disconnect and reconnect, idle release,
  close.
- ``FaultAndFenceTests`` (``faults.py``): exited, killed and frozen peers, and fences.

Everything here goes through ``kvbridge.load_transport`` and the ``Transport`` API, never through
an engine. The test process is one agent; peers are real OS processes on 127.0.0.1
(``python -m kvbridge.testing.peer``, see ``peer.py``), started with the test's interpreter and
environment, so the transport must load there as it does in the test. Data is random bytes from
known seeds, so the suite keeps the exact expected contents of every buffer and compares whole
buffers byte for byte: a wrong byte anywhere, also outside the transferred ranges, fails.
"""

from __future__ import annotations

from kvbridge.testing.conformance.base import (
    FAULT_TIMINGS,
    READ,
    U64,
    WRITE,
    Agent,
    Capabilities,
    ConformanceBase,
    MakeAgent,
    MiB,
    PeerBytes,
    Ranges,
    SpawnPeer,
    assert_same_bytes,
    at,
    check_read,
    check_write,
    connect_back,
    connected_pair,
    copy_ranges,
    peer_transfer_command,
    record_fault,
    scattered,
)
from kvbridge.testing.conformance.data_path import DataPathTests
from kvbridge.testing.conformance.faults import FaultAndFenceTests, even_pieces
from kvbridge.testing.conformance.peers import PeerLifecycleTests
from kvbridge.testing.conformance.registration import RegistrationTests

__all__ = [
    "FAULT_TIMINGS",
    "READ",
    "U64",
    "WRITE",
    "Agent",
    "Capabilities",
    "ConformanceBase",
    "DataPathTests",
    "FaultAndFenceTests",
    "MakeAgent",
    "MiB",
    "PeerBytes",
    "PeerLifecycleTests",
    "Ranges",
    "RegistrationTests",
    "SpawnPeer",
    "TransportConformance",
    "assert_same_bytes",
    "at",
    "check_read",
    "check_write",
    "connect_back",
    "connected_pair",
    "copy_ranges",
    "even_pieces",
    "peer_transfer_command",
    "record_fault",
    "scattered",
]


# pytest collects a class's tests base by base, the last base first: listed in this order, the
# tests run (and are listed) data path first, faults and fences last.
class TransportConformance(
    FaultAndFenceTests, PeerLifecycleTests, RegistrationTests, DataPathTests, abstract=True
):
    """All conformance tests: a transport's test class subclasses it and sets ``name`` (see
    ``kvbridge.testing.conformance``). Every test comes from one of the four mixins."""
