"""The side channel's deferred replies: a handler with long work (P hashing a large request for
D's integrity check) answers later, and the endpoint serves every other request meanwhile."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from kvbridge.control.channel import Endpoint, PeerClient
from kvbridge.control.messages import Digest, DigestRequest, Message, Ok, Ping
from kvbridge.core.errors import ControlError, MessageError
from tests.control.test_faults import wait_for

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def endpoint():
    held: dict[str, Future[Message]] = {}

    def handler(peer: str, body: Message) -> Message | Future[Message]:
        if isinstance(body, DigestRequest):  # answered when the test completes the future
            held[body.request_id] = Future()
            return held[body.request_id]
        return Ok()

    server = Endpoint("server", handler)
    clients: list[PeerClient] = []

    def client(name: str) -> PeerClient:
        clients.append(PeerClient(server.address, name, timeout=20))
        return clients[-1]

    yield held, client
    for c in clients:
        c.close()
    server.close()


@pytest.fixture
def asker():
    """Sends a request from another thread; its reply (or error) is the returned future's."""
    with ThreadPoolExecutor(2) as pool:
        yield lambda client, body: pool.submit(client.request, body)


def test_deferred_reply_arrives_later_and_others_are_served_meanwhile(endpoint, asker):
    held, client = endpoint
    asked = asker(client("decode-1"), DigestRequest("big", {0: [1]}, "full"))
    wait_for(lambda: "big" in held, 20)
    # The digest is still being computed: another peer's requests are answered now.
    other = client("decode-2")
    assert isinstance(other.request(Ping()), Ok)
    assert isinstance(other.request(Ping()), Ok)
    assert not held["big"].done() and not asked.done()
    held["big"].set_result(Digest(1234))
    assert asked.result(20) == Digest(1234)


def test_deferred_refusal_reaches_the_client_as_its_error(endpoint, asker):
    held, client = endpoint
    asked = asker(client("decode-1"), DigestRequest("gone", {0: [1]}, "full"))
    wait_for(lambda: "gone" in held, 20)
    held["gone"].set_exception(MessageError("invalid", "cannot digest 'gone'"))
    err = asked.exception(20)
    assert isinstance(err, ControlError) and err.code == "invalid", err
    # The endpoint keeps serving after a refused deferred request.
    assert isinstance(client("decode-2").request(Ping()), Ok)


def test_a_sent_message_is_answered_while_the_caller_works_and_frees_the_client(endpoint):
    """``send`` returns at once; the answer is read later (D plans while P claims), and the
    client serves its next call only then."""
    held, client = endpoint
    c = client("decode-1")
    call = c.send(DigestRequest("work", {0: [1]}, "full"), 20)
    wait_for(lambda: "work" in held, 20)  # the peer has it while the caller goes on
    with ThreadPoolExecutor(1) as pool:
        taken = pool.submit(c.request, Ping())
        with pytest.raises(TimeoutError):
            taken.result(0.3)  # the client is taken until the reply is read
        held["work"].set_result(Digest(7))
        assert call.reply() == Digest(7)
        assert isinstance(taken.result(20), Ok)
    with pytest.raises(RuntimeError, match="ended already"):
        call.reply()


def test_a_cancelled_call_frees_the_client_and_its_late_reply_is_dropped(endpoint):
    held, client = endpoint
    c = client("decode-1")
    call = c.send(DigestRequest("late", {0: [1]}, "full"), 20)
    wait_for(lambda: "late" in held, 20)
    call.cancel()
    with pytest.raises(RuntimeError, match="ended already"):
        call.cancel()
    held["late"].set_result(Digest(1))  # arrives after the cancel: not the next call's answer
    assert isinstance(c.request(Ping()), Ok)
    assert isinstance(c.request(Ping()), Ok)
    assert c.connected  # a cancel keeps the connection


def test_a_refused_sent_message_raises_at_its_reply_and_frees_the_client(endpoint):
    held, client = endpoint
    c = client("decode-1")
    call = c.send(DigestRequest("bad", {0: [1]}, "full"), 20)
    wait_for(lambda: "bad" in held, 20)
    held["bad"].set_exception(MessageError("invalid", "cannot digest 'bad'"))
    with pytest.raises(ControlError) as err:
        call.reply()
    assert err.value.code == "invalid"
    assert isinstance(c.request(Ping()), Ok)


@pytest.fixture
def restartable():
    """An endpoint that can be restarted at its address, as a killed engine comes back."""
    servers: list[Endpoint] = []

    def start(name: str, secret: bytes, port: int = 0) -> Endpoint:
        servers.append(Endpoint(name, lambda peer, body: Ok(), port=port, secret=secret))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


SECRET = b"s" * 32


@pytest.mark.parametrize("secret", [SECRET, b"x" * 32], ids=["same secret", "another secret"])
def test_an_engine_restarted_at_its_address_is_authenticated_again(restartable, secret):
    """zmq reconnects the client's socket to the new engine, which has no session for it: the
    client runs the challenge-response again (and trusts the engine only if it passes)."""
    first = restartable("prefill-1", SECRET)
    client = PeerClient(first.address, "decode", secret=SECRET, timeout=20)
    try:
        assert isinstance(client.request(Ping()), Ok) and client.remote_engine_id == "prefill-1"
        first.close()
        restartable("prefill-1-restarted", secret, port=first.port)
        if secret == SECRET:
            assert isinstance(client.request(Ping()), Ok)
            assert client.remote_engine_id == "prefill-1-restarted"
        else:
            with pytest.raises(ControlError) as refused:
                client.request(Ping())
            assert refused.value.code == "auth_failed", refused.value
    finally:
        client.close()


def test_a_client_authenticates_again_when_the_endpoint_dropped_its_session(restartable):
    server = restartable("prefill", SECRET)
    client = PeerClient(server.address, "decode", secret=SECRET, timeout=20)
    try:
        assert isinstance(client.request(Ping()), Ok)
        server._sessions.clear()  # what a full session table does to its oldest entry
        assert isinstance(client.request(Ping()), Ok)
    finally:
        client.close()
