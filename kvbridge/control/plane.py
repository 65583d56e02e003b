"""The P/D control plane: handshake, pull and push request flow, leases, timeouts, fences.

One ``ControlPlane`` per engine (worker). The prefill side *publishes* a request's blocks under a
lease and hands the returned ``TransferParams`` to the decode side through the serving engine;
the decode side *pulls* (reads, then releases) or asks for a *push* (P writes, then says done).
Every request ends in a ``RequestOutcome`` the adapter collects with ``poll_finished``: on P,
"these blocks may be freed"; on D, "this load finished or failed".

Fences: a failed, timed-out or aborted transfer is reported only once none of its bytes can still
land (``Transport.fence``). A pull is fenced by D's own transport. A push is fenced by P, which
says so in ``PushDone``; D never fails a push on its own clock: past its deadline it aborts the
push and asks P how it ended (``PushQuery``) until P answers or is gone. While P is alive but not
answering, the request's blocks stay out of circulation (``held``, logged); that costs time,
never a wrong byte.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from kvbridge.control.channel import Endpoint, PeerClient
from kvbridge.control.messages import (
    Abort,
    BlockIds,
    Digest,
    DigestRequest,
    Handshake,
    Message,
    Ok,
    Ping,
    PullStart,
    PushDone,
    PushQuery,
    PushRequest,
    Release,
)
from kvbridge.core.block_mapping import prepare_block_ids
from kvbridge.core.compat import check_compatible
from kvbridge.core.errors import (
    ControlError,
    IntegrityError,
    KvbridgeError,
    LayoutMismatchError,
    MessageError,
    OutcomeTimeoutError,
    PeerRefusedError,
    PeerTimeoutError,
)
from kvbridge.core.integrity import Verify, chosen, digest
from kvbridge.core.layout import Layout
from kvbridge.core.planning import plan_transfers
from kvbridge.core.transport import Fence, TransferHandle, TransferOp, Transport

log = logging.getLogger("kvbridge.control")


class Mode(str, enum.Enum):
    """Who moves the bytes."""

    PULL = "pull"  # D reads from P, then tells P to release
    PUSH = "push"  # D sends its block ids, P writes, then tells D it is done


class TransferParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What P publishes for a request and D needs to fetch it (kv_transfer_params in vLLM)."""

    request_id: str
    engine_id: str
    endpoint: str
    block_ids: BlockIds
    num_tokens: int
    transport: str
    mode: Mode = Mode.PULL

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)  # type: ignore[no-any-return]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TransferParams:
        """Validate params that came back through the serving engine (keys may be strings)."""
        try:
            return msgspec.convert(dict(data), cls, strict=False)
        except msgspec.ValidationError as err:
            raise MessageError("invalid", f"invalid transfer parameters: {err}") from None


@dataclass
class RequestStats:
    """Where a request's time went, and what it moved."""

    #: from handing the request to the plane until it ended here (D: the load; P: the push)
    total_s: float = 0.0
    #: waiting for a free worker of the plane
    queued_s: float = 0.0
    handshake_s: float = 0.0
    #: D's request to P (pull: ``PullStart``, push: ``PushRequest``) until P answered
    ask_s: float = 0.0
    plan_s: float = 0.0
    transfer_s: float = 0.0
    nbytes: int = 0
    descriptors: int = 0
    descriptors_before_merge: int = 0
    #: time between giving a transfer up and the fence (no byte of it can still land)
    fence_s: float = 0.0
    #: the fence needed the peer's word (the engine gave part of the transfer up blind)
    unconfirmed: bool = False
    #: time spent on the integrity check (``verify``), and whether it found a difference
    verify_s: float = 0.0
    verify_failed: bool = False


@dataclass
class RequestOutcome:
    """The definite end of a request on this side."""

    request_id: str
    ok: bool
    reason: str = ""
    stats: RequestStats = field(default_factory=RequestStats)


@dataclass
class _Lease:
    """P's hold on a published request's blocks."""

    params: TransferParams
    expires_at: float
    puller: str | None = None
    pushing: bool = False
    #: P's write in flight (push), released when D aborts
    handle: TransferHandle | None = None
    aborted: bool = False


@dataclass
class _RemoteEngine:
    """What a handshake taught us about another engine."""

    engine_id: str
    layout: Layout
    endpoint: str
    handshake_s: float = 0.0


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


@contextlib.contextmanager
def _timed(stats: RequestStats, name: str) -> Iterator[None]:
    """Record the block's duration in ``stats.<name>``, also when it raised or timed out: that
    is where a slow request's time went."""
    start = time.monotonic()
    try:
        yield
    finally:
        setattr(stats, name, time.monotonic() - start)


