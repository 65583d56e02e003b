"""The scale benchmark scaled down (``kvbridge.bench.scale``): one rank among 32, in real
processes over a real transport. What must not grow with the fleet is asserted, never a time:

* every peer's bytes land exactly (D checks each byte of one request per peer);
* what the hub holds per connected peer is bounded: no thread per peer where it serves reads
  (P), at most the one lane thread per peer it reads from now (D); a few descriptors and at
  most two sockets per peer (its side-channel connection and the peer's to it);
* after half the peers leave, the hub gives back what it held for them once it has been quiet:
  its side-channel connections are closed, the lanes' threads end, and what it holds returns to
  its start plus the remaining peers' connections to it.
"""

from __future__ import annotations

import time

import pytest

from kvbridge.bench.scale import Point, ScaleSpec, run_point

PEERS = 32
#: the hub's worker pools at rest (requests, asks, fences: 4 each) and the zmq contexts' threads
POOLS = 12 + 4


def _common(point: Point) -> None:
    assert point.failed == []
    assert point.checked > 0 and point.wrong_bytes == 0
    assert point.per_peer("sockets") <= 2.5, point.hub_connected
    assert point.per_peer("fds") <= 7, point.hub_connected
    rest, start = point.hub_after_leave, point.hub_start
    assert rest["side_channels"] == 0, rest
    assert rest["threads"] <= start["threads"] + POOLS, rest
    # What is left: the remaining peers' own side channels to the hub (theirs stay open: the
    # peers were not quiet for long), and the zmq contexts' descriptors.
    remaining = point.peers - point.left
    assert rest["fds"] <= start["fds"] + 2 * remaining + 16, (rest, start)


@pytest.mark.timeout(240)
def test_one_prefill_rank_serving_32_decode_ranks() -> None:
    point = run_point(ScaleSpec(per_process=16), "fan-out", PEERS, in_flight=[PEERS], rounds=1,
                      min_requests=PEERS)  # fmt: skip
    assert point.checked == PEERS
    _common(point)
    # P serves reads: no thread per D rank (its pools and the greeting of each D only).
    assert point.hub_connected["threads"] <= point.hub_start["threads"] + POOLS


@pytest.mark.timeout(240)
def test_one_decode_rank_loading_from_32_prefill_ranks_of_tp8() -> None:
    point = run_point(ScaleSpec(per_process=16), "fan-in", PEERS, tp=8, in_flight=[8], rounds=1,
                      min_requests=8)  # fmt: skip
    assert point.checked == PEERS // 8
    _common(point)
    # D reads from every P rank: a lane thread per rank it reads from now, no more.
    assert point.hub_connected["threads"] <= point.hub_start["threads"] + PEERS + POOLS


def test_a_quiet_prefill_is_released_and_met_again_at_the_next_request() -> None:
    """D releases the side channel and the transport connection to a P rank it has not asked
    for ``Deadlines.quiet``; its next request from that P handshakes again and moves every byte.
    Planes in one process over real side channels and ``cma``."""
    from kvbridge.bench.scale import _Host
    from kvbridge.control import auth

    spec = ScaleSpec()
    p, d = _Host(spec), _Host(spec)
    try:
        endpoint = p.start("p", [(0, 0, 1)])[0]["endpoint"]
        d.start("d", [(0, 0, 1)])
        plane = d.planes[0].plane

        def pull(rid: str) -> dict:
            params = p.publish([(rid, auth.new_token(), 0)])[0][0]
            return d.pull([(0, params)], check=True)

        first = pull("r1")
        assert first["failed"] == [] and first["wrong_bytes"] == 0
        assert (
            plane._handshakes.open_connections == 1 and plane._handshakes.at(endpoint) is not None
        )
        d.set_quiet(0.3)
        # The side channel and the transport are released by separate sweeps when their last
        # uses differ (D tells P its release after the load's outcome): wait for both.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (
            plane._handshakes.at(endpoint) is not None or plane._handshakes.open_connections
        ):
            time.sleep(0.05)
        assert plane._handshakes.at(endpoint) is None, "the quiet P was not released"
        assert plane._handshakes.open_connections == 0, "its side channel stayed open"
        d.set_quiet(600)
        again = pull("r2")
        assert again["failed"] == [] and again["wrong_bytes"] == 0
        assert plane._handshakes.at(endpoint) is not None  # met again by a handshake
    finally:
        p.close()
        d.close()


