"""Request flow through real engine processes: pull and push, many requests, several engines."""

from __future__ import annotations

import random
import time

import pytest

from tests.control.engine import BlockAllocator, run_requests
from tests.ports import free_port

pytestmark = pytest.mark.timeout(240)


def check_bytes(d, sources):
    result = d.call(cmd="verify", timeout=120, sources=sources)
    assert result["ok"], result


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_64_concurrent_requests_of_mixed_sizes(engines, transport, mode):
    p = engines("prefill", transport, seed=11, num_blocks=2048)
    d = engines("decode", transport, seed=12, num_blocks=2048)
    rng = random.Random(5)
    pairs = run_requests(
        p, d, 64, mode, rng, BlockAllocator(p.layout, 1), BlockAllocator(d.layout, 2)
    )
    check_bytes(d, [{"config": p.config, "pairs": pairs}])
    freed = {o["request_id"]: o for o in p.call(cmd="finished")}
    deadline = time.monotonic() + 10  # the last releases may reach P a moment after D is done
    while len(freed) < 64 and time.monotonic() < deadline:
        time.sleep(0.05)
        freed.update({o["request_id"]: o for o in p.call(cmd="finished")})
    assert len(freed) == 64 and all(o["ok"] for o in freed.values()), freed
    assert p.call(cmd="leased") == []
    closed = p.stop()
    assert closed == {"leased": [], "registered_after_plane_close": 0}


def test_one_prefill_serves_two_decodes(engines, transport):
    p = engines("prefill", transport, seed=21, num_blocks=1024)
    d1 = engines("decode1", transport, seed=22, num_blocks=1024)
    d2 = engines("decode2", transport, seed=23, num_blocks=1024)
    rng = random.Random(7)
    p_alloc = BlockAllocator(p.layout, 3)
    pairs1 = run_requests(p, d1, 16, "pull", rng, p_alloc, BlockAllocator(d1.layout, 4), "a")
    pairs2 = run_requests(p, d2, 16, "push", rng, p_alloc, BlockAllocator(d2.layout, 5), "b")
    check_bytes(d1, [{"config": p.config, "pairs": pairs1}])
    check_bytes(d2, [{"config": p.config, "pairs": pairs2}])
    # P's transport reaches only the decode it wrote to: serving reads opens no endpoint
    # towards the reader (handshakes' module docstring: NIXL/UCX aborted P when both sides
    # opened endpoints and D died while they were being set up).
    assert p.call(cmd="transport_peers") == [d2.info["engine_id"]]
    assert d1.call(cmd="transport_peers") == [p.info["engine_id"]]


def test_prefill_restarted_between_two_requests(engines, transport):
    d = engines("decode", transport, seed=32, num_blocks=512)
    d_alloc = BlockAllocator(d.layout, 6)
    p1 = engines("prefill1", transport, seed=31, num_blocks=512)
    pairs1 = run_requests(
        p1, d, 1, "pull", random.Random(1), BlockAllocator(p1.layout, 7), d_alloc, "before"
    )
    p1.stop()
    # A new prefill engine (new engine id, new endpoint and transport metadata).
    p2 = engines("prefill2", transport, seed=33, num_blocks=512)
    assert p2.info["engine_id"] != p1.info["engine_id"]
    pairs2 = run_requests(
        p2, d, 1, "pull", random.Random(2), BlockAllocator(p2.layout, 8), d_alloc, "after"
    )
    check_bytes(d, [{"config": p1.config, "pairs": pairs1}, {"config": p2.config, "pairs": pairs2}])


def test_two_prefills_serve_one_decode_at_once(engines, transport):
    prefills = [engines(f"prefill{i}", transport, seed=41 + i, num_blocks=1024) for i in range(2)]
    d = engines("decode", transport, seed=43, num_blocks=1024)
    d_alloc = BlockAllocator(d.layout, 9)
    rng = random.Random(11)
    allocs = [BlockAllocator(p.layout, 10 + i) for i, p in enumerate(prefills)]
    pairs: list[list] = [[], []]
    started = []
    for i in range(24):  # interleaved: both prefills' requests are in flight together
        which = i % 2
        tokens = rng.randint(1, 300)
        p_ids, d_ids = allocs[which].request(tokens), d_alloc.request(tokens)
        params = prefills[which].call(
            cmd="publish", request_id=f"x{i}", block_ids=p_ids, num_tokens=tokens
        )
        assert d.call(cmd="pull", params=params, block_ids=d_ids) == {"started": True}
        pairs[which].append((p_ids, d_ids))
        started.append(f"x{i}")
    for rid in started:
        out = d.call(cmd="wait", request_id=rid, timeout=60)
        assert out["ok"], out["reason"]
    check_bytes(
        d, [{"config": p.config, "pairs": pp} for p, pp in zip(prefills, pairs, strict=True)]
    )


