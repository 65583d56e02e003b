"""The prefill side (P): leases on published requests' blocks, and the pushes P runs.

P holds a published request's blocks under a lease until D releases them (pull), P's push ended
(push), D aborted, or the lease expired; a lease no D rank claimed ends sooner (``claim``). A
push D asks for before P published is kept until it does. How each push ended is remembered a
while, so that D can ask again (``PushQuery``).

Every request D sends about a request carries its capability token (``TransferParams.token``,
made here at publish): P answers a claim, a release, an abort, a push or a digest of it only to
the token's bearer, so an engine that knows the shared secret and a request id, but not the
token P handed out with the request's parameters, gets nothing (refused, code ``token``).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvbridge.control import auth
from kvbridge.control.context import PlaneContext
from kvbridge.control.handshakes import Handshakes, RemoteEngine
from kvbridge.control.messages import (
    Abort,
    BlockIds,
    Digest,
    DigestRequest,
    FromDecodeRank,
    LayersReady,
    Message,
    Ok,
    PullStart,
    PushDone,
    PushQuery,
    PushRequest,
    Release,
    StreamRequest,
    TransferFigures,
)
from kvbridge.control.requests import (
    Mode,
    RequestOutcome,
    RequestStats,
    TransferParams,
    checked_ids,
    forget_expired,
)
from kvbridge.control.streams import ComputedBlocks, PushKey, ReadyNotices, Stream, fence_all
from kvbridge.control.transfers import Move, RankShare, Transfers, pair_digest, plan_digest
from kvbridge.core.batches import Fence, TransferOp
from kvbridge.core.errors import KvbridgeError, MessageError, PeerRefusedError, TransportError
from kvbridge.core.integrity import Verify, unreadable_here
from kvbridge.core.planning import TransferPlan
from kvbridge.core.tp import plan_tp_pair, reporting_ranks

log = logging.getLogger("kvbridge.control")

#: The most ended holds P remembers (``Leases._ended``), each for ``Deadlines.remember``: a
#: thousand requests a second for a 30 s lease stay within it.
ENDED_KEPT = 65536


@dataclass
class _Reader(RankShare):
    """One decode TP rank's part of a published request: its claim (pull) or P's write (push).

    ``rank`` is the D rank; ``ended`` once released (pull), the push ended, or the rank reads
    nothing here; ``handle``: P's write in flight (push), released when D aborts.
    """

    lease: _Lease
    #: the D rank's engine, which alone may release or ask about this part
    engine_id: str = ""
    pushing: bool = False

    @property
    def params(self) -> TransferParams:
        return self.lease.params

    @property
    def aborted(self) -> bool:
        return self.lease.aborted


@dataclass(frozen=True)
class _Readers:
    """The D workers that read from this P worker (``FromDecodeRank.reader``): TP ranks
    ``ranks`` of D's TP size ``tp_size``, in each of D's ``pp_size`` stages."""

    ranks: range
    tp_size: int
    pp_size: int = 1

    def __iter__(self) -> Iterator[int]:
        return (s * self.tp_size + r for s in range(self.pp_size) for r in self.ranks)

    def __contains__(self, reader: object) -> bool:
        if not isinstance(reader, int) or reader < 0:
            return False
        stage, rank = divmod(reader, self.tp_size)
        return stage < self.pp_size and rank in self.ranks

    def __str__(self) -> str:
        return _span(self.ranks) + _stages(self.pp_size)


def _stages(pp_size: int) -> str:
    return f" in each of {pp_size} pipeline stages" if pp_size > 1 else ""


@dataclass
class _Lease:
    """P's hold on a published request's blocks, until every D rank that reads them ended."""

    params: TransferParams
    expires_at: float
    #: when P published it (a claimed lease lasts at least ``lease`` from here)
    published_at: float = 0.0
    #: the D workers that end this lease (``reporting_ranks`` of every D stage), known from the
    #: first D worker's word
    expected: _Readers | None = None
    readers: dict[int, _Reader] = field(default_factory=dict)
    aborted: bool = False

    @property
    def pushing(self) -> bool:
        return any(r.pushing for r in self.readers.values())

    @property
    def over(self) -> bool:
        """Every D rank that reads it is done."""
        return self.expected is not None and all(
            rank in self.readers and self.readers[rank].ended for rank in self.expected
        )


class _AskedEarly(NamedTuple):
    """A push (or layer-wise pull) a D rank asked for before P published the request."""

    remote: RemoteEngine
    request: _Early
    until: float


class _PushResult(NamedTuple):
    """How a finished push ended, kept for D's ``PushQuery`` until ``until``."""

    done: PushDone
    until: float
    token: str


