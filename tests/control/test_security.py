"""Authentication, strict decoding and bounds checks on a real prefill engine process."""

from __future__ import annotations

import contextlib
import time

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge.control import auth
from kvbridge.control.messages import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    Auth,
    Challenge,
    ErrorReply,
    Handshake,
    Hello,
    Ok,
    PullStart,
    Release,
    decode,
    encode,
)
from tests.control.engine import BlockAllocator

pytestmark = pytest.mark.timeout(180)
SECRET = "correct horse battery staple"


class RawClient:
    """A hand-driven DEALER: sends whatever it is given, returns the decoded reply."""

    def __init__(self, endpoint: str) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)

    def send_raw(self, payload: bytes, timeout: float = 5.0):
        self.socket.send(payload)
        assert self.socket.poll(int(timeout * 1000)), "the endpoint did not answer"
        return decode(self.socket.recv())

    def send(self, body, seq: int = 1):
        return self.send_raw(encode(seq, body))

    def login(self, secret: str) -> object:
        nonce = auth.new_nonce()
        challenge = self.send(Hello("raw-client", nonce)).body
        assert isinstance(challenge, Challenge)
        proof = auth.client_proof(secret.encode(), nonce, challenge.nonce)
        return self.send(Auth(proof)).body

    def close(self) -> None:
        self.socket.close()
        self.context.term()


@pytest.fixture
def raw():
    clients = []

    def make(endpoint: str) -> RawClient:
        clients.append(RawClient(endpoint))
        return clients[-1]

    yield make
    for client in clients:
        client.close()


def wait_until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def publish(p, rid, seed=1, tokens=100):
    ids = BlockAllocator(p.layout, seed).request(tokens)
    return p.call(cmd="publish", request_id=rid, block_ids=ids, num_tokens=tokens), ids


def test_wrong_secret_is_refused_and_gets_nothing(engines, transport, raw):
    p = engines("prefill", transport, seed=81, secret=SECRET)
    d = engines("decode", transport, seed=82, secret="not the secret", handshake_timeout=2)
    params, _ = publish(p, "guarded")
    d.call(cmd="pull", params=params, block_ids=BlockAllocator(d.layout, 2).request(100))
    outcome = d.call(cmd="wait", request_id="guarded")
    assert not outcome["ok"] and "authentication" in outcome["reason"]
    assert not outcome["stats"]["incompatible"]  # a refused peer, not a pair that cannot be
    assert p.call(cmd="pullers") == {"guarded": None}  # P served nothing for the request

    client = raw(params["endpoint"])
    reply = client.login("not the secret")
    assert isinstance(reply, ErrorReply) and reply.code == "auth_failed"
    handshake = Handshake("raw-client", p.layout.spec, transport, b"x")
    reply = client.send(handshake).body
    assert isinstance(reply, ErrorReply) and reply.code == "unauthenticated"  # no layout
    # the right secret opens the same endpoint
    assert isinstance(raw(params["endpoint"]).login(SECRET), Ok)


def test_secret_is_never_sent_in_clear(raw, engines, transport):
    p = engines("prefill", transport, seed=83, secret=SECRET)
    client = raw(p.info["endpoint"])
    nonce = auth.new_nonce()
    client.socket.send(encode(1, Hello("raw", nonce)))
    assert client.socket.poll(5000)
    wire = client.socket.recv()
    challenge = decode(wire).body
    assert SECRET.encode() not in wire
    # the server proved it knows the secret without revealing it
    assert challenge.proof == auth.server_proof(SECRET.encode(), nonce, challenge.nonce)


messages = st.one_of(
    st.binary(max_size=512),
    st.builds(
        msgspec.msgpack.encode,
        st.recursive(
            st.none()
            | st.booleans()
            | st.integers(-(2**63), 2**63 - 1)
            | st.text(max_size=20)
            | st.binary(max_size=20),
            lambda inner: (
                st.lists(inner, max_size=4)
                | st.dictionaries(st.text(max_size=10), inner, max_size=4)
            ),
            max_leaves=12,
        ),
    ),
    st.builds(
        lambda body, version, seq: msgspec.msgpack.encode(
            {"version": version, "seq": seq, "body": body}
        ),
        st.dictionaries(
            st.sampled_from(
                [
                    "type",
                    "request_id",
                    "block_ids",
                    "ok",
                    "reason",
                    "engine_id",
                    "nonce",
                    "proof",
                    "token",
                    "rank",
                    "tp_size",
                    "offset",
                    "length",
                    "action",
                ]
            ),
            st.one_of(
                st.sampled_from(
                    [
                        "pull_start",
                        "release",
                        "abort",
                        "push_request",
                        "handshake",
                        "hello",
                        "auth",
                        "auth_refused",
                        "push_query",
                        "digest_request",
                        "probe",
                        "probe_connect",
                        "describe",
                    ]
                ),
                st.integers(-(2**63), 2**64 - 1),
                st.text(max_size=30),
                st.binary(max_size=40),
                st.dictionaries(
                    st.integers(-5, 5), st.lists(st.integers(-5, 2**41), max_size=3), max_size=3
                ),
            ),
            max_size=5,
        ),
        st.sampled_from([PROTOCOL_VERSION] * 3 + [0, PROTOCOL_VERSION - 1]),
        st.integers(0, 2**62),
    ),
)


