"""The side channel's deferred replies: a handler with long work (P hashing a large request for
D's integrity check) answers later, and the endpoint serves every other request meanwhile."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from kvbridge.control.channel import Endpoint, PeerClient
from kvbridge.control.messages import Digest, DigestRequest, Message, Ok, Ping
from kvbridge.core.errors import ControlError, MessageError

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


def _ask_in_thread(client: PeerClient, body: Message) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["reply"] = client.request(body)
        except Exception as err:
            out["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def _wait_until(condition, seconds: float = 20.0) -> None:
    event = threading.Event()
    for _ in range(int(seconds / 0.01)):
        if condition():
            return
        event.wait(0.01)
    raise AssertionError("condition not met in time")


def test_deferred_reply_arrives_later_and_others_are_served_meanwhile(endpoint):
    held, client = endpoint
    thread, out = _ask_in_thread(client("decode-1"), DigestRequest("big", {0: [1]}, "full"))
    _wait_until(lambda: "big" in held)
    # The digest is still being computed: another peer's requests are answered now.
    other = client("decode-2")
    assert isinstance(other.request(Ping()), Ok)
    assert isinstance(other.request(Ping()), Ok)
    assert not held["big"].done() and thread.is_alive()
    held["big"].set_result(Digest(1234))
    thread.join(20)
    assert out.get("reply") == Digest(1234), out


def test_deferred_refusal_reaches_the_client_as_its_error(endpoint):
    held, client = endpoint
    thread, out = _ask_in_thread(client("decode-1"), DigestRequest("gone", {0: [1]}, "full"))
    _wait_until(lambda: "gone" in held)
    held["gone"].set_exception(MessageError("invalid", "cannot digest 'gone'"))
    thread.join(20)
    err = out.get("error")
    assert isinstance(err, ControlError) and err.code == "invalid", out
    # The endpoint keeps serving after a refused deferred request.
    assert isinstance(client("decode-2").request(Ping()), Ok)
