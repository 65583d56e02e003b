"""Transfer statistics in vLLM's connector stats format (``KVConnectorStats``).

Workers collect one record per finished transfer; vLLM ships ``data`` to its logger process,
rebuilds the object with ``KVBridgeConnector.build_kv_connector_stats`` and logs ``reduce()``
("KV Transfer metrics: ...") once per logging interval.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvbridge.control.requests import RequestStats

#: Per-transfer series kept in ``data`` (plain lists: the payload crosses processes).
SERIES = (
    "nbytes",
    "descriptors",
    "descriptors_before_merge",
    "transfer_s",
    "handshake_s",
    # of ``nbytes``, what moved layer by layer while P still computed (layer-wise push or pull)
    "streamed_nbytes",
    # the prefill steps they came in (one per chunk of a chunked prefill; 0: nothing streamed)
    "streamed_parts",
    # from P's answer to the last byte landed in D (0: P stamped no time)
    "landed_after_s",
)
#: Series where 0 means "nothing to measure": no handshake (a known peer), no time stamped by P;
#: the log line and the histograms leave those zeros out.
UNMEASURED_AT_ZERO = frozenset({"handshake_s", "landed_after_s", "streamed_parts"})


def measured(key: str, values: list[Any]) -> list[Any]:
    """``values`` of series ``key`` that were measured (0 is "unmeasured" for some series)."""
    return [v for v in values if v != 0] if key in UNMEASURED_AT_ZERO else list(values)


#: Counters summed over workers and intervals: failed loads; of those, the ones that waited for a
#: fence (and how long); requests held (the most at one time: blocks out of use while a silent
#: peer may still deliver bytes) and, of those, held for good (no fence proves their bytes
#: stopped: never handed back); loads whose
#: integrity check (``verify``) found a difference; P: published requests whose lease expired
#: before D released them, and of those the ones no D claimed (freed at the claim timeout);
#: D: failed loads from a P it cannot pair with (``RequestStats.incompatible``);
#: P's scheduler: prefills past its hold limit (P held nothing, D computed the prompt), the
#: most blocks it held for decode at one time since start (``held_blocks``) and its bound
#: (``hold_limit_blocks``); those two are maxima, not sums.
COUNTERS = (
    "failed",
    "fenced",
    "unproven",
    "held",
    "verify_failed",
    "lease_expired",
    "unclaimed",
    "incompatible",
    "hold_declined",
    "held_blocks",
    "hold_limit_blocks",
)
#: Counters that are the most at one time, not a sum over an interval.
MAXIMA = ("held_blocks", "hold_limit_blocks")


def _empty() -> dict[str, Any]:
    return {**{name: [] for name in SERIES}, **dict.fromkeys(COUNTERS, 0), "fence_s": []}


@dataclass
class KVBridgeStats(KVConnectorStats):
    """Bytes, descriptors and time of the transfers an engine finished in one interval."""

    data: dict[str, Any] = field(default_factory=_empty)

    def __post_init__(self) -> None:
        for key, value in _empty().items():
            self.data.setdefault(key, value)

    def record(self, stats: RequestStats) -> None:
        """A transfer this engine finished (D: a load; P: a push it made)."""
        for name in SERIES:
            self.data[name].append(getattr(stats, name))

    def record_failure(self, stats: RequestStats | None = None) -> None:
        """A load that failed (vLLM recomputes it under ``kv_load_failure_policy=recompute``)."""
        self.data["failed"] += 1
        if stats is not None and stats.fence_s > 0:
            self.data["fenced"] += 1
            self.data["fence_s"].append(stats.fence_s)
        if stats is not None and stats.verify_failed:
            self.data["verify_failed"] += 1
        if stats is not None and stats.incompatible:
            self.data["incompatible"] += 1

    def record_lease_expiry(self, unclaimed: bool = False) -> None:
        """P freed a published request's blocks because D never released them in time
        (``unclaimed``: no D claimed it at all)."""
        self.data["lease_expired"] += 1
        self.data["unclaimed"] += int(unclaimed)

    def record_holds(self, declined: int, peak_blocks: int, limit_blocks: int) -> None:
        """P's scheduler: prefills declined past the hold limit; the most blocks held for
        decode at one time since start, and the bound on them."""
        self.data["hold_declined"] += declined
        self.data["held_blocks"] = max(int(self.data["held_blocks"]), peak_blocks)
        self.data["hold_limit_blocks"] = max(int(self.data["hold_limit_blocks"]), limit_blocks)

    def record_held(self, count: int) -> None:
        """Requests whose blocks wait for a fence right now."""
        self.data["held"] = max(int(self.data["held"]), count)

    def record_unproven(self, count: int) -> None:
        """Loads newly held for good: no fence proves their bytes stopped."""
        self.data["unproven"] += count

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> KVBridgeStats:
        if not other.is_empty():
            for name in (*SERIES, "fence_s"):
                self.data[name].extend(other.data.get(name, ()))
            for name in COUNTERS:
                theirs = int(other.data.get(name, 0))
                if name in MAXIMA:
                    self.data[name] = max(int(self.data[name]), theirs)
                else:
                    self.data[name] += theirs
        return self

    def is_empty(self) -> bool:
        return not self.data["nbytes"] and not any(self.data[name] for name in COUNTERS)

    def reduce(self) -> dict[str, int | float]:
        nbytes = np.asarray(self.data["nbytes"], dtype=np.float64)
        seconds = np.asarray(self.data["transfer_s"], dtype=np.float64)
        out: dict[str, int | float] = {
            "transfers": int(nbytes.size),
            "failed": int(self.data["failed"]),
        }
        for name in COUNTERS[1:]:
            if self.data[name]:
                out[name] = int(self.data[name])
        if self.data["fence_s"]:
            out["max_fence_ms"] = round(float(np.max(self.data["fence_s"])) * 1e3, 3)
        if nbytes.size == 0:
            return out
        total_s = float(seconds.sum())
        out.update(
            {
                "MiB": round(float(nbytes.sum()) / 2**20, 3),
                "descriptors": int(np.sum(self.data["descriptors"])),
                "descriptors_before_merge": int(np.sum(self.data["descriptors_before_merge"])),
                "avg_transfer_ms": round(total_s / nbytes.size * 1e3, 3),
                "p90_transfer_ms": round(float(np.percentile(seconds, 90)) * 1e3, 3),
                "GB/s": round(float(nbytes.sum()) / total_s / 1e9, 3) if total_s > 0 else 0.0,
                "handshake_ms": round(float(np.sum(self.data["handshake_s"])) * 1e3, 3),
            }
        )
        streamed = float(np.sum(self.data["streamed_nbytes"]))
        if streamed:
            out["streamed_MiB"] = round(streamed / 2**20, 3)
            parts = measured("streamed_parts", self.data["streamed_parts"])
            out["avg_streamed_parts"] = round(float(np.mean(parts)), 2) if parts else 0.0
        landed = measured("landed_after_s", self.data["landed_after_s"])
        if landed:
            out["avg_landed_after_prefill_ms"] = round(float(np.mean(landed)) * 1e3, 3)
        return out
