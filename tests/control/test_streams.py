"""Layer-wise transfer through real engine processes (issue 29).

Push: D asks for a push before P has computed the request; P writes each layer as it is
computed (``ControlPlane.stream``), then the rest (the recurrent state) when it publishes.
Pull: D asks before P computed it; P tells D each computed layer and D reads it at once, then
the rest once P published. Every byte is checked against P's cache.

Failures are fenced as for a whole transfer: a refused layer write, D's abort mid-stream, and a
stream from a P that never publishes all end the load failed only after the fence of every
transfer of it (P's writes in a push, D's own reads in a pull).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import pytest

from kvbridge.core.groups import GroupKind
from tests.control.engine import BlockAllocator, EngineProcess

pytestmark = pytest.mark.timeout(180)

TOKENS = 300
TOKEN = "capability-of-s"  # the router's, given to both P and D up front


def paged_layers(engine: EngineProcess) -> list[str]:
    """The layers whose K/V (paged) the engine computes one by one, in the layout's order."""
    layout = engine.layout
    kinds = {i: g.kind for i, g in layout.groups.items()}
    names: list[str] = []
    for t in layout.spec.tensors:
        if kinds[t.group_index] is not GroupKind.STATE and t.layer_name not in names:
            names.append(t.layer_name)
    return names


def paged_ids(engine: EngineProcess, ids: dict[int, list[int]]) -> dict[int, list[int]]:
    kinds = {i: g.kind for i, g in engine.layout.groups.items()}
    return {g: b for g, b in ids.items() if kinds[g] is not GroupKind.STATE}


def layerwise_params(
    p: EngineProcess, rid: str, transport: str, mode: str = "push"
) -> dict[str, Any]:
    """D's parameters in the concurrent dispatch: P's address and the request's token, not P's
    block ids."""
    return {
        "request_id": rid,
        "engine_id": p.info["engine_id"],
        "endpoint": p.info["endpoint"],
        "block_ids": {},
        "num_tokens": TOKENS,
        "transport": transport,
        "mode": mode,
        "token": TOKEN,
        "layerwise": True,
    }


def early_push(p: EngineProcess, d: EngineProcess, rid: str, d_ids, transport: str) -> None:
    """D asks P for a push of a request P has not computed (the concurrent dispatch)."""
    params = layerwise_params(p, rid, transport)
    assert d.call(cmd="push", params=params, block_ids=d_ids) == {"started": True}
    deadline = time.monotonic() + 30
    while rid not in p.call(cmd="pending_push"):
        assert time.monotonic() < deadline, "D's push request never reached P"
        time.sleep(0.02)


def stream_until_written(p: EngineProcess, rid: str, token: str, ids, layers) -> int:
    """Stream layers; the first call may find the transport still connecting (0 bytes, the
    layers stay for later), so repeat the first layer until it is written."""
    deadline = time.monotonic() + 30
    while True:
        sent = p.call(cmd="stream", request_id=rid, token=token, block_ids=ids, layers=layers)
        if sent or time.monotonic() > deadline:
            return int(sent)
        time.sleep(0.05)


@pytest.mark.parametrize("verify", ["off", "full"])
def test_layers_streamed_before_publish_land_exactly(engines, transport, verify):
    # verify=full: D checks P's digest of what it wrote, planned with P's ids from PushDone
    p = engines("prefill", transport, seed=61, num_blocks=512)
    d = engines("decode", transport, seed=62, num_blocks=512, verify=verify)
    p_ids = BlockAllocator(p.layout, 1).request(TOKENS)
    d_ids = BlockAllocator(d.layout, 2).request(TOKENS)
    early_push(p, d, "s", d_ids, transport)
    layers = paged_layers(p)
    assert len(layers) >= 2
    paged = paged_ids(p, p_ids)
    first = stream_until_written(p, "s", TOKEN, paged, layers[:1])
    assert first > 0
    rest = p.call(cmd="stream", request_id="s", token=TOKEN, block_ids=paged, layers=layers[1:])
    assert rest > 0
    # a layer streamed twice is written once
    again = p.call(cmd="stream", request_id="s", token=TOKEN, block_ids=paged, layers=layers)
    assert again == 0
    p.call(
        cmd="publish", request_id="s", block_ids=p_ids, num_tokens=TOKENS, mode="push", token=TOKEN
    )
    out = d.call(cmd="wait", request_id="s", timeout=60)
    assert out["ok"], out["reason"]
    stats = out["stats"]
    assert stats["streamed_nbytes"] == first + rest
    # the recurrent state went at publish (the model has GDN layers): the rest of the bytes
    assert 0 < stats["streamed_nbytes"] < stats["nbytes"]
    result = d.call(
        cmd="verify", timeout=120, sources=[{"config": p.config, "pairs": [(p_ids, d_ids)]}]
    )
    assert result["ok"], result
    assert p.call(cmd="leased") == []