def test_malformed_and_fuzzed_messages_are_rejected_and_the_endpoint_keeps_serving(
    engines, transport, raw
):
    p = engines("prefill", transport, seed=91, secret=SECRET)
    d = engines("decode", transport, seed=92, secret=SECRET)
    params, _ = publish(p, "after-fuzz")
    anonymous = raw(p.info["endpoint"])
    trusted = raw(p.info["endpoint"])
    assert isinstance(trusted.login(SECRET), Ok)
    codes: set[str] = set()

    @settings(
        max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True
    )
    @given(payload=messages)
    def fuzz(payload: bytes) -> None:
        for client in (anonymous, trusted):
            reply = client.send_raw(payload).body
            assert isinstance(reply, ErrorReply | Ok | Challenge), reply
            if isinstance(reply, ErrorReply):
                assert reply.code != "internal", reply  # a handler crashed
                codes.add(reply.code)

    fuzz()
    assert {"malformed", "invalid"} <= codes
    reply = trusted.send_raw(b"\x00" * (MAX_MESSAGE_BYTES + 1)).body
    assert isinstance(reply, ErrorReply) and reply.code == "too_large"
    # the endpoint still serves the next valid request, end to end
    d.call(cmd="pull", params=params, block_ids=BlockAllocator(d.layout, 3).request(100))
    outcome = d.call(cmd="wait", request_id="after-fuzz")
    assert outcome["ok"], outcome


def test_block_ids_outside_the_request_allocation_are_refused(engines, transport, raw):
    p = engines("prefill", transport, seed=101)
    d = engines("decode", transport, seed=102)
    params, ids = publish(p, "mine")
    theirs, other_ids = publish(p, "theirs", seed=2)
    # D asks for attention blocks of another request: P refuses, D's load fails, P frees "mine"
    stolen = {**params, "block_ids": {**{str(k): v for k, v in ids.items()}, "0": other_ids[0]}}
    d.call(cmd="pull", params=stolen, block_ids=BlockAllocator(d.layout, 3).request(100))
    outcome = d.call(cmd="wait", request_id="mine")
    assert not outcome["ok"] and "does not own block" in outcome["reason"]

    assert wait_until(lambda: "mine" not in p.call(cmd="leased"))

    client = raw(p.info["endpoint"])
    assert isinstance(client.login(""), Ok)
    reply = client.send(PullStart("theirs", {0: [10**9]}, token=theirs["token"])).body
    assert isinstance(reply, ErrorReply) and reply.code == "block_id"
    reply = client.send(PullStart("nobody", {0: [1]})).body
    assert isinstance(reply, ErrorReply) and reply.code == "unknown_request"
    reply = client.send(Release("nobody")).body
    assert isinstance(reply, ErrorReply) and reply.code == "unknown_request"
    # out-of-range ids are refused where they enter: P's publish and D's load
    too_big = {"0": [p.config["num_blocks"]]}
    assert (
        "outside" in p.call(cmd="publish", request_id="x", block_ids=too_big, num_tokens=1)["error"]
    )
    assert "outside" in d.call(cmd="pull", params=params, block_ids=too_big)["error"]
    # the same request id twice is refused on both sides
    assert (
        "already published"
        in p.call(cmd="publish", request_id="theirs", block_ids={"0": []}, num_tokens=0)["error"]
    )


def test_incompatible_layouts_fail_the_handshake_with_the_field(engines, transport):
    p = engines("prefill", transport, seed=111)
    d = engines("decode", transport, seed=112, layers=4)  # a different model
    params, _ = publish(p, "mismatch")
    with contextlib.suppress(Exception):
        d.call(cmd="pull", params=params, block_ids=BlockAllocator(d.layout, 3).request(100))
    outcome = d.call(cmd="wait", request_id="mismatch")
    assert not outcome["ok"]
    assert "layouts are incompatible" in outcome["reason"]
    assert "only on" in outcome["reason"]  # names the layers that differ
    # by role: "this engine" in D's log meant P
    assert "only on prefill" in outcome["reason"] or "only on decode" in outcome["reason"]
    assert "this engine" not in outcome["reason"]
    # counted apart from a busy or gone peer (vllm:kvbridge_incompatible_loads_total)
    assert outcome["stats"]["incompatible"], outcome["stats"]
