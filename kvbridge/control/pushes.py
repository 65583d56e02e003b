"""D's pushes: D asks P to write a request into its blocks, and settles how each push ended.

D sends each P rank its block ids (``PushRequest``); P writes, fences its write and says how it
ended (``PushDone``), with a digest D checks when ``verify`` says so. A push is fenced by P, not
by D's clock: past its deadline, or once aborted, D aborts the push and asks P how it ended
(``PushQuery``) until P answers or is gone (``settle_later``). Meanwhile the request's blocks
stay out of use (``held``); P's word ``unproven`` holds them for good.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import wait
from typing import TypeVar

from kvbridge.control.channel import PeerClient
from kvbridge.control.context import PlaneContext
from kvbridge.control.handshakes import Handshakes
from kvbridge.control.loadbook import LoadBook, PendingLoad, RankLoad
from kvbridge.control.messages import Abort, PushDone, PushQuery, PushRequest
from kvbridge.control.requests import checked_ids, timed
from kvbridge.control.transfers import pair_digest
from kvbridge.core.errors import ControlError, KvbridgeError, PeerRefusedError, PeerTimeoutError
from kvbridge.core.integrity import Verify

log = logging.getLogger("kvbridge.control")

_A = TypeVar("_A")


class Pushes:
    """D's pushes (``run``), P's word on them (``on_push_done``) and their settling with P
    (``settle_later``), over the loads ``book``."""

    def __init__(self, ctx: PlaneContext, handshakes: Handshakes, book: LoadBook) -> None:
        self._ctx = ctx
        self._handshakes = handshakes
        self._book = book
        self._lock = ctx.lock
        self._me = book.me

    def run(self, pending: PendingLoad) -> None:
        """A request worker's push: ask every P rank at once; their ``PushDone`` end it."""
        params, rid = pending.params, pending.params.request_id
        pending.stats.queued_s = time.monotonic() - pending.started
        try:
            self._book.handshake_all(pending)
            if pending.aborted:  # never asked: P only needs to free its blocks
                raise KvbridgeError("aborted by decode")
        except Exception as err:  # nothing was asked: no P rank writes anything for it
            for part in pending.parts.values():
                self._ctx.requests.submit(
                    self._book.tell,
                    part.address,
                    Abort(
                        rid, pending.abort_reason or str(err)[:4000], **self._me, token=params.token
                    ),
                )
                part.asked.set()
            self._book.finish(rid, False, f"push request of {rid!r} failed: {err}")
            return
        asks = [self._ctx.asks.submit(self._ask_push, part) for part in pending.parts.values()]
        wait(asks)
        log.debug(
            "request %s: push requested from %d prefill rank(s)", params.request_id, len(asks)
        )
        # The outcome arrives as PushDone from each rank, or is settled with P past the deadline.

    def _ask_push(self, part: RankLoad) -> None:
        ctx, rid = self._ctx, part.params.request_id
        ids = part.pending.block_ids
        ask = PushRequest(
            rid, ids, ctx.verify.value, ids.first_token, **self._me, token=part.params.token
        )
        try:
            with timed(part.pending.stats, "ask_s"):
                self._handshakes.client(part.address.endpoint).request(ask, ctx.deadlines.call)
        except PeerTimeoutError:
            pass  # the request may have reached P: settled with P at the deadline
        except Exception as err:  # refused, P gone, or never sent: P writes nothing for it
            self._end_part(part, False, f"push request of {rid!r} failed: {err}")
        finally:
            part.asked.set()

    def on_push_done(self, body: PushDone, sender: str) -> None:
        """P's word on a push, from the P rank ``sender``."""
        part = self._book.part_of(body.request_id, sender)
        if part is not None:
            self._reported(part, body)

    def _reported(self, part: RankLoad, body: PushDone) -> None:
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
            self._book.hold_for_good(
                pending, f"push of {pending.params.request_id!r}: {body.reason}"
            )
        elif body.ok and ctx.verify is not Verify.OFF:
            ctx.requests.submit(self._check_push, part, body)
        else:
            self._end_part(part, body.ok, body.reason)

    def _check_push(self, part: RankLoad, body: PushDone) -> None:
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

    def _end_part(self, part: RankLoad, ok: bool, reason: str) -> None:
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
                self.settle_later(pending, reason)
            return
        failed = [p.reason for p in parts if not p.ok]
        self._book.finish(pending.params.request_id, not failed, failed[0] if failed else "")

    def settle_later(self, pending: PendingLoad, reason: str) -> None:
        """Settle with P each part of the push not ended nor settling yet (``_settle_push``, off
        the caller's thread); the request is held meanwhile."""
        with self._lock:
            if not self._book.booked(pending):
                return
            parts = [p for p in pending.parts.values() if not p.settling and not p.ended]
            for part in parts:
                part.settling = True
            if parts:
                self._book.hold(pending)
        for part in parts:
            self._ctx.peer_waits.submit(self._settle_push, part, reason)

    def _settle_push(self, part: RankLoad, reason: str) -> None:
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

    def _ask_prefill(
        self, part: RankLoad, ask: Callable[[PeerClient], _A | None], waiting: str
    ) -> _A | PeerRefusedError | None:
        """Call ``ask`` with the P rank's client until it has P's answer (not None); return it.

        Returns the refusal when P's address refuses connections: P is gone, and no byte of it
        can land any more; None when the plane closed or the request ended meanwhile. A P that
        does not answer is alive but frozen or cut off: the request stays held (logged,
        ``waiting`` for what), and P is asked again.
        """
        rid = part.params.request_id
        client = self._handshakes.client(part.address.endpoint)
        start = time.monotonic()
        while not self._ctx.closed and rid in self._book.pending:
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
