"""D's book of its loads: each request being loaded, from ``pull``/``push`` until its outcome.

A request D loads is a ``PendingLoad``; its load from one P rank a ``RankLoad``. ``LoadBook``
keeps them, under the plane's lock, with the steps every flow takes alike: begin, the handshake
with each P rank, finding the part a P rank speaks for, holding the blocks while a fence is
awaited (or for good), telling P a release or an abort, and the outcome. The flows themselves
are ``pulls.Pulls`` and ``pushes.Pushes``; ``loads.Loads`` is what the plane calls.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvbridge.control.context import PlaneContext
from kvbridge.control.handshakes import INCOMPATIBLE_CODES, Handshakes, RemoteEngine
from kvbridge.control.messages import Abort, BlockIds, LayersReady, Release
from kvbridge.control.requests import (
    Mode,
    RankAddress,
    RequestOutcome,
    RequestStats,
    TransferParams,
    checked_ids,
)
from kvbridge.control.streams import Stream
from kvbridge.control.transfers import RankShare, Transfers
from kvbridge.core.block_mapping import CheckedBlockIds
from kvbridge.core.errors import ControlError, KvbridgeError, LayoutError, MessageError
from kvbridge.core.planning import TransferPlan
from kvbridge.core.rank_slices import check_coverage
from kvbridge.core.tp import contact_ranks
from kvbridge.core.transpose import received_transposes

log = logging.getLogger("kvbridge.control")


@dataclass
class RankLoad(RankShare):
    """D's load of a request from one P rank (one of ``contact_ranks``).

    ``rank`` is the P rank; ``handle``: D's own read in flight (pull), released when the
    request is aborted; ``ended`` once no byte from that rank can still land.
    """

    pending: PendingLoad
    address: RankAddress
    remote: RemoteEngine | None = None
    #: what this P rank moves to this D rank (None: nothing, or not planned yet)
    plan: TransferPlan | None = None
    #: push: the push request was sent (or failed); only then may D ask how the push ended
    asked: threading.Event = field(default_factory=threading.Event)
    #: push: D is asking P how the push ended (deadline passed, aborted, or PushQuery)
    settling: bool = False
    #: push: P's word arrived (its figures are counted once)
    reported: bool = False
    #: layer-wise pull: D's reads of the layers P said were computed, and P's last word
    #: (published, or it will not be)
    stream: Stream | None = None
    ready: LayersReady | None = None

    @property
    def params(self) -> TransferParams:
        return self.pending.params

    @property
    def aborted(self) -> bool:
        return self.pending.aborted


@dataclass
class PendingLoad:
    """D's view of a request being loaded, from every P rank it needs."""

    params: TransferParams
    block_ids: CheckedBlockIds
    deadline: float
    parts: dict[int, RankLoad] = field(default_factory=dict)
    stats: RequestStats = field(default_factory=RequestStats)
    started: float = field(default_factory=time.monotonic)
    aborted: bool = False
    abort_reason: str = ""
    #: since when the outcome waits for a fence (0: not waiting)
    held_since: float = 0.0
    #: nothing proves that bytes of it stopped landing: held for good, never reported
    unproven: bool = False
    #: P's block ids and its answer's time, when D learnt them only from P (the concurrent
    #: dispatch)
    source_ids: BlockIds | None = None
    published_at: float = 0.0
    #: layer-wise pull: its end (reading the rest, or fencing what was read) has begun
    finishing: bool = False


class Tell(NamedTuple):
    """A word for one P rank about a request: a release or an abort."""

    address: RankAddress
    body: Release | Abort


