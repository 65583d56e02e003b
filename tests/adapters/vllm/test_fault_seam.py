"""The e2e fault kit reaches the connector's transport through the registry's seam.

``faulty_connector`` (what the e2e runs load into vLLM) installs ``faults`` when the worker
registers its KV caches: a class wrapping the configured transport is registered under its name
(``kvbridge.register_transport(..., replace=True)``), so the connector's own
``load_transport(name)`` builds the wrapper. Checked here in one process over ``cma``, with the
connector built as vLLM builds it (the e2e runs themselves take minutes).
"""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

import kvbridge
from kvbridge.control.plane import ControlPlane
from kvbridge.core.registry import available_transports, load_transport_class
from kvbridge.transports.cma import CmaTransport
from tests.adapters.vllm.conftest import allocate, hybrid_config
from tests.adapters.vllm.e2e import faults
from tests.adapters.vllm.e2e.faulty_connector import FaultyKVBridgeConnector

if not any(t.name == "cma" and t.usable for t in available_transports()):
    pytest.skip("the cma transport is not usable here", allow_module_level=True)


@pytest.fixture
def fault_dir(tmp_path, monkeypatch):
    """``faults`` as a fresh engine process has it; what ``install`` changes is undone after."""
    monkeypatch.setenv(faults.ENV, str(tmp_path))
    monkeypatch.setattr(faults, "_installed", False)
    monkeypatch.setattr(ControlPlane, "_record", ControlPlane._record)  # install wraps it
    yield tmp_path
    if load_transport_class("cma") is not CmaTransport:
        kvbridge.unregister_transport("cma")


def test_the_registered_wrapper_is_what_load_transport_returns(fault_dir):
    wrapper = faults.faulty_class(CmaTransport, fault_dir, "kv_consumer")
    kvbridge.register_transport("cma", wrapper, replace=True)
    assert load_transport_class("cma") is wrapper
    assert wrapper.host_option == CmaTransport.host_option  # what the connector asks first
    transport = kvbridge.load_transport("cma", timeout=5)
    assert isinstance(transport, faults.FaultyTransport)
    assert isinstance(transport.inner, CmaTransport) and transport.inner.timeout == 5
    transport.close()  # through __getattr__ to the real one
    kvbridge.unregister_transport("cma")
    assert load_transport_class("cma") is CmaTransport


@pytest.mark.timeout(60)
def test_the_faulty_connector_loads_the_wrapped_transport(fault_dir):
    config, kernels = hybrid_config()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    ktc = KVTransferConfig(
        kv_connector="FaultyKVBridgeConnector",
        kv_role="kv_consumer",
        engine_id="decode-1",
        kv_connector_extra_config={"transport": "cma", "port": port, "timeout": 10},
    )
    vcfg = SimpleNamespace(
        kv_transfer_config=ktc, parallel_config=SimpleNamespace(tensor_parallel_size=1)
    )
    sched = FaultyKVBridgeConnector(vcfg, KVConnectorRole.SCHEDULER, config)
    assert load_transport_class("cma") is CmaTransport  # the scheduler's side installs nothing
    worker = FaultyKVBridgeConnector(vcfg, KVConnectorRole.WORKER, config)
    try:
        worker.register_kv_caches(allocate(config, kernels, "LBHNC"))
        transport = worker.plane.transport
        assert isinstance(transport, faults.FaultyTransport)
        assert isinstance(transport.inner, CmaTransport)
        assert transport.role == "kv_consumer" and transport.directory == fault_dir
        assert ControlPlane._record.__name__ == "record_outcome"  # outcomes are recorded
    finally:
        worker.shutdown()
    del sched