def test_pull_that_arrives_before_the_publish_waits_for_it(engines, transport):
    # A serving engine may pass the parameters on before P's worker has published the request.
    p = engines("prefill", transport, seed=51, num_blocks=512)
    d = engines("decode", transport, seed=52, num_blocks=512, timeout=5)
    p_ids, d_ids = (
        BlockAllocator(p.layout, 1).request(150),
        BlockAllocator(d.layout, 2).request(150),
    )
    early = {
        "request_id": "early",
        "engine_id": p.info["engine_id"],
        "endpoint": p.info["endpoint"],
        "block_ids": p_ids,
        "num_tokens": 150,
        "transport": transport,
        "mode": "pull",
        "token": "token-of-early",  # made by P's scheduler before its worker publishes
    }
    assert d.call(cmd="pull", params=early, block_ids=d_ids) == {"started": True}
    time.sleep(0.5)
    published = p.call(
        cmd="publish", request_id="early", block_ids=p_ids, num_tokens=150, token="token-of-early"
    )
    assert published["request_id"] == "early"
    out = d.call(cmd="wait", request_id="early", timeout=30)
    assert out["ok"], out["reason"]
    check_bytes(d, [{"config": p.config, "pairs": [(p_ids, d_ids)]}])
    # never published: the load fails once the timeout has passed, with the reason
    never = {**early, "request_id": "never"}
    start = time.monotonic()
    d.call(cmd="pull", params=never, block_ids=BlockAllocator(d.layout, 3).request(150))
    out = d.call(cmd="wait", request_id="never", timeout=30)
    assert not out["ok"] and "not held here" in out["reason"]
    assert 4 < time.monotonic() - start < 15


def test_only_a_handshake_counts_as_handshake_time(engines, transport):
    # The first load from P handshakes (its time is the request's handshake_s: stats, the
    # handshake metric); later loads from the same P reuse it and spend no handshake time.
    p = engines("prefill", transport, seed=41, num_blocks=256)
    d = engines("decode", transport, seed=42, num_blocks=256)
    p_alloc, d_alloc = BlockAllocator(p.layout, 9), BlockAllocator(d.layout, 10)
    seen = []
    for i in range(3):
        p_ids, d_ids = p_alloc.request(64), d_alloc.request(64)
        params = p.call(
            cmd="publish", request_id=f"h{i}", block_ids=p_ids, num_tokens=64, mode="pull"
        )
        assert d.call(cmd="pull", params=params, block_ids=d_ids) == {"started": True}
        out = d.call(cmd="wait", request_id=f"h{i}", timeout=30)
        assert out["ok"], out
        seen.append(out["stats"]["handshake_s"])
    assert seen[0] > 0 and seen[1:] == [0.0, 0.0], seen


def test_an_early_handshake_spares_the_first_load_its_handshake(engines, transport):
    # D told P's side channel at start (the connector's prefill_peers) handshakes before any
    # request: the first load spends no handshake time, and its bytes are right. A side
    # channel nobody answers costs a bounded wait and nothing else.
    p = engines("prefill", transport, seed=43, num_blocks=256)
    d = engines("decode", transport, seed=44, num_blocks=256)
    silent = f"tcp://127.0.0.1:{free_port()}"
    start = time.monotonic()
    met = d.call(cmd="connect_early", endpoints=[p.info["endpoint"], silent], patience=2.0)
    assert met == [p.info["engine_id"], None]
    assert time.monotonic() - start < 10
    p_ids, d_ids = (
        BlockAllocator(p.layout, 11).request(64),
        BlockAllocator(d.layout, 12).request(64),
    )
    params = p.call(cmd="publish", request_id="e0", block_ids=p_ids, num_tokens=64, mode="pull")
    assert d.call(cmd="pull", params=params, block_ids=d_ids) == {"started": True}
    out = d.call(cmd="wait", request_id="e0", timeout=30)
    assert out["ok"], out
    assert out["stats"]["handshake_s"] == 0.0, out["stats"]
    check_bytes(d, [{"config": p.config, "pairs": [(p_ids, d_ids)]}])