def default_engine_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class ControlPlane:
    """Side channel plus request flow for one engine, on top of its layout and transport.

    The layout's memory is registered with the transport here and released by ``close``.
    ``timeout`` bounds every side-channel call; transfers are bounded by the transport's own
    ``timeout`` (give both the same value: the adapters do). ``lease`` is how long P keeps a
    published request's blocks when D never releases them (extended while D reads them);
    ``handshake_timeout`` bounds the retries of a handshake. ``fence_grace`` is how long D keeps
    blocks after an ``UNCONFIRMED`` fence once the peer answers again (the peer's engine applies
    what it already received within milliseconds once it runs). ``verify`` (D: ``off``,
    ``sample``, ``full``) compares digests of what P sent and D received after each load; a
    mismatch fails the load (``RequestStats.verify_failed``).
    """

    def __init__(
        self,
        layout: Layout,
        transport: Transport,
        *,
        engine_id: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        secret: bytes | str | None = None,
        timeout: float = 10.0,
        lease: float = 30.0,
        handshake_timeout: float = 10.0,
        workers: int = 4,
        fence_grace: float = 1.0,
        verify: Verify | str = Verify.OFF,
    ) -> None:
        for name, value in (("timeout", timeout), ("lease", lease),
                            ("handshake_timeout", handshake_timeout)):  # fmt: skip
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value!r}")
        if lease < 2 * timeout:
            raise ValueError(
                f"lease ({lease:g} s) must be at least twice the timeout ({timeout:g} s): P "
                "must not free blocks that D may still be reading; raise lease"
            )
        self.engine_id = engine_id or default_engine_id()
        self.layout = layout
        self.transport = transport
        self.timeout = timeout
        self.lease = lease
        self.handshake_timeout = handshake_timeout
        self.fence_grace = fence_grace
        self.verify = Verify(verify)
        #: a request taking this long logs where its time went (a quarter of the timeout)
        self.slow_after = timeout / 4
        self._secret = secret.encode() if isinstance(secret, str) else secret
        self._lock = threading.RLock()
        self._finished_cond = threading.Condition(self._lock)
        self._finished: dict[str, RequestOutcome] = {}
        self._leases: dict[str, _Lease] = {}
        self._pending_push: dict[str, tuple[str, PushRequest, float]] = {}
        self._pending: dict[str, _Pending] = {}
        self._aborted: dict[str, float] = {}  # request ids aborted on D, until when to remember
        # P: how finished pushes ended (D may ask again), and requests D withdrew before P saw
        # them (a late PushRequest or PullStart for them is refused); both until the time given.
        self._push_results: dict[str, tuple[PushDone, float]] = {}
        self._withdrawn: dict[str, float] = {}
        self._remotes: dict[str, _RemoteEngine] = {}  # by engine id (peers that handshook us)
        self._by_endpoint: dict[str, _RemoteEngine] = {}  # engines we handshook, by endpoint
        self._clients: dict[str, PeerClient] = {}
        self._handshake_gates: dict[str, threading.Lock] = {}
        self._closed = False
        transport.register(layout.registration)
        self._metadata = transport.metadata()
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="kvbridge-request")
        # Fences and settling may wait long on a frozen peer: they never take a request worker.
        self._fencer = ThreadPoolExecutor(workers, thread_name_prefix="kvbridge-fence")
        # P's digests for D's checks: memory-bound, off the endpoint thread.
        self._hasher = ThreadPoolExecutor(2, thread_name_prefix="kvbridge-digest")
        self._endpoint = Endpoint(
            self.engine_id, self._handle, host=host, port=port, secret=self._secret,
            on_tick=self._tick,
        )  # fmt: skip

    @property
    def endpoint(self) -> str:
        """The side-channel address peers connect to."""
        return self._endpoint.address

    # -- P side -----------------------------------------------------------------------------------
    def publish(
        self, request_id: str, block_ids: Mapping[int, Any], num_tokens: int, mode: Mode = Mode.PULL
    ) -> TransferParams:
        """Hold a prefilled request's blocks under a lease; return what D needs to fetch them."""
        ids = self._checked_ids(self.layout, block_ids, "published")
        params = TransferParams(
            request_id, self.engine_id, self.endpoint, ids, num_tokens,
            self.transport.name, Mode(mode),
        )  # fmt: skip
        with self._lock:
            if request_id in self._leases:
                raise KvbridgeError(f"request {request_id!r} is already published")
            lease = _Lease(params, time.monotonic() + self.lease)
            self._leases[request_id] = lease
            pushed = self._pending_push.pop(request_id, None)
        log.debug("request %s: published (%s)", request_id, "push waiting" if pushed else mode)
        if pushed is not None:
            self._start_push(lease, pushed[0], pushed[1])
        return params

    def unpublish(self, request_id: str) -> None:
        """Drop a lease without a transfer (the request was aborted on P)."""
        self._free(request_id, False, "withdrawn by prefill")

    @property
    def leased(self) -> list[str]:
        """Request ids whose blocks P still holds."""
        with self._lock:
            return list(self._leases)

    # -- D side -----------------------------------------------------------------------------------
    def pull(self, params: TransferParams, block_ids: Mapping[int, Any]) -> None:
        """Start reading a request into these local blocks; the outcome comes later."""
        pending = self._begin(params, block_ids)
        self._executor.submit(self._run_pull, pending)

    def push(self, params: TransferParams, block_ids: Mapping[int, Any]) -> None:
        """Ask P to write a request into these local blocks; the outcome comes later."""
        pending = self._begin(params, block_ids)
        self._executor.submit(self._run_push_request, pending)

    def abort(self, params: TransferParams, reason: str = "aborted by decode") -> None:
        """Give up a request, before or during its load; P is told so it frees the blocks at once.

        A load in progress ends with a failed outcome once it is fenced (no byte of it can land
        any more); one not started yet never starts.
        """
        rid = params.request_id
        with self._lock:
            pending = self._pending.get(rid)
            self._aborted[rid] = time.monotonic() + self.lease
            handle = None
            if pending is not None:
                pending.aborted, pending.abort_reason = True, reason
                handle = pending.handle
        if pending is None:
            self._executor.submit(self._send_abort, params, reason)
        elif params.mode is Mode.PUSH:
            self._settle_push_later(pending, reason)
        else:
            # The pull's worker sees the flag (or its wait fails on the release), fences its
            # read, reports the outcome and tells P.
            if handle is not None:
                self.transport.release(handle)

    @property
    def held(self) -> list[str]:
        """Request ids (D) whose failure waits for a fence: their blocks stay out of use."""
        with self._lock:
            return [r for r, p in self._pending.items() if p.held_since]

    # -- both sides -------------------------------------------------------------------------------
    def poll_finished(self) -> list[RequestOutcome]:
        """Outcomes since the last call: loads done or failed (D), blocks to free (P)."""
        with self._lock:
            done = list(self._finished.values())
            self._finished.clear()
            return done

    def wait(self, request_id: str, timeout: float) -> RequestOutcome:
        """Block until ``request_id`` has an outcome (and consume it), or ``TimeoutError``."""
        deadline = time.monotonic() + timeout
        with self._finished_cond:
            while request_id not in self._finished:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise OutcomeTimeoutError(
                        f"request {request_id!r} has no outcome after {timeout} s"
                    )
                self._finished_cond.wait(left)
            return self._finished.pop(request_id)

    def close(self) -> None:
        """Stop serving, fail what is pending, free every lease and registration."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._pending)
            leases = list(self._leases)
        for request_id in pending:
            self._finish_pending(request_id, False, "the control plane was closed")
        for request_id in leases:
            self._free(request_id, False, "the control plane was closed")
        self._endpoint.close()
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._fencer.shutdown(wait=True, cancel_futures=True)
        self._hasher.shutdown(wait=True, cancel_futures=True)
        for client in self._clients.values():
            client.close()
        self._clients.clear()
        self.transport.deregister(self.layout.registration)

    def __enter__(self) -> ControlPlane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals: P -----------------------------------------------------------------------------
    def _handle(self, peer: str, body: Message) -> Message | Future[Message]:
        if isinstance(body, Handshake):
            return self._on_handshake(body)
        if isinstance(body, PullStart):
            return self._on_pull_start(peer, body)
        if isinstance(body, Release):
            known = self._free(
                body.request_id, body.ok, "released by decode" if body.ok else body.reason
            )
            return Ok() if known else _unknown(body.request_id)
        if isinstance(body, Abort):
            self._on_abort(body)
            return Ok()
        if isinstance(body, PushRequest):
            return self._on_push_request(peer, body)
        if isinstance(body, PushDone):
            self._on_push_done(body, peer)
            return Ok()
        if isinstance(body, PushQuery):
            return self._on_push_query(body)
        if isinstance(body, Ping):
            return Ok()
        if isinstance(body, DigestRequest):
            return self._on_digest_request(peer, body)
        raise MessageError("unexpected", f"{type(body).__name__} is not a request")

    def _on_handshake(self, body: Handshake) -> Message:
        try:
            remote = Layout(body.layout)
        except KvbridgeError as err:
            raise MessageError("layout", f"invalid layout from {body.engine_id}: {err}") from None
        try:
            check_compatible(self.layout, remote, ("this engine", "peer"))
        except LayoutMismatchError as err:
            raise MessageError("layout_mismatch", str(err)) from None
        if body.transport != self.transport.name:
            raise MessageError(
                "transport_mismatch",
                f"peer uses transport {body.transport!r}, this engine {self.transport.name!r}",
            )
        self.transport.connect(body.engine_id, body.metadata)
        with self._lock:
            self._remotes[body.engine_id] = _RemoteEngine(body.engine_id, remote, body.endpoint)
        return self._own_handshake()

    def _own_handshake(self) -> Handshake:
        return Handshake(
            self.engine_id, self.layout.spec, self.transport.name, self._metadata, self.endpoint
        )

    def _on_pull_start(self, peer: str, body: PullStart) -> Message:
        with self._lock:
            lease = self._leases.get(body.request_id)
            if lease is None:
                return _unknown(body.request_id)
            if lease.puller is not None or lease.pushing:
                raise MessageError("duplicate", f"request {body.request_id!r} is already taken")
            _require_subset(body.block_ids, lease.params.block_ids, body.request_id)
            lease.puller = peer
            # D's read may take its transport's timeout, and its engine as long again to give
            # the read back: the blocks must outlive both, whatever is left of the lease.
            lease.expires_at = max(lease.expires_at, time.monotonic() + 2 * self.timeout)
        return Ok()

    def _on_digest_request(self, peer: str, body: DigestRequest) -> Message | Future[Message]:
        with self._lock:
            lease = self._leases.get(body.request_id)
            remote = self._remotes.get(peer)
            if lease is None or lease.puller != peer or remote is None:
                return _unknown(body.request_id)
            src_ids = lease.params.block_ids
        try:
            check = Verify(body.verify)
            plan = plan_transfers(self.layout, remote.layout, src_ids, body.block_ids)
        except (ValueError, KvbridgeError) as err:
            raise MessageError("invalid", f"cannot digest {body.request_id!r}: {err}") from None
        # Hashing a large request takes long: the endpoint answers others meanwhile. P still
        # holds the blocks: D keeps its claim until it has the digest.
        which = chosen(plan.count, check, body.request_id)
        return self._hasher.submit(lambda: Digest(digest(plan.src, plan.lengths, which)))

    def _on_abort(self, body: Abort) -> None:
        rid = body.request_id
        with self._lock:
            self._pending_push.pop(rid, None)
            lease = self._leases.get(rid)
            if lease is None:
                if rid not in self._push_results:
                    self._withdrawn[rid] = time.monotonic() + self.lease
                return
            pushing = lease.pushing
            if pushing:  # the push worker fences its write, then frees and says so
                lease.aborted = True
            handle = lease.handle
        if not pushing:
            self._free(rid, False, f"aborted by decode: {body.reason}")
        elif handle is not None:
            self.transport.release(handle)

    def _on_push_query(self, body: PushQuery) -> Message:
        rid = body.request_id
        with self._lock:
            result = self._push_results.get(rid)
            if result is not None:
                return result[0]
            lease = self._leases.get(rid)
            if rid in self._pending_push or (lease is not None and lease.pushing):
                return Ok()  # may still write
        return _unknown(rid)

    def _on_push_request(self, peer: str, body: PushRequest) -> Message:
        with self._lock:
            remote = self._remotes.get(peer)
            if remote is None:
                raise MessageError("no_handshake", "handshake before requesting a push")
            if body.request_id in self._withdrawn or body.request_id in self._push_results:
                raise MessageError(
                    "withdrawn", f"request {body.request_id!r} was aborted or already pushed"
                )
            self._checked_ids(remote.layout, body.block_ids, "destination")
            lease = self._leases.get(body.request_id)
            if lease is None:
                if body.request_id in self._pending_push:
                    raise MessageError("duplicate", f"push of {body.request_id!r} requested twice")
                # P has not finished prefilling yet: write once it publishes.
                self._pending_push[body.request_id] = (peer, body, time.monotonic() + self.lease)
                log.debug("request %s: push requested before publish", body.request_id)
                return Ok()
            if lease.puller is not None or lease.pushing:
                raise MessageError("duplicate", f"request {body.request_id!r} is already taken")
        self._start_push(lease, peer, body)
        return Ok()

    def _start_push(self, lease: _Lease, peer: str, request: PushRequest) -> None:
        with self._lock:
            lease.pushing = True
        self._executor.submit(self._run_push, lease, peer, request, time.monotonic())

    def _run_push(self, lease: _Lease, peer: str, request: PushRequest, started: float) -> None:
        rid, block_ids = lease.params.request_id, request.block_ids
        stats = RequestStats(queued_s=time.monotonic() - started)
        with self._lock:
            remote = self._remotes[peer]
        try:
            plan = self._plan(self.layout, remote.layout, lease.params.block_ids, block_ids, stats)
            self._move(TransferOp.WRITE, peer, plan, lease, stats, rid)
            check = Verify(request.verify)
            value = None
            if check is not Verify.OFF:
                value = digest(plan.src, plan.lengths, chosen(plan.count, check, rid))
            done = PushDone(
                rid, True, "", stats.nbytes, stats.descriptors, stats.descriptors_before_merge,
                stats.plan_s, stats.transfer_s, digest=value,
            )  # fmt: skip
            ok, reason = True, "pushed to decode"
        except Exception as err:
            ok, reason = False, str(err)
            handle = lease.handle
            fence = Fence.DRAINED if handle is None else self._fence(handle, rid, stats)
            done = PushDone(rid, False, f"prefill could not push: {err}",
                            unconfirmed=fence is not Fence.DRAINED)  # fmt: skip
        with self._lock:
            self._push_results[rid] = (done, time.monotonic() + self.lease)
        # Fenced: the engine reads P's blocks no more, so they may go back now.
        stats.total_s = time.monotonic() - started
        self._free(rid, ok, reason, stats)
        self._report_slow("push", rid, stats)
        self._fencer.submit(self._deliver, remote.endpoint, done)

    def _deliver(self, endpoint: str, done: PushDone) -> None:
        """Tell D how the push ended; a few tries, and D asks (``PushQuery``) if all fail."""
        for attempt in range(3):
            try:
                start = time.monotonic()
                self._client(endpoint).request(done, self.timeout)
                took = time.monotonic() - start
                log.log(logging.WARNING if took >= self.slow_after else logging.DEBUG,
                        "request %s: push end (ok=%s) delivered in %.3f s",
                        done.request_id, done.ok, took)  # fmt: skip
                return
            except PeerRefusedError as err:  # D is gone: nobody to tell
                log.info("request %s: decode is gone (%s)", done.request_id, err)
                return
            except Exception as err:
                log.warning("request %s: could not tell decode the push ended (try %d): %s",
                            done.request_id, attempt + 1, err)  # fmt: skip
            if self._closed:
                return

    def _fence(self, handle: TransferHandle, rid: str, stats: RequestStats) -> Fence:
        """Wait until no byte of a given-up transfer can still move; log while it takes long.

        ``PENDING`` only when the plane is closing; ``UNCONFIRMED`` when the engine could not say
        what the peer got (the caller settles that with the peer).
        """
        start = time.monotonic()
        while True:
            fence = self.transport.fence(handle, self.timeout)
            if fence is not Fence.PENDING or self._closed:
                break
            log.warning(
                "request %s: the %s engine still holds part of a given-up transfer after %.0f s; "
                "its blocks stay out of use until it gives it back",
                rid, self.transport.name, time.monotonic() - start,
            )  # fmt: skip
        stats.fence_s = time.monotonic() - start
        stats.unconfirmed = fence is not Fence.DRAINED
        return fence

    def _free(
        self, request_id: str, ok: bool, reason: str, stats: RequestStats | None = None
    ) -> bool:
        with self._lock:
            lease = self._leases.pop(request_id, None)
            if lease is None:
                return False
            self._record(RequestOutcome(request_id, ok, reason, stats or RequestStats()))
        log.debug("request %s: blocks freed (%s)", request_id, reason)
        return True

    def _tick(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [r for r, lease in self._leases.items()
                       if lease.expires_at < now and not lease.pushing]  # fmt: skip
            for rid, (_, _, deadline) in list(self._pending_push.items()):
                if deadline < now:
                    del self._pending_push[rid]
            # A pull's worker bounds its own steps and fences its read; a push past its
            # deadline is settled with P.
            late = [p for p in self._pending.values() if p.deadline < now
                    and p.params.mode is Mode.PUSH and not p.settling]  # fmt: skip
            for table in (self._aborted, self._withdrawn):
                for rid, until in list(table.items()):
                    if until < now:
                        del table[rid]
            for rid, (_, until) in list(self._push_results.items()):
                if until < now:
                    del self._push_results[rid]
        for rid in expired:
            self._free(rid, False, f"lease of {self.lease:g} s expired before decode released it")
        for pending in late:
            self._settle_push_later(pending, f"no push within {self.timeout:g} s")

    # -- internals: D -----------------------------------------------------------------------------
    def _begin(self, params: TransferParams, block_ids: Mapping[int, Any]) -> _Pending:
        ids = self._checked_ids(self.layout, block_ids, "destination")
        with self._lock:
            if self._closed:
                raise KvbridgeError("the control plane is closed")
            if params.request_id in self._pending:
                raise KvbridgeError(f"request {params.request_id!r} is already being loaded")
            if params.request_id in self._aborted:
                raise KvbridgeError(f"request {params.request_id!r} was aborted")
            # Overall bound: handshake, queueing and transfer included.
            deadline = time.monotonic() + self.handshake_timeout + 2 * self.timeout
            pending = _Pending(params, ids, deadline)
            self._pending[params.request_id] = pending
        return pending

    def _run_pull(self, pending: _Pending) -> None:
        params, rid = pending.params, pending.params.request_id
        pending.stats.queued_s = time.monotonic() - pending.started
        try:
            remote = self._remote_for(params, pending.stats)
            with _timed(pending.stats, "ask_s"):
                self._claim(params, pending)
            plan = self._plan(remote.layout, self.layout, params.block_ids, pending.block_ids,
                              pending.stats)  # fmt: skip
            self._move(TransferOp.READ, remote.engine_id, plan, pending, pending.stats, rid)
            if self.verify is not Verify.OFF:
                self._check_pull(params, pending, plan)
        except Exception as err:
            handle = pending.handle
            if handle is not None:
                self._hold(pending)
                fence = self._fence(handle, rid, pending.stats)
                if fence is Fence.UNCONFIRMED:
                    self._settle_with(params.endpoint, rid)
            reason = f"pull of {rid!r} from {params.endpoint} failed: {err}"
            self._finish_pending(rid, False, reason)
            self._executor.submit(self._send_release, params, False, str(err))
            return
        self._send_release(params, True, "")
        self._finish_pending(rid, True, "")

    def _check_pull(self, params: TransferParams, pending: _Pending, plan: Any) -> None:
        """Compare P's digest of what it holds with D's of what it read (P still holds it)."""
        start = time.monotonic()
        rid = params.request_id
        ask = DigestRequest(rid, pending.block_ids, self.verify.value)
        # P digests its side while D digests its own.
        asked = self._fencer.submit(self._client(params.endpoint).request, ask, self.timeout)
        mine = digest(plan.dst, plan.lengths, chosen(plan.count, self.verify, rid))
        reply = asked.result()
        pending.stats.verify_s = time.monotonic() - start
        theirs = reply.value if isinstance(reply, Digest) else None
        if theirs != mine:
            pending.stats.verify_failed = True
            raise IntegrityError(
                f"integrity check ({self.verify.value}) failed: prefill's digest {theirs} of "
                f"the bytes it holds differs from decode's {mine} of what it read"
            )

    def _check_push(self, params: TransferParams, pending: _Pending, body: PushDone) -> None:
        """Compare P's digest of what it wrote with D's of what it holds now."""
        start = time.monotonic()
        rid = params.request_id
        with self._lock:
            remote = self._by_endpoint.get(params.endpoint)
        try:
            if remote is None:
                raise KvbridgeError("no handshake with prefill to plan the check with")
            plan = plan_transfers(remote.layout, self.layout, params.block_ids, pending.block_ids)
            mine = digest(plan.dst, plan.lengths, chosen(plan.count, self.verify, rid))
        except Exception as err:
            self._finish_pending(rid, False, f"integrity check could not run: {err}")
            return
        pending.stats.verify_s = time.monotonic() - start
        if body.digest != mine:
            pending.stats.verify_failed = True
            self._finish_pending(
                rid, False,
                f"integrity check ({self.verify.value}) failed: prefill's digest {body.digest} "
                f"of what it wrote differs from decode's {mine} of what it holds",
            )  # fmt: skip
            return
        self._finish_pending(rid, True, "")

    def _hold(self, pending: _Pending) -> None:
        with self._lock:
            pending.held_since = pending.held_since or time.monotonic()

    def _settle_with(self, endpoint: str, rid: str) -> None:
        """After an ``UNCONFIRMED`` fence: wait until the peer answers (or is gone), then grace.

        A peer that answers is running again, so its engine hands over whatever it still held
        for us within the grace; a peer whose address refuses connections is gone.
        """
        start = time.monotonic()
        while not self._closed:
            try:
                self._client(endpoint).request(Ping(), self.timeout)
            except PeerRefusedError:
                return
            except Exception as err:
                log.warning("request %s: blocks held until %s answers (%.0f s so far): %s",
                            rid, endpoint, time.monotonic() - start, err)  # fmt: skip
                time.sleep(min(1.0, self.timeout))
                continue
            time.sleep(self.fence_grace)
            return

    def _claim(self, params: TransferParams, pending: _Pending) -> None:
        """Tell P which blocks D reads; wait (bounded) for P to publish a request it has not yet.

        A serving engine may hand the transfer parameters to D before its worker has published
        the request (vLLM publishes one engine step after the request finished on P).
        """
        client = self._client(params.endpoint)
        deadline = time.monotonic() + self.timeout
        delay = 0.005
        while True:
            try:
                client.request(PullStart(params.request_id, params.block_ids), self.timeout)
                return
            except ControlError as err:
                if err.code != "unknown_request" or pending.aborted:
                    raise
                if time.monotonic() + delay > deadline:
                    raise ControlError(err.code, f"{err} (waited {self.timeout:g} s)") from None
            time.sleep(delay)
            delay = min(delay * 2, 0.2)

    def _run_push_request(self, pending: _Pending) -> None:
        params, rid = pending.params, pending.params.request_id
        pending.stats.queued_s = time.monotonic() - pending.started
        try:
            self._remote_for(params, pending.stats)
            if pending.aborted:  # never asked: P only needs to free its blocks
                self._send_abort(params, pending.abort_reason)
                raise KvbridgeError("aborted by decode")
            ask = PushRequest(rid, pending.block_ids, self.verify.value)
            with _timed(pending.stats, "ask_s"):
                self._client(params.endpoint).request(ask, self.timeout)
            log.debug("request %s: push requested", rid)
        except PeerTimeoutError:
            pass  # the request may have reached P: settled with P at the deadline
        except Exception as err:  # refused, P gone, or never sent: P writes nothing for it
            self._finish_pending(rid, False, f"push request of {rid!r} failed: {err}")
        finally:
            pending.asked.set()
        # The outcome arrives as PushDone, or is settled with P past the deadline.

    def _on_push_done(self, body: PushDone, sender: str | None = None) -> None:
        """P's word on a push (``sender`` None: P's reply to ``PushQuery``)."""
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
            self._fencer.submit(self._finish_after_grace, body.request_id, body.reason)
        elif body.ok and self.verify is not Verify.OFF:
            self._executor.submit(self._check_push, pending.params, pending, body)
        else:
            self._finish_pending(body.request_id, body.ok, body.reason)

    def _finish_after_grace(self, rid: str, reason: str) -> None:
        time.sleep(self.fence_grace)
        self._finish_pending(rid, False, reason)

    def _settle_push_later(self, pending: _Pending, reason: str) -> None:
        with self._lock:
            if pending.settling or self._pending.get(pending.params.request_id) is not pending:
                return
            pending.settling = True
            self._hold(pending)
        self._fencer.submit(self._settle_push, pending, reason)

    def _settle_push(self, pending: _Pending, reason: str) -> None:
        """D gave up waiting for a push (deadline or abort): end it only once P's write is fenced.

        Aborts the push, then asks P how it ended until P answers: ``PushDone`` (P fenced its
        write, or it had succeeded), or "unknown" (P holds no write of it). A P whose address
        refuses connections is gone and writes nothing more. A P that does not answer is alive
        but frozen or cut off: the request stays held, and asked again.
        """
        params, rid = pending.params, pending.params.request_id
        pending.asked.wait(self.handshake_timeout + 2 * self.timeout)
        client = self._client(params.endpoint)
        aborted = False
        start = time.monotonic()
        while not self._closed and rid in self._pending:
            try:
                if not aborted:
                    client.request(Abort(rid, reason[:4000]), self.timeout)
                    aborted = True
                reply = client.request(PushQuery(rid), self.timeout)
            except PeerRefusedError as err:
                self._finish_pending(rid, False, f"{reason}; prefill is gone ({err})")
                return
            except ControlError as err:
                if err.code == "unknown_request":
                    self._finish_pending(rid, False, f"{reason}; prefill holds no write of it")
                    return
                log.warning("request %s: prefill refused to say how its push ended: %s", rid, err)
                time.sleep(min(1.0, self.timeout))
            except Exception as err:
                log.warning("request %s: blocks held until prefill confirms its push ended "
                            "(%.0f s so far): %s", rid, time.monotonic() - start, err)  # fmt: skip
                time.sleep(min(1.0, self.timeout))
                continue
            if isinstance(reply, PushDone):
                self._on_push_done(reply)
                return
            time.sleep(0.05)  # P is still fencing its write

    def _finish_pending(self, request_id: str, ok: bool, reason: str) -> None:
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
            self._record(outcome)
        log.debug("request %s: %s %s %s", request_id, "done" if ok else "failed", reason,
                  pending.stats)  # fmt: skip
        self._report_slow("load", request_id, pending.stats)

    def _report_slow(self, what: str, request_id: str, stats: RequestStats) -> None:
        """One warning with the breakdown for a request that took a large part of its timeout,
        so that a slow load says where its time went (this side's queue, the handshake, the
        peer's answer, the engine's transfer, a fence)."""
        if stats.total_s < self.slow_after:
            return
        parts = ("queued_s", "handshake_s", "ask_s", "plan_s", "transfer_s", "fence_s",
                 "verify_s")  # fmt: skip
        known = sum(getattr(stats, name) for name in parts)
        log.warning(  # in a push, D's unaccounted time is its wait for P's word
            "request %s: %s took %.2f s: %s, unaccounted %.2f s", request_id, what, stats.total_s,
            ", ".join(f"{name[:-2]} {getattr(stats, name):.2f}" for name in parts),
            max(0.0, stats.total_s - known),
        )  # fmt: skip

    def _send_release(self, params: TransferParams, ok: bool, reason: str) -> None:
        try:
            self._client(params.endpoint).request(
                Release(params.request_id, ok, reason[:4000]), self.timeout
            )
        except Exception as err:
            log.info(
                "request %s: release not delivered (%s); P's lease frees it", params.request_id, err
            )

    def _send_abort(self, params: TransferParams, reason: str) -> None:
        try:
            self._client(params.endpoint).request(Abort(params.request_id, reason), self.timeout)
        except Exception as err:
            log.info(
                "request %s: abort not delivered (%s); P's lease frees it", params.request_id, err
            )

    def _remote_for(self, params: TransferParams, stats: RequestStats) -> _RemoteEngine:
        """The handshake with P, cached; redone when P restarted (a new engine id)."""
        with self._lock:
            gate = self._handshake_gates.setdefault(params.endpoint, threading.Lock())
        # One handshake per remote engine at a time: requests arriving together wait for it
        # instead of each reconnecting the transport under the others' transfers. Waiting for
        # another request's handshake counts as this one's handshake time.
        with _timed(stats, "handshake_s"), gate:
            with self._lock:
                remote = self._by_endpoint.get(params.endpoint)
            if remote is not None and remote.engine_id == params.engine_id:
                return remote
            return self._handshake(params)

    def _handshake(self, params: TransferParams) -> _RemoteEngine:
        deadline = time.monotonic() + self.handshake_timeout
        delay = 0.05
        while True:
            try:
                client = self._client(params.endpoint)
                reply = client.request(self._own_handshake(), min(self.timeout, max(
                    0.1, deadline - time.monotonic())))  # fmt: skip
                break
            except ControlError:
                raise  # refused (auth, layout): retrying cannot help
            except Exception:
                if time.monotonic() + delay >= deadline:
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
        if not isinstance(reply, Handshake):
            raise ControlError("protocol", f"{params.endpoint} answered a handshake with {reply}")
        if reply.engine_id != params.engine_id:
            raise ControlError(
                "engine_changed",
                f"{params.endpoint} is engine {reply.engine_id!r}, the request came from "
                f"{params.engine_id!r} (prefill restarted); the request's blocks are gone",
            )
        remote_layout = Layout(reply.layout)
        check_compatible(remote_layout, self.layout)
        if reply.transport != self.transport.name:
            raise ControlError("transport_mismatch", f"prefill uses {reply.transport!r}")
        with self._lock:
            old = self._by_endpoint.get(params.endpoint)
        if old is not None and old.engine_id != reply.engine_id:
            self.transport.disconnect(old.engine_id)  # P restarted: forget the old engine
        self.transport.connect(reply.engine_id, reply.metadata)
        remote = _RemoteEngine(reply.engine_id, remote_layout, params.endpoint)
        with self._lock:
            self._by_endpoint[params.endpoint] = remote
        return remote

    # -- internals: shared ------------------------------------------------------------------------
    def _client(self, endpoint: str) -> PeerClient:
        with self._lock:
            client = self._clients.get(endpoint)
            if client is None:
                client = PeerClient(endpoint, self.engine_id, secret=self._secret,
                                    timeout=self.timeout)  # fmt: skip
                self._clients[endpoint] = client
            return client

    def _plan(
        self, src: Layout, dst: Layout, src_ids: BlockIds, dst_ids: BlockIds, stats: RequestStats
    ) -> Any:
        start = time.monotonic()
        plan = plan_transfers(src, dst, src_ids, dst_ids)
        stats.plan_s = time.monotonic() - start
        stats.nbytes, stats.descriptors = plan.nbytes, plan.count
        stats.descriptors_before_merge = plan.unmerged
        return plan

    def _move(
        self, op: TransferOp, peer: str, plan: Any, holder: _Lease | _Pending,
        stats: RequestStats, rid: str,
    ) -> None:  # fmt: skip
        """Submit the plan and wait for it; ``holder.handle`` keeps the batch for abort and fence.

        An abort that came before the submission stops it; one that comes during it finds the
        handle and releases it (the wait then fails, and the caller fences).
        """
        start = time.monotonic()
        with self._lock:
            if holder.aborted:
                raise KvbridgeError("aborted by decode before the transfer started")
        local, remote, lengths = plan.local_remote(op)
        handle = self.transport.submit(op, peer, local, remote, lengths)
        log.debug("request %s: %s of %d descriptors submitted", rid, op.value, len(lengths))
        with self._lock:
            holder.handle = handle
            aborted = holder.aborted
        if aborted:
            self.transport.release(handle)
        self.transport.wait(handle)
        stats.transfer_s = time.monotonic() - start

    def _record(self, outcome: RequestOutcome) -> None:
        self._finished[outcome.request_id] = outcome
        self._finished_cond.notify_all()

    @staticmethod
    def _checked_ids(layout: Layout, block_ids: Mapping[int, Any], side: str) -> BlockIds:
        ids: BlockIds = {}
        for group, values in block_ids.items():
            index = int(group)
            if index not in layout.groups:
                raise MessageError("block_id", f"{side} block ids name unknown group {index}")
            arr = np.asarray(values, dtype=np.int64).reshape(-1)
            try:
                prepare_block_ids(layout.groups[index], arr, side)
            except KvbridgeError as err:
                raise MessageError("block_id", str(err)) from None
            ids[index] = [int(v) for v in arr]
        return ids


def _unknown(request_id: str) -> Message:
    raise MessageError(
        "unknown_request",
        f"request {request_id!r} is not held here (never published, released, or lease expired)",
    )


def _require_subset(asked: BlockIds, held: BlockIds, request_id: str) -> None:
    for group, ids in asked.items():
        extra = set(ids) - set(held.get(group, ()))
        if extra:
            raise MessageError(
                "block_id",
                f"request {request_id!r} does not own block(s) {sorted(extra)[:8]} "
                f"of group {group}",
            )
