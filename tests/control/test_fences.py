"""Fences through real engine processes: after a failed, timed-out or aborted transfer, no byte
lands in D's blocks once D has reported the outcome, and a lost ``PushDone`` costs only time."""

from __future__ import annotations

import signal
import time

import pytest

from tests.control.conftest import FAULT_TIMINGS
from tests.control.engine import BlockAllocator
from tests.control.test_faults import BIG, assert_nothing_left, freed, publish, wait_for

pytestmark = pytest.mark.timeout(180)

TIMEOUT = 3.0  # short, so a frozen peer outlasts it quickly


def assert_quiet_after(d, seconds=2.0):
    """D's memory does not change any more: nothing of a given-up transfer lands late."""
    before = d.call(cmd="digest")
    time.sleep(seconds)
    assert d.call(cmd="digest") == before, "bytes landed in D after it reported the outcome"


def test_push_into_frozen_decode_reports_only_after_the_fence(engines, transport):
    p = engines("prefill", transport, seed=81, lease=60, timeout=TIMEOUT, **BIG)
    d = engines("decode", transport, seed=82, timeout=TIMEOUT, **BIG)
    rid = "frozen-d"
    d_ids = BlockAllocator(d.layout, 2).request(4000)
    ids = BlockAllocator(p.layout, 1).request(4000)
    params = {  # D asks for the push before P has published: P writes as soon as it does
        "request_id": rid,
        "engine_id": p.info["engine_id"],
        "endpoint": p.info["endpoint"],
        "block_ids": ids,
        "num_tokens": 4000,
        "transport": transport,
        "mode": "push",
    }
    d.call(cmd="push", params=params, block_ids=d_ids)
    wait_for(lambda: rid in p.call(cmd="pending_push"), 10)
    d.kill(signal.SIGSTOP)
    start = time.monotonic()
    p.call(cmd="publish", request_id=rid, block_ids=ids, num_tokens=4000, mode="push")
    time.sleep(2 * TIMEOUT + 1)  # P's write gives up on the frozen D meanwhile
    d.kill(signal.SIGCONT)
    outcome = d.call(cmd="wait", request_id=rid, timeout=60)
    FAULT_TIMINGS.append(
        (
            f"{transport}: D frozen {2 * TIMEOUT + 1:g} s during a push -> D's outcome",
            time.monotonic() - start,
        )
    )
    assert_quiet_after(d)
    if outcome["ok"]:  # everything landed before P gave up: then it must be all of it
        assert d.call(cmd="verify", sources=[{"config": p.config, "pairs": [[ids, d_ids]]}])["ok"]
    else:
        assert "prefill could not push" in outcome["reason"] or "no push" in outcome["reason"]
    assert freed(p, rid) is not None or wait_for(lambda: freed(p, rid), 10)
    assert d.call(cmd="held") == []
    assert_nothing_left(p)


def test_lost_push_done_costs_time_not_the_request(engines, transport):
    """P's word that the push ended never arrives: D asks P past its deadline and loads."""
    p = engines("prefill", transport, seed=91, lease=60, timeout=TIMEOUT, faults=["drop_push_done"])
    d = engines("decode", transport, seed=92, timeout=TIMEOUT, handshake_timeout=TIMEOUT)
    params = publish(p, "mute", mode="push")
    d_ids = BlockAllocator(d.layout, 2).request(200)
    start = time.monotonic()
    d.call(cmd="push", params=params, block_ids=d_ids)
    outcome = d.call(cmd="wait", request_id="mute", timeout=60)
    FAULT_TIMINGS.append((f"{transport}: PushDone lost -> D asks P", time.monotonic() - start))
    assert outcome["ok"], outcome["reason"]
    source = {"config": p.config, "pairs": [[params["block_ids"], d_ids]]}
    assert d.call(cmd="verify", sources=[source])["ok"]
    assert_nothing_left(p)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_abort_during_transfer_reports_after_the_fence(engines, transport, mode):
    """D aborts while the load runs: the outcome comes once no byte of it can still land."""
    p = engines("prefill", transport, seed=101, lease=60, timeout=TIMEOUT, **BIG)
    d = engines("decode", transport, seed=102, timeout=TIMEOUT, **BIG)
    params = publish(p, "cut", tokens=4000, mode=mode)
    d.call(cmd=mode, params=params, block_ids=BlockAllocator(d.layout, 2).request(4000))
    d.call(cmd="abort", params=params, reason="client went away")
    outcome = d.call(cmd="wait", request_id="cut", timeout=60)
    assert not outcome["ok"] and "client went away" in outcome["reason"]
    assert_quiet_after(d)
    wait_for(lambda: freed(p, "cut"), 10)
    assert_nothing_left(p)


