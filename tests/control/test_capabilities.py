"""Per-request capability tokens, unclaimed holds and refusal logs, against real engine processes.

An adversary here holds the shared secret (it is any instance of the deployment) and knows a
request id, but not the request's token: P must serve it nothing, keep the request for its
bearer, and log each kind of refusal once, with the peer's engine id and address.
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest

from kvbridge.control import auth
from kvbridge.control.messages import (
    Abort,
    Auth,
    Challenge,
    DigestRequest,
    ErrorReply,
    Hello,
    Ok,
    PullStart,
    PushQuery,
    Release,
    encode,
)
from tests.control.engine import BlockAllocator
from tests.control.test_security import SECRET, RawClient, publish, raw, wait_until

pytestmark = pytest.mark.timeout(180)
__all__ = ["raw"]  # the fixture, imported for these tests


def refusals(engine: Any, code: str, peer: str) -> list[str]:
    """The refusal lines of ``engine``'s log for ``code`` sent to engine id ``peer``."""
    assert engine.log_path is not None
    text = engine.log_path.read_text()
    return [
        line
        for line in text.splitlines()
        if "refused a message from peer" in line and f"'{peer}'" in line and f"({code})" in line
    ]


def code_of(reply: object) -> str:
    assert isinstance(reply, ErrorReply), reply
    return reply.code


def test_a_peer_with_the_secret_but_not_the_token_gets_nothing(engines, transport, raw):
    p = engines("prefill", transport, seed=201, secret=SECRET)
    d = engines("decode", transport, seed=202, secret=SECRET)
    params, p_ids = publish(p, "victim")
    other, _ = publish(p, "other", seed=2)
    assert params["token"] and other["token"] and params["token"] != other["token"]
    thief = raw(p.info["endpoint"])
    assert isinstance(thief.login(SECRET), Ok)
    ids = {int(k): v for k, v in params["block_ids"].items()}
    # No token, a guessed one, and the token of another request: each message D could send.
    for token in ("", "0" * 32, other["token"]):
        asks = [
            PullStart("victim", ids, token=token),
            Release("victim", token=token),
            Abort("victim", "stolen", token=token),
            PushQuery("victim", token=token),
        ]
        for ask in asks:
            assert code_of(thief.send(ask).body) == "token", (type(ask).__name__, token)
        # a digest needs a claim first: nothing is hashed for a peer that never claimed
        digest = DigestRequest("victim", ids, "full", token=token)
        assert code_of(thief.send(digest).body) in ("token", "unknown_request")
    for _ in range(20):  # a flood of the same refusal
        assert code_of(thief.send(PullStart("victim", ids, token="x")).body) == "token"
    # P still holds the request for its bearer, unclaimed; the bearer loads every byte.
    assert p.call(cmd="pullers") == {"victim": None, "other": None}
    d_ids = BlockAllocator(d.layout, 3).request(100)
    d.call(cmd="pull", params=params, block_ids=d_ids)
    outcome = d.call(cmd="wait", request_id="victim")
    assert outcome["ok"], outcome
    assert d.call(cmd="verify", sources=[{"config": p.config, "pairs": [[p_ids, d_ids]]}])["ok"]
    # Logged on P once per kind of refusal from that peer, with its address; the flood too.
    lines = refusals(p, "token", "raw-client")
    assert len(lines) == 1, lines
    assert "at 127.0.0.1" in lines[0] and "capability token" in lines[0]
    assert params["token"] not in p.log_path.read_text()  # a credential is never logged


