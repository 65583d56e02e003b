"""Prometheus metrics of the connector, through vLLM's connector metrics hook.

vLLM's ``PrometheusStatLogger`` (in the API server process) asks the connector class for a
``KVConnectorPromMetrics`` once (``KVBridgeConnector.build_prom_metrics``), handing it the metric
classes to use (prometheus_client's, or Ray's wrappers under Ray metrics), its label names
(``model_name``, ``engine``) and each engine's label values. It then calls ``observe`` with the
stats data of every engine step that reported any (``KVBridgeStats.data``, already summed over
the engine's workers) and the engine's index. vLLM serves the result on its ``/metrics``.

Every series is per engine. A TP engine's ranks each move their own slice, so a request counts
once per rank, as in the ``KV Transfer metrics`` log line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
from vllm.v1.metrics.utils import create_metric_per_engine

from kvbridge.adapters.vllm.stats import measured

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT

#: Seconds: a small request over shared memory takes about a millisecond; the default
#: ``timeout`` is 10 s and a failed transfer's fence may take a few timeouts.
TIME_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                30.0, 60.0]  # fmt: skip
#: Bytes per transfer: 1 KiB to 16 GiB, each 4 times the last.
BYTES_BUCKETS = [float(2**e) for e in range(10, 35, 2)]
#: Descriptors per transfer (after merging): 1 to 1 Mi, each 4 times the last.
DESCRIPTOR_BUCKETS = [float(4**e) for e in range(11)]
#: Prefill steps per layer-wise transfer: 1 to 64 chunks.
PARTS_BUCKETS = [1.0, 2.0, 3.0, 4.0, 8.0, 16.0, 32.0, 64.0]


class _Metric(NamedTuple):
    """One metric: the ``KVBridgeStats.data`` key it records, its Prometheus name and help."""

    key: str
    name: str
    documentation: str


class _Histogram(NamedTuple):
    """A histogram: as ``_Metric``, with its buckets."""

    key: str
    name: str
    documentation: str
    buckets: list[float]


#: Histograms; only ``measured`` values are observed.
HISTOGRAMS = (
    _Histogram(
        "transfer_s",
        "vllm:kvbridge_transfer_time_seconds",
        "Duration of kvbridge KV cache transfers that succeeded (D: its read in pull mode; P and "
        "D: P's write in push mode).",
        TIME_BUCKETS,
    ),
    _Histogram(
        "nbytes",
        "vllm:kvbridge_transfer_bytes",
        "Bytes moved per successful kvbridge KV cache transfer.",
        BYTES_BUCKETS,
    ),
    _Histogram(
        "descriptors",
        "vllm:kvbridge_transfer_descriptors",
        "Descriptors per successful kvbridge KV cache transfer, after merging adjacent ones.",
        DESCRIPTOR_BUCKETS,
    ),
    _Histogram(
        "streamed_nbytes",
        "vllm:kvbridge_streamed_bytes",
        "Of each successful transfer's bytes, those that moved layer by layer while the prefill "
        "instance was still computing the request (layer-wise push or pull; 0 for the others).",
        [0.0, *BYTES_BUCKETS],
    ),
    _Histogram(
        "streamed_parts",
        "vllm:kvbridge_streamed_parts",
        "Of the transfers that moved bytes layer by layer, the prefill steps those bytes came in: "
        "1 for a prefill done in one step, one per chunk of a chunked prefill (each chunk streams "
        "as it is computed).",
        PARTS_BUCKETS,
    ),
    _Histogram(
        "landed_after_s",
        "vllm:kvbridge_landed_after_prefill_seconds",
        "Time from the prefill instance's answer (its forward pass for the prompt ended) until "
        "the last byte of the request's KV cache landed in the decode instance (a push: the "
        "prefill's clock; a pull: the decode's, so across hosts it holds their clock offset). "
        "Layer-wise push shortens it.",
        TIME_BUCKETS,
    ),
    _Histogram(
        "handshake_s",
        "vllm:kvbridge_handshake_time_seconds",
        "Time successful transfers spent on the handshake with their peer (a new or restarted "
        "peer's handshake, or waiting for one in progress); transfers to a known peer spend none "
        "and are not observed.",
        TIME_BUCKETS,
    ),
    _Histogram(
        "fence_s",
        "vllm:kvbridge_fence_time_seconds",
        "Time failed loads waited, after giving up, until no byte of them could still land in the "
        "decode instance's blocks.",
        TIME_BUCKETS,
    ),
)
#: Counters; "nbytes": one transfer per entry.
COUNTERS = (
    _Metric(
        "nbytes",
        "vllm:kvbridge_transfers",
        "Successful kvbridge KV cache transfers.",
    ),
    _Metric(
        "failed",
        "vllm:kvbridge_transfer_failures",
        "Failed kvbridge KV cache loads (recomputed under kv_load_failure_policy=recompute); "
        "counted on the decode instance.",
    ),
    _Metric(
        "lease_expired",
        "vllm:kvbridge_lease_expiries",
        "Prefilled requests whose blocks the prefill instance freed because decode did not "
        "release them within the lease; counted on the prefill instance.",
    ),
    _Metric(
        "unclaimed",
        "vllm:kvbridge_unclaimed_holds",
        "Prefilled requests no decode claimed, freed at the claim timeout (before the lease); "
        "counted on the prefill instance (also in lease expiries).",
    ),
    _Metric(
        "incompatible",
        "vllm:kvbridge_incompatible_loads",
        "Failed loads because prefill and decode cannot pair (different models, block sizes, KV "
        "layouts, transports or TP ranks): decode computes every such prompt until the deployment "
        "is fixed; counted on the decode instance (also in transfer failures), its log names what "
        "differs.",
    ),
    _Metric(
        "hold_declined",
        "vllm:kvbridge_holds_declined",
        "Prefills past the hold limit (max_held_requests, max_held_fraction): the prefill "
        "instance held nothing and decode computed the prompt itself.",
    ),
    _Metric(
        "fenced",
        "vllm:kvbridge_fenced",
        "Failed loads that waited for a fence before their blocks were freed.",
    ),
    _Metric(
        "unproven",
        "vllm:kvbridge_unproven_fences",
        "Failed loads held for good: the transport could not prove that no byte of them still "
        "lands, so their blocks never go back to the engine.",
    ),
    _Metric(
        "verify_failed",
        "vllm:kvbridge_verify_failures",
        "Loads whose integrity check (verify) found a difference between what prefill sent and "
        "decode received.",
    ),
)
#: Gauges: maxima the scheduler reports, set as they come.
GAUGES = (
    _Metric(
        "held_blocks",
        "vllm:kvbridge_held_blocks_peak",
        "The most KV blocks the prefill instance held for decode at one time since start (bounded "
        "by vllm:kvbridge_hold_limit_blocks).",
    ),
    _Metric(
        "hold_limit_blocks",
        "vllm:kvbridge_hold_limit_blocks",
        "The most KV blocks the prefill instance holds for decode at once (max_held_fraction of "
        "its pool).",
    ),
)


class KVBridgePromMetrics(KVConnectorPromMetrics):
    """kvbridge's histograms and counters; ``observe`` records one step's ``KVBridgeStats.data``."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # (data key, per-engine metric) of each kind
        self._histograms: list[tuple[str, dict[int, Any]]] = [
            (h.key, self._histogram(h.name, h.documentation, h.buckets)) for h in HISTOGRAMS
        ]
        self._counters: list[tuple[str, dict[int, Any]]] = [
            (c.key, self._counter(c.name, c.documentation)) for c in COUNTERS
        ]
        self._gauges: list[tuple[str, dict[int, Any]]] = [
            (g.key, self._gauge(g.name, g.documentation)) for g in GAUGES
        ]

    def _gauge(self, name: str, documentation: str) -> dict[int, Any]:
        gauge_cls: Any = self._gauge_cls
        metric = gauge_cls(
            name=name,
            documentation=documentation,
            labelnames=self._labelnames,
            multiprocess_mode="mostrecent",
        )
        return create_metric_per_engine(metric, self.per_engine_labelvalues)

    def _histogram(self, name: str, documentation: str, buckets: list[float]) -> dict[int, Any]:
        # vLLM types the classes it hands in as any of its three metric kinds.
        histogram_cls: Any = self._histogram_cls
        metric = histogram_cls(
            name=name, documentation=documentation, buckets=buckets, labelnames=self._labelnames
        )
        return create_metric_per_engine(metric, self.per_engine_labelvalues)

    def _counter(self, name: str, documentation: str) -> dict[int, Any]:
        metric = self._counter_cls(
            name=name, documentation=documentation, labelnames=self._labelnames
        )
        return create_metric_per_engine(metric, self.per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Record one step's stats data (``KVBridgeStats.data``) for engine ``engine_idx``."""
        data = transfer_stats_data
        for key, histogram in self._histograms:
            child = histogram[engine_idx]
            for value in measured(key, data.get(key) or []):
                child.observe(value)
        for key, counter in self._counters:
            value = data.get(key) or 0
            count = len(value) if isinstance(value, (list, tuple)) else int(value)
            if count:
                counter[engine_idx].inc(count)
        for key, gauge in self._gauges:
            if data.get(key):
                gauge[engine_idx].set(int(data[key]))
