"""D's pulls: D reads a request's blocks from P, whole once P published them, or layer by layer
while P computes them (the layer-wise pull).

A pull claims the blocks (``PullStart``, answered once P published), reads them with D's own
transport, checks them when ``verify`` says so, and releases them (``Release``). A layer-wise
pull asks P first (``StreamRequest``); P tells each computed layer (``LayersReady``), D reads it
at once, and reads the rest once P published. A pull is fenced by D's transport: a failed one
fences every read of it before its outcome, then tells P (a release, or an abort of a request
P has not published).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import wait
from dataclasses import dataclass

from kvbridge.control.channel import PendingReply
from kvbridge.control.context import PlaneContext
from kvbridge.control.handshakes import Handshakes
from kvbridge.control.loadbook import LoadBook, PendingLoad, RankLoad, Tell
from kvbridge.control.messages import (
    Abort,
    Digest,
    DigestRequest,
    LayersReady,
    PullStart,
    Release,
    StreamRequest,
)
from kvbridge.control.requests import checked_ids, timed
from kvbridge.control.streams import ComputedBlocks, Stream
from kvbridge.control.transfers import Move, Transfers, plan_digest
from kvbridge.core.batches import Fence, TransferHandle, TransferOp
from kvbridge.core.errors import (
    ControlError,
    IntegrityError,
    KvbridgeError,
    PeerTimeoutError,
    TransportError,
)
from kvbridge.core.integrity import Verify
from kvbridge.core.planning import TransferPlan
from kvbridge.core.tp import plan_tp_pair

log = logging.getLogger("kvbridge.control")


@dataclass
class _Claim:
    """A pull's ``PullStart`` to one P rank: sent (``call``), refused before it went
    (``error``), or neither (to be sent when its endpoint is free)."""

    part: RankLoad
    started: float
    call: PendingReply | None = None
    error: Exception | None = None


class Pulls:
    """D's pulls, whole (``run``) or layer-wise (``run_layerwise``), over the loads ``book``."""

    def __init__(
        self, ctx: PlaneContext, handshakes: Handshakes, transfers: Transfers, book: LoadBook
    ) -> None:
        self._ctx = ctx
        self._handshakes = handshakes
        self._transfers = transfers
        self._book = book
        self._lock = ctx.lock
        self._me = book.me

    def run(self, pending: PendingLoad) -> None:
        """A request worker's pull: claim the blocks while planning the read, read, check;
        then the outcome and P told (``_pull_done``, ``_pull_failed``)."""
        ctx, transfers = self._ctx, self._transfers
        params, rid = pending.params, pending.params.request_id
        parts = list(pending.parts.values())
        pending.stats.queued_s = time.monotonic() - pending.started
        try:
            self._book.handshake_all(pending)
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
                Move(part.remote.engine_id, part.plan, part)
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
        pending: PendingLoad,
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
            self._book.hold(pending)
        fences = [self._transfers.fence(handle, rid, pending.stats) for handle in reading]
        reason = f"{what}: {err}"
        if Fence.UNPROVEN in fences:
            self._book.hold_for_good(pending, reason)
        else:
            self._book.finish(rid, False, reason)
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
            self._ctx.requests.submit(self._book.tell, part.address, tell)

    def _pull_done(self, pending: PendingLoad) -> None:
        """The bytes are in and fenced: the load is done now; P's releases are off D's path (one
        that does not arrive is freed by P's lease)."""
        params, rid = pending.params, pending.params.request_id
        self._book.finish(rid, True, "")
        release = Release(rid, True, "", **self._me, token=params.token)
        self._book.tell_all([Tell(part.address, release) for part in pending.parts.values()])

    def _send_claims(self, parts: list[RankLoad]) -> list[_Claim]:
        """Send each P rank its ``PullStart`` now (``Handshakes.send_first``: a rank that shares
        another's endpoint sends its own when the first was answered)."""
        started = time.monotonic()
        calls = [(part.address.endpoint, self._pull_start(part)) for part in parts]
        sent = self._handshakes.send_first(calls, self._ctx.deadlines.call)
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

    def _pull_start(self, part: RankLoad) -> PullStart:
        params = part.params
        return PullStart(params.request_id, params.block_ids, **self._me, token=params.token)

    def _claim(self, part: RankLoad, sent: PendingReply | None, until: float) -> None:
        """Tell P which blocks D reads (``sent``: told already, its answer to come); until
        ``until`` (``time.monotonic()``) wait for P to publish a request it has not yet.

        A serving engine may hand the transfer parameters to D before its worker has published
        the request (vLLM publishes one engine step after the request finished on P).
        """
        deadlines = self._ctx.deadlines
        client = self._handshakes.client(part.address.endpoint)
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

    def _check_pull(self, part: RankLoad, plan: TransferPlan) -> None:
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
            self._handshakes.client(part.address.endpoint).request, ask, ctx.deadlines.call
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

    # -- layer-wise pull -------------------------------------------------------------------------
    def run_layerwise(self, pending: PendingLoad) -> None:
        """A request worker's start of a layer-wise pull: ask each P rank for word of its
        computed layers; ``on_layers_ready`` reads them, and ``settle_layerwise`` ends it."""
        rid = pending.params.request_id
        pending.stats.queued_s = time.monotonic() - pending.started
        try:
            self._book.handshake_all(pending)
            if pending.aborted:
                raise KvbridgeError(pending.abort_reason or "aborted by decode")
            for part in pending.parts.values():
                assert part.remote is not None
                part.stream = Stream(part.remote, TransferOp.READ)
        except Exception as err:
            self.settle_layerwise(pending, f"layer-wise pull of {rid!r} failed: {err}")
            return
        wait([self._ctx.asks.submit(self._ask_stream, part) for part in pending.parts.values()])
        # P's word comes as LayersReady; the load's deadline bounds the wait for it.

    def _ask_stream(self, part: RankLoad) -> None:
        ctx, params = self._ctx, part.params
        ask = StreamRequest(params.request_id, **self._me, token=params.token)
        try:
            with timed(part.pending.stats, "ask_s"):
                reply = self._handshakes.client(part.address.endpoint).request(
                    ask, ctx.deadlines.call
                )
        except PeerTimeoutError:
            return  # it may have reached P: P's word or the deadline ends the load
        except Exception as err:  # refused, P gone: P tells nothing, D read nothing
            why = f"layer-wise pull of {params.request_id!r} failed: {err}"
            self.settle_layerwise(part.pending, why)
            return
        if isinstance(reply, LayersReady):  # P had published it already
            self._on_ready(part, reply)

    def on_layers_ready(self, body: LayersReady, sender: str) -> None:
        """P's word on a layer-wise pull, from the P rank ``sender``."""
        part = self._book.part_of(body.request_id, sender)
        if part is not None:
            self._on_ready(part, body)

    def _on_ready(self, part: RankLoad, body: LayersReady) -> None:
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
            self.settle_layerwise(pending, f"layer-wise pull of {body.request_id!r}: {why}")
        elif everyone:
            self.settle_layerwise(pending, "")

    def _read_layers(self, part: RankLoad, body: LayersReady) -> None:
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

    def settle_layerwise(self, pending: PendingLoad, failure: str) -> None:
        """End a layer-wise pull, once: read the rest (``failure`` empty: P published it), or
        fence what was read."""
        with self._lock:
            if pending.finishing or not self._book.booked(pending):
                return
            pending.finishing = True
        self._ctx.requests.submit(self._finish_layerwise, pending, failure)

    def _finish_layerwise(self, pending: PendingLoad, failure: str) -> None:
        """Read what no layer-wise read took, wait for the early reads, check; or fail (and
        fence) with ``failure``."""
        ctx, transfers = self._ctx, self._transfers
        parts = list(pending.parts.values())
        streamed = [h for part in parts if part.stream is not None for h in part.stream.take()]
        try:
            if failure:
                raise KvbridgeError(failure)
            moving: list[Move] = []
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
                    moving.append(Move(part.remote.engine_id, rest, part))
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