def test_a_stream_with_another_token_writes_nothing(engines, transport):
    p = engines("prefill", transport, seed=63, num_blocks=512)
    d = engines("decode", transport, seed=64, num_blocks=512)
    p_ids = BlockAllocator(p.layout, 3).request(TOKENS)
    d_ids = BlockAllocator(d.layout, 4).request(TOKENS)
    before = d.call(cmd="digest")
    early_push(p, d, "s", d_ids, transport)
    layers, paged = paged_layers(p), paged_ids(p, p_ids)
    for _ in range(5):  # whatever the connection's state, the wrong bearer gets nothing
        wrong = p.call(
            cmd="stream", request_id="s", token="not-" + TOKEN, block_ids=paged, layers=layers
        )
        assert wrong == 0
        time.sleep(0.05)
    assert d.call(cmd="digest") == before
    p.call(
        cmd="publish", request_id="s", block_ids=p_ids, num_tokens=TOKENS, mode="push", token=TOKEN
    )
    out = d.call(cmd="wait", request_id="s", timeout=60)
    assert out["ok"], out["reason"]
    assert out["stats"]["streamed_nbytes"] == 0  # all of it went at publish
    result = d.call(
        cmd="verify", timeout=120, sources=[{"config": p.config, "pairs": [(p_ids, d_ids)]}]
    )
    assert result["ok"], result


def test_a_refused_layer_write_fails_the_push_fenced(engines, transport):
    p = engines("prefill", transport, seed=65, num_blocks=512)
    d = engines("decode", transport, seed=66, num_blocks=512)
    p_ids = BlockAllocator(p.layout, 5).request(TOKENS)
    d_ids = BlockAllocator(d.layout, 6).request(TOKENS)
    early_push(p, d, "s", d_ids, transport)
    layers, paged = paged_layers(p), paged_ids(p, p_ids)
    assert stream_until_written(p, "s", TOKEN, paged, layers[:1]) > 0
    p.call(cmd="fault", name="fail_next_submit")
    assert (
        p.call(cmd="stream", request_id="s", token=TOKEN, block_ids=paged, layers=layers[1:2]) == 0
    )
    p.call(
        cmd="publish", request_id="s", block_ids=p_ids, num_tokens=TOKENS, mode="push", token=TOKEN
    )
    out = d.call(cmd="wait", request_id="s", timeout=60)
    assert not out["ok"]
    assert "layer-wise write could not start" in out["reason"], out["reason"]
    # P freed its blocks once its writes were fenced; D's outcome came after P's word
    deadline = time.monotonic() + 10
    while p.call(cmd="leased") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert p.call(cmd="leased") == []
    assert d.call(cmd="held") == []


def test_an_abort_mid_stream_ends_the_load_after_the_fence(engines, transport):
    p = engines("prefill", transport, seed=67, num_blocks=512)
    d = engines("decode", transport, seed=68, num_blocks=512, timeout=5)
    p_ids = BlockAllocator(p.layout, 7).request(TOKENS)
    d_ids = BlockAllocator(d.layout, 8).request(TOKENS)
    early_push(p, d, "s", d_ids, transport)
    layers, paged = paged_layers(p), paged_ids(p, p_ids)
    assert stream_until_written(p, "s", TOKEN, paged, layers[:1]) > 0
    params = layerwise_params(p, "s", transport)
    d.call(cmd="abort", params=params, reason="client went away")
    out = d.call(cmd="wait", request_id="s", timeout=60)
    assert not out["ok"]
    # P streams no more for it, and its later publish holds nothing for a D that left
    assert p.call(cmd="stream", request_id="s", token=TOKEN, block_ids=paged, layers=layers) == 0
    assert "s" in p.call(cmd="withdrawn")
    p.call(
        cmd="publish", request_id="s", block_ids=p_ids, num_tokens=TOKENS, mode="push", token=TOKEN
    )
    assert p.call(cmd="leased") == []