def test_a_replayed_login_or_claim_is_refused(engines, raw):
    p = engines("prefill", "cma", seed=211, secret=SECRET)
    d = engines("decode", "cma", seed=212, secret=SECRET)
    params, _ = publish(p, "once")
    # Record an honest login, then replay its proof on a new connection: the server's fresh
    # nonce makes the recorded proof worthless.
    honest = raw(p.info["endpoint"])
    nonce = auth.new_nonce()
    challenge = honest.send(Hello("honest", nonce)).body
    assert isinstance(challenge, Challenge)
    recorded = encode(2, Auth(auth.client_proof(SECRET.encode(), nonce, challenge.nonce)))
    assert isinstance(honest.send_raw(recorded).body, Ok)
    replayer = raw(p.info["endpoint"])
    assert isinstance(replayer.send(Hello("honest", nonce)).body, Challenge)
    assert code_of(replayer.send_raw(recorded).body) == "auth_failed"
    assert code_of(replayer.send(Release("once", token=params["token"])).body) == (
        "unauthenticated"
    )
    # The bearer loads it; a replay of its claim afterwards finds nothing to take, and is told
    # so at once (P remembers the ended hold for the bearer of its token), not to wait for P
    # to publish it; without the token the id is unknown, as one never published.
    d.call(cmd="pull", params=params, block_ids=BlockAllocator(d.layout, 3).request(100))
    assert d.call(cmd="wait", request_id="once")["ok"]
    assert wait_until(lambda: p.call(cmd="leased") == [])
    ids = {int(k): v for k, v in params["block_ids"].items()}
    claim = PullStart("once", ids, token=params["token"])
    reply = honest.send(claim).body
    assert code_of(reply) == "hold_ended" and "released by decode" in reply.message, reply
    guess = PullStart("once", ids, token="x" * len(params["token"]))
    assert code_of(honest.send(guess).body) == "unknown_request"
    # A late release by the bearer (D's, after P's lease ran out) has nothing left to free:
    # answered Ok and logged as no refusal; without the token it is unknown, as above.
    late = raw(p.info["endpoint"])  # a peer with no refusal logged yet
    assert isinstance(late.login(SECRET), Ok)
    assert isinstance(late.send(Release("once", token=params["token"])).body, Ok)
    assert refusals(p, "unknown_request", "raw-client") == []
    guessed = Release("once", token="x" * len(params["token"]))
    assert code_of(late.send(guessed).body) == "unknown_request"
    assert len(refusals(p, "unknown_request", "raw-client")) == 1


def test_an_abort_before_publish_withdraws_only_with_the_token(engines, raw):
    p = engines("prefill", "cma", seed=221, secret=SECRET)
    d = engines("decode", "cma", seed=222, secret=SECRET)
    vandal = raw(p.info["endpoint"])
    assert isinstance(vandal.login(SECRET), Ok)
    # Aborts of a request P has not published yet: one without a token, one with a guess.
    for token in ("", "guess"):
        assert isinstance(vandal.send(Abort("early", "vandal", token=token)).body, Ok)
    ids = BlockAllocator(p.layout, 1).request(100)
    token = auth.new_token()
    # The bearer's own abort, of another request, does withdraw that one.
    assert isinstance(vandal.send(Abort("given-up", "bearer", token=token)).body, Ok)
    params = p.call(cmd="publish", request_id="early", block_ids=ids, num_tokens=100, token=token)
    assert params["token"] == token and p.call(cmd="leased") == ["early"]  # not withdrawn
    d.call(cmd="pull", params=params, block_ids=BlockAllocator(d.layout, 3).request(100))
    assert d.call(cmd="wait", request_id="early")["ok"]
    gone = p.call(cmd="publish", request_id="given-up", block_ids=ids, num_tokens=100, token=token)
    assert gone["request_id"] == "given-up" and "given-up" not in p.call(cmd="leased")


