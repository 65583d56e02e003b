"""The side channel: one ROUTER endpoint per engine, one DEALER client per remote engine (pyzmq).

The endpoint serves requests in its own thread and keeps serving whatever a peer sends: a message
that cannot be decoded, is too large or arrives before the peer authenticated gets an
``ErrorReply`` and a log line naming the peer's engine id and address (rate-limited:
``refusals.RefusalLog``). Failed authentication is logged on both sides: a client whose check
of the server's proof fails tells the server so (``AuthRefused``) before it gives up. Clients
make request/reply calls, each bounded by a timeout.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvbridge.control import auth
from kvbridge.control.messages import (
    MAX_MESSAGE_BYTES,
    Auth,
    AuthRefused,
    Challenge,
    ErrorReply,
    Hello,
    Message,
    Ok,
    decode,
    encode,
)
from kvbridge.control.refusals import RefusalLog
from kvbridge.core.errors import (
    ControlError,
    KvbridgeError,
    MessageError,
    PeerError,
    PeerRefusedError,
    PeerTimeoutError,
)

log = logging.getLogger("kvbridge.control")

#: ``handler(peer engine id, message) -> reply``; raise ``MessageError`` or a kvbridge error to
#: refuse the request (the endpoint turns it into an ``ErrorReply``). A handler whose work is
#: long (hashing gigabytes) returns a ``Future`` of the reply instead: the endpoint keeps serving
#: other requests and sends that reply once it is done.
Handler = Callable[[str, Message], "Message | Future[Message]"]


#: Socket events that tell whether the peer's address accepts connections.
_WATCHED = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
#: Connects retried since a message was sent (each a connect refused, or a connection the
#: other end closed at once, as an HTTP server does with the greeting) that mean no side
#: channel listens there. One is not enough: zmq reports an attempt from its I/O thread, so the
#: refusal of an attempt made before the send (a restarting peer not yet bound) can arrive
#: after it; zmq makes one attempt at a time, so a second is of an attempt made after the send.
_REFUSALS = 2


@dataclass
class _Session:
    """What the endpoint knows about one connected client."""

    engine_id: str = ""
    client_nonce: bytes = b""
    server_nonce: bytes = b""
    authenticated: bool = False
    #: the peer's network address as the socket saw it ("" when unknown)
    address: str = ""


class Endpoint:
    """A bound ROUTER socket serving ``handler`` in a background thread.

    ``port=0`` binds a free port; ``address`` tells which. With a ``secret`` a client must pass
    the challenge-response before any other message is answered; without one the same exchange
    runs with empty proofs. ``on_tick`` runs in the endpoint thread about every ``tick`` seconds
    (lease expiry and similar housekeeping).
    """

    def __init__(
        self,
        engine_id: str,
        handler: Handler,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        secret: bytes | None = None,
        on_tick: Callable[[], None] | None = None,
        tick: float = 0.05,
    ) -> None:
        self.engine_id = engine_id
        self._handler = handler
        self._secret = secret
        self._on_tick = on_tick
        self._tick = tick
        self._refusals = RefusalLog(log)
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        # zmq drops (and disconnects) anything far beyond our own limit before it is buffered.
        self._socket.setsockopt(zmq.MAXMSGSIZE, 4 * MAX_MESSAGE_BYTES)
        target = f"tcp://{_bracket(host)}"
        try:
            if port == 0:
                port = self._socket.bind_to_random_port(target)
            else:
                self._socket.bind(f"{target}:{port}")
        except zmq.ZMQError as err:
            self._socket.close()
            self._context.term()
            raise PeerError(f"cannot bind the side channel on {host}:{port}: {err}") from None
        self.host, self.port = host, port
        self._sessions: dict[bytes, _Session] = {}
        # Deferred replies, finished in other threads; a byte on the pipe wakes the loop, which
        # alone may use the socket.
        self._ready: deque[tuple[bytes, bytes]] = deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._wake_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"kvbridge-endpoint[{engine_id}]")
        self._thread.daemon = True
        self._thread.start()

    @property
    def address(self) -> str:
        return f"tcp://{_bracket(self.host)}:{self.port}"

    def close(self) -> None:
        """Stop serving and free the port; a second call does nothing."""
        self._stop.set()
        self._thread.join(5)
        if not self._thread.is_alive() and self._wake_w != -1:
            self._socket.close()
            self._context.term()
            with self._wake_lock:
                os.close(self._wake_r)
                os.close(self._wake_w)
                self._wake_w = -1

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_tick = time.monotonic()
        while not self._stop.is_set():
            events = dict(poller.poll(int(self._tick * 1000)))
            if self._wake_r in events:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
            while self._ready:
                self._socket.send_multipart(list(self._ready.popleft()))
            if self._socket in events:
                try:
                    frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    continue
                if len(frames) == 2:
                    identity, payload = frames[0].bytes, frames[1].bytes
                    reply = self._answer(identity, payload, _peer_address(frames[1]))
                    if reply is not None:
                        self._socket.send_multipart([identity, reply])
                else:
                    log.warning("side channel: dropped a message of %d frames", len(frames))
            if self._on_tick is not None and time.monotonic() >= next_tick:
                next_tick = time.monotonic() + self._tick
                try:
                    self._on_tick()
                except Exception:
                    log.exception("side channel: housekeeping failed")

    def _answer(self, identity: bytes, payload: bytes, address: str = "") -> bytes | None:
        """The encoded reply, or None when the handler answers later (a ``Future``)."""
        seq = 0
        before = self._sessions.get(identity)  # a failed login drops the session: name it still
        try:
            envelope = decode(payload)
            seq = envelope.seq
            body = self._dispatch(identity, envelope.body, address)
            if isinstance(body, Future):
                body.add_done_callback(lambda done: self._deferred(identity, seq, done))
                return None
            return encode(seq, body)
        except Exception as err:
            return self._refusal(seq, err, self._who(identity, address, before))

    def _who(self, identity: bytes, address: str, session: _Session | None = None) -> str:
        """The peer as a log line names it: its engine id (once it said it) and address."""
        session = self._sessions.get(identity) or session
        engine = repr(session.engine_id) if session is not None and session.engine_id else "?"
        return f"{engine} at {address or (session.address if session else '') or 'unknown'}"

    def _deferred(self, identity: bytes, seq: int, done: Future[Message]) -> None:
        try:
            reply = encode(seq, done.result())
        except Exception as err:
            reply = self._refusal(seq, err, self._who(identity, ""))
        with self._wake_lock:
            if self._wake_w < 0:  # closed: the endpoint answers nothing any more
                return
            self._ready.append((identity, reply))
            with contextlib.suppress(BlockingIOError):  # full: the loop is awake anyway
                os.write(self._wake_w, b"x")

    def _refusal(self, seq: int, err: Exception, peer: str) -> bytes:
        if isinstance(err, MessageError):
            self._refusals.warning(
                err.code,
                peer,
                f"side channel: refused a message from peer {peer} ({err.code}): {err}",
            )
            return encode(seq, ErrorReply(err.code, str(err)))
        if isinstance(err, KvbridgeError):
            log.info("side channel: refused a request: %s", err)
            code = getattr(err, "code", type(err).__name__)
            return encode(seq, ErrorReply(str(code)[:64], str(err)))
        log.error("side channel: handler failed", exc_info=err)
        return encode(seq, ErrorReply("internal", f"{type(err).__name__}: {err}"))

    def _dispatch(
        self, identity: bytes, body: Message, address: str = ""
    ) -> Message | Future[Message]:
        session = self._sessions.get(identity)
        if isinstance(body, Hello):
            session = _Session(body.engine_id, body.nonce, auth.new_nonce(), address=address)
            if len(self._sessions) > 4096:  # bound the table against connection floods
                self._sessions.pop(next(iter(self._sessions)))
            self._sessions[identity] = session
            proof = auth.server_proof(self._secret, session.client_nonce, session.server_nonce)
            return Challenge(self.engine_id, session.server_nonce, proof)
        if isinstance(body, Auth):
            if session is None:
                raise MessageError("unauthenticated", "send hello before auth")
            expected = auth.client_proof(self._secret, session.client_nonce, session.server_nonce)
            if not auth.verify(expected, body.proof):
                self._sessions.pop(identity, None)
                # logged with the peer's address by ``_refusal``, like every refusal
                raise MessageError(
                    "auth_failed",
                    "authentication failed: the peer's proof does not match this engine's "
                    "secret (a different secret, or a secret set on one side only)",
                )
            session.authenticated = True
            return Ok()
        if isinstance(body, AuthRefused):
            if session is None:
                raise MessageError("unauthenticated", "send hello before auth")
            self._sessions.pop(identity, None)
            raise MessageError(
                "auth_failed",
                "the peer found this engine's proof wrong: a different secret, or a secret "
                f"set on one side only ({body.reason[:200]})",
            )
        if session is None or not session.authenticated:
            raise MessageError("unauthenticated", "authenticate (hello, auth) before any request")
        return self._handler(session.engine_id, body)


class PeerClient:
    """A connection to one remote endpoint; ``request`` sends a message and waits for its reply.

    Thread-safe (one call at a time per peer). The first call runs the challenge-response, and
    runs it again, once, if the endpoint answers that it does not know us (it restarted at the
    same address); a timeout resets the socket so a late reply can never be taken for the next
    one.

    ``context``: the zmq context to open the socket in, shared by every client of an engine
    (a context costs two OS threads and a few descriptors: one per client would grow with the
    fleet); the caller terminates it after closing its clients. Without one the client has a
    context of its own, terminated by ``close``.
    """

    def __init__(
        self,
        address: str,
        engine_id: str,
        *,
        secret: bytes | None = None,
        timeout: float = 5.0,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        self.address = address
        self.engine_id = engine_id
        self.timeout = timeout
        self.remote_engine_id: str | None = None
        self._secret = secret
        self._owns_context = context is None
        self._context: zmq.Context[zmq.Socket[bytes]] = (
            zmq.Context() if context is None else context
        )
        #: ``time.monotonic()`` of the last call's end (``release_if_idle``)
        self._last_used = time.monotonic()
        self._lock = threading.Lock()
        self._seq = 0
        self._socket: zmq.Socket[bytes] | None = None
        self._monitor: zmq.Socket[bytes] | None = None
        self._poller = zmq.Poller()  # the socket and its monitor, while connected
        self._up = False  # a TCP connection to the peer is established
        self._retried = 0  # connects retried since the last send (``_refused``)
        self._authenticated = False

    def close(self) -> None:
        with self._lock:
            self._reset()
            if self._owns_context:
                self._context.term()

    def release_if_idle(self, idle_for: float) -> bool:
        """Close the connection when no call used it for ``idle_for`` seconds and none is under
        way; the next call connects and authenticates again. Whether it was released.

        Nothing is lost: a call waits for its reply, so between calls no message of this
        client is in flight.
        """
        if not self._lock.acquire(blocking=False):
            return False  # a call is under way
        try:
            if self._socket is None or time.monotonic() - self._last_used < idle_for:
                return False
            self._reset()
            return True
        finally:
            self._lock.release()

    @property
    def connected(self) -> bool:
        """Whether the client holds a socket (it opens one at its next call otherwise)."""
        return self._socket is not None

    def _reset(self) -> None:
        if self._socket is not None:
            with contextlib.suppress(zmq.ZMQError):  # the shared context may be ending
                self._socket.disable_monitor()
            self._socket.close(linger=0)
        if self._monitor is not None:
            self._monitor.close(linger=0)
        self._socket = self._monitor = None
        self._poller = zmq.Poller()
        self._up = self._authenticated = False

    def _connect(self) -> zmq.Socket[bytes]:
        if self._socket is None:
            sock = self._context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTING_ID, f"{self.engine_id}-{uuid.uuid4().hex[:8]}".encode())
            self._monitor = sock.get_monitor_socket(_WATCHED)
            sock.connect(self.address)
            self._socket = sock
            self._poller.register(sock, zmq.POLLIN)
            self._poller.register(self._monitor, zmq.POLLIN)
        return self._socket

    def _refused(self) -> bool:
        """Read the socket's pending events: were connects retried ``_REFUSALS`` times since
        the last send, each while no connection was up?"""
        assert self._monitor is not None
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            if event == zmq.EVENT_CONNECTED:
                self._up = True
            elif event == zmq.EVENT_DISCONNECTED:
                self._up = False
            elif event == zmq.EVENT_CONNECT_RETRIED and not self._up:
                self._retried += 1
        return self._retried >= _REFUSALS

    def request(self, body: Message, timeout: float | None = None) -> Message:
        """Send ``body``; return the reply, raise ``ControlError`` if refused, or time out."""
        return self.send(body, timeout).reply()

    def send(self, body: Message, timeout: float | None = None) -> PendingReply:
        """Send ``body`` now; its ``PendingReply.reply()`` waits for the answer (within
        ``timeout`` from now), so the caller can work while the peer does. The client serves
        nothing else until ``reply()`` or ``PendingReply.cancel()`` is called: call one of them
        (the first call of a client, or one that must authenticate, waits for that here)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        self._lock.acquire()
        try:
            fresh = not self._authenticated
            if fresh:
                self._authenticate(deadline)
            seq = self._send(body)
        except BaseException as err:
            self._end_call(err)
            raise
        return PendingReply(self, body, seq, deadline, fresh)

    def _finish(self, call: PendingReply) -> Message:
        """``call``'s reply (the client's lock is held since ``send``; released here)."""
        try:
            try:
                reply = self._receive(call.body, call.seq, call.deadline)
            except ControlError as err:
                if call.fresh or err.code != "unauthenticated":
                    raise
                # The endpoint no longer knows our session although we authenticated: the
                # engine restarted at this address and zmq reconnected underneath us, or it
                # dropped the session from a full table. It refused before handling the
                # request, so authenticating again and sending it once more is safe.
                log.info("side channel: %s lost our session; authenticating again", self.address)
                self._authenticated = False
                self._authenticate(call.deadline)
                reply = self._call(call.body, call.deadline)
        except BaseException as err:
            self._end_call(err)
            raise
        self._end_call(None)
        return reply

    def _end_call(self, err: BaseException | None) -> None:
        """A call ended (``err``: how it failed): reset the connection where the failure
        leaves it in doubt, note the time, free the client for the next call."""
        try:
            if isinstance(err, (PeerTimeoutError, PeerRefusedError, ControlError, zmq.ZMQError)):
                self._reset()
        finally:
            self._last_used = time.monotonic()
            self._lock.release()

    def _authenticate(self, deadline: float) -> None:
        nonce = auth.new_nonce()
        challenge = self._call(Hello(self.engine_id, nonce), deadline)
        if not isinstance(challenge, Challenge):
            raise ControlError("protocol", f"expected a challenge from {self.address}")
        expected = auth.server_proof(self._secret, nonce, challenge.nonce)
        if not auth.verify(expected, challenge.proof):
            if self._secret and not challenge.proof:
                why = "it has no shared secret set, this side has one: set one on both sides"
            elif not self._secret:
                why = "it requires a shared secret, none is set here"
            else:
                why = "wrong shared secret: the two sides' secrets differ"
            # Tell the server, so that its log shows the failure too; no proof of ours goes out
            # to an engine that did not prove itself. Best effort, within a short bound.
            with contextlib.suppress(Exception):
                left = min(0.5, max(0.0, deadline - time.monotonic()))
                self._call(
                    AuthRefused("the server's proof did not verify"), time.monotonic() + left
                )
            raise ControlError(
                "auth_failed", f"the engine at {self.address} failed authentication ({why})"
            )
        self._call(Auth(auth.client_proof(self._secret, nonce, challenge.nonce)), deadline)
        self.remote_engine_id = challenge.engine_id
        self._authenticated = True

    def _call(self, body: Message, deadline: float) -> Message:
        return self._receive(body, self._send(body), deadline)

    def _send(self, body: Message) -> int:
        """Send ``body`` under a new sequence number, which its reply carries back."""
        fresh = self._socket is None
        sock = self._connect()
        if not fresh:
            # Events from an earlier call (retries while a restarting peer was down) say
            # nothing about this one: only refusals after the send mean nothing listens now.
            self._refused()
        self._retried = 0
        self._seq += 1
        sock.send(encode(self._seq, body))
        return self._seq

    def _receive(self, body: Message, seq: int, deadline: float) -> Message:
        """The reply to the message sent as ``seq`` (``body``), within ``deadline``."""
        sock = self._socket
        assert sock is not None
        while True:
            remaining = deadline - time.monotonic()
            ready = dict(self._poller.poll(int(remaining * 1000) + 1)) if remaining > 0 else {}
            if self._monitor in ready and self._refused():
                raise PeerRefusedError(
                    f"the engine at {self.address} refused the connection for "
                    f"{type(body).__name__} (nothing listens there: engine dead or not started)"
                )
            if sock not in ready:
                if time.monotonic() < deadline:
                    continue  # only socket events so far
                raise PeerTimeoutError(
                    f"the engine at {self.address} did not answer {type(body).__name__} in time "
                    "(dead, frozen or unreachable)"
                )
            try:
                envelope = decode(sock.recv())
            except MessageError as err:
                raise ControlError(err.code, f"bad reply from {self.address}: {err}") from None
            if envelope.seq != seq:
                continue  # a late reply to an earlier call that timed out or was cancelled
            reply = envelope.body
            if isinstance(reply, ErrorReply):
                raise ControlError(reply.code, f"{self.address} refused: {reply.message}")
            return reply


class PendingReply:
    """A message ``PeerClient.send`` sent: ``reply()`` waits for its answer, ``cancel()`` gives
    it up. Either ends the call (once) and frees the client for the next one."""

    def __init__(
        self, client: PeerClient, body: Message, seq: int, deadline: float, fresh: bool
    ) -> None:
        self.client = client
        self.body = body
        self.seq = seq
        self.deadline = deadline
        self.fresh = fresh  # the client authenticated for this call
        self._ended = False

    def reply(self) -> Message:
        """The reply; ``ControlError`` if refused, ``PeerTimeoutError`` past the deadline."""
        self._end()
        return self.client._finish(self)

    def cancel(self) -> None:
        """Give the reply up: a late one is dropped by the client's next call (its sequence
        number differs), so the connection stays; the peer may still act on the message."""
        self._end()
        self.client._end_call(None)

    def _end(self) -> None:
        if self._ended:
            raise RuntimeError("this call has ended already (reply or cancel, once)")
        self._ended = True


def _peer_address(frame: zmq.Frame) -> str:
    """The sender's IP address, as zmq saw the TCP connection ("" when it cannot say)."""
    try:
        return str(frame.get("Peer-Address"))
    except (zmq.ZMQError, AttributeError, TypeError):
        return ""


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