def test_a_stream_that_is_never_published_fails_the_load_after_the_fence(engines, transport):
    p = engines("prefill", transport, seed=69, num_blocks=512, timeout=2, lease=4.0)
    d = engines("decode", transport, seed=70, num_blocks=512, timeout=3)
    p_ids = BlockAllocator(p.layout, 9).request(TOKENS)
    d_ids = BlockAllocator(d.layout, 10).request(TOKENS)
    early_push(p, d, "s", d_ids, transport)
    layers, paged = paged_layers(p), paged_ids(p, p_ids)
    assert stream_until_written(p, "s", TOKEN, paged, layers) > 0
    # P's request ends without a publish (aborted on P): D's load fails, and only with P's word
    out = d.call(cmd="wait", request_id="s", timeout=90)
    assert not out["ok"]
    assert d.call(cmd="held") == []


def test_a_withdrawn_request_fails_the_waiting_load_with_ps_reason(engines, transport):
    # D's timeout is far beyond the test's wait: only P's word can end the load this early.
    p = engines("prefill", transport, seed=71, num_blocks=512)
    d = engines("decode", transport, seed=72, num_blocks=512, timeout=60, lease=120)
    p_ids = BlockAllocator(p.layout, 11).request(TOKENS)
    d_ids = BlockAllocator(d.layout, 12).request(TOKENS)
    early_push(p, d, "s", d_ids, transport)
    layers, paged = paged_layers(p), paged_ids(p, p_ids)
    assert stream_until_written(p, "s", TOKEN, paged, layers[:1]) > 0
    p.call(cmd="withdraw", request_id="s", token=TOKEN, reason="prefill declined: hold limit")
    out = d.call(cmd="wait", request_id="s", timeout=30)
    assert not out["ok"] and "hold limit" in out["reason"], out
    assert d.call(cmd="held") == []
    assert p.call(cmd="pending_push") == []


def test_a_push_asked_after_the_withdrawal_is_refused(engines, transport):
    p = engines("prefill", transport, seed=73, num_blocks=512)
    d = engines("decode", transport, seed=74, num_blocks=512, timeout=60, lease=120)
    p.call(cmd="withdraw", request_id="s", token=TOKEN, reason="prefill declined: hold limit")
    d_ids = BlockAllocator(d.layout, 13).request(TOKENS)
    params = layerwise_params(p, "s", transport)
    d.call(cmd="push", params=params, block_ids=d_ids)
    out = d.call(cmd="wait", request_id="s", timeout=30)
    assert not out["ok"] and "withdrawn" in out["reason"], out
    assert p.call(cmd="pending_push") == []


