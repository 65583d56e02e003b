"""The decode side (D): loading requests from P, by pull or by push, and settling their ends.

A pull is D's own read, fenced by D's transport. A push is P's write, fenced by P, which says so
in ``PushDone``; past its deadline D aborts the push and asks P how it ended (``PushQuery``)
until P answers or is gone. Meanwhile the request's blocks stay out of use (``held``). A fence
that proves nothing (``Fence.UNPROVEN``: D's own, or P's word ``unproven`` on its write) keeps
the request held for good (``unproven``): no timer and no answer of the peer hands its blocks
back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import wait
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvbridge.control.channel import PeerClient, PendingReply
from kvbridge.control.context import PlaneContext
from kvbridge.control.handshakes import INCOMPATIBLE_CODES, Handshakes, RemoteEngine
from kvbridge.control.messages import (
    Abort,
    BlockIds,
    Digest,
    DigestRequest,
    LayersReady,
    PullStart,
    PushDone,
    PushQuery,
    PushRequest,
    Release,
    StreamRequest,
)
from kvbridge.control.requests import (
    Mode,
    RankAddress,
    RequestOutcome,
    RequestStats,
    TransferParams,
    checked_ids,
    forget_expired,
    timed,
)
from kvbridge.control.streams import ComputedBlocks, Stream
from kvbridge.control.transfers import RankShare, Transfers, pair_digest, plan_digest
from kvbridge.core.batches import Fence, TransferHandle, TransferOp
from kvbridge.core.block_mapping import CheckedBlockIds
from kvbridge.core.errors import (
    ControlError,
    IntegrityError,
    KvbridgeError,
    LayoutError,
    MessageError,
    PeerRefusedError,
    PeerTimeoutError,
    TransportError,
)
from kvbridge.core.integrity import Verify
from kvbridge.core.planning import TransferPlan
from kvbridge.core.rank_slices import check_coverage
from kvbridge.core.tp import contact_ranks, plan_tp_pair
from kvbridge.core.transpose import received_transposes

log = logging.getLogger("kvbridge.control")

_A = TypeVar("_A")


@dataclass
class _RankLoad(RankShare):
    """D's load of a request from one P rank (one of ``contact_ranks``).

    ``rank`` is the P rank; ``handle``: D's own read in flight (pull), released when the
    request is aborted; ``ended`` once no byte from that rank can still land.
    """

    pending: _Pending
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
class _Claim:
    """A pull's ``PullStart`` to one P rank: sent (``call``), refused before it went
    (``error``), or neither (to be sent when its endpoint is free)."""

    part: _RankLoad
    started: float
    call: PendingReply | None = None
    error: Exception | None = None


@dataclass
class _Pending:
    """D's view of a request being loaded, from every P rank it needs."""

    params: TransferParams
    block_ids: CheckedBlockIds
    deadline: float
    parts: dict[int, _RankLoad] = field(default_factory=dict)
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


