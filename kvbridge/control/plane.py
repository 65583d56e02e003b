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
never a wrong byte. A fence is a proof, not a timer: where the transport cannot prove that a
failed transfer's bytes stopped (``Fence.UNPROVEN``), the blocks stay held for good
(``unproven``) rather than go back after a grace.

``ControlPlane`` owns what the engine's roles share (endpoint, transport registration, worker
pools, lock, outcomes, housekeeping) and composes them: ``leases.Leases`` (the prefill side,
``_leases``), ``loads.Loads`` (the decode side, ``_loads``: its pulls and pushes) and
``handshakes.Handshakes`` (peers and their clients, ``_handshakes``), with
``transfers.Transfers`` for the transfer steps both sides take. The roles get what they share
as one ``context.PlaneContext`` (never the plane itself), and every time bound from its
``deadlines.Deadlines``.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from kvbridge.control.channel import Endpoint
from kvbridge.control.context import PlaneContext
from kvbridge.control.deadlines import Deadlines
from kvbridge.control.exposure import refuse_weak_settings
from kvbridge.control.handshakes import Handshakes, RemoteEngine
from kvbridge.control.leases import Leases
from kvbridge.control.loads import Loads
from kvbridge.control.messages import (
    Abort,
    Describe,
    DigestRequest,
    Handshake,
    LayersReady,
    Message,
    Ok,
    Ping,
    Probe,
    ProbeConnect,
    PullStart,
    PushDone,
    PushQuery,
    PushRequest,
    Release,
    StreamRequest,
)
from kvbridge.control.probes import Probes
from kvbridge.control.requests import Mode, RequestOutcome, RequestStats, TransferParams
from kvbridge.control.streams import ComputedBlocks
from kvbridge.control.transfers import Transfers
from kvbridge.core.errors import MessageError, OutcomeTimeoutError
from kvbridge.core.integrity import Verify, unreadable_here
from kvbridge.core.layout import Layout
from kvbridge.core.transport import Transport

__all__ = [
    "ControlPlane",
    "Mode",
    "RequestOutcome",
    "RequestStats",
    "TransferParams",
    "default_engine_id",
]


#: Handshakes ``connect_early`` runs at once (threads); the others queue behind them.
EARLY_HANDSHAKES = 16