class _Ended(NamedTuple):
    """A hold that ended: until when it is remembered, and why."""

    until: float
    reason: str


class _EarlyWords(NamedTuple):
    """What D ranks asked of a request before P published it, taken at publish: every ask
    (``asked``), those joined to the lease (``starts``), and the layer notices kept for each."""

    asked: list[tuple[PushKey, _AskedEarly]]
    starts: list[tuple[_Reader, _AskedEarly]]
    notices: dict[PushKey, ReadyNotices | None]


class Leases:
    """P's published requests: leases, D's claims on them, and the pushes P runs for D.

    A lease ends when every D rank that reads from this P rank is done with it
    (``reporting_ranks`` of D's TP size, learnt from the first D rank's word): released (pull),
    its push ended, or it had nothing to read here; or when any D rank aborted, or it expired.
    """

    def __init__(self, ctx: PlaneContext, handshakes: Handshakes, transfers: Transfers) -> None:
        self._ctx = ctx
        self._handshakes = handshakes
        self._transfers = transfers
        self._lock = ctx.lock
        self._leases: dict[str, _Lease] = {}
        # Pushes (and layer-wise pulls) D ranks asked for before P published: (D, its request,
        # until when), by (request id, D rank, token): one with another token cannot crowd out
        # the bearer's.
        self._pending_push: dict[PushKey, _AskedEarly] = {}
        # How finished pushes ended (D may ask again), by (request id, D rank), with the
        # request's token, and requests D withdrew before P saw them, by (request id, token)
        # (a late PushRequest or PullStart for them is refused); both until the time given.
        self._push_results: dict[tuple[str, int], _PushResult] = {}
        self._withdrawn: dict[tuple[str, str], float] = {}
        # Holds that ended (released, pushed, aborted, unclaimed or past the lease), by
        # (request id, token), oldest first: until when, and why. A D rank that comes late (its
        # request queued past the claim timeout, a retried or repeated request) is told so at
        # once instead of waiting for a publish or a push that never comes. At most
        # ``ENDED_KEPT``: the oldest go first (then a late claim waits its bound, as before).
        self._ended: OrderedDict[tuple[str, str], _Ended] = OrderedDict()
        # Layers written to D ranks before publish (``stream``), by the pending push's key;
        # kept until the push at publish takes them over, or fenced when it never comes.
        self._streams: dict[PushKey, Stream] = {}
        # Layer-wise pulls: what P tells each D rank of the layers it computed, by the same key.
        self._notices: dict[PushKey, ReadyNotices] = {}

    def publish(
        self,
        request_id: str,
        block_ids: Mapping[int, Any],
        num_tokens: int,
        mode: Mode,
        token: str | None = None,
        published_at: float | None = None,
    ) -> TransferParams:
        """Hold a prefilled request's blocks under a lease; return what D needs to fetch them.

        ``token``: the request's capability (``TransferParams.token``), when the caller made
        it (a serving engine's scheduler, the same for every TP rank); a fresh one otherwise.
        ``published_at``: when P answered the request (``TransferParams.published_at``), when
        the caller stamped it (the scheduler, when the request finished); now otherwise.
        """
        ctx = self._ctx
        ids = checked_ids(ctx.layout, block_ids, "published")
        params = TransferParams(
            request_id,
            ctx.engine_id,
            ctx.endpoint,
            ids,
            num_tokens,
            ctx.transport.name,
            Mode(mode),
            token=token or auth.new_token(),
            published_at=time.time() if published_at is None else published_at,
        )
        token = params.token
        with self._lock:
            if request_id in self._leases:
                raise KvbridgeError(f"request {request_id!r} is already published")
            self._ended.pop((request_id, token), None)  # published again: held anew
            if (request_id, token) in self._withdrawn:
                # D gave it up before this engine published it: nobody will read the blocks.
                reason = "aborted by decode before it was published"
                ctx.record(RequestOutcome(request_id, False, reason, RequestStats()))
                log.debug("request %s: %s; blocks freed", request_id, reason)
                return params
            now = time.monotonic()
            lease = _Lease(params, now + ctx.deadlines.claim, published_at=now)
            self._leases[request_id] = lease
            early = self._take_early(lease)
        log.debug(
            "request %s: published (%s)",
            request_id,
            f"{len(early.starts)} early reader(s) waiting" if early.starts else mode,
        )
        self._answer_early(params, early)
        return params

    def _take_early(self, lease: _Lease) -> _EarlyWords:
        """What D ranks asked of a request before P published it (lock held, ``lease`` new):
        each taken from the waiting ones; the pushes of the right token joined to the lease."""
        request_id, token = lease.params.request_id, lease.params.token
        waiting = sorted(key for key in self._pending_push if key.request_id == request_id)
        asked = [(key, self._pending_push.pop(key)) for key in waiting]
        starts = []
        for key, push in asked:
            if auth.token_matches(token, key.token):
                starts.append((self._join(lease, push.request, push.remote.engine_id), push))
            else:
                log.warning(
                    "request %s: refused a push asked by %r before publish: wrong capability token",
                    request_id,
                    push.remote.engine_id,
                )
        notices = {key: self._notices.pop(key, None) for key, _ in asked}
        return _EarlyWords(asked, starts, notices)

    def _answer_early(self, params: TransferParams, early: _EarlyWords) -> None:
        """Answer, now that P published, the D ranks that asked before: a layer-wise pull
        hears it may read the rest; a push starts."""
        for key, (remote, request, _) in early.asked:
            notice = early.notices[key]
            if isinstance(request, StreamRequest) and auth.token_matches(params.token, key.token):
                # D reads the rest now (after the layers told): P holds it for D's claim
                self._last_word(key, remote, notice, _published(params))
            elif notice is not None:
                notice.close()
        for reader, (remote, request, _) in early.starts:
            if isinstance(request, PushRequest):
                self._start_push(reader, remote, request, early=True)

    def unpublish(self, request_id: str) -> None:
        """Drop a lease without a transfer (the request was aborted on P)."""
        self._free(request_id, False, "withdrawn by prefill")

    def stream(self, request_id: str, token: str, part: ComputedBlocks, layers: list[str]) -> int:
        """Write these computed layers of a request P has not published yet to every D rank
        that asked for a push of it with ``token``; returns the bytes submitted (0: no D rank
        asked yet, or its transport is not connected yet: the push at publish sends them).

        Never waits on a peer: it runs on the engine's forward pass. ``part``: P's ids of the
        groups whose layers are streamed (paged groups; a recurrent state is sent at publish,
        once final), of the blocks this prefill step completed.
        """
        ctx = self._ctx
        with self._lock:
            asked = [
                (key, push)
                for key, push in self._pending_push.items()
                if key.request_id == request_id and auth.token_matches(token, key.token)
            ]
        if not asked:
            return 0
        submitted = 0
        for key, (remote, push, _) in asked:
            if isinstance(push, StreamRequest):  # D reads: tell it, off the forward pass
                self._tell_ready(key, remote, part, layers)
                continue
            connected = remote.connect_soon()
            if not connected.done() or connected.exception() is not None:
                continue
            with self._lock:
                stream = self._streams.setdefault(key, Stream(remote))
            with stream.lock:  # the push (or the end) taking it over waits for this write
                if stream.failed or stream.closed:
                    continue
                try:
                    submitted += stream.send(ctx, part, push.block_ids, layers)
                except MessageError:  # the engine's ids do not fit: nothing was written
                    raise
                except Exception as err:  # the push at publish fails, fenced with the rest
                    stream.failed = f"a layer-wise write could not start: {err}"
                    log.warning("request %s: %s", request_id, stream.failed)
        return submitted

    def _tell_ready(
        self, key: PushKey, remote: RemoteEngine, part: ComputedBlocks, layers: list[str]
    ) -> None:
        """A layer-wise pull: tell the D rank these layers are computed (``ReadyNotices``)."""
        with self._lock:
            notices = self._notices.setdefault(key, ReadyNotices(remote))
        if notices.add(self._ctx, part, layers):
            self._ctx.peer_waits.submit(self._send_ready, key.request_id, notices)

    def _last_word(
        self,
        key: PushKey,
        remote: RemoteEngine,
        notices: ReadyNotices | None,
        last: LayersReady,
    ) -> None:
        """A layer-wise pull's last word to D, after the layers told (if any were)."""
        if notices is None:
            self._ctx.peer_waits.submit(self._deliver, remote.endpoint, last)
        elif notices.finish(last):
            self._ctx.peer_waits.submit(self._send_ready, key.request_id, notices)

    def _send_ready(self, request_id: str, notices: ReadyNotices) -> None:
        """Send what ``notices`` holds, in order, until nothing is left. A layer notice that
        does not arrive costs time only (D reads those layers once P published the request);
        the last word is delivered as a push's end is."""
        while (ready := notices.take(request_id)) is not None:
            if ready.published or not ready.ok:
                self._deliver(notices.remote.endpoint, ready)
                continue
            try:
                client = self._handshakes.client(notices.remote.endpoint)
                client.request(ready, self._ctx.deadlines.call)
            except Exception as err:
                log.info("request %s: layers ready not told to decode: %s", request_id, err)

    @property
    def leased(self) -> list[str]:
        """Request ids whose blocks P still holds."""
        with self._lock:
            return list(self._leases)

    def expire(self, now: float) -> None:
        """Housekeeping: free leases D never released, forget what is remembered too long."""
        with self._lock:
            expired = [
                r
                for r, lease in self._leases.items()
                if lease.expires_at < now and not lease.pushing
            ]
            unclaimed = {r for r in expired if not self._leases[r].readers}
            deadlines = self._ctx.deadlines
            reasons = {
                r: (
                    f"no decode claimed it within {deadlines.claim:g} s of publishing"
                    if r in unclaimed
                    else f"lease of {deadlines.lease:g} s expired before decode released it"
                )
                for r in expired
            }
            while self._ended and next(iter(self._ended.values())).until < now:
                self._ended.popitem(last=False)  # kept alike: the oldest expire first
            forget_expired(self._pending_push, now, lambda asked: asked.until)
            orphans = [
                key
                for key in self._streams
                if key not in self._pending_push and key.request_id not in self._leases
            ]
            for key in [k for k in self._notices if k not in self._pending_push]:
                self._notices.pop(key).close()
            forget_expired(self._withdrawn, now, lambda until: until)
            forget_expired(self._push_results, now, lambda result: result.until)
            # Freed under the lock that found them expired: a D rank's claim or push that comes
            # meanwhile either extended the lease before (then it is not expired) or finds it
            # ended (``hold_ended``), never a lease about to be freed under a starting push.
            for rid in expired:
                stats = RequestStats(lease_expired=True, unclaimed=rid in unclaimed)
                self._free(rid, False, reasons[rid], stats)
        for key in orphans:
            self._end_stream(key, "prefill never published the request it streamed")

    def close(self) -> None:
        """Free every lease (the plane is closing)."""
        with self._lock:
            leases = list(self._leases)
            streams = list(self._streams)
        for request_id in leases:
            self._free(request_id, False, "the control plane was closed")
        for key in streams:
            self._end_stream(key, "the control plane was closed", wait=True)

    def withdraw(self, request_id: str, token: str, reason: str) -> None:
        """P will not publish a request D may be waiting for (it declined to hold it, or the
        request ended otherwise on P): every D rank that asked for its push hears so now
        (after the fence of what was streamed), and a push asked later is refused, so that D
        computes the prompt itself at once instead of at its deadline."""
        with self._lock:
            until = time.monotonic() + self._ctx.deadlines.remember
            self._withdrawn[(request_id, token)] = until
            asked = {
                key: self._pending_push.pop(key)
                for key in list(self._pending_push)
                if key.request_id == request_id and auth.token_matches(token, key.token)
            }
            notices = {key: self._notices.pop(key, None) for key in asked}
        for key, (remote, request, _) in asked.items():
            if isinstance(request, StreamRequest):  # D read only P's blocks: nothing to fence
                why = f"prefill will not send it: {reason}"
                self._last_word(
                    key, remote, notices[key], LayersReady(request_id, ok=False, reason=why)
                )
            else:
                self._end_stream(key, reason, tell=remote.endpoint)

    def _end_stream(
        self, key: PushKey, reason: str, wait: bool = False, tell: str | None = None
    ) -> None:
        """A stream whose push will not run (aborted, never published, closing): stop its
        writes, and once they are fenced remember the failed push for D's ``PushQuery``."""
        with self._lock:
            stream = self._streams.get(key)
        if stream is None and tell is None:
            return
        handles = stream.release(self._ctx) if stream is not None else []
        rid, rank, token = key

        def fence() -> None:
            stats = RequestStats()
            proof = fence_all(self._transfers, handles, rid, stats)
            done = PushDone(
                rid,
                False,
                f"prefill could not push: {reason}",
                TransferFigures(unproven=proof is not Fence.DRAINED),
            )
            with self._lock:
                until = time.monotonic() + self._ctx.deadlines.remember
                self._push_results[(rid, rank)] = _PushResult(done, until, token)
                self._streams.pop(key, None)
            log.debug("request %s: stream to decode rank %d ended: %s", rid, rank, reason)
            if tell is not None:  # D waits for this push: it fails now, not at its deadline
                self._deliver(tell, done)

        if wait or self._ctx.closed:
            fence()
        else:
            self._ctx.peer_waits.submit(fence)

    # -- D's requests -----------------------------------------------------------------------------
    def _join(self, lease: _Lease, body: FromDecodeRank, peer: str = "") -> _Reader:
        """The D rank's part of the lease, new; lock held. Refuses a rank that does not read
        from this P rank, or one that already took its part."""
        rid = lease.params.request_id
        spec = self._ctx.layout.spec
        try:
            ranks = reporting_ranks(spec.tp_rank, spec.tp_size, body.tp_size)
        except KvbridgeError as err:
            raise MessageError("tp_size", f"request {rid!r}: {err}") from None
        if body.pp_rank >= body.pp_size:
            raise MessageError(
                "pp_size", f"decode stage {body.pp_rank} is outside its {body.pp_size} stages"
            )
        # Every D stage talks to every P stage (one holding none of its layers reads nothing).
        expected = _Readers(ranks, body.tp_size, body.pp_size)
        if lease.expected is not None and lease.expected != expected:
            raise MessageError(
                "tp_size",
                f"request {rid!r} is read by decode ranks {lease.expected}, not by a decode "
                f"of TP size {body.tp_size}" + _stages(body.pp_size),
            )
        if body.reader not in expected:
            raise MessageError(
                "not_a_reader",
                f"decode rank {body.rank} of TP size {body.tp_size} does not read from prefill "
                f"rank {spec.tp_rank} of {spec.tp_size} (its readers: {_span(ranks)})",
            )
        if body.reader in lease.readers:
            raise MessageError(
                "duplicate",
                f"request {rid!r} is already taken by decode rank {body.rank}"
                + (f" of stage {body.pp_rank}" if body.pp_size > 1 else ""),
            )
        lease.expected = expected
        reader = _Reader(lease, peer, rank=body.reader)
        lease.readers[body.reader] = reader
        # Claimed: the lease runs its full length from publishing (an unclaimed one ends at
        # ``claim``), and the blocks outlive D's read and its engine giving it back.
        hold = time.monotonic() + self._ctx.deadlines.read_hold
        lease.expires_at = max(
            lease.expires_at, lease.published_at + self._ctx.deadlines.lease, hold
        )
        return reader

    def on_pull_start(self, peer: str, body: PullStart) -> Message:
        with self._lock:
            lease = self._leases.get(body.request_id)
            if lease is None:
                self._refuse_ended(body.request_id, body.token)
                raise _unknown(body.request_id)
            _require_token(lease, body)
            if any(r.pushing for r in lease.readers.values()):
                raise MessageError("duplicate", f"request {body.request_id!r} is already taken")
            _require_subset(body.block_ids, lease.params.block_ids, body.request_id)
            self._join(lease, body, peer)
        return Ok()

    def on_release(self, peer: str, body: Release) -> Message:
        with self._lock:
            lease = self._leases.get(body.request_id)
            if lease is None:
                if (body.request_id, body.token) in self._ended:
                    # The hold ended first (its lease ran out, D aborted, or this is a late
                    # repeat): the blocks went back then and its end was logged, so the bearer's
                    # release has nothing left to free and is no refusal.
                    log.debug("request %s: release after its hold ended", body.request_id)
                    return Ok()
                raise _unknown(body.request_id)
            _require_token(lease, body)
            reader = lease.readers.get(body.reader)
            if reader is None:  # a D rank that read nothing here: its word ends its part
                reader = self._join(lease, body, peer)
            elif reader.engine_id != peer or reader.pushing:
                raise MessageError(
                    "not_yours",
                    f"engine {peer!r} cannot release decode rank "
                    f"{body.rank}'s part of {body.request_id!r}",
                )
            if reader.ended:
                return Ok()  # a repeated release
            reader.end(body.ok, "released by decode" if body.ok else body.reason)
        self._end_if_over(lease)
        return Ok()

    def on_digest_request(self, peer: str, body: DigestRequest) -> Message | Future[Message]:
        with self._lock:
            lease = self._leases.get(body.request_id)
            reader = lease.readers.get(body.reader) if lease is not None else None
            remote = self._handshakes.peer(peer)
            if lease is None or reader is None or reader.engine_id != peer or remote is None:
                raise _unknown(body.request_id)
            _require_token(lease, body)
            src_ids = lease.params.block_ids
        unreadable = unreadable_here(self._ctx.layout)
        if unreadable:  # reading GPU memory from the CPU would take the engine down
            raise MessageError("verify_unsupported", f"prefill: {unreadable} on decode")
        try:
            check = Verify(body.verify)
            plan = plan_tp_pair(
                self._ctx.layout,
                remote.layout,
                src_ids,
                body.block_ids,
                dst_first_token=body.first_token,
            )
        except (ValueError, KvbridgeError) as err:
            raise MessageError("invalid", f"cannot digest {body.request_id!r}: {err}") from None
        if plan is None:
            raise MessageError("invalid", f"nothing of {body.request_id!r} moves to that rank")
        # Hashing a large request takes long: the endpoint answers others meanwhile. P still
        # holds the blocks: D keeps its claim until it has the digest.
        rid = body.request_id
        return self._ctx.digests.submit(lambda: Digest(plan_digest(plan, "src", check, rid)))

    def on_abort(self, body: Abort) -> None:
        rid, token = body.request_id, body.token
        with self._lock:
            for key in [k for k in self._pending_push if _asked_with(k, rid, token)]:
                del self._pending_push[key]
            streamed = [k for k in self._streams if _asked_with(k, rid, token)]
            pushed = any(request_id == rid for request_id, _ in self._push_results)
            told = [k for k in self._notices if _asked_with(k, rid, token)]
            notices = [self._notices.pop(k) for k in told]
        for notice in notices:
            notice.close()
        for key in streamed:  # layers written before publish: fenced, then the push failed
            self._end_stream(key, f"aborted by decode: {body.reason}")
        with self._lock:
            lease = self._leases.get(rid)
            if lease is None:
                if token and not pushed:
                    # Only the bearer's abort withdraws it (checked when P publishes).
                    self._withdrawn[(rid, token)] = time.monotonic() + self._ctx.deadlines.remember
                return
            _require_token(lease, body)
            lease.aborted = True  # push workers fence their writes, then end their parts
            handles = [r.handle for r in lease.readers.values() if r.pushing and r.handle]
            pushing = lease.pushing
        if not pushing:
            self._free(rid, False, f"aborted by decode: {body.reason}")
        for handle in handles:
            self._ctx.transport.release(handle)

    def on_push_query(self, body: PushQuery) -> Message:
        rid = body.request_id
        with self._lock:
            result = self._push_results.get((rid, body.reader))
            if result is not None:
                if not auth.token_matches(result.token, body.token):
                    raise _wrong_token(rid)
                return result.done
            lease = self._leases.get(rid)
            if lease is not None:
                _require_token(lease, body)
            reader = lease.readers.get(body.reader) if lease is not None else None
            key = PushKey(rid, body.reader, body.token)
            pending = key in self._pending_push or key in self._streams
            if pending or (reader is not None and reader.pushing):
                return Ok()  # may still write
        raise _unknown(rid)

    def on_push_request(self, peer: str, body: PushRequest) -> Message:
        with self._lock:
            remote, lease = self._admit(peer, body)
            if lease is None:
                return Ok()  # P has not finished prefilling yet: it writes once it publishes
            reader = self._join(lease, body, peer)
        self._start_push(reader, remote, body)
        return Ok()

    def on_stream_request(self, peer: str, body: StreamRequest) -> Message:
        """D asks for a layer-wise pull: kept until P publishes (``LayersReady`` meanwhile), or
        answered with the published request at once when P has published it already."""
        with self._lock:
            _, lease = self._admit(peer, body)
            if lease is None:
                return Ok()
            self._join(lease, body, peer)
            return _published(lease.params)

    def _admit(self, peer: str, body: _Early) -> tuple[RemoteEngine, _Lease | None]:
        """A D rank's push or layer-wise pull request, lock held: the rank's engine, and the
        lease when P published the request; otherwise the request is kept (with its token)
        until P publishes it, and the lease is None."""
        rid, what = body.request_id, type(body).__name__
        remote = self._handshakes.peer(peer)
        if remote is None:
            raise MessageError("no_handshake", f"handshake before a {what}")
        lease = self._leases.get(rid)
        if lease is not None:
            _require_token(lease, body)
        else:
            self._refuse_ended(rid, body.token)
        if (rid, body.token) in self._withdrawn or (rid, body.reader) in self._push_results:
            raise MessageError(
                "withdrawn", f"request {rid!r} was aborted, withdrawn by prefill, or already pushed"
            )
        if isinstance(body, PushRequest):
            body.block_ids = checked_ids(
                remote.layout, body.block_ids, "destination", body.first_token
            )
            remote.connect_soon()  # P writes to this rank: connect meanwhile, off the push
        if lease is None:
            key = PushKey(rid, body.reader, body.token)
            if key in self._pending_push:
                raise MessageError("duplicate", f"{what} of {rid!r} sent twice")
            until = time.monotonic() + self._ctx.deadlines.remember
            self._pending_push[key] = _AskedEarly(remote, body, until)
            log.debug("request %s: %s before publish", rid, what)
        return remote, lease

    def _refuse_ended(self, request_id: str, token: str) -> None:
        """Refuse, lock held, a D rank's word on a hold that ended (its request waited in
        D's queue past the claim timeout, or came again after its load): D then computes the
        prompt itself now, not after waiting for a publish that never comes. Only the bearer
        of the request's token learns why."""
        ended = self._ended.get((request_id, token))
        if ended is not None:
            hint = ""
            if ended.reason.startswith("no decode claimed"):
                hint = " (if decode queues requests that long, raise claim_timeout on prefill)"
            raise MessageError(
                "hold_ended",
                f"prefill no longer holds request {request_id!r}: {ended.reason}; decode computes "
                f"it{hint}",
            )

    # -- P's push ---------------------------------------------------------------------------------
    def _start_push(
        self, reader: _Reader, remote: RemoteEngine, request: PushRequest, early: bool = False
    ) -> None:
        """``early``: D asked before P published (it does not know P's block ids)."""
        with self._lock:
            reader.pushing, reader.engine_id = True, remote.engine_id
        started = time.monotonic()
        self._ctx.requests.submit(self._run_push, reader, remote, request, started, early)

    def _run_push(
        self,
        reader: _Reader,
        remote: RemoteEngine,
        request: PushRequest,
        started: float,
        early: bool = False,
    ) -> None:
        ctx, transfers = self._ctx, self._transfers
        rid, block_ids = reader.params.request_id, request.block_ids
        stats = RequestStats(queued_s=time.monotonic() - started)
        with self._lock:  # the layers written before publish, if P streamed them
            stream = self._streams.pop(PushKey(rid, reader.rank, reader.params.token), None)
        streamed = stream.take() if stream is not None else []
        try:
            if stream is not None and stream.failed:
                raise TransportError(stream.failed)
            src_ids = reader.params.block_ids
            plan = transfers.plan(
                ctx.layout, remote.layout, src_ids, block_ids, stats, by_layer=stream is not None
            )
            rest = plan
            if stream is not None:
                rest, stats.streamed_nbytes = stream.rest(plan, src_ids)
                stats.streamed_parts = stream.parts if stats.streamed_nbytes else 0
            if rest is not None:
                try:
                    remote.wait_connected(ctx.deadlines.connect)
                except Exception as err:  # the connect's own error says what is wrong
                    raise TransportError(f"the transport could not reach decode: {err}") from None
                transfers.move(TransferOp.WRITE, [Move(remote.engine_id, rest, reader)], stats)
            for written in streamed:  # every layer written before publish has landed
                ctx.transport.wait(written)
            stats.landed(reader.params.published_at)
            value = self._push_digest(request, remote, src_ids, plan, rid, stream is not None)
            # D plans its check with P's ids, and permutes what it received by them (a layout
            # of another cell order): a D that asked early never had them.
            source = dict(src_ids) if value is not None or early else None
            done = PushDone(rid, True, "", stats.figures(), digest=value, source_block_ids=source)
            ok, reason = True, "pushed to decode"
        except Exception as err:
            ok, reason = False, str(err)
            handle = reader.handle
            handles = [*streamed, *([handle] if handle is not None else [])]
            fence = fence_all(transfers, handles, rid, stats)
            unproven = TransferFigures(unproven=fence is not Fence.DRAINED)
            done = PushDone(rid, False, f"prefill could not push: {err}", unproven)
        with self._lock:
            until = time.monotonic() + ctx.deadlines.remember
            self._push_results[(rid, reader.rank)] = _PushResult(done, until, reader.params.token)
            # Fenced: the engine reads P's blocks for this part no more.
            reader.pushing, reader.handle = False, None
            reader.end(ok, reason)
        stats.total_s = time.monotonic() - started
        self._end_if_over(reader.lease, stats)
        transfers.report_slow("push", rid, stats)
        ctx.peer_waits.submit(self._deliver, remote.endpoint, done)

    def _push_digest(
        self,
        request: PushRequest,
        remote: RemoteEngine,
        src_ids: BlockIds,
        plan: TransferPlan | None,
        rid: str,
        streamed: bool,
    ) -> int | None:
        """The digest of what P pushed, as D asked for it (``None``: no check asked). D digests
        its whole plan: the same descriptors, not the cut by layer of a streamed push."""
        check = Verify(request.verify)
        if check is Verify.OFF or plan is None:
            return None
        if not streamed:
            return plan_digest(plan, "src", check, rid)
        return pair_digest(
            self._ctx.layout, remote.layout, src_ids, request.block_ids, "src", check, rid
        )

    def _end_if_over(self, lease: _Lease, stats: RequestStats | None = None) -> None:
        """Free the lease once every reader is done, or once an aborted one pushes no more."""
        with self._lock:
            if self._leases.get(lease.params.request_id) is not lease:
                return
            if lease.aborted and not lease.pushing:
                ok, reason = False, "aborted by decode"
            elif lease.over:
                parts = [lease.readers[r] for r in lease.expected or ()]
                ok = all(r.ok for r in parts)
                failed = [r.reason for r in parts if not r.ok]
                reason = failed[0] if failed else parts[0].reason if parts else ""
            else:
                return
        self._free(lease.params.request_id, ok, reason, stats)

    def _deliver(self, endpoint: str, done: PushDone | LayersReady) -> None:
        """Tell D how the push ended (or that a layer-wise pull's request is published or will
        not be); a few tries, then D asks (``PushQuery``) or its deadline ends the load."""
        ctx = self._ctx
        for attempt in range(3):
            try:
                start = time.monotonic()
                self._handshakes.client(endpoint).request(done, ctx.deadlines.call)
                took = time.monotonic() - start
                log.log(
                    logging.WARNING if took >= ctx.deadlines.slow_after else logging.DEBUG,
                    "request %s: %s (ok=%s) delivered in %.3f s",
                    done.request_id,
                    type(done).__name__,
                    done.ok,
                    took,
                )
                return
            except PeerRefusedError as err:  # D is gone: nobody to tell
                log.info("request %s: decode is gone (%s)", done.request_id, err)
                return
            except Exception as err:
                log.warning(
                    "request %s: could not tell decode %s (try %d): %s",
                    done.request_id,
                    type(done).__name__,
                    attempt + 1,
                    err,
                )
            if ctx.closed:
                return

    def _free(
        self, request_id: str, ok: bool, reason: str, stats: RequestStats | None = None
    ) -> bool:
        """End a lease: P's outcome says its blocks may go back. False if it was not held."""
        with self._lock:
            lease = self._leases.pop(request_id, None)
            if lease is None:
                return False
            self._ctx.record(RequestOutcome(request_id, ok, reason, stats or RequestStats()))
            self._ended[(request_id, lease.params.token)] = _Ended(
                time.monotonic() + self._ctx.deadlines.remember,
                reason or "its transfer ended",
            )
            while len(self._ended) > ENDED_KEPT:
                self._ended.popitem(last=False)
        log.debug("request %s: blocks freed (%s)", request_id, reason)
        return True