def test_prefill_frozen_during_pull_holds_decode_blocks_until_fenced(engines, transport):
    p = engines("prefill", transport, seed=121, lease=60, timeout=TIMEOUT, **BIG)
    d = engines("decode", transport, seed=122, timeout=TIMEOUT, **BIG)
    warm = publish(p, "warm", seed=3)  # connections up, so the freeze hits a read, not a handshake
    d_alloc = BlockAllocator(d.layout, 4)
    d.call(cmd="pull", params=warm, block_ids=d_alloc.request(200))
    assert d.call(cmd="wait", request_id="warm")["ok"]
    params = publish(p, "frozen-p", tokens=4000, seed=5)
    d.call(cmd="pull", params=params, block_ids=d_alloc.request(4000))
    # Freeze P once D's read is under way. (Not as soon as P knows the puller: P may then be
    # stopped before its answer to D's claim leaves, and D fails the claim with nothing read.)
    wait_for(lambda: "frozen-p" in d.call(cmd="reading"), 10, step=0.001)
    p.kill(signal.SIGSTOP)
    start = time.monotonic()
    time.sleep(TIMEOUT + 3)
    held = d.call(cmd="held")  # the read failed on the frozen P: its blocks wait for a fence
    p.kill(signal.SIGCONT)
    outcome = d.call(cmd="wait", request_id="frozen-p", timeout=60)
    FAULT_TIMINGS.append(
        (
            f"{transport}: P frozen {TIMEOUT + 3:g} s during a pull -> D's outcome",
            time.monotonic() - start,
        )
    )
    assert_quiet_after(d)
    assert outcome.get("request_id") == "frozen-p", outcome
    # Unless the read had finished (UCX's cma copies even from a stopped process), D held the
    # blocks while P was frozen and reported only after P answered again.
    assert held == [] if outcome["ok"] else held == ["frozen-p"]
    if not outcome["ok"]:  # the slow load says where its time went: the read and its fence
        stats = outcome["stats"]
        assert stats["total_s"] >= TIMEOUT + 2, stats
        assert stats["transfer_s"] + stats["fence_s"] >= TIMEOUT, stats
        assert "request frozen-p: load took" in d.log_path.read_text(), "no slow-load warning"
    wait_for(lambda: freed(p, "frozen-p"), 20)
    assert_nothing_left(p)


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("verify", ["sample", "full"])
def test_verify_passes_clean_loads_and_fails_corrupted_ones(engines, transport, mode, verify):
    p = engines("prefill", transport, seed=131, timeout=TIMEOUT)
    d = engines("decode", transport, seed=132, timeout=TIMEOUT, verify=verify)
    bad = engines(
        "decode", transport, seed=133, timeout=TIMEOUT, verify=verify, faults=["corrupt_received"]
    )
    for name, engine, expect_ok in (("clean", d, True), ("corrupt", bad, False)):
        params = publish(p, name, mode=mode, tokens=300)
        ids = BlockAllocator(engine.layout, 2).request(300)
        engine.call(cmd=mode, params=params, block_ids=ids)
        outcome = engine.call(cmd="wait", request_id=name)
        assert outcome["ok"] is expect_ok, outcome
        if expect_ok:
            assert outcome["stats"]["verify_s"] > 0
            source = {"config": p.config, "pairs": [[params["block_ids"], ids]]}
            assert engine.call(cmd="verify", sources=[source])["ok"]
        else:
            assert "integrity check" in outcome["reason"] and outcome["stats"]["verify_failed"]
    wait_for(lambda: not p.call(cmd="leased"), 10)
    assert_nothing_left(p)


#: 32 layers of 8 KV heads x 128: a request of 8192 tokens moves 256 MiB of attention blocks.
HUGE = {"kv_heads": 8, "head_dim": 128, "layers": 32, "num_blocks": 1100}
HUGE_TOKENS = 8192


def huge_pair(engines, transport, mode, seed):
    """P and D with 256 MiB requests, one warm-up load in ``mode`` done (connections up, so a
    stop hits a transfer, not a handshake), and the block ids every round of a test reuses."""
    p = engines("prefill", transport, seed=seed, lease=60, timeout=TIMEOUT, **HUGE)
    d = engines("decode", transport, seed=seed + 1, timeout=TIMEOUT, **HUGE)
    warm = publish(p, "warm", seed=3, mode=mode)
    d_alloc = BlockAllocator(d.layout, 4)
    d.call(cmd=mode, params=warm, block_ids=d_alloc.request(200))
    assert d.call(cmd="wait", request_id="warm")["ok"]
    p_ids = BlockAllocator(p.layout, 5).request(HUGE_TOKENS)
    return p, d, p_ids, d_alloc.request(HUGE_TOKENS)


