"""Moving one request's bytes with the engine's transport: plan, submit and wait, fence.

Shared by P's push (a write) and D's pull (a read), together with the warning that says where a
slow request's time went.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Protocol

from kvbridge.control.messages import BlockIds
from kvbridge.control.requests import RequestStats, TransferParams
from kvbridge.core.errors import KvbridgeError
from kvbridge.core.layout import Layout
from kvbridge.core.planning import TransferPlan, plan_transfers
from kvbridge.core.transport import Fence, TransferHandle, TransferOp

if TYPE_CHECKING:
    from kvbridge.control.plane import ControlPlane

log = logging.getLogger("kvbridge.control")


class Holder(Protocol):
    """A request whose transfer an abort may stop: P's lease (push) or D's load (pull)."""

    params: TransferParams
    #: the transfer in flight, for the abort to release and the failure to fence
    handle: TransferHandle | None
    aborted: bool


class Transfers:
    """The transfer steps both sides share, on the plane's transport and under its lock."""

    def __init__(self, plane: ControlPlane) -> None:
        self._plane = plane
        self._lock = plane._lock

    @staticmethod
    def plan(
        src: Layout, dst: Layout, src_ids: BlockIds, dst_ids: BlockIds, stats: RequestStats
    ) -> TransferPlan:
        start = time.monotonic()
        plan = plan_transfers(src, dst, src_ids, dst_ids)
        stats.plan_s = time.monotonic() - start
        stats.nbytes, stats.descriptors = plan.nbytes, plan.count
        stats.descriptors_before_merge = plan.unmerged
        return plan

    def move(
        self, op: TransferOp, peer: str, plan: TransferPlan, holder: Holder, stats: RequestStats
    ) -> None:
        """Submit the plan and wait for it; ``holder.handle`` keeps the batch for abort and fence.

        An abort that came before the submission stops it; one that comes during it finds the
        handle and releases it (the wait then fails, and the caller fences).
        """
        transport = self._plane.transport
        start = time.monotonic()
        with self._lock:
            if holder.aborted:
                raise KvbridgeError("aborted by decode before the transfer started")
        local, remote, lengths = plan.local_remote(op)
        handle = transport.submit(op, peer, local, remote, lengths)
        log.debug("request %s: %s of %d descriptors submitted", holder.params.request_id,
                  op.value, len(lengths))  # fmt: skip
        with self._lock:
            holder.handle = handle
            aborted = holder.aborted
        if aborted:
            transport.release(handle)
        transport.wait(handle)
        stats.transfer_s = time.monotonic() - start

    def fence(self, handle: TransferHandle, rid: str, stats: RequestStats) -> Fence:
        """Wait until no byte of a given-up transfer can still move; log while it takes long.

        ``PENDING`` only when the plane is closing; ``UNCONFIRMED`` when the engine could not say
        what the peer got (the caller settles that with the peer).
        """
        plane = self._plane
        start = time.monotonic()
        while True:
            fence = plane.transport.fence(handle, plane.timeout)
            if fence is not Fence.PENDING or plane._closed:
                break
            log.warning(
                "request %s: the %s engine still holds part of a given-up transfer after %.0f s; "
                "its blocks stay out of use until it gives it back",
                rid, plane.transport.name, time.monotonic() - start,
            )  # fmt: skip
        stats.fence_s = time.monotonic() - start
        stats.unconfirmed = fence is not Fence.DRAINED
        return fence

    def report_slow(self, what: str, request_id: str, stats: RequestStats) -> None:
        """One warning with the breakdown for a request that took a large part of its timeout,
        so that a slow load says where its time went (this side's queue, the handshake, the
        peer's answer, the engine's transfer, a fence)."""
        if stats.total_s < self._plane.slow_after:
            return
        parts = ("queued_s", "handshake_s", "ask_s", "plan_s", "transfer_s", "fence_s",
                 "verify_s")  # fmt: skip
        known = sum(getattr(stats, name) for name in parts)
        log.warning(  # in a push, D's unaccounted time is its wait for P's word
            "request %s: %s took %.2f s: %s, unaccounted %.2f s", request_id, what, stats.total_s,
            ", ".join(f"{name[:-2]} {getattr(stats, name):.2f}" for name in parts),
            max(0.0, stats.total_s - known),
        )  # fmt: skip