class Loads:
    """D's requests being loaded, from ``pull``/``push`` until their outcome.

    A D rank loads from the P ranks of ``contact_ranks`` (one when P's TP size is at most D's);
    each is a ``_RankLoad``. The load succeeds when every part did; a failed part ends the load only
    once every other part is fenced too (no byte of it can land any more).
    """

    def __init__(self, ctx: PlaneContext, peers: Handshakes, transfers: Transfers) -> None:
        self._ctx = ctx
        self._peers = peers
        self._transfers = transfers
        self._lock = ctx.lock
        self._pending: dict[str, _Pending] = {}
        self._aborted: dict[str, float] = {}  # request ids aborted on D, until when to remember
        spec = ctx.layout.spec
        self._me = {
            "rank": spec.tp_rank,
            "tp_size": spec.tp_size,
            "pp_rank": spec.pp_rank,
            "pp_size": spec.pp_size,
        }

    def pull(
        self, params: TransferParams, block_ids: Mapping[int, Any], first_token: int = 0
    ) -> None:
        """Start reading a request into these local blocks; the outcome comes later.

        ``first_token``: the request's token at which these blocks start (the tokens D held
        already), which groups of different block sizes pair by.
        ``params.layerwise`` (the concurrent dispatch: P computes the request now): D asks P to
        tell it each computed layer, reads it at once, and reads the rest once P published."""
        pending = self._begin(params, block_ids, first_token)
        run = self._run_stream_request if params.layerwise else self._run_pull
        self._ctx.requests.submit(run, pending)

    def push(
        self, params: TransferParams, block_ids: Mapping[int, Any], first_token: int = 0
    ) -> None:
        """Ask P to write a request into these local blocks (starting at the request's token
        ``first_token``); the outcome comes later."""
        pending = self._begin(params, block_ids, first_token)
        self._ctx.requests.submit(self._run_push_request, pending)

    def abort(self, params: TransferParams, reason: str) -> None:
        """Give up a request, before or during its load; P is told so it frees the blocks."""
        rid = params.request_id
        with self._lock:
            pending = self._pending.get(rid)
            self._aborted[rid] = time.monotonic() + self._ctx.deadlines.remember
            handles = []
            if pending is not None:
                pending.aborted, pending.abort_reason = True, reason
                handles = [part.handle for part in pending.parts.values() if part.handle]
                for part in pending.parts.values():
                    if part.stream is not None:
                        handles += part.stream.take()
        if pending is None:
            try:
                addresses = [params.rank(p) for p in self._contacts(params)]
            except KvbridgeError as err:
                log.warning("request %s: abort not sent (%s); P's lease frees it", rid, err)
                return
            for address in addresses:
                self._ctx.requests.submit(
                    self._tell, address, Abort(rid, reason, **self._me, token=params.token)
                )
        elif params.mode is Mode.PUSH:
            self._settle_push_later(pending, reason)
        else:
            if params.layerwise:  # maybe nobody runs it now: its end fences what was read
                self._settle_stream_pull(pending, reason)
            # The pull's worker sees the flag (or its wait fails on the release), fences its
            # reads, reports the outcome and tells P.
            for handle in handles:
                self._ctx.transport.release(handle)

    @property
    def held(self) -> list[str]:
        """Request ids whose failure waits for a fence: their blocks stay out of use."""
        with self._lock:
            return [r for r, p in self._pending.items() if p.held_since]

    @property
    def unproven(self) -> list[str]:
        """Request ids held for good: nothing proves their bytes stopped landing."""
        with self._lock:
            return [r for r, p in self._pending.items() if p.unproven]

    def expire(self, now: float) -> None:
        """Housekeeping: settle pushes past their deadline with P; forget old aborts."""
        with self._lock:
            # A pull's worker bounds its own steps and fences its read; a push past its
            # deadline is settled with P.
            late = [
                p
                for p in self._pending.values()
                if p.deadline < now
                and p.params.mode is Mode.PUSH
                and any(not part.settling and not part.ended for part in p.parts.values())
            ]
            # A layer-wise pull waits for P's word: past its deadline D fences its own reads.
            waiting = [
                p
                for p in self._pending.values()
                if p.deadline < now
                and p.params.layerwise
                and p.params.mode is Mode.PULL
                and not p.finishing  # already reading the rest, or fencing
            ]
            forget_expired(self._aborted, now, lambda until: until)
        for pending in late:
            self._settle_push_later(pending, f"no push within {self._ctx.deadlines.timeout:g} s")
        for pending in waiting:
            self._settle_stream_pull(
                pending, f"prefill published nothing within {self._ctx.deadlines.load:g} s"
            )

    def close(self) -> None:
        """Fail every load in progress (the plane is closing)."""
        with self._lock:
            pending = list(self._pending)
        for request_id in pending:
            self._finish_pending(request_id, False, "the control plane was closed", closing=True)

    def _contacts(self, params: TransferParams) -> list[int]:
        """P's workers this D worker talks to about a request (``TransferParams.rank``): the
        TP ranks of ``contact_ranks`` in every P stage, even a stage holding none of this
        worker's layers (it reads nothing there, but its word ends P's lease all the same)."""
        spec = self._ctx.layout.spec
        tp = params.tp_size
        ranks = contact_ranks(spec.tp_rank, spec.tp_size, tp)
        return [stage * tp + rank for stage in range(params.pp_size) for rank in ranks]

    def _begin(
        self, params: TransferParams, block_ids: Mapping[int, Any], first_token: int
    ) -> _Pending:
        ctx = self._ctx
        ids = checked_ids(ctx.layout, block_ids, "destination", first_token)
        contacts = self._contacts(params)
        with self._lock:
            if ctx.closed:
                raise KvbridgeError("the control plane is closed")
            if params.request_id in self._pending:
                raise KvbridgeError(f"request {params.request_id!r} is already being loaded")
            if params.request_id in self._aborted:
                raise KvbridgeError(f"request {params.request_id!r} was aborted")
            deadline = time.monotonic() + ctx.deadlines.load
            pending = _Pending(params, ids, deadline)
            pending.parts = {p: _RankLoad(pending, params.rank(p), rank=p) for p in contacts}
            self._pending[params.request_id] = pending
        return pending

    def _handshake_all(self, pending: _Pending) -> None:
        """Handshake with every P rank of the request (cached) and check who they are; a
        pairing refused on either side marks the load ``incompatible`` (counted apart)."""
        try:
            self._check_ranks(pending)
        except (ControlError, LayoutError) as err:
            if isinstance(err, LayoutError) or err.code in INCOMPATIBLE_CODES:
                pending.stats.incompatible = True
            raise

    def _check_ranks(self, pending: _Pending) -> None:
        params = pending.params
        tp, pp = params.tp_size, params.pp_size
        for rank, part in pending.parts.items():
            remote = self._peers.remote_for(part.address, pending.stats)
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

    # -- pull -------------------------------------------------------------------------------------
    def _run_pull(self, pending: _Pending) -> None:
        ctx, transfers = self._ctx, self._transfers
        params, rid = pending.params, pending.params.request_id
        parts = list(pending.parts.values())
        pending.stats.queued_s = time.monotonic() - pending.started
        try:
            self._handshake_all(pending)
            # Ask P (a round trip, or a wait until it published) while planning the read: each
            # claim goes out before planning and its answer is read after, in this one thread
            # (a thread per claim would contend with planning for the interpreter's lock).
            claims = self._send_claims(parts)
            try:
                for part in parts:
                    assert part.remote is not None
                    part.plan = transfers.plan(
                        part.remote.layout,
                        ctx.layout,
                        params.block_ids,
                        pending.block_ids,
                        pending.stats,
                    )
            except BaseException:
                self._end_claims(claims, failed=True)  # P answered every claim before D fails
                raise
            self._end_claims(claims)
            moving = [
                (part.remote.engine_id, part.plan, part)
                for part in parts
                if part.plan is not None and part.remote is not None
            ]
            transfers.move(TransferOp.READ, moving, pending.stats)
            if ctx.verify is not Verify.OFF:
                for part in parts:
                    if part.plan is not None:
                        self._check_pull(part, part.plan)
        except Exception as err:
            self._pull_failed(pending, f"pull of {rid!r} from {params.endpoint} failed", err)
            return
        self._pull_done(pending)

    def _pull_failed(
        self,
        pending: _Pending,
        what: str,
        err: Exception,
        streamed: list[TransferHandle] | None = None,
    ) -> None:
        """A pull failed: fence every read of it (``streamed``: a layer-wise pull's early ones),
        then end the load, and tell P (it may free its blocks: D only read them)."""
        params, rid = pending.params, pending.params.request_id
        reading = [*(part.handle for part in pending.parts.values() if part.handle is not None)]
        reading += streamed or []
        if reading:
            self._hold(pending)
        fences = [self._transfers.fence(handle, rid, pending.stats) for handle in reading]
        reason = f"{what}: {err}"
        if Fence.UNPROVEN in fences:
            self._hold_for_good(pending, reason)
        else:
            self._finish_pending(rid, False, reason)
        why = str(err)[:4000]
        for part in pending.parts.values():
            # A release ends this rank's claim (other D ranks may still read P's blocks); a
            # layer-wise pull P has not published yet is aborted (P keeps nothing of it).
            unclaimed = params.layerwise and (part.ready is None or not part.ready.published)
            tell: Release | Abort = (
                Abort(rid, why, **self._me, token=params.token)
                if unclaimed
                else Release(rid, False, why, **self._me, token=params.token)
            )
            self._ctx.requests.submit(self._tell, part.address, tell)

    def _pull_done(self, pending: _Pending) -> None:
        """The bytes are in and fenced: the load is done now; P's releases are off D's path (one
        that does not arrive is freed by P's lease)."""
        params, rid = pending.params, pending.params.request_id
        self._finish_pending(rid, True, "")
        release = Release(rid, True, "", **self._me, token=params.token)
        self._tell_all([(part.address, release) for part in pending.parts.values()])

    def _send_claims(self, parts: list[_RankLoad]) -> list[_Claim]:
        """Send each P rank its ``PullStart`` now (``Handshakes.send_first``: a rank that shares
        another's endpoint sends its own when the first was answered)."""
        started = time.monotonic()
        calls = [(part.address.endpoint, self._pull_start(part)) for part in parts]
        sent = self._peers.send_first(calls, self._ctx.deadlines.call)
        return [
            _Claim(part, started, error=call)
            if isinstance(call, Exception)
            else _Claim(part, started, call)
            for part, call in zip(parts, sent, strict=True)
        ]

    def _end_claims(self, claims: list[_Claim], failed: bool = False) -> None:
        """Wait for every claim's answer (``_claim``); then raise the first that failed, unless
        the load ``failed`` already (then a claim not sent yet is not sent, and none waits for
        P to publish). ``ask_s``: the longest claim."""
        error: Exception | None = None
        # One bound for all: P's ranks publish the request together, and once one claim
        # failed the load has, so the rest are answered without waiting for a publish.
        until = min((c.started for c in claims), default=0.0) + self._ctx.deadlines.publish_wait
        for claim in claims:
            try:
                if claim.error is not None:
                    raise claim.error
                if failed and claim.call is None:
                    continue
                self._claim(claim.part, claim.call, 0.0 if failed or error else until)
            except Exception as err:
                error = error or err
            finally:
                stats = claim.part.pending.stats
                stats.ask_s = max(stats.ask_s, time.monotonic() - claim.started)
        if error is not None and not failed:
            raise error

    def _pull_start(self, part: _RankLoad) -> PullStart:
        params = part.params
        return PullStart(params.request_id, params.block_ids, **self._me, token=params.token)

    def _claim(self, part: _RankLoad, sent: PendingReply | None, until: float) -> None:
        """Tell P which blocks D reads (``sent``: told already, its answer to come); until
        ``until`` (``time.monotonic()``) wait for P to publish a request it has not yet.

        A serving engine may hand the transfer parameters to D before its worker has published
        the request (vLLM publishes one engine step after the request finished on P).
        """
        deadlines = self._ctx.deadlines
        client = self._peers.client(part.address.endpoint)
        delay = 0.005
        while True:
            call, sent = sent, None
            try:
                (call or client.send(self._pull_start(part), deadlines.call)).reply()
                return
            except ControlError as err:
                if err.code != "unknown_request" or part.aborted:
                    raise
                if time.monotonic() + delay > until:
                    waited = f"{err} (waited {deadlines.publish_wait:g} s)"
                    raise ControlError(err.code, waited) from None
            time.sleep(delay)
            delay = min(delay * 2, 0.2)

    def _check_pull(self, part: _RankLoad, plan: TransferPlan) -> None:
        """Compare P's digest of what it holds with D's of what it read (P still holds it)."""
        ctx, pending = self._ctx, part.pending
        start = time.monotonic()
        rid = pending.params.request_id
        ask = DigestRequest(
            rid,
            pending.block_ids,
            ctx.verify.value,
            pending.block_ids.first_token,
            **self._me,
            token=pending.params.token,
        )
        # P digests its side while D digests its own.
        asked = ctx.peer_waits.submit(
            self._peers.client(part.address.endpoint).request, ask, ctx.deadlines.call
        )
        mine = plan_digest(plan, "dst", ctx.verify, rid)
        reply = asked.result()
        pending.stats.verify_s += time.monotonic() - start
        theirs = reply.value if isinstance(reply, Digest) else None
        if theirs != mine:
            pending.stats.verify_failed = True
            raise IntegrityError(
                f"integrity check ({ctx.verify.value}) failed: prefill's digest {theirs} of "
                f"the bytes it holds differs from decode's {mine} of what it read"
            )

    # -- layer-wise pull ---------------------------------------------------------------------------
    def _run_stream_request(self, pending: _Pending) -> None:
        rid = pending.params.request_id
        pending.stats.queued_s = time.monotonic() - pending.started
        try:
            self._handshake_all(pending)
            if pending.aborted:
                raise KvbridgeError(pending.abort_reason or "aborted by decode")
            for part in pending.parts.values():
                assert part.remote is not None
                part.stream = Stream(part.remote, TransferOp.READ)
        except Exception as err:
            self._settle_stream_pull(pending, f"layer-wise pull of {rid!r} failed: {err}")
            return
        wait([self._ctx.asks.submit(self._ask_stream, part) for part in pending.parts.values()])
        # P's word comes as LayersReady; the load's deadline bounds the wait for it.

    def _ask_stream(self, part: _RankLoad) -> None:
        ctx, params = self._ctx, part.params
        ask = StreamRequest(params.request_id, **self._me, token=params.token)
        try:
            with timed(part.pending.stats, "ask_s"):
                reply = self._peers.client(part.address.endpoint).request(ask, ctx.deadlines.call)
        except PeerTimeoutError:
            return  # it may have reached P: P's word or the deadline ends the load
        except Exception as err:  # refused, P gone: P tells nothing, D read nothing
            why = f"layer-wise pull of {params.request_id!r} failed: {err}"
            self._settle_stream_pull(part.pending, why)
            return
        if isinstance(reply, LayersReady):  # P had published it already
            self._on_ready(part, reply)

    def on_layers_ready(self, body: LayersReady, sender: str) -> None:
        """P's word on a layer-wise pull, from the P rank ``sender``."""
        part = self._part_of(body.request_id, sender)
        if part is not None:
            self._on_ready(part, body)

    def _on_ready(self, part: _RankLoad, body: LayersReady) -> None:
        pending = part.pending
        if body.ok and not body.published:
            # Computed layers: submit their reads before answering, so that P's last word,
            # which it sends after this notice, finds them submitted (the submit does not wait).
            self._read_layers(part, body)
            return
        with self._lock:
            if part.ready is not None:
                return
            part.ready = body
            everyone = all(p.ready is not None for p in pending.parts.values())
        if not body.ok:
            why = body.reason or "prefill will not send it"
            self._settle_stream_pull(pending, f"layer-wise pull of {body.request_id!r}: {why}")
        elif everyone:
            self._settle_stream_pull(pending, "")

    def _read_layers(self, part: _RankLoad, body: LayersReady) -> None:
        stream = part.stream
        if stream is None:
            return
        with stream.lock:  # the end (reading the rest, or the fence) waits for this read
            if stream.closed or stream.failed or part.aborted:
                return
            try:
                told = ComputedBlocks(body.source_block_ids, body.first_blocks, body.total_blocks)
                stream.send(self._ctx, told, part.pending.block_ids, body.layers)
            except Exception as err:  # the end fails, fenced with the rest
                stream.failed = f"a layer-wise read could not start: {err}"
                log.warning("request %s: %s", body.request_id, stream.failed)

    def _settle_stream_pull(self, pending: _Pending, failure: str) -> None:
        """End a layer-wise pull, once: read the rest (``failure`` empty: P published it), or
        fence what was read."""
        with self._lock:
            if pending.finishing or self._pending.get(pending.params.request_id) is not pending:
                return
            pending.finishing = True
        self._ctx.requests.submit(self._finish_stream_pull, pending, failure)

    def _finish_stream_pull(self, pending: _Pending, failure: str) -> None:
        ctx, transfers = self._ctx, self._transfers
        parts = list(pending.parts.values())
        streamed = [h for part in parts if part.stream is not None for h in part.stream.take()]
        try:
            if failure:
                raise KvbridgeError(failure)
            moving = []
            for part in parts:
                assert part.remote is not None and part.ready is not None
                assert part.stream is not None
                if part.stream.failed:
                    raise TransportError(part.stream.failed)
                source = checked_ids(part.remote.layout, part.ready.source_block_ids, "source")
                pending.source_ids, pending.published_at = source, part.ready.published_at
                part.plan = transfers.plan(
                    part.remote.layout, ctx.layout, source, pending.block_ids, pending.stats, True
                )
                rest, early = part.stream.rest(part.plan, source)
                pending.stats.streamed_nbytes += early
                if early:
                    steps = part.stream.parts
                    pending.stats.streamed_parts = max(pending.stats.streamed_parts, steps)
                if rest is not None and rest.count:
                    moving.append((part.remote.engine_id, rest, part))
            transfers.move(TransferOp.READ, moving, pending.stats)
            for handle in streamed:  # every layer read before publish has landed
                ctx.transport.wait(handle)
            if ctx.verify is not Verify.OFF:
                for part in parts:
                    assert part.remote is not None and pending.source_ids is not None
                    # P digests its whole plan: the same descriptors, not the cut by layer
                    whole = plan_tp_pair(
                        part.remote.layout, ctx.layout, pending.source_ids, pending.block_ids
                    )
                    if whole is not None:
                        self._check_pull(part, whole)
        except Exception as err:
            what = f"layer-wise pull of {pending.params.request_id!r}"
            self._pull_failed(pending, what, err, streamed)
            return
        self._pull_done(pending)

    # -- push -------------------------------------------------------------------------------------
    def _run_push_request(self, pending: _Pending) -> None:
        params, rid = pending.params, pending.params.request_id
        pending.stats.queued_s = time.monotonic() - pending.started
        try:
            self._handshake_all(pending)
            if pending.aborted:  # never asked: P only needs to free its blocks
                raise KvbridgeError("aborted by decode")
        except Exception as err:  # nothing was asked: no P rank writes anything for it
            for part in pending.parts.values():
                self._ctx.requests.submit(
                    self._tell,
                    part.address,
                    Abort(
                        rid, pending.abort_reason or str(err)[:4000], **self._me, token=params.token
                    ),
                )
                part.asked.set()
            self._finish_pending(rid, False, f"push request of {rid!r} failed: {err}")
            return
        asks = [self._ctx.asks.submit(self._ask_push, part) for part in pending.parts.values()]
        wait(asks)
        log.debug(
            "request %s: push requested from %d prefill rank(s)", params.request_id, len(asks)
        )
        # The outcome arrives as PushDone from each rank, or is settled with P past the deadline.

    def _ask_push(self, part: _RankLoad) -> None:
        ctx, rid = self._ctx, part.params.request_id
        ids = part.pending.block_ids
        ask = PushRequest(
            rid, ids, ctx.verify.value, ids.first_token, **self._me, token=part.params.token
        )
        try:
            with timed(part.pending.stats, "ask_s"):
                self._peers.client(part.address.endpoint).request(ask, ctx.deadlines.call)
        except PeerTimeoutError:
            pass  # the request may have reached P: settled with P at the deadline
        except Exception as err:  # refused, P gone, or never sent: P writes nothing for it
            self._end_part(part, False, f"push request of {rid!r} failed: {err}")
        finally:
            part.asked.set()

    def on_push_done(self, body: PushDone, sender: str) -> None:
        """P's word on a push, from the P rank ``sender``."""
        part = self._part_of(body.request_id, sender)
        if part is not None:
            self._reported(part, body)

    def _part_of(self, request_id: str, sender: str) -> _RankLoad | None:
        """The part of a load that P rank ``sender`` speaks for; None if the load ended (a late
        or repeated word); ``not_yours`` if the sender has no part in it."""
        with self._lock:
            pending = self._pending.get(request_id)
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

    def _reported(self, part: _RankLoad, body: PushDone) -> None:
        """A P rank's word on its push (its ``PushDone``, or its answer to ``PushQuery``)."""
        ctx, pending = self._ctx, part.pending
        with self._lock:
            if part.reported or part.ended:
                return
            part.reported = True
            pending.stats.add_pushed(body.figures)
            if body.source_block_ids is not None and not pending.params.block_ids:
                pending.source_ids = body.source_block_ids  # the concurrent dispatch
            if body.unproven:  # nothing proves P's engine stopped writing here
                part.settling = True
        if body.unproven:
            self._hold_for_good(pending, f"push of {pending.params.request_id!r}: {body.reason}")
        elif body.ok and ctx.verify is not Verify.OFF:
            ctx.requests.submit(self._check_push, part, body)
        else:
            self._end_part(part, body.ok, body.reason)

    def _check_push(self, part: _RankLoad, body: PushDone) -> None:
        """Compare P's digest of what it wrote with D's of what it holds now."""
        ctx, pending = self._ctx, part.pending
        start = time.monotonic()
        rid = pending.params.request_id
        try:
            if part.remote is None:
                raise KvbridgeError("no handshake with prefill to plan the check with")
            source = pending.params.block_ids
            if not source and pending.source_ids is not None:
                # The concurrent dispatch: D learns P's ids only now, from P.
                source = checked_ids(part.remote.layout, pending.source_ids, "source")
            mine = pair_digest(
                part.remote.layout, ctx.layout, source, pending.block_ids, "dst", ctx.verify, rid
            )
        except Exception as err:
            self._end_part(part, False, f"integrity check could not run: {err}")
            return
        pending.stats.verify_s += time.monotonic() - start
        if body.digest != mine:
            pending.stats.verify_failed = True
            self._end_part(
                part,
                False,
                f"integrity check ({ctx.verify.value}) failed: prefill's digest {body.digest} "
                f"of what it wrote differs from decode's {mine} of what it holds",
            )
            return
        self._end_part(part, True, "")

    def _end_part(self, part: _RankLoad, ok: bool, reason: str) -> None:
        """A part ended (no byte of it can still land). The load ends with its last part; a
        failed part has the others given up (aborted and settled with their P ranks) first."""
        pending = part.pending
        with self._lock:
            if part.ended:
                return
            part.end(ok, reason)
            parts = list(pending.parts.values())
            over = all(p.ended for p in parts)
        if not over:
            if not ok:
                self._settle_push_later(pending, reason)
            return
        failed = [p.reason for p in parts if not p.ok]
        self._finish_pending(pending.params.request_id, not failed, failed[0] if failed else "")

    def _settle_push_later(self, pending: _Pending, reason: str) -> None:
        with self._lock:
            if self._pending.get(pending.params.request_id) is not pending:
                return
            parts = [p for p in pending.parts.values() if not p.settling and not p.ended]
            for part in parts:
                part.settling = True
            if parts:
                self._hold(pending)
        for part in parts:
            self._ctx.peer_waits.submit(self._settle_push, part, reason)

    def _settle_push(self, part: _RankLoad, reason: str) -> None:
        """D gave up waiting for a push (deadline or abort): end it only once P's write is fenced.

        Aborts the push, then asks P how it ended until P answers: ``PushDone`` (P fenced its
        write, or it had succeeded), or "unknown" (P holds no write of it).
        """
        ctx, rid = self._ctx, part.params.request_id
        part.asked.wait(ctx.deadlines.load)
        aborted = False

        def query(client: PeerClient) -> PushDone | ControlError | None:
            nonlocal aborted
            try:
                if not aborted:
                    abort = Abort(rid, reason[:4000], **self._me, token=part.params.token)
                    client.request(abort, ctx.deadlines.call)
                    aborted = True
                query_ = PushQuery(rid, **self._me, token=part.params.token)
                reply = client.request(query_, ctx.deadlines.call)
            except ControlError as err:
                if err.code == "unknown_request":
                    return err
                log.warning("request %s: prefill refused to say how its push ended: %s", rid, err)
                time.sleep(ctx.deadlines.retry_pause)
                return None
            if isinstance(reply, PushDone):
                return reply
            time.sleep(0.05)  # P is still fencing its write
            return None

        answer = self._ask_prefill(part, query, "prefill confirms its push ended")
        if isinstance(answer, PushDone):
            self._reported(part, answer)
        elif isinstance(answer, ControlError):
            self._end_part(part, False, f"{reason}; prefill holds no write of it")
        elif answer is not None:
            self._end_part(part, False, f"{reason}; prefill is gone ({answer})")

    # -- both -------------------------------------------------------------------------------------
    def _ask_prefill(
        self, part: _RankLoad, ask: Callable[[PeerClient], _A | None], waiting: str
    ) -> _A | PeerRefusedError | None:
        """Call ``ask`` with the P rank's client until it has P's answer (not None); return it.

        Returns the refusal when P's address refuses connections: P is gone, and no byte of it
        can land any more; None when the plane closed or the request ended meanwhile. A P that
        does not answer is alive but frozen or cut off: the request stays held (logged,
        ``waiting`` for what), and P is asked again.
        """
        rid = part.params.request_id
        client = self._peers.client(part.address.endpoint)
        start = time.monotonic()
        while not self._ctx.closed and rid in self._pending:
            try:
                answer = ask(client)
            except PeerRefusedError as err:
                return err
            except Exception as err:
                log.warning(
                    "request %s: blocks held until %s (%.0f s so far): %s",
                    rid,
                    waiting,
                    time.monotonic() - start,
                    err,
                )
                time.sleep(self._ctx.deadlines.retry_pause)
                continue
            if answer is not None:
                return answer
        return None

    def _hold(self, pending: _Pending) -> None:
        with self._lock:
            pending.held_since = pending.held_since or time.monotonic()

    def _hold_for_good(self, pending: _Pending, reason: str) -> None:
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

    def _tell(self, address: RankAddress, body: Release | Abort) -> None:
        """Send a P rank a release or abort; one that does not arrive is freed by P's lease."""
        self._tell_all([(address, body)])

    def _tell_all(self, tells: list[tuple[RankAddress, Release | Abort]]) -> None:
        """``_tell`` each, all sent before any answer is read (``Handshakes.send_first``: a
        rank that shares another's endpoint is told once the first answered)."""
        timeout = self._ctx.deadlines.call
        calls = self._peers.send_first([(a.endpoint, body) for a, body in tells], timeout)
        for (address, body), call in zip(tells, calls, strict=True):
            try:
                if isinstance(call, Exception):
                    raise call
                if call is None:
                    self._peers.client(address.endpoint).request(body, timeout)
                else:
                    call.reply()
            except Exception as err:
                _not_delivered(address, body, err)

    def _finish_pending(
        self, request_id: str, ok: bool, reason: str, *, closing: bool = False
    ) -> None:
        ctx = self._ctx
        with self._lock:
            pending = self._pending.get(request_id)
            if pending is None or (pending.unproven and not closing):
                return  # ended already, or held for good (only closing the plane ends it)
            del self._pending[request_id]
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


def _not_delivered(address: RankAddress, body: Release | Abort, err: Exception) -> None:
    log.info(
        "request %s: %s not delivered to %s (%s); P's lease frees it",
        body.request_id,
        type(body).__name__.lower(),
        address.endpoint,
        err,
    )


def _stage(pp_rank: int, pp_size: int) -> str:
    return f" in pipeline stage {pp_rank} of {pp_size}" if pp_size > 1 else ""
