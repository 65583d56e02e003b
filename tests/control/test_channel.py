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
