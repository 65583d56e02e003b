"""Moving one request's bytes with the engine's transport: plan, submit and wait, fence.

Shared by P's push (a write) and D's pull (a read), together with the warning that says where a
slow request's time went.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

from kvbridge.control.context import PlaneContext
from kvbridge.control.messages import BlockIds
from kvbridge.control.requests import RequestStats, TransferParams
from kvbridge.core.batches import Fence, TransferHandle, TransferOp
from kvbridge.core.errors import KvbridgeError
from kvbridge.core.integrity import Verify, chosen, digest
from kvbridge.core.layout import Layout
from kvbridge.core.planning import TransferPlan
from kvbridge.core.tp import plan_tp_pair

log = logging.getLogger("kvbridge.control")


@dataclass(kw_only=True)
class RankShare:
    """One pair of TP ranks' share of a request, as this side holds it: on P, a D rank's part
    of P's lease (``leases._Reader``: its claim, or P's write to it); on D, a P rank's part of
    D's load (``loadbook.RankLoad``: D's read from it, or its write). What each side keeps beyond
    this is its own; the transfer steps here take either.

    ``rank`` is the other side's TP rank. The part is over once ``ended`` (``end``): nothing of
    its transfer can still move, and ``ok``/``reason`` say how it ended.
    """

    rank: int
    #: the transfer in flight, for an abort to release and a failure to fence
    handle: TransferHandle | None = None
    ended: bool = False
    ok: bool = False
    reason: str = ""

    @property
    def params(self) -> TransferParams:
        """The request this is a part of."""
        raise NotImplementedError

    @property
    def aborted(self) -> bool:
        """Whether the request was aborted (a transfer not started yet never starts)."""
        raise NotImplementedError

    def end(self, ok: bool, reason: str) -> None:
        """The part is over; lock held."""
        self.ended, self.ok, self.reason = True, ok, reason


class Move(NamedTuple):
    """One part's batch for ``Transfers.move``: its ``plan``, with the engine ``peer``."""

    peer: str
    plan: TransferPlan
    part: RankShare


def plan_digest(
    plan: TransferPlan, side: Literal["src", "dst"], check: Verify, request_id: str
) -> int:
    """The integrity digest of one side's bytes of ``plan``: ``src`` on P (what it holds or
    wrote), ``dst`` on D (what it read or holds now). Both sides choose the same descriptors
    for one request and ``check`` (``kvbridge.core.integrity.chosen``), so equal bytes give
    equal digests."""
    addrs = plan.src if side == "src" else plan.dst
    return digest(addrs, plan.lengths, chosen(plan.count, check, request_id))


def pair_digest(
    src: Layout,
    dst: Layout,
    src_ids: BlockIds,
    dst_ids: BlockIds,
    side: Literal["src", "dst"],
    check: Verify,
    request_id: str,
) -> int | None:
    """``plan_digest`` of the pair's whole plan (not cut by layer), which both sides make alike
    whatever plan the bytes moved by; None when the pair moves nothing."""
    plan = plan_tp_pair(src, dst, src_ids, dst_ids)
    return None if plan is None else plan_digest(plan, side, check, request_id)


class Transfers:
    """The transfer steps both sides share, on the plane's transport and under its lock."""

    def __init__(self, ctx: PlaneContext) -> None:
        self._ctx = ctx
        self._lock = ctx.lock

    @staticmethod
    def plan(
        src: Layout,
        dst: Layout,
        src_ids: BlockIds,
        dst_ids: BlockIds,
        stats: RequestStats,
        by_layer: bool = False,
    ) -> TransferPlan | None:
        """What source rank ``src`` moves to destination rank ``dst`` (``None``: nothing); its
        time and size add to ``stats`` (a load from several P ranks sums its parts).
        ``by_layer``: cut by layer (``TransferPlan.for_layers``)."""
        start = time.monotonic()
        plan = plan_tp_pair(src, dst, src_ids, dst_ids, by_layer=by_layer)
        stats.plan_s += time.monotonic() - start
        if plan is not None:
            stats.nbytes += plan.nbytes
            stats.descriptors += plan.count
            stats.descriptors_before_merge += plan.unmerged
        return plan

    def move(
        self,
        op: TransferOp,
        parts: Sequence[Move],
        stats: RequestStats,
    ) -> None:
        """Submit each part's plan to its peer, then wait for them all; each ``part.handle``
        keeps its batch for abort and fence (on failure the caller fences every one set).

        An abort that came before a submission stops it; one that comes during it finds the
        handle and releases it (the wait then fails, and the caller fences).
        """
        transport = self._ctx.transport
        start = time.monotonic()
        for peer, plan, part in parts:
            with self._lock:
                if part.aborted:
                    raise KvbridgeError("aborted by decode before the transfer started")
            local, remote, lengths = plan.local_remote(op)
            handle = transport.submit(op, peer, local, remote, lengths)
            log.debug(
                "request %s: %s of %d descriptors submitted to %s",
                part.params.request_id,
                op.value,
                len(lengths),
                peer,
            )
            with self._lock:
                part.handle = handle
                aborted = part.aborted
            if aborted:
                transport.release(handle)
        for move in parts:
            assert move.part.handle is not None
            transport.wait(move.part.handle)
        stats.transfer_s = time.monotonic() - start

    def fence(self, handle: TransferHandle, rid: str, stats: RequestStats) -> Fence:
        """Wait until no byte of a given-up transfer can still move; log while it takes long.

        ``PENDING`` only when the plane is closing; ``UNPROVEN`` when nothing proves the bytes
        stopped (the caller holds the memory for good).
        """
        ctx = self._ctx
        start = time.monotonic()
        while True:
            fence = ctx.transport.fence(handle, ctx.deadlines.fence_round)
            if fence is not Fence.PENDING or ctx.closed:
                break
            log.warning(
                "request %s: the %s engine still holds part of a given-up transfer after %.0f s; "
                "its blocks stay out of use until it gives it back",
                rid,
                ctx.transport.name,
                time.monotonic() - start,
            )
        stats.fence_s = time.monotonic() - start
        stats.unproven = fence is not Fence.DRAINED
        return fence

    def report_slow(self, what: str, request_id: str, stats: RequestStats) -> None:
        """One warning with the breakdown for a request that took a large part of its timeout,
        so that a slow load says where its time went (this side's queue, the handshake, the
        peer's answer, the engine's transfer, a fence)."""
        if stats.total_s < self._ctx.deadlines.slow_after:
            return
        parts = ("queued_s", "handshake_s", "ask_s", "plan_s", "transfer_s", "fence_s", "verify_s")
        known = sum(getattr(stats, name) for name in parts)
        log.warning(  # in a push, D's unaccounted time is its wait for P's word
            "request %s: %s took %.2f s: %s, unaccounted %.2f s",
            request_id,
            what,
            stats.total_s,
            ", ".join(f"{name[:-2]} {getattr(stats, name):.2f}" for name in parts),
            max(0.0, stats.total_s - known),
        )