# -- layer-wise pull ---------------------------------------------------------------------------
@dataclass
class PullPair:
    """A P and a D engine, and one request's blocks on each, for a layer-wise pull."""

    p: EngineProcess
    d: EngineProcess
    transport: str
    p_ids: dict[int, list[int]]
    d_ids: dict[int, list[int]]

    @classmethod
    def start(cls, engines, transport: str, seed: int, **d_config: Any) -> PullPair:
        p = engines("prefill", transport, seed=seed, num_blocks=512)
        d = engines("decode", transport, seed=seed + 1, num_blocks=512, **d_config)
        p_ids = BlockAllocator(p.layout, seed).request(TOKENS)
        return cls(p, d, transport, p_ids, BlockAllocator(d.layout, seed + 1).request(TOKENS))

    def params(self, rid: str = "s") -> dict[str, Any]:
        return layerwise_params(self.p, rid, self.transport, "pull")

    def ask_early(self) -> list[str]:
        """D asks P for a layer-wise pull of a request P has not computed (the concurrent
        dispatch); returns what D's memory held before."""
        before = self.d.call(cmd="digest")
        assert self.d.call(cmd="pull", params=self.params(), block_ids=self.d_ids) == {
            "started": True
        }
        deadline = time.monotonic() + 30
        while "s" not in self.p.call(cmd="pending_push"):
            assert time.monotonic() < deadline, "D's stream request never reached P"
            time.sleep(0.02)
        return before

    def stream(self, layers: slice, token: str = TOKEN) -> int:
        """P computed these of its paged layers (P writes nothing itself in a pull: 0)."""
        paged = paged_ids(self.p, self.p_ids)
        names = paged_layers(self.p)[layers]
        return int(
            self.p.call(cmd="stream", request_id="s", token=token, block_ids=paged, layers=names)
        )

    def wait_read(self, before: list[str]) -> None:
        """D's memory changes: it read what P said was computed, before anything else."""
        deadline = time.monotonic() + 30
        while self.d.call(cmd="digest") == before:
            assert time.monotonic() < deadline, "D read nothing of the layers P said were ready"
            time.sleep(0.05)

    def publish(self, token: str = TOKEN) -> None:
        self.p.call(
            cmd="publish",
            request_id="s",
            block_ids=self.p_ids,
            num_tokens=TOKENS,
            mode="pull",
            token=token,
        )

    def check_bytes(self) -> None:
        pairs = [(self.p_ids, self.d_ids)]
        result = self.d.call(
            cmd="verify", timeout=120, sources=[{"config": self.p.config, "pairs": pairs}]
        )
        assert result["ok"], result

    def wait_released(self) -> None:
        """P's lease ends once D released it (D tells P after its outcome)."""
        deadline = time.monotonic() + 10
        while self.p.call(cmd="leased") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.p.call(cmd="leased") == []


@pytest.mark.parametrize("verify", ["off", "full"])
def test_layers_read_before_publish_land_exactly(engines, transport, verify):
    # verify=full: D checks P's digest of what it holds against its own of what it read
    pair = PullPair.start(engines, transport, 81, verify=verify)
    before = pair.ask_early()
    assert pair.stream(slice(0, 1)) == 0  # P writes nothing itself: D reads
    pair.wait_read(before)  # D read the first layer before P published anything
    pair.stream(slice(1, None))
    pair.publish()
    out = pair.d.call(cmd="wait", request_id="s", timeout=60)
    assert out["ok"], out["reason"]
    stats = out["stats"]
    # D read some layers early (at least the first), and the recurrent state after publish
    assert 0 < stats["streamed_nbytes"] < stats["nbytes"], stats
    pair.check_bytes()
    pair.wait_released()


def test_a_pull_asked_after_publish_reads_everything(engines, transport):
    # D asks after P published (a slow D): P's answer is the published request, D reads it all
    pair = PullPair.start(engines, transport, 83)
    pair.publish()
    pair.d.call(cmd="pull", params=pair.params(), block_ids=pair.d_ids)
    out = pair.d.call(cmd="wait", request_id="s", timeout=60)
    assert out["ok"], out["reason"]
    assert out["stats"]["streamed_nbytes"] == 0 and out["stats"]["nbytes"] > 0
    pair.check_bytes()
    pair.wait_released()


def test_a_pull_with_another_token_is_told_nothing(engines, transport):
    pair = PullPair.start(engines, transport, 85, timeout=2, lease=4.0)
    before = pair.ask_early()
    for _ in range(5):
        pair.stream(slice(None), token="not-" + TOKEN)
        time.sleep(0.05)
    assert pair.d.call(cmd="digest") == before
    pair.publish(token="not-" + TOKEN)
    # P held nothing for D's token: D's load ends at its deadline, having read nothing
    out = pair.d.call(cmd="wait", request_id="s", timeout=60)
    assert not out["ok"]
    assert pair.d.call(cmd="digest") == before
    assert pair.d.call(cmd="held") == []


def test_an_abort_mid_pull_fences_what_was_read(engines, transport):
    pair = PullPair.start(engines, transport, 87, timeout=5)
    p, d = pair.p, pair.d
    before = pair.ask_early()
    pair.stream(slice(0, 1))
    pair.wait_read(before)
    d.call(cmd="abort", params=pair.params(), reason="client left")
    out = d.call(cmd="wait", request_id="s", timeout=60, reuse=True)
    assert not out["ok"] and "client left" in out["reason"], out
    # D's reads were fenced before the outcome: nothing lands in the reused blocks after it
    time.sleep(0.5)
    assert d.call(cmd="digest") == out["digest"]
    assert d.call(cmd="held") == []
    # P tells nothing more, and its later publish holds nothing for a D that left
    deadline = time.monotonic() + 10
    while "s" not in p.call(cmd="withdrawn"):
        assert time.monotonic() < deadline, "D's abort never reached P"
        time.sleep(0.05)
    assert p.call(cmd="pending_push") == []
    pair.publish()
    assert p.call(cmd="leased") == []