def default_engine_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class ControlPlane:
    """Side channel plus request flow for one engine, on top of its layout and transport.

    The layout's memory is registered with the transport here and released by ``close``.
    ``timeout`` bounds every side-channel call; transfers are bounded by the transport's own
    ``timeout``, which is the default (pass it only to differ). ``lease`` is how long P keeps a
    published request's blocks when D never releases them (extended while D reads them);
    ``handshake_timeout`` bounds the retries of a handshake; ``claim_timeout`` how long P holds a
    request no D claimed (default from the others: ``Deadlines.claim``). Every bound the plane
    keeps is derived from these once, in ``deadlines`` (``Deadlines``). ``verify`` (D: ``off``,
    ``sample``, ``full``) compares digests of what P sent and D received after each load; a
    mismatch fails the load (``RequestStats.verify_failed``).

    ``secret`` authenticates every peer (challenge-response; never sent). Without one the side
    channel may listen on a loopback ``host`` only, unless ``insecure=True`` says the network
    is isolated on purpose; an empty secret or a port outside 0-65535 is refused
    (``WeakSettingError``, before anything is registered or bound).
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
        timeout: float | None = None,
        lease: float = 30.0,
        handshake_timeout: float = 10.0,
        claim_timeout: float | None = None,
        workers: int = 4,
        verify: Verify | str = Verify.OFF,
        insecure: bool = False,
    ) -> None:
        refuse_weak_settings(host, [port], secret, insecure=insecure, where="ControlPlane")
        _refuse_unreadable(layout, verify)
        # Every time bound of the plane, derived once (the roles read it, never re-derive).
        deadlines = Deadlines(
            transport.timeout if timeout is None else timeout,
            lease,
            handshake_timeout,
            claim_timeout,
        )
        self.engine_id = engine_id or default_engine_id()
        self.layout = layout
        self.transport = transport
        secret = secret.encode() if isinstance(secret, str) else secret
        lock = threading.RLock()
        self._lock = lock
        self._finished_cond = threading.Condition(lock)
        self._finished: dict[str, RequestOutcome] = {}
        transport.register(layout.registration)
        #: what the roles share, handed to them instead of the plane (``PlaneContext``)
        self._ctx = ctx = self._context(lock, deadlines, Verify(verify), workers)
        self._handshakes = Handshakes(ctx, secret)
        transfers = Transfers(ctx)
        self._leases = Leases(ctx, self._handshakes, transfers)
        self._loads = Loads(ctx, self._handshakes, transfers)
        #: ``kvbridge check``: its scratch registered now, freed in ``close``
        self._probes = Probes(ctx)
        self._endpoint = Endpoint(
            self.engine_id,
            self._handle,
            host=host,
            port=port,
            secret=secret,
            on_tick=self._tick,
        )
        ctx.endpoint = self._endpoint.address

    def _context(
        self, lock: threading.RLock, deadlines: Deadlines, verify: Verify, workers: int
    ) -> PlaneContext:
        """What the roles share: the layout, the transport, the lock, the bounds, the pools."""
        return PlaneContext(
            self.engine_id,
            self.layout,
            self.transport,
            lock,
            # looked up at each outcome: a test may wrap the class's ``_record``
            record=lambda outcome: self._record(outcome),
            deadlines=deadlines,
            verify=verify,
            requests=ThreadPoolExecutor(workers, thread_name_prefix="kvbridge-request"),
            peer_waits=ThreadPoolExecutor(workers, thread_name_prefix="kvbridge-fence"),
            asks=ThreadPoolExecutor(workers, thread_name_prefix="kvbridge-ask"),
            digests=ThreadPoolExecutor(2, thread_name_prefix="kvbridge-digest"),
        )

    # -- settings: the roles read them from the context; a change derives every bound again -----
    @property
    def deadlines(self) -> Deadlines:
        """Every time bound of the plane, derived from ``timeout``, ``lease`` and
        ``handshake_timeout``."""
        return self._ctx.deadlines

    @deadlines.setter
    def deadlines(self, value: Deadlines) -> None:
        self._ctx.deadlines = value

    @property
    def verify(self) -> Verify:
        """D: the integrity check after each load (``off``, ``sample``, ``full``)."""
        return self._ctx.verify

    @verify.setter
    def verify(self, value: Verify | str) -> None:
        _refuse_unreadable(self.layout, value)
        self._ctx.verify = Verify(value)

    @property
    def timeout(self) -> float:
        return self.deadlines.timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        self.deadlines = replace(self.deadlines, timeout=value)

    @property
    def lease(self) -> float:
        return self.deadlines.lease

    @property
    def handshake_timeout(self) -> float:
        return self.deadlines.handshake_timeout

    @handshake_timeout.setter
    def handshake_timeout(self, value: float) -> None:
        self.deadlines = replace(self.deadlines, handshake_timeout=value)

    @property
    def endpoint(self) -> str:
        """The side-channel address peers connect to."""
        return self._endpoint.address

    # -- P side -----------------------------------------------------------------------------------
    def publish(
        self,
        request_id: str,
        block_ids: Mapping[int, Any],
        num_tokens: int,
        mode: Mode = Mode.PULL,
        token: str | None = None,
        published_at: float | None = None,
    ) -> TransferParams:
        """Hold a prefilled request's blocks under a lease; return what D needs to fetch them.

        The params carry the request's capability ``token``: ``token`` when given (an engine's
        scheduler makes it, the same for every TP rank), else a fresh one. Only a D that sends
        it back is served. ``published_at``: when this engine answered the request
        (``time.time()``; now when not given), the start of ``RequestStats.landed_after_s``.
        """
        return self._leases.publish(request_id, block_ids, num_tokens, mode, token, published_at)

    def unpublish(self, request_id: str) -> None:
        """Drop a lease without a transfer (the request was aborted on P)."""
        self._leases.unpublish(request_id)

    def stream(
        self,
        request_id: str,
        token: str,
        block_ids: Mapping[int, Any],
        layers: Sequence[str],
        first: Mapping[int, int] | None = None,
        total: Mapping[int, int] | None = None,
    ) -> int:
        """Layer-wise transfer: P computed these layers of a request it has not published yet;
        write them now to every decode rank that asked for a push of it with ``token``, and
        tell every one that asked for a layer-wise pull (``LayersReady``: it reads them).

        Returns the bytes submitted by writes (0 when no decode rank asked yet: the push at
        ``publish`` sends every layer not streamed; a pull reads the rest). Never waits on a
        peer (it runs between two layers of the engine's forward pass); failures surface at
        ``publish``'s push, fenced.
        ``block_ids``: P's ids of the groups whose layers stream (not a recurrent state, sent
        at publish once final). A chunked prefill streams each chunk's completed blocks: the
        ids then start at position ``first`` of each group's blocks, of the ``total`` P holds
        once the prefill ends (``streams.ComputedBlocks``); pass the same ``block_ids`` object for
        every layer of a step. See ``kvbridge.control.streams``.
        """
        part = ComputedBlocks(block_ids, first or {}, total or {})
        return self._leases.stream(request_id, token, part, list(layers))

    def withdraw(self, request_id: str, token: str, reason: str) -> None:
        """P will not publish this request (declined past its hold limit, or ended otherwise):
        every decode rank waiting for its push (the concurrent dispatch) is told at once, after
        the fence of what was streamed; a push asked later is refused."""
        self._leases.withdraw(request_id, token, reason)

    @property
    def leased(self) -> list[str]:
        """Request ids whose blocks P still holds."""
        return self._leases.leased

    # -- D side -----------------------------------------------------------------------------------
    def pull(
        self, params: TransferParams, block_ids: Mapping[int, Any], first_token: int = 0
    ) -> None:
        """Start reading a request into these local blocks; the outcome comes later.
        ``params.layerwise``: while P computes it, each layer as P says it is computed.
        ``first_token``: the request's token at which these blocks start (the tokens this
        engine held already), which P and D of different block sizes pair by."""
        self._loads.pull(params, block_ids, first_token)

    def push(
        self, params: TransferParams, block_ids: Mapping[int, Any], first_token: int = 0
    ) -> None:
        """Ask P to write a request into these local blocks (from the request's token
        ``first_token`` on); the outcome comes later."""
        self._loads.push(params, block_ids, first_token)

    def abort(self, params: TransferParams, reason: str = "aborted by decode") -> None:
        """Give up a request, before or during its load; P is told so it frees the blocks at once.

        A load in progress ends with a failed outcome once it is fenced (no byte of it can land
        any more); one not started yet never starts.
        """
        self._loads.abort(params, reason)

    @property
    def held(self) -> list[str]:
        """Request ids (D) whose failure waits for a fence: their blocks stay out of use."""
        return self._loads.held

    @property
    def unproven(self) -> list[str]:
        """Request ids (D) held for good: no fence proves their bytes stopped landing (also in
        ``held``); their outcome is never reported, their blocks never handed back."""
        return self._loads.unproven

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

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called."""
        return self._ctx.closed

    def connect_early(
        self, endpoints: Sequence[str], patience: float = 300.0
    ) -> list[Future[RemoteEngine | None]]:
        """D: handshake in the background with the prefill side channels at ``endpoints``
        (``tcp://host:port``, as P publishes them), so that the first request from each needs
        none. Each ends with the engine met there, or ``None`` (logged) when none answered
        within ``patience`` seconds (P may still be loading its model) or it refused."""
        # Threads of their own: a P not up yet holds one for up to handshake_timeout, which
        # must not take the workers requests use. The pool ends when its tasks do; bounded, as
        # a D rank of a large fleet names hundreds of P ranks (a handshake mostly waits).
        pool = ThreadPoolExecutor(
            max(1, min(len(endpoints), EARLY_HANDSHAKES)), thread_name_prefix="kvbridge-early"
        )
        try:
            return [pool.submit(self._handshakes.prefetch, e, patience) for e in endpoints]
        finally:
            pool.shutdown(wait=False)

    def close(self) -> None:
        """Stop serving, fail what is pending, free every lease and registration."""
        ctx = self._ctx
        with self._lock:
            if ctx.closed:
                return
            ctx.closing.set()
        self._loads.close()
        self._leases.close()
        self._endpoint.close()
        ctx.requests.shutdown(wait=True, cancel_futures=True)
        ctx.asks.shutdown(wait=True, cancel_futures=True)  # after the pulls that wait on it
        ctx.peer_waits.shutdown(wait=True, cancel_futures=True)
        ctx.digests.shutdown(wait=True, cancel_futures=True)
        self._handshakes.close()
        self._probes.close()
        self.transport.deregister(self.layout.registration)

    def __enter__(self) -> ControlPlane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------------
    def _record(self, outcome: RequestOutcome) -> None:
        """Make a request's outcome available to ``poll_finished``/``wait``; lock held."""
        self._finished[outcome.request_id] = outcome
        self._finished_cond.notify_all()

    def _handle(self, peer: str, body: Message) -> Message | Future[Message]:
        """Answer a peer's request (in the endpoint's thread), as ``_PROTOCOL`` says."""
        answer = _PROTOCOL.get(type(body))
        if answer is None:
            raise MessageError("unexpected", f"{type(body).__name__} is not a request")
        return answer(self, peer, body)

    def _tick(self) -> None:
        """Housekeeping, in the endpoint's thread: expired leases, late pushes, old memories."""
        now = time.monotonic()
        self._leases.expire(now)
        self._loads.expire(now)
        self._handshakes.release_quiet(now)


