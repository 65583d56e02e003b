"""The P/D control plane: handshake, pull and push request flow, leases, timeouts.

One ``ControlPlane`` per engine (worker). The prefill side *publishes* a request's blocks under a
lease and hands the returned ``TransferParams`` to the decode side through the serving engine;
the decode side *pulls* (reads, then releases) or asks for a *push* (P writes, then says done).
Every wait is bounded; every request ends in a ``RequestOutcome`` the adapter collects with
``poll_finished``: on P, "these blocks may be freed"; on D, "this load finished or failed".
"""

from __future__ import annotations

import enum
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from kvbridge.core.block_mapping import prepare_block_ids
from kvbridge.core.compat import check_compatible
from kvbridge.core.control.channel import ControlError, Endpoint, PeerClient
from kvbridge.core.control.messages import (
    Abort,
    BlockIds,
    Handshake,
    Message,
    MessageError,
    Ok,
    PullStart,
    PushDone,
    PushRequest,
    Release,
)
from kvbridge.core.errors import KvbridgeError, LayoutMismatchError
from kvbridge.core.layout import Layout
from kvbridge.core.planning import plan_transfers
from kvbridge.core.transport import TransferOp, Transport

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

    handshake_s: float = 0.0
    plan_s: float = 0.0
    transfer_s: float = 0.0
    nbytes: int = 0
    descriptors: int = 0
    descriptors_before_merge: int = 0


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
    aborted: bool = False


