"""Peer handshakes: exchanging layouts and transport metadata, and the side-channel clients.

Either side answers a handshake (it learns the peer's layout and the peer's transport metadata);
D starts one before its first transfer with a P, and again when that P restarted, and connects its
transport to P's at once: D reads (pull), or is written (push), through that connection.

The answering side (P) connects its transport to D's only when it must write there (a push):
a P that only serves reads holds no transport endpoint towards its D ranks, as in vLLM's own
NIXL connector. Measured reason, beyond the endpoints saved: with NIXL over UCX 1.23's TCP
transport, when both sides open endpoints to each other and D dies while they are still being
set up, UCX aborts P (``stubs.c`` assertion while destroying a TCP endpoint with requests still
pending); with D's endpoint alone, P logs the refused reconnect and lives on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial

import zmq

from kvbridge.control.channel import PeerClient, PendingReply
from kvbridge.control.context import PlaneContext
from kvbridge.control.messages import Handshake, Message, Ping
from kvbridge.control.requests import RankAddress, RequestStats, timed
from kvbridge.core.compat import check_compatible
from kvbridge.core.errors import (
    ControlError,
    KvbridgeError,
    LayoutError,
    LayoutMismatchError,
    MessageError,
    PeerRefusedError,
)
from kvbridge.core.layout import Layout

log = logging.getLogger("kvbridge.control")

#: Refusal codes that mean P and D cannot pair at all (each side's layout, the transport, a TP
#: rank that is not the one named, another protocol version): every load between them fails
#: alike until the deployment is fixed, unlike a peer that is busy, gone or restarted.
INCOMPATIBLE_CODES = frozenset(
    {"layout", "layout_mismatch", "transport_mismatch", "tp_rank", "version"}
)


def _log_connect_failure(engine_id: str, connecting: Future[None]) -> None:
    err = None if connecting.cancelled() else connecting.exception()
    if err is not None:
        log.warning("could not connect the transport to engine %s: %s", engine_id, err)


def _done() -> Future[None]:
    done: Future[None] = Future()
    done.set_result(None)
    return done


@dataclass
class RemoteEngine:
    """What a handshake taught us about another engine."""

    engine_id: str
    layout: Layout
    endpoint: str
    #: the transport's connection to it; ``None`` until ``connect_soon`` starts it (an
    #: answered handshake connects only when this side must write to the peer)
    connected: Future[None] | None = field(default_factory=_done)
    #: starts that connection in the background (set where ``connected`` starts as ``None``)
    start_connect: Callable[[], Future[None]] | None = field(default=None, repr=False)
    #: when a write to it last asked for the connection (``connect_soon``): a quiet release
    #: (``Handshakes.release_quiet``) spares a connection a push is about to use
    used: float = field(default=0.0, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def connect_soon(self) -> Future[None]:
        """The transport's connection to this engine, started now if nothing started it yet;
        does not block. Counts as a use of the connection (it is not released as quiet)."""
        with self._lock:
            self.used = time.monotonic()
            if self.connected is None:
                if self.start_connect is None:
                    raise RuntimeError(f"no way to connect to engine {self.engine_id!r}")
                self.connected = self.start_connect()
            return self.connected

    def wait_connected(self, timeout: float) -> None:
        """Block until the transport reaches this engine (connecting first if nothing did); its
        connect error, if it failed."""
        self.connect_soon().result(timeout)


class Handshakes:
    """The engines this one handshook with, either way, and one side-channel client per peer."""

    def __init__(self, ctx: PlaneContext, secret: bytes | None) -> None:
        self._ctx = ctx
        self._lock = ctx.lock
        self._secret = secret
        self._metadata = ctx.transport.metadata()
        self._remotes: dict[str, RemoteEngine] = {}  # by engine id (peers that handshook us)
        self._by_endpoint: dict[str, RemoteEngine] = {}  # engines we handshook, by endpoint
        #: when each peer engine was last looked up for a request (``release_quiet``)
        self._used: dict[str, float] = {}
        self._clients: dict[str, PeerClient] = {}
        self._handshake_gates: dict[str, threading.Lock] = {}
        #: one zmq context for every client: its I/O thread serves them all (a context per
        #: client cost two OS threads and ~6 descriptors per peer)
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._closed = False
        self._last_sweep = time.monotonic()

    def peer(self, engine_id: str) -> RemoteEngine | None:
        """The engine that handshook us under ``engine_id``, if any."""
        with self._lock:
            remote = self._remotes.get(engine_id)
            if remote is not None:
                self._used[engine_id] = time.monotonic()
            return remote

    def at(self, endpoint: str) -> RemoteEngine | None:
        """The engine we last handshook at ``endpoint``, if any."""
        with self._lock:
            return self._by_endpoint.get(endpoint)

    def client(self, endpoint: str) -> PeerClient:
        """The side-channel client for ``endpoint`` (one per peer, kept until ``close``);
        ``ControlError`` once closing (every client's socket must be closed before the shared
        context ends)."""
        with self._lock:
            client = self._clients.get(endpoint)
            if client is None:
                if self._closed:
                    raise ControlError("closed", f"engine {self._ctx.engine_id} is closing")
                client = PeerClient(
                    endpoint,
                    self._ctx.engine_id,
                    secret=self._secret,
                    timeout=self._ctx.deadlines.call,
                    context=self._context,
                )
                self._clients[endpoint] = client
            return client

    def send_first(
        self, calls: Sequence[tuple[str, Message]], timeout: float
    ) -> list[PendingReply | Exception | None]:
        """Send each message of ``calls`` (endpoint, message) whose endpoint has none before it
        in the list, all before any answer is read: its ``PendingReply``, or the error that
        stopped it. ``None`` for the others: a client carries one call at a time, so the caller
        sends those once the endpoint's first has been answered."""
        out: list[PendingReply | Exception | None] = []
        busy: set[str] = set()
        for endpoint, body in calls:
            if endpoint in busy:
                out.append(None)
                continue
            busy.add(endpoint)
            try:
                out.append(self.client(endpoint).send(body, timeout))
            except Exception as err:
                out.append(err)
        return out

    def release_quiet(self, now: float) -> int:
        """Close the side-channel connections no call used for ``Deadlines.quiet`` (a peer that
        left, or has had nothing to say): a connection to a peer that is gone would otherwise be
        retried by zmq for good. The next call to the peer connects again. Sweeps at most every
        quarter of that bound (it runs on the endpoint's tick); returns how many it closed."""
        quiet = self._ctx.deadlines.quiet
        if now - self._last_sweep < quiet / 4:
            return 0
        self._last_sweep = now
        with self._lock:
            clients = list(self._clients.values())
        released = sum(client.release_if_idle(quiet) for client in clients)
        released += self._release_transports(now - quiet)
        if released:
            log.debug("released %d connection(s) quiet for %.0f s", released, quiet)
        return released

    def _release_transports(self, before: float) -> int:
        """Disconnect the transport from peers no request looked up since ``before`` and with
        nothing in flight to them (``Transport.disconnect_idle``: fenced); D handshakes again
        at its next request to such a P, P reconnects at its next push to such a D."""
        with self._lock:
            quiet = [e for e, used in self._used.items() if used < before]
        released = 0
        for engine_id in quiet:
            gates = [
                self._handshake_gates.get(endpoint)
                for endpoint, remote in list(self._by_endpoint.items())
                if remote.engine_id == engine_id
            ]
            held = [g for g in gates if g is not None and g.acquire(blocking=False)]
            try:
                if len(held) != len(gates):
                    continue  # a handshake with it is under way
                with self._lock:
                    if self._used.get(engine_id, before) >= before:
                        continue  # looked up meanwhile
                    answered = self._remotes.get(engine_id)
                    # Held until ``connected`` is reset: a push asking for the connection
                    # either marked it used before (spared) or reconnects after.
                    with answered._lock if answered is not None else nullcontext():
                        if answered is not None and answered.used >= before:
                            continue  # a push or layer write asked for it meanwhile
                        # Whether connected or not, forgotten here: a D that left for good
                        # costs nothing after; a P that answers again is met by a handshake.
                        if not self._ctx.transport.disconnect_idle(engine_id):
                            continue  # a batch to it is still in flight: the next sweep
                        released += 1
                        del self._used[engine_id]
                        for endpoint, remote in list(self._by_endpoint.items()):
                            if remote.engine_id == engine_id:
                                del self._by_endpoint[endpoint]
                        if answered is not None and answered.start_connect is not None:
                            answered.connected = None  # a push reconnects (``connect_soon``)
            finally:
                for gate in held:
                    gate.release()
        return released

    @property
    def open_connections(self) -> int:
        """Side-channel connections to peers open now (each re-opened on demand)."""
        with self._lock:
            return sum(client.connected for client in self._clients.values())

    def close(self) -> None:
        with self._lock:
            self._closed = True  # no client is made after this: each one is closed below
            clients = list(self._clients.values())
            self._clients.clear()
        for client in clients:
            client.close()  # waits for a call under way (bounded by its timeout)
        self._context.term()

    # -- answering a peer -------------------------------------------------------------------------
    def answer(self, body: Handshake) -> Handshake:
        """Check a peer's handshake, connect the transport to it, and answer with ours."""
        ctx = self._ctx
        try:
            remote = Layout(body.layout)
        except KvbridgeError as err:
            raise MessageError("layout", f"invalid layout from {body.engine_id}: {err}") from None
        try:
            # Named by role, not "this engine": the answer is read in the asking D's log.
            check_compatible(ctx.layout, remote, ("prefill", "decode"))
        except LayoutMismatchError as err:
            raise MessageError("layout_mismatch", str(err)) from None
        if body.transport != ctx.transport.name:
            raise MessageError(
                "transport_mismatch",
                f"decode uses transport {body.transport!r}, prefill {ctx.transport.name!r}",
            )
        # Only a push needs this side's transport to reach the peer: it connects when the
        # first push from this peer is asked for (``connect_soon``), not here (module
        # docstring: a pull-only P opens no transport endpoint towards D).
        with self._lock:
            self._remotes[body.engine_id] = RemoteEngine(
                body.engine_id,
                remote,
                body.endpoint,
                None,
                partial(self._start_connect, body.engine_id, body.metadata),
            )
        if body.endpoint:
            # This side will tell the peer things (a push's end, a layer-wise pull's layers):
            # open and authenticate that connection now, off any request's path, so that the
            # first of them does not pay for it.
            ctx.peer_waits.submit(self._greet, body.endpoint)
        return self._own()

    def _start_connect(self, engine_id: str, metadata: bytes) -> Future[None]:
        """Connect the transport to a peer that handshook us, in the background."""
        connecting = self._ctx.peer_waits.submit(self._ctx.transport.connect, engine_id, metadata)
        connecting.add_done_callback(partial(_log_connect_failure, engine_id))
        return connecting

    def _greet(self, endpoint: str) -> None:
        """Connect and authenticate the side-channel client to a peer that handshook with us
        (best effort: a failure costs the first message to it the same work, later)."""
        start = time.monotonic()
        try:
            self.client(endpoint).request(Ping(), self._ctx.deadlines.call)
        except Exception as err:
            log.info("side channel to %s not opened ahead: %s", endpoint, err)
            return
        took = time.monotonic() - start
        level = logging.WARNING if took >= self._ctx.deadlines.slow_after else logging.DEBUG
        log.log(level, "side channel to %s opened ahead in %.3f s", endpoint, took)

    def _own(self) -> Handshake:
        ctx = self._ctx
        return Handshake(
            ctx.engine_id,
            ctx.layout.spec,
            ctx.transport.name,
            self._metadata,
            ctx.endpoint,
        )

    # -- handshaking a prefill engine (D) ---------------------------------------------------------
    def remote_for(self, address: RankAddress, stats: RequestStats) -> RemoteEngine:
        """The handshake with a P rank, cached; redone when P restarted (a new engine id)."""
        with self._lock:
            gate = self._handshake_gates.setdefault(address.endpoint, threading.Lock())
        # A known peer that nobody is handshaking right now: no handshake, no handshake time.
        if gate.acquire(blocking=False):
            try:
                remote = self.at(address.endpoint)
                if remote is not None and remote.engine_id == address.engine_id:
                    self._used[remote.engine_id] = time.monotonic()
                    return remote
            finally:
                gate.release()
        # One handshake per remote engine at a time: requests arriving together wait for it
        # instead of each reconnecting the transport under the others' transfers. Waiting for
        # another request's handshake counts as this one's handshake time.
        with timed(stats, "handshake_s"), gate:
            remote = self.at(address.endpoint)
            if remote is not None and remote.engine_id == address.engine_id:
                return remote
            return self._handshake(address)

    def prefetch(self, endpoint: str, patience: float) -> RemoteEngine | None:
        """Handshake with the engine at ``endpoint`` before any request names it (D, at start).

        Whatever engine answers there is remembered, so the first request from it needs no
        handshake; a request from another engine id (P restarted meanwhile) handshakes again as
        usual. Retries for up to ``patience`` seconds (a P still loading its model); a failure
        is logged and costs only the first request its handshake.
        """
        with self._lock:
            gate = self._handshake_gates.setdefault(endpoint, threading.Lock())
        deadline = time.monotonic() + patience
        while True:
            with gate:
                known = self.at(endpoint)
                if known is not None:
                    return known
                try:
                    remote = self._handshake(RankAddress("", endpoint), retries=logging.DEBUG)
                    break
                except (ControlError, LayoutError) as err:  # refused: say it, do not retry
                    log.warning("early handshake with %s refused: %s", endpoint, err)
                    return None
                except Exception as err:
                    if time.monotonic() >= deadline or self._ctx.closed:
                        log.info(
                            "early handshake with %s: no answer within %.0f s (%s); the "
                            "first request from it will handshake",
                            endpoint,
                            patience,
                            type(err).__name__,
                        )
                        return None
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        log.info("early handshake with %s: engine %s", endpoint, remote.engine_id)
        return remote

    def _handshake(self, params: RankAddress, retries: int = logging.INFO) -> RemoteEngine:
        ctx = self._ctx
        t0 = time.monotonic()
        reply, attempt = self._ask(params, retries)
        answered = time.monotonic()
        if not isinstance(reply, Handshake):
            raise ControlError("protocol", f"{params.endpoint} answered a handshake with {reply}")
        if params.engine_id and reply.engine_id != params.engine_id:  # "": any (prefetch)
            raise ControlError(
                "engine_changed",
                f"{params.endpoint} is engine {reply.engine_id!r}, the request came from "
                f"{params.engine_id!r} (prefill restarted); the request's blocks are gone",
            )
        remote_layout = Layout(reply.layout)
        check_compatible(remote_layout, ctx.layout)
        if reply.transport != ctx.transport.name:
            raise ControlError("transport_mismatch", f"prefill uses {reply.transport!r}")
        old = self.at(params.endpoint)
        if old is not None and old.engine_id != reply.engine_id:
            ctx.transport.disconnect(old.engine_id)  # P restarted: forget the old engine
        ctx.transport.connect(reply.engine_id, reply.metadata)
        log.debug(
            "handshake with %s (%s): answered in %.3f s after %d attempt(s), transport "
            "connected in %.3f s",
            params.endpoint,
            reply.engine_id,
            answered - t0,
            attempt,
            time.monotonic() - answered,
        )
        remote = RemoteEngine(reply.engine_id, remote_layout, params.endpoint)
        with self._lock:
            self._by_endpoint[params.endpoint] = remote
            self._used[reply.engine_id] = time.monotonic()
        return remote

    def _ask(self, params: RankAddress, retries: int) -> tuple[Message, int]:
        """Send this engine's handshake to ``params`` until it answers or the handshake's
        deadline passes, backing off; the answer and the number of attempts it took."""
        deadline = time.monotonic() + self._ctx.deadlines.handshake_timeout
        delay = 0.05
        t0 = time.monotonic()
        attempt = 1
        while True:
            try:
                client = self.client(params.endpoint)
                attempt_s = self._ctx.deadlines.handshake_attempt(deadline - time.monotonic())
                reply = client.request(self._own(), attempt_s)
                return reply, attempt
            except ControlError:
                raise  # refused (auth, layout): retrying cannot help
            except Exception as err:
                # Nothing listening where the request's P answered from means P died (a
                # restarted P holds none of the request's blocks): the request fails now, not
                # at the deadline. An engine not known yet (``prefetch``: a P still starting)
                # is tried again.
                if isinstance(err, PeerRefusedError) and params.engine_id:
                    raise
                if time.monotonic() + delay >= deadline:
                    raise
                # Each retry says why and how long it waits: a slow first request shows here.
                log.log(
                    retries,
                    "handshake with %s: attempt %d failed after %.3f s (%s); retrying in %.2f s",
                    params.endpoint,
                    attempt,
                    time.monotonic() - t0,
                    type(err).__name__,
                    delay,
                )
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
                attempt += 1
