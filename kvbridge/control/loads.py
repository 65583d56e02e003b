"""The decode side (D): loading requests from P, by pull or by push, and settling their ends.

A pull is D's own read, fenced by D's transport. A push is P's write, fenced by P, which says so
in ``PushDone``; past its deadline D aborts the push and asks P how it ended (``PushQuery``)
until P answers or is gone. Meanwhile the request's blocks stay out of use (``held``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from kvbridge.control.channel import PeerClient
from kvbridge.control.handshakes import Handshakes
from kvbridge.control.messages import (
    Abort,
    BlockIds,
    Digest,
    DigestRequest,
    Message,
    Ping,
    PullStart,
    PushDone,
    PushQuery,
    PushRequest,
    Release,
)
from kvbridge.control.requests import (
    Mode,
    RequestOutcome,
    RequestStats,
    TransferParams,
    checked_ids,
    forget_expired,
    timed,
)
from kvbridge.control.transfers import Transfers
from kvbridge.core.errors import (
    ControlError,
    IntegrityError,
    KvbridgeError,
    MessageError,
    PeerRefusedError,
    PeerTimeoutError,
)
from kvbridge.core.integrity import Verify, chosen, digest
from kvbridge.core.planning import TransferPlan, plan_transfers
from kvbridge.core.transport import Fence, TransferHandle, TransferOp

if TYPE_CHECKING:
    from kvbridge.control.plane import ControlPlane

log = logging.getLogger("kvbridge.control")

_A = TypeVar("_A")


@dataclass
class _Pending:
    """D's view of a request being loaded."""

    params: TransferParams
    block_ids: BlockIds
    deadline: float
    stats: RequestStats = field(default_factory=RequestStats)
    started: float = field(default_factory=time.monotonic)
    aborted: bool = False
    abort_reason: str = ""
    #: D's own read in flight (pull), released when the request is aborted
    handle: TransferHandle | None = None
    #: push: the push request was sent (or failed); only then may D ask how the push ended
    asked: threading.Event = field(default_factory=threading.Event)
    #: push: D is asking P how the push ended (deadline passed, aborted, or PushQuery)
    settling: bool = False
    #: since when the outcome waits for a fence (0: not waiting)
    held_since: float = 0.0