@pytest.mark.timeout(60)
def test_send_first_tells_every_endpoint_before_any_answer_is_read() -> None:
    """``Handshakes.send_first`` (D's pull claims and its releases to a request's P ranks): each
    endpoint gets its first message at once, while no answer has come; a second one for the
    same endpoint is left to the caller (a client carries one call at a time); a client that
    cannot be had (the plane is closing) is an error in its place, not a raise."""
    from concurrent.futures import Future

    from kvbridge.bench.scale import _Host
    from kvbridge.control.channel import Endpoint
    from kvbridge.control.messages import Digest, DigestRequest, Message
    from kvbridge.core.errors import ControlError
    from tests.control.test_faults import wait_for

    held: dict[str, Future[Message]] = {}

    def handler(peer: str, body: Message) -> Message | Future[Message]:
        assert isinstance(body, DigestRequest)
        held[body.request_id] = Future()
        return held[body.request_id]

    a, b = Endpoint("p-a", handler), Endpoint("p-b", handler)
    d = _Host(ScaleSpec())
    try:
        d.start("d", [(0, 0, 1)])
        peers = d.planes[0].plane._handshakes
        asks = [(a.address, "a1"), (a.address, "a2"), (b.address, "b1")]
        sent = peers.send_first([(e, DigestRequest(r, {0: [1]}, "full")) for e, r in asks], 20)
        assert sent[1] is None, "a second call went to an endpoint with one in flight"
        wait_for(lambda: set(held) == {"a1", "b1"}, 20)  # both arrived, no answer read yet
        for rid, future in held.items():
            future.set_result(Digest(len(rid)))
        first_a, first_b = sent[0], sent[2]
        assert not isinstance(first_a, Exception) and first_a is not None
        assert not isinstance(first_b, Exception) and first_b is not None
        assert (first_a.reply(), first_b.reply()) == (Digest(2), Digest(2))
        peers.close()
        (refused,) = peers.send_first([(a.address, DigestRequest("a3", {0: [1]}, "full"))], 20)
        assert isinstance(refused, ControlError) and refused.code == "closed", refused
    finally:
        d.close()
        a.close()
        b.close()


@pytest.mark.timeout(60)
def test_closing_while_early_handshakes_wait_for_absent_prefills() -> None:
    """A D closing while its early handshakes still wait for P ranks that are not up, or that
    accept a connection and never answer (frozen), returns: their clients share one zmq
    context, which ends at close once every client's call has (each bounded by the timeout);
    every early handshake ends with ``None``."""
    import socket

    from kvbridge.bench.scale import _Host

    frozen = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]  # never answer
    ports = [s.getsockname()[1] for s in frozen]
    for _ in range(2):  # free ports nothing listens on
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    d = _Host(ScaleSpec(timeout=2.0))
    try:
        d.start("d", [(0, 0, 1)])
        plane = d.planes[0].plane
        early = plane.connect_early([f"tcp://127.0.0.1:{p}" for p in ports], patience=30)
        time.sleep(0.5)  # the handshakes are under way or retrying
        d.close()
        assert plane.closed
        assert [f.result(timeout=30) for f in early] == [None] * len(ports)
    finally:
        for s in frozen:
            s.close()


def test_a_quiet_release_spares_a_connection_a_push_asked_for() -> None:
    """P releases its transport connection to a D rank no request looked up for
    ``Deadlines.quiet``, unless a push or layer write asked for that connection since
    (``RemoteEngine.connect_soon``): a prefill longer than ``quiet`` must not lose the
    connection between its push's ``wait_connected`` and its write. Once released, the next
    ``connect_soon`` connects again. Real planes and side channels over ``cma``."""
    from kvbridge.bench.scale import _Host

    spec = ScaleSpec()
    p, d = _Host(spec), _Host(spec)
    try:
        d_id = d.start("d", [(0, 0, 1)])[0]["engine_id"]
        d.handshake([p.start("p", [(0, 0, 1)])[0]["endpoint"]])
        peers = p.planes[0].plane._handshakes
        remote = peers.peer(d_id)  # D's push ask looks it up (``Leases``)
        assert remote is not None
        looked_up = peers._used[d_id]
        time.sleep(0.05)
        remote.connect_soon().result(timeout=30)  # the push, at publish, asks for it
        quiet_since = looked_up + 0.01  # after the last lookup, before the push's ask
        assert peers._release_transports(quiet_since) == 0
        assert remote.connected is not None and remote.connected.done()
        # With no ask since, it is released, and the next push's ask connects again.
        assert peers._release_transports(time.monotonic() + 1) == 1
        assert remote.connected is None and d_id not in peers._used
        remote.connect_soon().result(timeout=30)
    finally:
        p.close()
        d.close()