def test_a_pull_that_is_never_published_ends_at_ds_deadline(engines, transport):
    pair = PullPair.start(engines, transport, 89, timeout=2, lease=4.0)
    before = pair.ask_early()
    pair.stream(slice(None))
    pair.wait_read(before)
    # P's request ends without a publish: D fences its own reads and fails at its deadline
    out = pair.d.call(cmd="wait", request_id="s", timeout=90)
    assert not out["ok"] and "published nothing" in out["reason"], out
    assert pair.d.call(cmd="held") == []


def test_a_withdrawn_pull_fails_at_once_with_ps_reason(engines, transport):
    # D's timeout is far beyond the test's wait: only P's word can end the load this early.
    pair = PullPair.start(engines, transport, 91, timeout=60, lease=120)
    p, d = pair.p, pair.d
    before = pair.ask_early()
    pair.stream(slice(0, 1))
    pair.wait_read(before)
    p.call(cmd="withdraw", request_id="s", token=TOKEN, reason="prefill declined: hold limit")
    out = d.call(cmd="wait", request_id="s", timeout=30)
    assert not out["ok"] and "hold limit" in out["reason"], out
    assert d.call(cmd="held") == []
    assert p.call(cmd="pending_push") == []
    # a pull asked after the withdrawal is refused at once
    p.call(cmd="withdraw", request_id="s2", token=TOKEN, reason="prefill declined: hold limit")
    d.call(
        cmd="pull", params=pair.params("s2"), block_ids=BlockAllocator(d.layout, 3).request(TOKENS)
    )
    out = d.call(cmd="wait", request_id="s2", timeout=30)
    assert not out["ok"] and "withdrawn" in out["reason"], out


def test_a_refused_layer_read_fails_the_pull_fenced(engines, transport):
    pair = PullPair.start(engines, transport, 93)
    before = pair.ask_early()
    pair.stream(slice(0, 1))
    pair.wait_read(before)
    pair.d.call(cmd="fault", name="fail_next_submit")
    pair.stream(slice(1, 2))
    pair.publish()
    out = pair.d.call(cmd="wait", request_id="s", timeout=60)
    assert not out["ok"]
    assert "layer-wise read could not start" in out["reason"], out["reason"]
    assert pair.d.call(cmd="held") == []
    pair.wait_released()  # D released its claim after fencing its reads


# -- chunked prefill: each chunk's blocks stream as the chunk is computed ---------------------