#: How this engine answers a request from the peer engine ``peer``: a reply, or a future of one
#: (the endpoint answers other requests meanwhile). A ``MessageError`` it raises is the reply.
_Answer = Callable[[ControlPlane, str, Any], "Message | Future[Message]"]


def _acked(answer: Callable[[ControlPlane, str, Any], None]) -> _Answer:
    """An answer that is only ``Ok`` once the role took the message."""

    def acked(plane: ControlPlane, peer: str, body: Any) -> Message:
        answer(plane, peer, body)
        return Ok()

    return acked


#: The side-channel protocol, every request a peer may send and who answers it (the roles are
#: looked up at each call: a test may replace one's method on the instance). Any other message
#: is refused (``unexpected``); replies (``Ok``, ``Digest``, ``ErrorReply``) and the
#: authentication messages never come here.
_PROTOCOL: dict[type[Message], _Answer] = {
    # either side: a peer's layout and transport; answered with ours
    Handshake: lambda plane, peer, body: plane._handshakes.answer(body),
    # to P, from a D rank: pull (claim, then release), push (ask, then ask how it ended)
    PullStart: lambda plane, peer, body: plane._leases.on_pull_start(peer, body),
    Release: lambda plane, peer, body: plane._leases.on_release(peer, body),
    PushRequest: lambda plane, peer, body: plane._leases.on_push_request(peer, body),
    PushQuery: lambda plane, peer, body: plane._leases.on_push_query(body),
    # to P, from a D rank: a layer-wise pull asked before P published the request
    StreamRequest: lambda plane, peer, body: plane._leases.on_stream_request(peer, body),
    DigestRequest: lambda plane, peer, body: plane._leases.on_digest_request(peer, body),
    Abort: _acked(lambda plane, peer, body: plane._leases.on_abort(body)),
    # to D, from a P rank: how its push ended
    PushDone: _acked(lambda plane, peer, body: plane._loads.on_push_done(body, peer)),
    # to D, from a P rank: layers of a layer-wise pull computed, or the request published
    LayersReady: _acked(lambda plane, peer, body: plane._loads.on_layers_ready(body, peer)),
    # any side: is the peer alive and serving
    Ping: lambda plane, peer, body: Ok(),
    # any side, from `kvbridge check`: versions and handshake, then probes of its scratch only
    Describe: lambda plane, peer, body: plane._probes.about(),
    ProbeConnect: lambda plane, peer, body: plane._probes.connect(peer, body),
    Probe: lambda plane, peer, body: plane._probes.probe(peer, body),
}


def _refuse_unreadable(layout: Layout, verify: Verify | str) -> None:
    """``ValueError`` (one line) for an integrity check this process cannot run on ``layout``."""
    why = unreadable_here(layout)
    if why and Verify(verify) is not Verify.OFF:
        raise ValueError(f"verify={Verify(verify).value}: {why}")
