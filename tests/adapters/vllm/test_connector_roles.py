"""Each connector builds the side of its role only: vLLM's scheduler process gets no worker
state, a worker no scheduler state, and a call of the other side's says so in one line."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvbridge.adapters.vllm.connector import KVBridgeConnector
from tests.adapters.vllm.conftest import hybrid_config


def _connector(role: KVConnectorRole) -> KVBridgeConnector:
    config, _ = hybrid_config()
    ktc = KVTransferConfig(
        kv_connector="KVBridgeConnector",
        kv_role="kv_producer",
        engine_id="roles",
        kv_connector_extra_config={"transport": "cma", "host": "127.0.0.1", "port": 5790},
    )
    vcfg = SimpleNamespace(
        kv_transfer_config=ktc, parallel_config=SimpleNamespace(tensor_parallel_size=1)
    )
    return KVBridgeConnector(vcfg, role, config)


def test_the_scheduler_role_builds_no_worker() -> None:
    sched = _connector(KVConnectorRole.SCHEDULER)
    assert sched.scheduler is not None and sched.worker is None
    assert sched.plane is None
    with pytest.raises(RuntimeError, match="worker-side call on the scheduler connector"):
        sched.register_kv_caches({})
    with pytest.raises(RuntimeError, match="worker-side call"):
        sched.get_finished(set())
    sched.shutdown()  # what vLLM's scheduler calls at exit: nothing of a worker's to close


def test_the_worker_role_builds_no_scheduler() -> None:
    worker = _connector(KVConnectorRole.WORKER)
    assert worker.worker is not None and worker.scheduler is None
    assert worker.plane is None  # until register_kv_caches
    assert worker.get_kv_connector_stats() is None  # nothing moved yet
    assert not worker.has_pending_push_work()
    with pytest.raises(RuntimeError, match="scheduler-side call on a worker connector"):
        worker.build_connector_meta(None)
    worker.shutdown()
