"""The connector's stats in vLLM's KVConnectorStats shape: aggregation and the logged summary."""

from __future__ import annotations

from kvbridge.adapters.vllm.stats import KVBridgeStats
from kvbridge.control.plane import RequestStats


def test_aggregate_and_reduce() -> None:
    a, b = KVBridgeStats(), KVBridgeStats()
    assert a.is_empty() and a.reduce() == {"transfers": 0, "failed": 0}
    a.record(
        RequestStats(transfer_s=0.001, nbytes=2**20, descriptors=4, descriptors_before_merge=9)
    )
    b.record(RequestStats(transfer_s=0.003, nbytes=3 * 2**20, descriptors=2))
    b.record_failure()
    total = a.aggregate(KVBridgeStats(data=b.to_dict()))  # as vLLM rebuilds it from the payload
    out = total.reduce()
    assert out["transfers"] == 2 and out["failed"] == 1 and out["MiB"] == 4.0
    assert out["descriptors"] == 6 and out["descriptors_before_merge"] == 9
    assert out["avg_transfer_ms"] == 2.0 and out["GB/s"] == round(4 * 2**20 / 0.004 / 1e9, 3)
    total.reset()
    assert total.is_empty()


def test_failures_alone_are_reported() -> None:
    s = KVBridgeStats()
    s.record_failure()
    assert not s.is_empty() and s.reduce() == {"transfers": 0, "failed": 1}