#: What D asks before P published a request: a push, or a layer-wise pull.
_Early = PushRequest | StreamRequest


def _asked_with(key: PushKey, request_id: str, token: str) -> bool:
    """Whether a D rank (any) asked this push of ``request_id`` with ``token`` (compared
    exactly: an abort names the token its own request carries)."""
    return key.request_id == request_id and key.token == token


def _published(params: TransferParams) -> LayersReady:
    """A layer-wise pull's word that P published the request and holds it for D."""
    return LayersReady(
        params.request_id,
        dict(params.block_ids),
        published=True,
        num_tokens=params.num_tokens,
        published_at=params.published_at,
    )


def _span(ranks: range) -> str:
    return f"{ranks.start}" if len(ranks) == 1 else f"{ranks.start}-{ranks.stop - 1}"


def _unknown(request_id: str) -> MessageError:
    return MessageError(
        "unknown_request",
        f"request {request_id!r} is not held here (never published, released, or lease expired)",
    )


def _wrong_token(request_id: str) -> MessageError:
    return MessageError(
        "token",
        f"request {request_id!r}: wrong or missing capability token (send the token of the "
        "kv_transfer_params prefill returned for this request)",
    )


def _require_token(lease: _Lease, body: FromDecodeRank) -> None:
    """Refuse a peer that does not bear the request's capability token; lock held."""
    if not auth.token_matches(lease.params.token, body.token):
        raise _wrong_token(lease.params.request_id)


def _require_subset(asked: BlockIds, held: BlockIds, request_id: str) -> None:
    for group, ids in asked.items():
        mine = held.get(group, ())
        if ids == mine:  # D names them all, as it usually does: no sets to build
            continue
        extra = set(ids) - set(mine)
        if extra:
            raise MessageError(
                "block_id",
                f"request {request_id!r} does not own block(s) {sorted(extra)[:8]} "
                f"of group {group}",
            )