def test_a_flood_of_unclaimed_prefills_is_freed_at_the_claim_timeout(engines):
    """Nobody claims 200 published requests: P frees each at the claim timeout, well before the
    lease, says so, and serves a real request normally meanwhile."""
    claim, lease = 1.0, 60.0
    p = engines("prefill", "cma", seed=231, claim_timeout=claim, lease=lease, num_blocks=1024)
    d = engines("decode", "cma", seed=232, num_blocks=1024)
    alloc = BlockAllocator(p.layout, 7)
    flood = [f"flood-{i}" for i in range(200)]
    for rid in flood:
        p.call(cmd="publish", request_id=rid, block_ids=alloc.request(16), num_tokens=16)
    started = time.monotonic()
    params, p_ids = publish(p, "normal", seed=9)
    d_ids = BlockAllocator(d.layout, 3).request(100)
    d.call(cmd="pull", params=params, block_ids=d_ids)
    assert d.call(cmd="wait", request_id="normal")["ok"]
    assert d.call(cmd="verify", sources=[{"config": p.config, "pairs": [[p_ids, d_ids]]}])["ok"]
    freed: dict[str, Any] = {}
    while len(freed) < len(flood) + 1 and time.monotonic() - started < lease / 2:
        for outcome in p.call(cmd="finished"):
            freed[outcome["request_id"]] = outcome
        time.sleep(0.05)
    assert set(freed) == {*flood, "normal"}  # all ended long before the lease would
    assert p.call(cmd="leased") == []
    for rid in flood:
        assert not freed[rid]["ok"]
        assert re.search(rf"no decode claimed it within {claim:g} s", freed[rid]["reason"])
    assert freed["normal"]["ok"], freed["normal"]


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_claim_after_the_claim_timeout_is_refused_at_once_with_the_reason(engines, mode):
    """D queued the request past P's claim timeout (decode saturated): P freed the blocks. D's
    late claim is told why at once, so D computes the prompt now, neither reading released
    blocks nor waiting for a publish (pull) or a write (push) that never comes; a later request
    still moves every byte."""
    claim = 1.0
    p = engines("prefill", "cma", seed=251, claim_timeout=claim, lease=60.0)
    d = engines("decode", "cma", seed=252)
    alloc, d_alloc = BlockAllocator(p.layout, 5), BlockAllocator(d.layout, 6)
    late_ids = alloc.request(100)
    late = p.call(cmd="publish", request_id="late", block_ids=late_ids, num_tokens=100, mode=mode)
    assert wait_until(lambda: p.call(cmd="leased") == [], timeout=10 * claim)
    d.call(cmd=mode, params=late, block_ids=d_alloc.request(100))
    outcome = d.call(cmd="wait", request_id="late")
    assert not outcome["ok"]
    # P's word, not D's own bound: "not held ... (waited 8 s)" or a push settled at the deadline
    assert f"no decode claimed it within {claim:g} s of publishing" in outcome["reason"], outcome
    assert "hold_expired" in outcome["reason"] or "no longer holds" in outcome["reason"], outcome
    p_ids = alloc.request(100)
    params = p.call(cmd="publish", request_id="next", block_ids=p_ids, num_tokens=100, mode=mode)
    d_ids = d_alloc.request(100)
    d.call(cmd=mode, params=params, block_ids=d_ids)
    assert d.call(cmd="wait", request_id="next")["ok"]
    assert d.call(cmd="verify", sources=[{"config": p.config, "pairs": [[p_ids, d_ids]]}])["ok"]


def test_failed_authentication_is_logged_on_both_sides(engines):
    p = engines("prefill", "cma", seed=241, secret=SECRET)
    d = engines("decode", "cma", seed=242, secret="not the secret", handshake_timeout=2)
    params, _ = publish(p, "guarded")
    d.call(cmd="pull", params=params, block_ids=BlockAllocator(d.layout, 2).request(100))
    outcome = d.call(cmd="wait", request_id="guarded")
    assert not outcome["ok"] and "authentication" in outcome["reason"]
    # D found P's proof wrong and said so: P's log names D's engine id and address too.
    assert wait_until(lambda: refusals(p, "auth_failed", d.info["engine_id"]))
    line = refusals(p, "auth_failed", d.info["engine_id"])[0]
    assert "at 127.0.0.1" in line and "secret" in line
    assert SECRET not in p.log_path.read_text() and SECRET not in d.log_path.read_text()


def test_the_raw_client_is_the_one_of_the_security_tests() -> None:
    # The adversary above is the hand-driven DEALER of test_security, not a kvbridge client.
    assert RawClient.__module__ == "tests.control.test_security"