def stutter_round(stopped, d, transport, rid, window_ms, what):
    """Stop ``stopped`` mid-transfer past the deadline, let it run ``window_ms``, stop it again
    for 3 s, then let it run: D's outcome (D zeroes its buffers the moment it has it, as vLLM
    reuses blocks), D's held requests while P was stopped, and a check that nothing lands since."""
    time.sleep(0.01)  # bytes are moving
    stopped.kill(signal.SIGSTOP)
    start = time.monotonic()
    time.sleep(TIMEOUT + 1)  # the transfer passes its deadline while stopped
    held = d.call(cmd="held") if stopped is not d else None  # a stopped D answers nothing
    stopped.kill(signal.SIGCONT)  # it answers what it can in the window
    time.sleep(window_ms / 1e3)
    stopped.kill(signal.SIGSTOP)
    time.sleep(3.0)
    stopped.kill(signal.SIGCONT)
    outcome = d.call(cmd="wait", request_id=rid, timeout=120, reuse=True)
    FAULT_TIMINGS.append(
        (
            f"{transport}: {what} stuttering ({window_ms} ms) -> D's outcome",
            time.monotonic() - start,
        )
    )
    assert_untouched_since(d, outcome["digest"])
    assert outcome["request_id"] == rid, outcome
    assert not outcome["stats"]["unproven"], outcome
    assert d.call(cmd="held") == []
    return outcome, held


def assert_untouched_since(d, digest, seconds=2.0):
    """D zeroed every buffer the moment it had the outcome: nothing may land in them since."""
    time.sleep(seconds)
    assert d.call(cmd="digest") == digest, "bytes landed in D's blocks after it reported"


#: How long the stopped side runs between its two stops: one end of the 1-100 ms sweep that the
#: conformance suite makes (1, 10, 100 ms) for every transport in both directions
#: (``test_stuttering_peer_fence``). Here, where the plane's fence is under test, each transport
#: takes one end per mode and the two modes take opposite ends, so each mode meets both ends and
#: each transport both (one round each: a round is about 35 s, most of it the stops).
WINDOWS_MS = {
    ("pull", "cma"): 1,
    ("pull", "mooncake"): 100,
    ("pull", "nixl"): 1,
    ("push", "cma"): 100,
    ("push", "mooncake"): 1,
    ("push", "nixl"): 100,
}


def test_prefill_stuttering_during_pull(engines, transport):
    """P stops mid-read of 256 MiB, runs for a few ms, stops again for 3 s: D reports only once
    its read is fenced by proof, and not one byte lands in its (reused) blocks after that."""
    p, d, p_ids, d_ids = huge_pair(engines, transport, "pull", seed=141)
    window_ms = WINDOWS_MS["pull", transport]
    rid = f"stutter-p-{window_ms}"
    params = p.call(
        cmd="publish", request_id=rid, block_ids=p_ids, num_tokens=HUGE_TOKENS, mode="pull"
    )
    d.call(cmd="pull", params=params, block_ids=d_ids)
    wait_for(lambda: rid in d.call(cmd="reading"), 10, step=0.001)
    outcome, held = stutter_round(p, d, transport, rid, window_ms, "P in a pull")
    assert held == [] if outcome["ok"] else held == [rid]
    wait_for(lambda: freed(p, rid), 20)  # P's blocks are free at the end
    assert_nothing_left(p)


def test_decode_stuttering_during_push(engines, transport):
    """D stops mid-write of 256 MiB, runs for a few ms, stops again for 3 s: D reports only on
    P's proven fence, and not one byte lands in its (reused) blocks after that."""
    p, d, p_ids, d_ids = huge_pair(engines, transport, "push", seed=151)
    window_ms = WINDOWS_MS["push", transport]
    rid = f"stutter-d-{window_ms}"
    params = {  # D asks for the push before P has published: P writes as soon as it does
        "request_id": rid,
        "engine_id": p.info["engine_id"],
        "endpoint": p.info["endpoint"],
        "block_ids": p_ids,
        "num_tokens": HUGE_TOKENS,
        "transport": transport,
        "mode": "push",
    }
    d.call(cmd="push", params=params, block_ids=d_ids)
    wait_for(lambda: rid in p.call(cmd="pending_push"), 10)
    p.call(cmd="publish", request_id=rid, block_ids=p_ids, num_tokens=HUGE_TOKENS, mode="push")
    stutter_round(d, d, transport, rid, window_ms, "D in a push")
    wait_for(lambda: freed(p, rid), 20)
    assert_nothing_left(p)