def default_engine_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class ControlPlane:
    """Side channel plus request flow for one engine, on top of its layout and transport.

    The layout's memory is registered with the transport here and released by ``close``.
    ``timeout`` bounds every side-channel call and every transfer wait; ``lease`` is how long P
    keeps a published request's blocks when D never releases them; ``handshake_timeout`` bounds
    the retries of a handshake.
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
    ) -> None:
        self.engine_id = engine_id or default_engine_id()
        self.layout = layout
        self.transport = transport
        self.timeout = timeout
        self.lease = lease
        self.handshake_timeout = handshake_timeout
        self._secret = secret.encode() if isinstance(secret, str) else secret
        self._lock = threading.RLock()
        self._finished_cond = threading.Condition(self._lock)
        self._finished: dict[str, RequestOutcome] = {}
        self._leases: dict[str, _Lease] = {}
        self._pending_push: dict[str, tuple[str, BlockIds, float]] = {}
        self._pending: dict[str, _Pending] = {}
        self._aborted: dict[str, float] = {}  # request ids aborted on D, until when to remember
        self._remotes: dict[str, _RemoteEngine] = {}  # by engine id (peers that handshook us)
        self._by_endpoint: dict[str, _RemoteEngine] = {}  # engines we handshook, by endpoint
        self._clients: dict[str, PeerClient] = {}
        self._handshake_gates: dict[str, threading.Lock] = {}
        self._closed = False
        transport.register(layout.registration)
        self._metadata = transport.metadata()
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="kvbridge-request")
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

        A load in progress ends with a failed outcome; one not started yet never starts.
        """
        with self._lock:
            pending = self._pending.get(params.request_id)
            if pending is not None:
                pending.aborted = True
            self._aborted[params.request_id] = time.monotonic() + self.lease
        self._executor.submit(self._send_abort, params, reason)
        self._finish_pending(params.request_id, False, reason)

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
                    raise TimeoutError(f"request {request_id!r} has no outcome after {timeout} s")
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
        for client in self._clients.values():
            client.close()
        self._clients.clear()
        self.transport.deregister(self.layout.registration)

    def __enter__(self) -> ControlPlane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals: P -----------------------------------------------------------------------------
    def _handle(self, peer: str, body: Message) -> Message:
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
            self._pending_push.pop(body.request_id, None)
            self._free(body.request_id, False, f"aborted by decode: {body.reason}")
            return Ok()
        if isinstance(body, PushRequest):
            return self._on_push_request(peer, body)
        if isinstance(body, PushDone):
            self._on_push_done(body)
            return Ok()
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
        return Ok()

    def _on_push_request(self, peer: str, body: PushRequest) -> Message:
        with self._lock:
            remote = self._remotes.get(peer)
            if remote is None:
                raise MessageError("no_handshake", "handshake before requesting a push")
            self._checked_ids(remote.layout, body.block_ids, "destination")
            lease = self._leases.get(body.request_id)
            if lease is None:
                if body.request_id in self._pending_push:
                    raise MessageError("duplicate", f"push of {body.request_id!r} requested twice")
                # P has not finished prefilling yet: write once it publishes.
                self._pending_push[body.request_id] = (
                    peer,
                    body.block_ids,
                    time.monotonic() + self.lease,
                )
                return Ok()
            if lease.puller is not None or lease.pushing:
                raise MessageError("duplicate", f"request {body.request_id!r} is already taken")
        self._start_push(lease, peer, body.block_ids)
        return Ok()

    def _start_push(self, lease: _Lease, peer: str, block_ids: BlockIds) -> None:
        with self._lock:
            lease.pushing = True
        self._executor.submit(self._run_push, lease, peer, block_ids)

    def _run_push(self, lease: _Lease, peer: str, block_ids: BlockIds) -> None:
        rid = lease.params.request_id
        stats = RequestStats()
        try:
            with self._lock:
                remote = self._remotes[peer]
            plan = self._plan(self.layout, remote.layout, lease.params.block_ids, block_ids, stats)
            self._move(TransferOp.WRITE, peer, plan, stats)
            done = PushDone(
                rid, True, "", stats.nbytes, stats.descriptors, stats.descriptors_before_merge,
                stats.plan_s, stats.transfer_s,
            )  # fmt: skip
            ok, reason = True, "pushed to decode"
        except Exception as err:
            done = PushDone(rid, False, f"prefill could not push: {err}")
            ok, reason = False, str(err)
        try:
            self._client(remote.endpoint).request(done, self.timeout)
        except Exception as err:
            log.warning("request %s: could not tell decode the push ended: %s", rid, err)
        self._free(rid, ok, reason, stats)

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
            late = [r for r, p in self._pending.items() if p.deadline < now]
            for rid, until in list(self._aborted.items()):
                if until < now:
                    del self._aborted[rid]
        for rid in expired:
            self._free(rid, False, f"lease of {self.lease:g} s expired before decode released it")
        for rid in late:
            self._finish_pending(rid, False, f"no transfer within {self.timeout:g} s")

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
        try:
            remote = self._remote_for(params, pending.stats)
            self._claim(params, pending)
            if pending.aborted:
                return
            plan = self._plan(remote.layout, self.layout, params.block_ids, pending.block_ids,
                              pending.stats)  # fmt: skip
            self._move(TransferOp.READ, remote.engine_id, plan, pending.stats)
        except Exception as err:
            reason = f"pull of {rid!r} from {params.endpoint} failed: {err}"
            self._finish_pending(rid, False, reason)
            self._executor.submit(self._send_release, params, False, str(err))
            return
        self._send_release(params, True, "")
        self._finish_pending(rid, True, "")

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
        try:
            self._remote_for(params, pending.stats)
            self._client(params.endpoint).request(PushRequest(rid, pending.block_ids), self.timeout)
        except Exception as err:
            self._finish_pending(rid, False, f"push request of {rid!r} failed: {err}")
        # The outcome arrives as PushDone (or the deadline passes in _tick).

    def _on_push_done(self, body: PushDone) -> None:
        with self._lock:
            pending = self._pending.get(body.request_id)
            if pending is None:
                return
            stats = pending.stats
            stats.nbytes, stats.descriptors = body.nbytes, body.descriptors
            stats.descriptors_before_merge = body.descriptors_before_merge
            stats.plan_s, stats.transfer_s = body.plan_s, body.transfer_s
        self._finish_pending(body.request_id, body.ok, body.reason)

    def _finish_pending(self, request_id: str, ok: bool, reason: str) -> None:
        with self._lock:
            pending = self._pending.pop(request_id, None)
            if pending is None:
                return
            outcome = RequestOutcome(request_id, ok and not pending.aborted, reason, pending.stats)
            self._record(outcome)
        log.debug("request %s: %s %s %s", request_id, "done" if ok else "failed", reason,
                  pending.stats)  # fmt: skip

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
        # instead of each reconnecting the transport under the others' transfers.
        with gate:
            with self._lock:
                remote = self._by_endpoint.get(params.endpoint)
            if remote is not None and remote.engine_id == params.engine_id:
                return remote
            start = time.monotonic()
            remote = self._handshake(params)
            stats.handshake_s = time.monotonic() - start
            return remote

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

    def _move(self, op: TransferOp, peer: str, plan: Any, stats: RequestStats) -> None:
        start = time.monotonic()
        local, remote, lengths = plan.local_remote(op)
        handle = self.transport.submit(op, peer, local, remote, lengths)
        self.transport.wait(handle, self.timeout)
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