class Loads:
    """D's requests being loaded, from ``pull``/``push`` until their outcome."""

    def __init__(self, plane: ControlPlane, peers: Handshakes, transfers: Transfers) -> None:
        self._plane = plane
        self._peers = peers
        self._transfers = transfers
        self._lock = plane._lock
        self._pending: dict[str, _Pending] = {}
        self._aborted: dict[str, float] = {}  # request ids aborted on D, until when to remember

    def pull(self, params: TransferParams, block_ids: Mapping[int, Any]) -> None:
        """Start reading a request into these local blocks; the outcome comes later."""
        pending = self._begin(params, block_ids)
        self._plane._executor.submit(self._run_pull, pending)

    def push(self, params: TransferParams, block_ids: Mapping[int, Any]) -> None:
        """Ask P to write a request into these local blocks; the outcome comes later."""
        pending = self._begin(params, block_ids)
        self._plane._executor.submit(self._run_push_request, pending)

    def abort(self, params: TransferParams, reason: str) -> None:
        """Give up a request, before or during its load; P is told so it frees the blocks."""
        rid = params.request_id
        with self._lock:
            pending = self._pending.get(rid)
            self._aborted[rid] = time.monotonic() + self._plane.lease
            handle = None
            if pending is not None:
                pending.aborted, pending.abort_reason = True, reason
                handle = pending.handle
        if pending is None:
            self._plane._executor.submit(self._tell, params, Abort(rid, reason))
        elif params.mode is Mode.PUSH:
            self._settle_push_later(pending, reason)
        else:
            # The pull's worker sees the flag (or its wait fails on the release), fences its
            # read, reports the outcome and tells P.
            if handle is not None:
                self._plane.transport.release(handle)

    @property
    def held(self) -> list[str]:
        """Request ids whose failure waits for a fence: their blocks stay out of use."""
        with self._lock:
            return [r for r, p in self._pending.items() if p.held_since]

    def expire(self, now: float) -> None:
        """Housekeeping: settle pushes past their deadline with P; forget old aborts."""
        with self._lock:
            # A pull's worker bounds its own steps and fences its read; a push past its
            # deadline is settled with P.
            late = [p for p in self._pending.values() if p.deadline < now
                    and p.params.mode is Mode.PUSH and not p.settling]  # fmt: skip
            forget_expired(self._aborted, now, lambda until: until)
        for pending in late:
            self._settle_push_later(pending, f"no push within {self._plane.timeout:g} s")

    def close(self) -> None:
        """Fail every load in progress (the plane is closing)."""
        with self._lock:
            pending = list(self._pending)
        for request_id in pending:
            self._finish_pending(request_id, False, "the control plane was closed")

    def _begin(self, params: TransferParams, block_ids: Mapping[int, Any]) -> _Pending:
        plane = self._plane
        ids = checked_ids(plane.layout, block_ids, "destination")
        with self._lock:
            if plane._closed:
                raise KvbridgeError("the control plane is closed")
            if params.request_id in self._pending:
                raise KvbridgeError(f"request {params.request_id!r} is already being loaded")
            if params.request_id in self._aborted:
                raise KvbridgeError(f"request {params.request_id!r} was aborted")
            # Overall bound: handshake, queueing and transfer included.
            deadline = time.monotonic() + plane.handshake_timeout + 2 * plane.timeout
            pending = _Pending(params, ids, deadline)
            self._pending[params.request_id] = pending
        return pending

    # -- pull -------------------------------------------------------------------------------------
    def _run_pull(self, pending: _Pending) -> None:
        plane, transfers = self._plane, self._transfers
        params, rid = pending.params, pending.params.request_id
        pending.stats.queued_s = time.monotonic() - pending.started
        try:
            remote = self._peers.remote_for(params, pending.stats)
            # Ask P (a round trip, or a wait until it published) while planning the read.
            asked = plane._asker.submit(self._timed_claim, pending)
            try:
                plan = transfers.plan(remote.layout, plane.layout, params.block_ids,
                                      pending.block_ids, pending.stats)  # fmt: skip
            finally:
                wait([asked])  # nothing else is said to P before it answered this
            asked.result()
            transfers.move(TransferOp.READ, remote.engine_id, plan, pending, pending.stats)
            if plane.verify is not Verify.OFF:
                self._check_pull(pending, plan)
        except Exception as err:
            handle = pending.handle
            if handle is not None:
                self._hold(pending)
                fence = transfers.fence(handle, rid, pending.stats)
                if fence is Fence.UNCONFIRMED:
                    self._wait_for_answer(pending)
            reason = f"pull of {rid!r} from {params.endpoint} failed: {err}"
            self._finish_pending(rid, False, reason)
            plane._executor.submit(self._tell, params, Release(rid, False, str(err)[:4000]))
            return
        # The bytes are in and fenced: the load is done now; P's release is off D's path (one
        # that does not arrive is freed by P's lease).
        self._finish_pending(rid, True, "")
        self._tell(params, Release(rid, True, ""))

    def _timed_claim(self, pending: _Pending) -> None:
        with timed(pending.stats, "ask_s"):
            self._claim(pending)

    def _claim(self, pending: _Pending) -> None:
        """Tell P which blocks D reads; wait (bounded) for P to publish a request it has not yet.

        A serving engine may hand the transfer parameters to D before its worker has published
        the request (vLLM publishes one engine step after the request finished on P).
        """
        params, timeout = pending.params, self._plane.timeout
        client = self._peers.client(params.endpoint)
        deadline = time.monotonic() + timeout
        delay = 0.005
        while True:
            try:
                client.request(PullStart(params.request_id, params.block_ids), timeout)
                return
            except ControlError as err:
                if err.code != "unknown_request" or pending.aborted:
                    raise
                if time.monotonic() + delay > deadline:
                    raise ControlError(err.code, f"{err} (waited {timeout:g} s)") from None
            time.sleep(delay)
            delay = min(delay * 2, 0.2)

    def _check_pull(self, pending: _Pending, plan: TransferPlan) -> None:
        """Compare P's digest of what it holds with D's of what it read (P still holds it)."""
        plane = self._plane
        start = time.monotonic()
        params, rid = pending.params, pending.params.request_id
        ask = DigestRequest(rid, pending.block_ids, plane.verify.value)
        # P digests its side while D digests its own.
        asked = plane._fencer.submit(self._peers.client(params.endpoint).request, ask,
                                     plane.timeout)  # fmt: skip
        mine = digest(plan.dst, plan.lengths, chosen(plan.count, plane.verify, rid))
        reply = asked.result()
        pending.stats.verify_s = time.monotonic() - start
        theirs = reply.value if isinstance(reply, Digest) else None
        if theirs != mine:
            pending.stats.verify_failed = True
            raise IntegrityError(
                f"integrity check ({plane.verify.value}) failed: prefill's digest {theirs} of "
                f"the bytes it holds differs from decode's {mine} of what it read"
            )

    def _wait_for_answer(self, pending: _Pending) -> None:
        """After an ``UNCONFIRMED`` fence: wait until P answers (or is gone), then grace.

        A P that answers is running again, so its engine hands over whatever it still held for
        us within the grace; a P whose address refuses connections is gone.
        """
        plane = self._plane
        answer = self._ask_prefill(
            pending, lambda client: client.request(Ping(), plane.timeout),
            f"{pending.params.endpoint} answers",
        )  # fmt: skip
        if isinstance(answer, Message):
            time.sleep(plane.fence_grace)

    # -- push -------------------------------------------------------------------------------------
    def _run_push_request(self, pending: _Pending) -> None:
        plane = self._plane
        params, rid = pending.params, pending.params.request_id
        pending.stats.queued_s = time.monotonic() - pending.started
        try:
            self._peers.remote_for(params, pending.stats)
            if pending.aborted:  # never asked: P only needs to free its blocks
                self._tell(params, Abort(rid, pending.abort_reason))
                raise KvbridgeError("aborted by decode")
            ask = PushRequest(rid, pending.block_ids, plane.verify.value)
            with timed(pending.stats, "ask_s"):
                self._peers.client(params.endpoint).request(ask, plane.timeout)
            log.debug("request %s: push requested", rid)
        except PeerTimeoutError:
            pass  # the request may have reached P: settled with P at the deadline
        except Exception as err:  # refused, P gone, or never sent: P writes nothing for it
            self._finish_pending(rid, False, f"push request of {rid!r} failed: {err}")
        finally:
            pending.asked.set()
        # The outcome arrives as PushDone, or is settled with P past the deadline.

    def on_push_done(self, body: PushDone, sender: str | None = None) -> None:
        """P's word on a push (``sender`` None: P's reply to ``PushQuery``)."""
        plane = self._plane
        with self._lock:
            pending = self._pending.get(body.request_id)
            if pending is None:
                return  # late or duplicate: that request has its outcome already
            if sender is not None and sender != pending.params.engine_id:
                raise MessageError(
                    "not_yours",
                    f"engine {sender!r} cannot end the push of {body.request_id!r}: it comes "
                    f"from {pending.params.engine_id!r}",
                )
            stats = pending.stats
            stats.nbytes, stats.descriptors = body.nbytes, body.descriptors
            stats.descriptors_before_merge = body.descriptors_before_merge
            stats.plan_s, stats.transfer_s = body.plan_s, body.transfer_s
            stats.unconfirmed = body.unconfirmed
            if body.unconfirmed:  # bytes P's engine gave up on may still be applied here
                pending.settling = True
                self._hold(pending)
        if body.unconfirmed:
            plane._fencer.submit(self._finish_after_grace, body.request_id, body.reason)
        elif body.ok and plane.verify is not Verify.OFF:
            plane._executor.submit(self._check_push, pending, body)
        else:
            self._finish_pending(body.request_id, body.ok, body.reason)

    def _check_push(self, pending: _Pending, body: PushDone) -> None:
        """Compare P's digest of what it wrote with D's of what it holds now."""
        plane = self._plane
        start = time.monotonic()
        params, rid = pending.params, pending.params.request_id
        remote = self._peers.at(params.endpoint)
        try:
            if remote is None:
                raise KvbridgeError("no handshake with prefill to plan the check with")
            plan = plan_transfers(remote.layout, plane.layout, params.block_ids, pending.block_ids)
            mine = digest(plan.dst, plan.lengths, chosen(plan.count, plane.verify, rid))
        except Exception as err:
            self._finish_pending(rid, False, f"integrity check could not run: {err}")
            return
        pending.stats.verify_s = time.monotonic() - start
        if body.digest != mine:
            pending.stats.verify_failed = True
            self._finish_pending(
                rid, False,
                f"integrity check ({plane.verify.value}) failed: prefill's digest {body.digest} "
                f"of what it wrote differs from decode's {mine} of what it holds",
            )  # fmt: skip
            return
        self._finish_pending(rid, True, "")

    def _finish_after_grace(self, rid: str, reason: str) -> None:
        time.sleep(self._plane.fence_grace)
        self._finish_pending(rid, False, reason)

    def _settle_push_later(self, pending: _Pending, reason: str) -> None:
        with self._lock:
            if pending.settling or self._pending.get(pending.params.request_id) is not pending:
                return
            pending.settling = True
            self._hold(pending)
        self._plane._fencer.submit(self._settle_push, pending, reason)

    def _settle_push(self, pending: _Pending, reason: str) -> None:
        """D gave up waiting for a push (deadline or abort): end it only once P's write is fenced.

        Aborts the push, then asks P how it ended until P answers: ``PushDone`` (P fenced its
        write, or it had succeeded), or "unknown" (P holds no write of it).
        """
        plane, rid = self._plane, pending.params.request_id
        pending.asked.wait(plane.handshake_timeout + 2 * plane.timeout)
        aborted = False

        def query(client: PeerClient) -> PushDone | ControlError | None:
            nonlocal aborted
            try:
                if not aborted:
                    client.request(Abort(rid, reason[:4000]), plane.timeout)
                    aborted = True
                reply = client.request(PushQuery(rid), plane.timeout)
            except ControlError as err:
                if err.code == "unknown_request":
                    return err
                log.warning("request %s: prefill refused to say how its push ended: %s", rid, err)
                time.sleep(min(1.0, plane.timeout))
                return None
            if isinstance(reply, PushDone):
                return reply
            time.sleep(0.05)  # P is still fencing its write
            return None

        answer = self._ask_prefill(pending, query, "prefill confirms its push ended")
        if isinstance(answer, PushDone):
            self.on_push_done(answer)
        elif isinstance(answer, ControlError):
            self._finish_pending(rid, False, f"{reason}; prefill holds no write of it")
        elif answer is not None:
            self._finish_pending(rid, False, f"{reason}; prefill is gone ({answer})")

    # -- both -------------------------------------------------------------------------------------
    def _ask_prefill(
        self, pending: _Pending, ask: Callable[[PeerClient], _A | None], waiting: str
    ) -> _A | PeerRefusedError | None:
        """Call ``ask`` with P's client until it has P's answer (not None), and return that.

        Returns the refusal when P's address refuses connections: P is gone, and no byte of it
        can land any more; None when the plane closed or the request ended meanwhile. A P that
        does not answer is alive but frozen or cut off: the request stays held (logged,
        ``waiting`` for what), and P is asked again.
        """
        rid = pending.params.request_id
        client = self._peers.client(pending.params.endpoint)
        start = time.monotonic()
        while not self._plane._closed and rid in self._pending:
            try:
                answer = ask(client)
            except PeerRefusedError as err:
                return err
            except Exception as err:
                log.warning("request %s: blocks held until %s (%.0f s so far): %s",
                            rid, waiting, time.monotonic() - start, err)  # fmt: skip
                time.sleep(min(1.0, self._plane.timeout))
                continue
            if answer is not None:
                return answer
        return None

    def _hold(self, pending: _Pending) -> None:
        with self._lock:
            pending.held_since = pending.held_since or time.monotonic()

    def _tell(self, params: TransferParams, body: Release | Abort) -> None:
        """Send P a release or abort; one that does not arrive is freed by P's lease."""
        try:
            self._peers.client(params.endpoint).request(body, self._plane.timeout)
        except Exception as err:
            log.info("request %s: %s not delivered (%s); P's lease frees it", params.request_id,
                     type(body).__name__.lower(), err)  # fmt: skip

    def _finish_pending(self, request_id: str, ok: bool, reason: str) -> None:
        plane = self._plane
        with self._lock:
            pending = self._pending.pop(request_id, None)
            if pending is None:
                return
            if pending.held_since:
                held = time.monotonic() - pending.held_since
                pending.stats.fence_s = max(pending.stats.fence_s, held)
            if pending.aborted:
                why = pending.abort_reason
                reason = why if not reason or why in reason else f"{why} ({reason})"
            pending.stats.total_s = time.monotonic() - pending.started
            outcome = RequestOutcome(request_id, ok and not pending.aborted, reason, pending.stats)
            plane._record(outcome)
        log.debug("request %s: %s %s %s", request_id, "done" if ok else "failed", reason,
                  pending.stats)  # fmt: skip
        self._transfers.report_slow("load", request_id, pending.stats)