class LoadBook:
    """D's requests being loaded (``pending``) and aborted (``aborts``), shared by the pulls
    and the pushes.

    A D rank loads from the P ranks of ``contact_ranks`` (one when P's TP size is at most D's);
    each is a ``RankLoad``. The load succeeds when every part did; a failed part ends the load
    only once every other part is fenced too (no byte of it can land any more).
    """

    def __init__(self, ctx: PlaneContext, handshakes: Handshakes, transfers: Transfers) -> None:
        self._ctx = ctx
        self._handshakes = handshakes
        self._transfers = transfers
        self._lock = ctx.lock
        #: the requests being loaded, by request id
        self.pending: dict[str, PendingLoad] = {}
        #: request ids aborted on D, until when to remember them
        self.aborts: dict[str, float] = {}
        spec = ctx.layout.spec
        #: this D worker, as every message to P names it
        self.me = {
            "rank": spec.tp_rank,
            "tp_size": spec.tp_size,
            "pp_rank": spec.pp_rank,
            "pp_size": spec.pp_size,
        }

    def contacts(self, params: TransferParams) -> list[int]:
        """P's workers this D worker talks to about a request (``TransferParams.rank``): the
        TP ranks of ``contact_ranks`` in every P stage, even a stage holding none of this
        worker's layers (it reads nothing there, but its word ends P's lease all the same)."""
        spec = self._ctx.layout.spec
        tp = params.tp_size
        ranks = contact_ranks(spec.tp_rank, spec.tp_size, tp)
        return [stage * tp + rank for stage in range(params.pp_size) for rank in ranks]

    def begin(
        self, params: TransferParams, block_ids: Mapping[int, Any], first_token: int
    ) -> PendingLoad:
        """Book a new load into these local blocks; refused when the plane closed, or the
        request is loading already or was aborted."""
        ctx = self._ctx
        ids = checked_ids(ctx.layout, block_ids, "destination", first_token)
        contacts = self.contacts(params)
        with self._lock:
            if ctx.closed:
                raise KvbridgeError("the control plane is closed")
            if params.request_id in self.pending:
                raise KvbridgeError(f"request {params.request_id!r} is already being loaded")
            if params.request_id in self.aborts:
                raise KvbridgeError(f"request {params.request_id!r} was aborted")
            deadline = time.monotonic() + ctx.deadlines.load
            pending = PendingLoad(params, ids, deadline)
            pending.parts = {p: RankLoad(pending, params.rank(p), rank=p) for p in contacts}
            self.pending[params.request_id] = pending
        return pending

    def booked(self, pending: PendingLoad) -> bool:
        """Whether ``pending`` is still being loaded (not ended, nor replaced); lock held."""
        return self.pending.get(pending.params.request_id) is pending

    def handshake_all(self, pending: PendingLoad) -> None:
        """Handshake with every P rank of the request (cached) and check who they are; a
        pairing refused on either side marks the load ``incompatible`` (counted apart)."""
        try:
            self._check_ranks(pending)
        except (ControlError, LayoutError) as err:
            if isinstance(err, LayoutError) or err.code in INCOMPATIBLE_CODES:
                pending.stats.incompatible = True
            raise

    def _check_ranks(self, pending: PendingLoad) -> None:
        params = pending.params
        tp, pp = params.tp_size, params.pp_size
        for rank, part in pending.parts.items():
            remote = self._handshakes.remote_for(part.address, pending.stats)
            spec = remote.layout.spec
            if (spec.pp_rank, spec.pp_size, spec.tp_rank, spec.tp_size) != (
                rank // tp,
                pp,
                rank % tp,
                tp,
            ):
                raise ControlError(
                    "tp_rank",
                    f"{part.address.endpoint} is prefill rank {spec.tp_rank} of TP size "
                    f"{spec.tp_size}{_stage(spec.pp_rank, spec.pp_size)}; the request names it "
                    f"rank {rank % tp} of {tp}{_stage(rank // tp, pp)}",
                )
            part.remote = remote
        layouts = {r: part.remote.layout for r, part in pending.parts.items() if part.remote}
        start = time.monotonic()
        check_coverage(layouts, self._ctx.layout)
        pending.stats.plan_s += time.monotonic() - start

    def part_of(self, request_id: str, sender: str) -> RankLoad | None:
        """The part of a load that P rank ``sender`` speaks for; None if the load ended (a late
        or repeated word); ``not_yours`` if the sender has no part in it."""
        with self._lock:
            pending = self.pending.get(request_id)
            if pending is None:
                return None
            ranks = pending.parts.values()
            part = next((p for p in ranks if p.remote and p.remote.engine_id == sender), None)
            if part is None:
                raise MessageError(
                    "not_yours",
                    f"engine {sender!r} cannot speak for {request_id!r}: it comes from "
                    f"{[p.address.engine_id for p in pending.parts.values()]}",
                )
        return part

    def hold(self, pending: PendingLoad) -> None:
        """The load's outcome waits for a fence: its blocks stay out of use (``held``)."""
        with self._lock:
            pending.held_since = pending.held_since or time.monotonic()

    def hold_for_good(self, pending: PendingLoad, reason: str) -> None:
        """No fence proves the load's bytes stopped: keep its blocks out of use, for good.

        The outcome is never reported (a serving engine would reuse the blocks): the request
        stays in ``held`` and ``unproven``, and the transport keeps it visible in its logs.
        """
        with self._lock:
            if pending.unproven:
                return
            pending.unproven = True
            pending.held_since = pending.held_since or time.monotonic()
            pending.stats.unproven = True
        log.warning(
            "request %s: its blocks stay held for good: the %s transport cannot prove that no "
            "byte of the failed transfer still lands in them (%s)",
            pending.params.request_id,
            self._ctx.transport.name,
            reason,
        )

    def tell(self, address: RankAddress, body: Release | Abort) -> None:
        """Send a P rank a release or abort; one that does not arrive is freed by P's lease."""
        self.tell_all([Tell(address, body)])

    def tell_all(self, tells: list[Tell]) -> None:
        """``tell`` each, all sent before any answer is read (``Handshakes.send_first``: a
        rank that shares another's endpoint is told once the first answered)."""
        timeout = self._ctx.deadlines.call
        sends = [(tell.address.endpoint, tell.body) for tell in tells]
        calls = self._handshakes.send_first(sends, timeout)
        for tell, call in zip(tells, calls, strict=True):
            try:
                if isinstance(call, Exception):
                    raise call
                if call is None:
                    self._handshakes.client(tell.address.endpoint).request(tell.body, timeout)
                else:
                    call.reply()
            except Exception as err:
                _not_delivered(tell, err)

    def finish(self, request_id: str, ok: bool, reason: str, *, closing: bool = False) -> None:
        """The load ended: report its outcome (``ok``, or why not) unless it is held for good;
        only ``closing`` the plane ends one held for good."""
        ctx = self._ctx
        with self._lock:
            pending = self.pending.get(request_id)
            if pending is None or (pending.unproven and not closing):
                return  # ended already, or held for good (only closing the plane ends it)
            del self.pending[request_id]
            if pending.held_since:
                held = time.monotonic() - pending.held_since
                pending.stats.fence_s = max(pending.stats.fence_s, held)
            if pending.aborted:
                why = pending.abort_reason
                reason = why if not reason or why in reason else f"{why} ({reason})"
            pending.stats.total_s = time.monotonic() - pending.started
            ok = ok and not pending.aborted
            if ok and pending.params.mode is Mode.PULL:  # a push's P counted its own
                pending.stats.landed(pending.params.published_at or pending.published_at)
            outcome = RequestOutcome(request_id, ok, reason, pending.stats)
            if ok:
                outcome.transposes = [
                    t
                    for part in pending.parts.values()
                    if part.remote is not None
                    for t in received_transposes(
                        part.remote.layout,
                        ctx.layout,
                        pending.source_ids or pending.params.block_ids,
                        pending.block_ids,
                    )
                ]
            ctx.record(outcome)
        log.debug(
            "request %s: %s %s %s", request_id, "done" if ok else "failed", reason, pending.stats
        )
        self._transfers.report_slow("load", request_id, pending.stats)


def _not_delivered(tell: Tell, err: Exception) -> None:
    log.info(
        "request %s: %s not delivered to %s (%s); P's lease frees it",
        tell.body.request_id,
        type(tell.body).__name__.lower(),
        tell.address.endpoint,
        err,
    )


def _stage(pp_rank: int, pp_size: int) -> str:
    return f" in pipeline stage {pp_rank} of {pp_size}" if pp_size > 1 else ""