def chunk_parts(engine: EngineProcess, ids: dict[int, list[int]]) -> list[dict[str, Any]]:
    """A prefill in two chunks, as vLLM's scheduler hands them to ``ControlPlane.stream``: the
    blocks the first chunk completed, then the rest (the paged groups; the state goes at
    publish)."""
    paged = paged_ids(engine, ids)
    cut = {g: len(b) // 2 for g, b in paged.items()}
    total = {g: len(b) for g, b in paged.items()}
    return [
        {"block_ids": {g: b[: cut[g]] for g, b in paged.items()}, "first": {}, "total": total},
        {"block_ids": {g: b[cut[g] :] for g, b in paged.items()}, "first": cut, "total": total},
    ]


def tail_only(engine: EngineProcess, ids: dict[int, list[int]], drop: int) -> dict[int, list]:
    """D's ids when its own prefix cache holds the first ``drop`` blocks: it asks P for the
    rest only (P's tail pairs with them)."""
    kinds = {i: g.kind for i, g in engine.layout.groups.items()}
    return {g: b if kinds[g] is GroupKind.STATE else b[drop:] for g, b in ids.items()}


def test_a_chunked_prefill_pushes_each_chunk_as_computed(engines, transport):
    p = engines("prefill", transport, seed=95, num_blocks=512)
    d = engines("decode", transport, seed=96, num_blocks=512)
    p_ids = BlockAllocator(p.layout, 5).request(TOKENS)
    d_ids = tail_only(d, BlockAllocator(d.layout, 6).request(TOKENS), 2)
    before = d.call(cmd="digest")
    early_push(p, d, "s", d_ids, transport)
    layers = paged_layers(p)
    one, two = chunk_parts(p, p_ids)

    def stream(part: dict[str, Any], names: list[str]) -> int:
        return int(p.call(cmd="stream", request_id="s", token=TOKEN, layers=names, **part))

    # the first chunk, every layer but the first (whose notice is lost: it goes whole at publish)
    deadline = time.monotonic() + 30
    while not (streamed := stream(one, layers[1:2])):  # the transport may still be connecting
        assert time.monotonic() < deadline, "the first chunk's layer was never written"
        time.sleep(0.05)
    streamed += stream(one, layers[2:])
    deadline = time.monotonic() + 30
    while d.call(cmd="digest") == before:  # the first chunk lands before the prefill ends
        assert time.monotonic() < deadline, "nothing of the first chunk landed in D"
        time.sleep(0.05)
    streamed += stream(two, layers)  # the last chunk, every layer
    assert stream(two, layers) == 0  # a part's layer is written once
    p.call(
        cmd="publish", request_id="s", block_ids=p_ids, num_tokens=TOKENS, mode="push", token=TOKEN
    )
    out = d.call(cmd="wait", request_id="s", timeout=60)
    assert out["ok"], out["reason"]
    stats = out["stats"]
    assert stats["streamed_nbytes"] == streamed and stats["streamed_parts"] == 2, stats
    # the first layer again and the recurrent state went at publish
    assert 0 < stats["streamed_nbytes"] < stats["nbytes"], stats
    result = d.call(
        cmd="verify", timeout=120, sources=[{"config": p.config, "pairs": [(p_ids, d_ids)]}]
    )
    assert result["ok"], result
    assert p.call(cmd="leased") == []


def test_a_chunked_prefill_is_read_chunk_by_chunk(engines, transport):
    pair = PullPair.start(engines, transport, 97)
    pair.d_ids = tail_only(pair.d, pair.d_ids, 3)
    before = pair.ask_early()
    names = paged_layers(pair.p)
    one, two = chunk_parts(pair.p, pair.p_ids)
    call = {"cmd": "stream", "request_id": "s", "token": TOKEN, "layers": names}
    assert pair.p.call(**call, **one) == 0  # P writes nothing itself: D reads
    pair.wait_read(before)  # D read the first chunk before P computed the second
    pair.p.call(**call, **two)
    pair.publish()
    out = pair.d.call(cmd="wait", request_id="s", timeout=60)
    assert out["ok"], out["reason"]
    stats = out["stats"]
    assert stats["streamed_parts"] == 2 and 0 < stats["streamed_nbytes"] < stats["nbytes"], stats
    pair.check_bytes()
    pair.wait_released()


def test_a_stream_whose_blocks_change_fails_fenced(engines, transport):
    # P preempted mid-prefill and computing the request again in other blocks: a write from
    # the old blocks may still be on its way, so the push fails (fenced) and D computes it
    p = engines("prefill", transport, seed=98, num_blocks=512)
    d = engines("decode", transport, seed=99, num_blocks=512)
    alloc = BlockAllocator(p.layout, 7)
    p_ids, again = alloc.request(TOKENS), alloc.request(TOKENS)
    d_ids = BlockAllocator(d.layout, 8).request(TOKENS)
    early_push(p, d, "s", d_ids, transport)
    layers = paged_layers(p)
    one = chunk_parts(p, p_ids)[0]
    deadline = time.monotonic() + 30
    while not p.call(cmd="stream", request_id="s", token=TOKEN, layers=layers, **one):
        assert time.monotonic() < deadline, "the first chunk was never written"
        time.sleep(0.05)
    moved = chunk_parts(p, again)[0]  # the same positions, other blocks
    assert p.call(cmd="stream", request_id="s", token=TOKEN, layers=layers, **moved) == 0
    p.call(
        cmd="publish", request_id="s", block_ids=again, num_tokens=TOKENS, mode="push", token=TOKEN
    )
    out = d.call(cmd="wait", request_id="s", timeout=60)
    assert not out["ok"] and "changed while streaming" in out["reason"], out
    assert d.call(cmd="held") == []
    assert p.call(cmd="leased") == []
