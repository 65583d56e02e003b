"""Faults through real engine processes: each ends in a definite outcome, nothing is left held."""

from __future__ import annotations

import time

import pytest

from tests.control.conftest import FAULT_TIMINGS
from tests.control.engine import BlockAllocator

pytestmark = pytest.mark.timeout(180)

# 64 KiB pages, so a request of a few thousand tokens takes tens of milliseconds to move.
BIG = {"kv_heads": 8, "head_dim": 128, "num_blocks": 1024}


def publish(p, rid, tokens=200, mode="pull", seed=1, token=None):
    ids = BlockAllocator(p.layout, seed).request(tokens)
    return p.call(
        cmd="publish", request_id=rid, block_ids=ids, num_tokens=tokens, mode=mode, token=token
    )


def wait_for(predicate, timeout, step=0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"condition not met within {timeout} s")


def freed(p, rid):
    return next((o for o in p.call(cmd="finished") if o["request_id"] == rid), None)


def assert_nothing_left(p):
    # D's release reaches P a moment after D's outcome (it is off D's path).
    wait_for(lambda: p.call(cmd="leased") == [], 10)
    assert p.stop() == {"leased": [], "registered_after_plane_close": 0}


def test_decode_killed_mid_transfer_prefill_frees_at_lease_expiry(engines, transport):
    lease = 3.0  # at least twice the control timeout, which it must outlive
    p = engines("prefill", transport, seed=41, lease=lease, timeout=1.5, **BIG)
    d = engines("decode", transport, seed=42, **BIG)
    params = publish(p, "big", tokens=4000)
    d_ids = BlockAllocator(d.layout, 2).request(4000)
    d.call(cmd="pull", params=params, block_ids=d_ids)
    # D has told P it is reading (P records it as the puller): kill D now, mid-transfer.
    wait_for(lambda: p.call(cmd="pullers").get("big"), 10, step=0.001)
    d.kill()
    killed = time.monotonic()
    assert p.call(cmd="leased") == ["big"]  # still held: D may be alive and reading
    outcome = wait_for(lambda: freed(p, "big"), lease + 5)
    elapsed = time.monotonic() - killed
    FAULT_TIMINGS.append(
        (f"{transport}: D killed mid-transfer -> P frees at lease expiry", elapsed)
    )
    assert not outcome["ok"] and "lease of 3 s expired" in outcome["reason"]
    assert_nothing_left(p)


@pytest.mark.parametrize("known", [False, True], ids=["first-contact", "after-handshake"])
def test_prefill_killed_decode_fails_within_timeout(engines, transport, known):
    timeout = 3.0
    p = engines("prefill", transport, seed=51)
    d = engines(
        "decode", transport, seed=52, timeout=timeout, handshake_timeout=timeout, log_level="INFO"
    )
    d_alloc = BlockAllocator(d.layout, 3)
    if known:  # D has handshaken with P and loaded one request before P dies
        first = publish(p, "warm", seed=4)
        d.call(cmd="pull", params=first, block_ids=d_alloc.request(200))
        assert d.call(cmd="wait", request_id="warm")["ok"]
    params = publish(p, "orphan", seed=5)
    p.kill()
    start = time.monotonic()
    d.call(cmd="pull", params=params, block_ids=d_alloc.request(200))
    outcome = d.call(cmd="wait", request_id="orphan", timeout=4 * timeout)
    elapsed = time.monotonic() - start
    case = "after handshake" if known else "at first contact"
    FAULT_TIMINGS.append((f"{transport}: P killed {case} -> D's request fails", elapsed))
    assert not outcome["ok"]
    # A killed engine's port refuses connections: D fails on the refusal, not on a timeout.
    assert "pull of 'orphan'" in outcome["reason"] and "refused" in outcome["reason"]
    assert elapsed < 2 * timeout + 2
    # At first contact too: one attempt, no retry until the handshake deadline (P, which
    # answered the request, is gone; a restarted one would hold none of its blocks).
    assert d.log_path is not None and "retrying in" not in d.log_path.read_text()


def test_decode_aborts_before_transfer_prefill_frees_at_once(engines, transport):
    p = engines("prefill", transport, seed=61, lease=60)
    d = engines("decode", transport, seed=62)
    params = publish(p, "unwanted")
    start = time.monotonic()
    d.call(cmd="abort", params=params, reason="client went away")
    outcome = wait_for(lambda: freed(p, "unwanted"), 10)
    elapsed = time.monotonic() - start
    FAULT_TIMINGS.append((f"{transport}: D aborts before transfer -> P frees", elapsed))
    assert not outcome["ok"] and "aborted by decode: client went away" in outcome["reason"]
    assert elapsed < 5  # far below the 60 s lease
    # the aborted request id cannot be loaded afterwards
    d_ids = BlockAllocator(d.layout, 9).request(200)
    assert "was aborted" in d.call(cmd="pull", params=params, block_ids=d_ids)["error"]
    assert_nothing_left(p)


def test_decode_aborts_during_transfer(engines, transport):
    p = engines("prefill", transport, seed=71, lease=60, **BIG)
    d = engines("decode", transport, seed=72, **BIG)
    params = publish(p, "cut", tokens=4000)
    d.call(cmd="pull", params=params, block_ids=BlockAllocator(d.layout, 2).request(4000))
    d.call(cmd="abort", params=params)
    outcome = d.call(cmd="wait", request_id="cut")
    assert not outcome["ok"] and "test abort" in outcome["reason"]
    p_outcome = wait_for(lambda: freed(p, "cut"), 10)
    assert not p_outcome["ok"] or p_outcome["reason"] == "released by decode"
    assert_nothing_left(p)


def test_decode_aborts_before_prefill_publishes(engines, transport):
    """D gives a request up before P's engine published it (vLLM publishes a step after the
    prefill): P publishes it later and frees its blocks at once, not at the lease's end."""
    p = engines("prefill", transport, seed=81, lease=60)
    d = engines("decode", transport, seed=82)
    first = publish(p, "first")  # P's engine id and endpoint, as D's params carry them
    # D's params for "late" carry the token P's scheduler made for it before P's worker
    # published it (the same token the publish below is given).
    late = {**first, "request_id": "late", "token": "token-of-late"}
    d.call(cmd="abort", params=late, reason="client went away")
    wait_for(lambda: p.call(cmd="withdrawn") == ["late"], 10)
    publish(p, "late", seed=3, token="token-of-late")
    outcome = wait_for(lambda: freed(p, "late"), 10)
    assert not outcome["ok"] and "before it was published" in outcome["reason"]
    assert p.call(cmd="leased") == ["first"]
    d.call(cmd="pull", params=first, block_ids=BlockAllocator(d.layout, 2).request(200))
    assert d.call(cmd="wait", request_id="first")["ok"]
    assert_nothing_left(p)
