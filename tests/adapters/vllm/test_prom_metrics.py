"""Prometheus metrics through vLLM's own loggers: what ``/metrics`` exports for kvbridge's stats.

vLLM's objects throughout: a ``VllmConfig`` of a tiny local model (config only, nothing loaded),
the connector class vLLM's factory resolves, vLLM's ``StatLoggerManager``/``PrometheusStatLogger``
fed ``SchedulerStats`` as the engine core sends them, and prometheus_client's default registry,
read back from its text exposition.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from vllm.config import ModelConfig, VllmConfig
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm
from vllm.v1.metrics.loggers import PrometheusStatLogger, StatLoggerManager
from vllm.v1.metrics.prometheus import unregister_vllm_metrics
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.request import RequestStatus

from kvbridge.adapters.vllm.connector import KVBridgeConnector
from kvbridge.adapters.vllm.plugin import register
from kvbridge.adapters.vllm.prom_metrics import KVBridgePromMetrics
from kvbridge.adapters.vllm.stats import KVBridgeStats
from kvbridge.control.plane import RequestStats
from kvbridge.core.registry import available_transports
from tests.adapters.vllm.conftest import allocate, hybrid_config, make_request
from tests.adapters.vllm.e2e.models import llama_config

MODEL = "kvbridge-prom-test"
KiB, MiB, GiB = 2**10, 2**20, 2**30
INF = float("inf")


def _vllm_config(model_dir: Path, connector: str) -> VllmConfig:
    model = ModelConfig(
        model=str(model_dir), served_model_name=MODEL, skip_tokenizer_init=True, max_model_len=1024
    )
    ktc = KVTransferConfig(kv_connector=connector, kv_role="kv_both")
    return VllmConfig(model_config=model, kv_transfer_config=ktc)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    register()  # what vLLM's plugin loading does: the connector names resolve
    path = tmp_path_factory.mktemp("model")
    (path / "config.json").write_text(json.dumps(llama_config()))
    return path


@pytest.fixture(scope="module")
def vllm_config(model_dir: Path) -> VllmConfig:
    return _vllm_config(model_dir, "KVBridgeConnector-mooncake")


@pytest.fixture(autouse=True)
def _clean_registry() -> Iterator[None]:
    unregister_vllm_metrics()  # vLLM's loggers register on the process-wide registry
    yield
    unregister_vllm_metrics()


Samples = dict[tuple[str, frozenset[tuple[str, Any]]], float]


def exported() -> Samples:
    """Every sample of the text exposition (what a scrape of ``/metrics`` reads); bucket
    bounds (``le``, written like Go's floats: ``4.194304e+06``) as floats."""
    text = generate_latest(REGISTRY).decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = {k: float(v) if k == "le" else v for k, v in s.labels.items()}
            out[(s.name, frozenset(labels.items()))] = s.value
    return out


def sample(samples: Samples, name: str, engine: int = 0, **labels: Any) -> float | None:
    key = frozenset({"model_name": MODEL, "engine": str(engine), **labels}.items())
    return samples.get((name, key))


def bounds(samples: Samples, histogram: str, engine: int = 1) -> list[float]:
    """The bucket bounds a histogram exports."""
    return sorted(
        dict(labels)["le"]
        for name, labels in samples
        if name == f"{histogram}_bucket" and dict(labels)["engine"] == str(engine)
    )


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def transfer(
    seconds: float,
    nbytes: int,
    descriptors: int,
    handshake: float = 0.0,
    landed: float = 0.0,
    parts: int = 0,
) -> RequestStats:
    return RequestStats(
        transfer_s=seconds,
        nbytes=nbytes,
        descriptors=descriptors,
        descriptors_before_merge=2 * descriptors,
        handshake_s=handshake,
        landed_after_s=landed,
        streamed_nbytes=nbytes if parts else 0,
        streamed_parts=parts,
    )


def two_workers() -> dict[str, Any]:
    """One step of an engine with two TP workers, aggregated as vLLM's output aggregator does."""
    w0, w1 = KVBridgeStats(), KVBridgeStats()
    w0.record(transfer(0.004, 3 * KiB, 1, handshake=0.15, landed=0.03))
    w0.record(transfer(0.02, 5 * MiB, 40, parts=3))  # P stamped no time: no landed_after_s
    w1.record(transfer(3.0, 2 * GiB, 5000))
    w1.record_failure(RequestStats(fence_s=0.2))
    w1.record_unproven(1)
    w1.record_failure(RequestStats(verify_failed=True))
    w1.record_failure()
    w1.record_lease_expiry()
    w1.record_lease_expiry()
    # Worker → scheduler → API server: the payload crosses processes as ``to_dict()``.
    step = w0.aggregate(KVBridgeConnector.build_kv_connector_stats(w1.to_dict()))
    return step.to_dict()


def test_vllm_builds_kvbridge_metrics_for_every_connector_name(model_dir: Path) -> None:
    for name in ("KVBridgeConnector", "KVBridgeConnector-mooncake", "KVBridgeConnector-cma"):
        config = _vllm_config(model_dir, name)
        cls = KVConnectorFactory.get_connector_class(config.kv_transfer_config)
        assert issubclass(cls, KVBridgeConnector)
        prom = KVConnectorProm(config, ["model_name", "engine"], {0: [MODEL, "0"]})
        assert isinstance(prom.prom_metrics, KVBridgePromMetrics), name
        unregister_vllm_metrics()


def test_prometheus_logger_exports_one_step(vllm_config: VllmConfig) -> None:
    prom = PrometheusStatLogger(vllm_config, engine_indexes=[0, 1])
    assert isinstance(prom.kv_connector_prom.prom_metrics, KVBridgePromMetrics)
    prom.record(SchedulerStats(kv_connector_stats=two_workers()), None, engine_idx=1)
    got = exported()

    def one(name: str, **labels: Any) -> float | None:
        return sample(got, name, engine=1, **labels)

    # Transfer time: 4 ms, 20 ms, 3 s.
    hist = "vllm:kvbridge_transfer_time_seconds"
    assert one(f"{hist}_count") == 3
    assert one(f"{hist}_sum") == pytest.approx(3.024)
    buckets = {0.001: 0, 0.005: 1, 0.025: 2, 2.5: 2, 5.0: 3, INF: 3}
    assert {le: one(f"{hist}_bucket", le=le) for le in buckets} == buckets
    # Bytes: 3 KiB, 5 MiB, 2 GiB.
    hist = "vllm:kvbridge_transfer_bytes"
    assert one(f"{hist}_sum") == 3 * KiB + 5 * MiB + 2 * GiB
    buckets = {1024.0: 0, 4096.0: 1, 4.0 * MiB: 1, 16.0 * MiB: 2, 1.0 * GiB: 2, 4.0 * GiB: 3}
    assert {b: one(f"{hist}_bucket", le=b) for b in buckets} == buckets
    assert bounds(got, hist) == [2.0**e for e in range(10, 35, 2)] + [INF]  # 1 KiB ... 16 GiB
    seconds = bounds(got, "vllm:kvbridge_transfer_time_seconds")
    assert seconds[0] == 0.001 and seconds[-2:] == [60.0, INF]  # 1 ms ... 1 min
    # Descriptors: 1, 40, 5000 (after merging; the unmerged counts are not exported).
    hist = "vllm:kvbridge_transfer_descriptors"
    assert one(f"{hist}_sum") == 5041
    buckets = {1.0: 1, 16.0: 1, 64.0: 2, 4096.0: 2, 16384.0: 3}
    assert {b: one(f"{hist}_bucket", le=b) for b in buckets} == buckets
    # Handshakes: only the transfer that waited for one; fences: only the fenced failure.
    assert one("vllm:kvbridge_handshake_time_seconds_count") == 1
    assert one("vllm:kvbridge_handshake_time_seconds_sum") == pytest.approx(0.15)
    assert one("vllm:kvbridge_handshake_time_seconds_bucket", le=0.1) == 0
    assert one("vllm:kvbridge_fence_time_seconds_count") == 1
    assert one("vllm:kvbridge_fence_time_seconds_sum") == pytest.approx(0.2)
    # From P's answer to the last byte: only the transfer whose P stamped its answer.
    assert one("vllm:kvbridge_landed_after_prefill_seconds_count") == 1
    assert one("vllm:kvbridge_landed_after_prefill_seconds_sum") == pytest.approx(0.03)
    # Layer by layer: the transfer that streamed, in the three chunks of its prefill.
    assert one("vllm:kvbridge_streamed_parts_count") == 1
    assert one("vllm:kvbridge_streamed_parts_bucket", le=2.0) == 0
    assert one("vllm:kvbridge_streamed_parts_bucket", le=3.0) == 1
    assert one("vllm:kvbridge_streamed_bytes_sum") == 5 * MiB
    counters = {
        "vllm:kvbridge_transfers_total": 3,
        "vllm:kvbridge_transfer_failures_total": 3,
        "vllm:kvbridge_lease_expiries_total": 2,
        "vllm:kvbridge_fenced_total": 1,
        "vllm:kvbridge_unproven_fences_total": 1,
        "vllm:kvbridge_verify_failures_total": 1,
    }
    assert {name: one(name) for name in counters} == counters
    # Engine 0 reported nothing: its series exist, at zero.
    assert sample(got, "vllm:kvbridge_transfer_time_seconds_count", engine=0) == 0
    assert sample(got, "vllm:kvbridge_transfers_total", engine=0) == 0


def test_steps_accumulate_and_failures_alone_add_no_observation(vllm_config: VllmConfig) -> None:
    prom = PrometheusStatLogger(vllm_config)
    prom.record(SchedulerStats(kv_connector_stats=two_workers()), None)
    only_failure = KVBridgeStats()
    only_failure.record_failure()
    prom.record(SchedulerStats(kv_connector_stats=only_failure.to_dict()), None)
    prom.record(SchedulerStats(), None)  # a step without connector stats
    got = exported()
    assert sample(got, "vllm:kvbridge_transfer_failures_total") == 4
    assert sample(got, "vllm:kvbridge_transfers_total") == 3
    assert sample(got, "vllm:kvbridge_transfer_time_seconds_count") == 3
    assert sample(got, "vllm:kvbridge_lease_expiries_total") == 2


def test_loads_from_a_prefill_that_cannot_pair_are_counted_apart(vllm_config: VllmConfig) -> None:
    """D's failed loads from an incompatible P: among the failures, and in their own counter
    (what the readiness probe and an operator's alert read)."""
    prom = PrometheusStatLogger(vllm_config)
    stats = KVBridgeStats()
    stats.record_failure(RequestStats(incompatible=True))
    stats.record_failure(RequestStats())  # a peer gone, a timeout: not counted there
    assert stats.reduce() == {"transfers": 0, "failed": 2, "incompatible": 1}
    prom.record(SchedulerStats(kv_connector_stats=stats.to_dict()), None)
    got = exported()
    assert sample(got, "vllm:kvbridge_transfer_failures_total") == 2
    assert sample(got, "vllm:kvbridge_incompatible_loads_total") == 1


def test_stat_logger_manager_hands_each_step_to_observe(
    vllm_config: VllmConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[dict[str, Any], int]] = []
    real = KVBridgePromMetrics.observe

    def spy(self: KVBridgePromMetrics, data: dict[str, Any], engine_idx: int = 0) -> None:
        seen.append((data, engine_idx))
        real(self, data, engine_idx)

    monkeypatch.setattr(KVBridgePromMetrics, "observe", spy)
    # What AsyncLLM builds and calls for every engine-core output (logging and Prometheus).
    manager = StatLoggerManager(vllm_config, engine_idxs=[0, 1])
    data = two_workers()
    manager.record(SchedulerStats(kv_connector_stats=data), None, engine_idx=1)
    manager.log()  # the interval's log line (vLLM's LoggingStatLogger), which must not break
    assert seen == [(data, 1)]
    assert sample(exported(), "vllm:kvbridge_transfers_total", engine=1) == 3


@pytest.mark.timeout(60)
@pytest.mark.skipif(
    not any(t.name == "cma" and t.usable for t in available_transports()),
    reason="the cma transport is not usable here",
)
def test_lease_expiry_on_prefill_reaches_the_stats_and_metrics(vllm_config: VllmConfig) -> None:
    """P publishes, no D ever comes: the lease expires and P's worker counts it."""
    config, kernels = hybrid_config(kernel=32)
    ktc = KVTransferConfig(
        kv_connector="KVBridgeConnector-cma",
        kv_role="kv_producer",
        engine_id="prefill-lease",
        kv_connector_extra_config={"port": _port(), "timeout": 0.1, "lease": 0.3},
    )
    vcfg = SimpleNamespace(
        kv_transfer_config=ktc, parallel_config=SimpleNamespace(tensor_parallel_size=1)
    )
    cls = KVConnectorFactory.get_connector_class(ktc)
    sched = cls(vcfg, KVConnectorRole.SCHEDULER, config)
    worker = cls(vcfg, KVConnectorRole.WORKER, config)
    worker.register_kv_caches(allocate(config, kernels))
    try:
        req = make_request("r1", 130, {"do_remote_decode": True})
        sched.on_new_request(req)
        req.num_computed_tokens = req.num_prompt_tokens
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        delay, params = sched.request_finished_all_groups(req, ([3, 4, 5], [0, 0, 7]))
        assert delay and params is not None
        worker.bind_connector_metadata(sched.build_connector_meta(None))
        worker.start_load_kv(None)
        worker.clear_connector_metadata()
        assert worker.plane.leased == ["r1"]
        deadline = time.monotonic() + 10
        while "r1" not in worker.get_transfer_results(set()).finished_sending:
            assert time.monotonic() < deadline, "the lease did not expire"
            time.sleep(0.02)
        stats = worker.get_kv_connector_stats()
        assert stats is not None and stats.data["lease_expired"] == 1
        assert stats.data["unclaimed"] == 1  # no decode ever claimed it
        assert stats.reduce() == {"transfers": 0, "failed": 0, "lease_expired": 1, "unclaimed": 1}
        assert worker.get_kv_connector_stats() is None  # counted once
    finally:
        worker.shutdown()
    prom = PrometheusStatLogger(vllm_config)
    prom.record(SchedulerStats(kv_connector_stats=stats.to_dict()), None)
    got = exported()
    assert sample(got, "vllm:kvbridge_lease_expiries_total") == 1
    assert sample(got, "vllm:kvbridge_transfer_failures_total") == 0  # P failed no load


def test_holds_reach_prometheus_as_a_counter_and_two_gauges(vllm_config: VllmConfig) -> None:
    """P's scheduler side: prefills declined past the hold limit are counted; the most blocks
    held for decode since start and the bound are gauges (the peak never exceeds the bound)."""
    prom = PrometheusStatLogger(vllm_config)
    for declined, peak in ((0, 12), (3, 40), (2, 40)):
        step = KVBridgeStats()
        step.record_holds(declined, peak, 50)
        prom.record(SchedulerStats(kv_connector_stats=step.to_dict()), None)
    got = exported()
    assert sample(got, "vllm:kvbridge_holds_declined_total") == 5
    assert sample(got, "vllm:kvbridge_held_blocks_peak") == 40
    assert sample(got, "vllm:kvbridge_hold_limit_blocks") == 50
    assert KVBridgeStats(data=step.to_dict()).reduce()["hold_declined"] == 2
