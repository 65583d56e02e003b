"""P and D of different TP sizes: every TP rank an OS process, real bytes through the transports.

Each rank's cache is a ``TPModel`` rank (``tests.core.tp_layouts``: shards as vLLM shards KV
heads, MLA's latent, GDN conv channels and ssm heads) over real memory; what each D rank holds
afterwards is checked byte for byte against the slow per-unit reference (``tp_reference``),
not against the planner. The serving engine's part (one set of transfer parameters naming every
P rank; the same block ids on every rank of a side) is played by the test.
"""

from __future__ import annotations

import random
import signal
import time
from typing import Any

import pytest

from kvbridge.control import auth
from kvbridge.control.requests import rank_engine_id
from tests.control.conftest import FAULT_TIMINGS
from tests.control.engine import BlockAllocator, EngineProcess

pytestmark = pytest.mark.timeout(240)

#: the transports between whose processes TP pairs are proven (the issue's: both engines)
ENGINES = ["mooncake", "nixl"]
TIMEOUT = 4.0
MODELS: dict[str, dict[str, Any]] = {
    "attention": {"kind": "attention", "kv_heads": 4, "head_bytes": 16, "block": 16, "layers": 3},
    "attention K<TP": {
        "kind": "attention",
        "kv_heads": 1,
        "head_bytes": 16,
        "block": 16,
        "layers": 3,
        "kv_layout": "k_first",
    },
    "mla": {"kind": "mla", "latent_bytes": 64, "block": 16, "layers": 3},
    "gdn hybrid": {
        "kind": "gdn",
        "kv_heads": 2,
        "head_bytes": 16,
        "block": 16,
        "layers": 2,
        "key_dim": 16,
        "value_dim": 32,
        "state_len": 3,
        "v_heads": 4,
        "ssm_head_bytes": 64,
    },
}


@pytest.fixture(params=ENGINES)
def engine_name(request: pytest.FixtureRequest) -> str:
    from tests.control.conftest import USABLE

    if request.param not in USABLE:
        pytest.skip(f"{request.param} is not usable here")
    return str(request.param)


def start_side(engines, transport: str, side: str, size: int, model: dict, **config: Any):
    return [
        engines(
            f"{side}{rank}",
            transport,
            tp={"model": model, "rank": rank, "size": size},
            num_blocks=96,
            seed=(100 if side == "p" else 200) + rank,
            engine_id=f"{side}-engine.tp{rank}",
            timeout=TIMEOUT,
            **config,
        )
        for rank in range(size)
    ]


def publish(p: list[EngineProcess], rid: str, ids: dict, tokens: int, mode: str) -> dict:
    """Publish on every P rank; the transfer parameters the serving engine hands to D.

    One capability token for every rank, as vLLM's scheduler makes it for the request."""
    token = auth.new_token()
    params = [
        r.call(
            cmd="publish", request_id=rid, block_ids=ids, num_tokens=tokens, mode=mode, token=token
        )
        for r in p
    ]
    out = dict(params[0])
    if len(p) > 1:
        out["ranks"] = [[prm["engine_id"], prm["endpoint"]] for prm in params]
        out["pp_size"] = p[0].config["tp"].get("pp", {}).get("size", 1)
    return out


def outcomes(engine: EngineProcess, want: int, timeout: float = 20) -> dict[str, dict]:
    got: dict[str, dict] = {}
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        got.update({o["request_id"]: o for o in engine.call(cmd="finished")})
        if len(got) < want:
            time.sleep(0.05)
    return got


def run(p, d, mode: str, count: int, seed: int):
    """Publish ``count`` requests on every P rank, load them on every D rank at once; the ids."""
    rng = random.Random(seed)
    p_alloc, d_alloc = BlockAllocator(p[0].layout, seed), BlockAllocator(d[0].layout, seed + 1)
    requests, params = [], []
    for i in range(count):
        tokens = rng.randint(1, 200)
        p_ids, d_ids = p_alloc.request(tokens), d_alloc.request(tokens)
        params.append(publish(p, f"r{seed}-{i}", p_ids, tokens, mode))
        requests.append((p_ids, d_ids))
    for prm, (_, d_ids) in zip(params, requests, strict=True):
        for rank in d:
            assert rank.call(cmd=mode, params=prm, block_ids=d_ids) == {"started": True}
    return requests, params


CASES = [
    *[("pull", kind) for kind in MODELS],
    ("push", "attention K<TP"),
    ("push", "gdn hybrid"),
]


@pytest.mark.parametrize("tps", [(2, 1), (1, 2)], ids=["P2-D1", "P1-D2"])
@pytest.mark.parametrize(("mode", "kind"), CASES, ids=[f"{m}-{k}" for m, k in CASES])
def test_tp_pair_moves_every_byte(engines, engine_name, tps, mode, kind):
    tp_p, tp_d = tps
    p = start_side(engines, engine_name, "p", tp_p, MODELS[kind])
    d = start_side(engines, engine_name, "d", tp_d, MODELS[kind])
    requests, params = run(p, d, mode, 6, seed=7)
    for rank in d:
        for prm in params:
            out = rank.call(cmd="wait", request_id=prm["request_id"], timeout=60)
            assert out["ok"], out["reason"]
        checked = rank.call(
            cmd="verify_tp", timeout=120, sources=[r.config for r in p], requests=requests
        )
        assert checked["ok"] and checked["bytes"] > 0, checked
    # every P rank frees each request once every D rank reading it is done
    for rank in p:
        freed = outcomes(rank, len(params))
        assert len(freed) == len(params) and all(o["ok"] for o in freed.values()), freed
        assert rank.call(cmd="leased") == []
    for rank in [*p, *d]:
        assert rank.stop() == {"leased": [], "registered_after_plane_close": 0}


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_equal_tp_above_one_reads_rank_to_rank(engines, engine_name, mode):
    """TP 2 on both sides: D rank r loads from P rank r alone (each P rank's lease ends with
    one release), every byte as the reference says."""
    p = start_side(engines, engine_name, "p", 2, MODELS["gdn hybrid"])
    d = start_side(engines, engine_name, "d", 2, MODELS["gdn hybrid"])
    requests, params = run(p, d, mode, 4, seed=9)
    for rank in d:
        for prm in params:
            out = rank.call(cmd="wait", request_id=prm["request_id"], timeout=60)
            assert out["ok"], out["reason"]
        assert rank.call(
            cmd="verify_tp", timeout=120, sources=[r.config for r in p], requests=requests
        )["ok"]
    for rank in p:
        freed = outcomes(rank, len(params))
        assert len(freed) == len(params) and all(o["ok"] for o in freed.values()), freed


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_prefill_rank_killed_fails_the_load_and_frees_the_rest(engines, engine_name, mode):
    """P TP 2 → D TP 1: P rank 1 dies after the request was published; D fails it within its
    bound (no wait without end), P rank 0 frees its blocks, nothing stays held or registered."""
    p = start_side(engines, engine_name, "p", 2, MODELS["attention"])
    d = start_side(engines, engine_name, "d", 1, MODELS["attention"])
    _, [first] = run(p, d, mode, 1, seed=3)  # handshakes done, transports connected
    assert d[0].call(cmd="wait", request_id=first["request_id"], timeout=60)["ok"]
    p_ids = BlockAllocator(p[0].layout, 5).request(150)
    d_ids = BlockAllocator(d[0].layout, 6).request(150)
    params = publish(p, "victim", p_ids, 150, mode)
    p[1].kill(signal.SIGKILL)
    start = time.monotonic()
    assert d[0].call(cmd=mode, params=params, block_ids=d_ids) == {"started": True}
    out = d[0].call(cmd="wait", request_id="victim", timeout=60)
    took = time.monotonic() - start
    FAULT_TIMINGS.append((f"{engine_name}: P rank 1 of 2 killed ({mode}) -> D fails", took))
    assert not out["ok"]
    assert took < 5 + 2 * TIMEOUT + 5  # handshake bound + transfer bounds + slack
    freed = outcomes(p[0], 2)  # the first request, and the victim
    # freed: at D's failed release (pull), or once its own write ended (push: it may have
    # written its part before D heard of rank 1; D's load failed all the same)
    assert "victim" in freed, freed
    assert mode == "push" or not freed["victim"]["ok"], freed
    assert p[0].call(cmd="leased") == []
    assert d[0].call(cmd="held") == []
    for rank in (p[0], d[0]):
        assert rank.stop() == {"leased": [], "registered_after_plane_close": 0}


def test_decode_rank_killed_leaves_the_lease_to_expire(engines, engine_name):
    """P TP 1 → D TP 2: D rank 1 dies before loading; D rank 0 still loads every byte, and P
    keeps the blocks (D rank 1 may still read them) until its lease ends, then frees them."""
    lease = 2 * TIMEOUT + 1
    p = start_side(engines, engine_name, "p", 1, MODELS["attention"], lease=lease)
    d = start_side(engines, engine_name, "d", 2, MODELS["attention"], lease=lease)
    d[1].kill(signal.SIGKILL)
    p_ids = BlockAllocator(p[0].layout, 5).request(100)
    d_ids = BlockAllocator(d[0].layout, 6).request(100)
    params = publish(p, "half", p_ids, 100, "pull")
    start = time.monotonic()
    assert d[0].call(cmd="pull", params=params, block_ids=d_ids) == {"started": True}
    assert d[0].call(cmd="wait", request_id="half", timeout=60)["ok"]
    assert d[0].call(
        cmd="verify_tp", timeout=120, sources=[r.config for r in p], requests=[(p_ids, d_ids)]
    )["ok"]
    assert p[0].call(cmd="leased") == ["half"]  # D rank 1 has not said it is done
    freed = outcomes(p[0], 1, timeout=lease + 10)
    FAULT_TIMINGS.append(
        (f"{engine_name}: D rank 1 of 2 killed -> P frees at lease", time.monotonic() - start)
    )
    assert "half" in freed and not freed["half"]["ok"]
    assert "expired" in freed["half"]["reason"]
    assert p[0].stop() == {"leased": [], "registered_after_plane_close": 0}


def test_prefill_rank_killed_mid_transfer(engines, engine_name):
    """P TP 2 → D TP 1, pull: P rank 1 dies the moment D claimed its part (D's reads from both
    ranks are submitted together). D's load ends within its bound: failed, or (the bytes had
    already arrived) done and exact; P rank 0 frees its blocks; nothing stays held."""
    model = dict(MODELS["attention"], head_bytes=256, layers=4)
    p = start_side(engines, engine_name, "p", 2, model)
    d = start_side(engines, engine_name, "d", 1, model)
    earlier, [first] = run(p, d, "pull", 1, seed=3)
    assert d[0].call(cmd="wait", request_id=first["request_id"], timeout=60)["ok"]
    p_ids = BlockAllocator(p[0].layout, 5).request(1000)
    d_ids = BlockAllocator(d[0].layout, 6).request(1000)
    params = publish(p, "victim", p_ids, 1000, "pull")
    start = time.monotonic()
    assert d[0].call(cmd="pull", params=params, block_ids=d_ids) == {"started": True}
    deadline = time.monotonic() + 10
    while not p[1].call(cmd="readers").get("victim") and time.monotonic() < deadline:
        time.sleep(0.001)
    p[1].kill(signal.SIGKILL)
    out = d[0].call(cmd="wait", request_id="victim", timeout=60)
    took = time.monotonic() - start
    FAULT_TIMINGS.append((f"{engine_name}: P rank 1 of 2 killed mid-pull -> D {out['ok']}", took))
    assert took < 5 + 2 * TIMEOUT + 5
    if out["ok"]:  # the read had finished before the kill: the bytes must be exact
        checked = d[0].call(
            cmd="verify_tp",
            timeout=120,
            sources=[r.config for r in p],
            requests=[*earlier, (p_ids, d_ids)],
        )
        assert checked["ok"], checked
    freed = outcomes(p[0], 2)
    assert "victim" in freed, freed
    assert p[0].call(cmd="leased") == []
    assert d[0].call(cmd="held") == []
    for rank in (p[0], d[0]):
        assert rank.stop() == {"leased": [], "registered_after_plane_close": 0}


def test_decode_rank_killed_mid_transfer(engines, engine_name):
    """P TP 1 → D TP 2, pull: D rank 1 dies the moment it claimed its part. D rank 0 loads every
    byte; P keeps the blocks until D rank 1's word or the lease's end, then frees them."""
    lease = 2 * TIMEOUT + 1
    model = dict(MODELS["attention"], head_bytes=256, layers=4)
    p = start_side(engines, engine_name, "p", 1, model, lease=lease)
    d = start_side(engines, engine_name, "d", 2, model, lease=lease)
    p_ids = BlockAllocator(p[0].layout, 5).request(1000)
    d_ids = BlockAllocator(d[0].layout, 6).request(1000)
    params = publish(p, "half", p_ids, 1000, "pull")
    start = time.monotonic()
    for rank in d:
        assert rank.call(cmd="pull", params=params, block_ids=d_ids) == {"started": True}
    deadline = time.monotonic() + 10
    while 1 not in p[0].call(cmd="readers").get("half", [1]) and time.monotonic() < deadline:
        time.sleep(0.001)
    d[1].kill(signal.SIGKILL)
    loaded = d[0].call(cmd="wait", request_id="half", timeout=60)
    assert loaded["ok"], loaded
    assert d[0].call(
        cmd="verify_tp", timeout=120, sources=[r.config for r in p], requests=[(p_ids, d_ids)]
    )["ok"]
    freed = outcomes(p[0], 1, timeout=lease + 10)
    FAULT_TIMINGS.append(
        (f"{engine_name}: D rank 1 of 2 killed mid-pull -> P frees", time.monotonic() - start)
    )
    assert "half" in freed, freed
    assert p[0].call(cmd="leased") == []
    assert p[0].stop() == {"leased": [], "registered_after_plane_close": 0}


def start_stages(
    engines, transport: str, side: str, pp: int, tp: int, model: dict, **config: Any
) -> list[EngineProcess]:
    """Every worker of an engine of ``pp`` pipeline stages of ``tp`` ranks, stage-major (as
    ``TransferParams.ranks`` lists them): each holds its stage's layers alone (vLLM's split);
    the workers of one TP rank share a seed, so every layer's bytes are those of the whole."""
    return [
        engines(
            f"{side}{stage}.{rank}",
            transport,
            tp={"model": model, "rank": rank, "size": tp, "pp": {"rank": stage, "size": pp}},
            num_blocks=96,
            seed=(100 if side == "p" else 200) + rank,
            engine_id=rank_engine_id(f"{side}-engine", rank, tp, stage, pp),
            timeout=TIMEOUT,
            **config,
        )
        for stage in range(pp)
        for rank in range(tp)
    ]


#: Each direction on each transport, each mode, with and without TP (CI time: every pair on
#: both transports adds a minute; a stage's part is a TP pair's, which the cases above prove
#: on both).
STAGE_CASES = [
    ("mooncake", (2, 1), (1, 1), "pull"),
    ("nixl", (1, 2), (1, 1), "push"),
    ("mooncake", (2, 3), (2, 1), "pull"),
    ("nixl", (3, 2), (1, 2), "push"),
]


@pytest.mark.parametrize(
    ("transport", "pps", "tps", "mode"),
    STAGE_CASES,
    ids=[f"{e}-PP{p[0]}xTP{t[0]}-PP{p[1]}xTP{t[1]}-{m}" for e, p, t, m in STAGE_CASES],
)
def test_pipeline_stages_move_every_byte(engines, transport, pps, tps, mode):
    """P and D of different pipeline-parallel sizes (and TP sizes): every D worker loads its
    stage's layers from the P stages holding them, every byte as the whole engines' reference
    says (no byte of another stage's layers touched); every P worker's lease ends once every
    D worker said it is done (a D stage reading nothing there too)."""
    from tests.control.conftest import USABLE

    if transport not in USABLE:
        pytest.skip(f"{transport} is not usable here")
    model = dict(MODELS["attention"], layers=5)
    p = start_stages(engines, transport, "p", pps[0], tps[0], model)
    d = start_stages(engines, transport, "d", pps[1], tps[1], model)
    requests, params = run(p, d, mode, 4, seed=11)
    assert all(prm["pp_size"] == pps[0] for prm in params)
    moved = 0
    for worker in d:
        for prm in params:
            out = worker.call(cmd="wait", request_id=prm["request_id"], timeout=60)
            assert out["ok"], out["reason"]
        checked = worker.call(
            cmd="verify_tp", timeout=120, sources=[r.config for r in p[: tps[0]]], requests=requests
        )
        assert checked["ok"], checked
        moved += checked["bytes"]
    assert moved > 0
    for worker in p:
        freed = outcomes(worker, len(params))
        assert len(freed) == len(params) and all(o["ok"] for o in freed.values()), freed
        assert worker.call(cmd="leased") == []
    for worker in [*p, *d]:
        assert worker.stop() == {"leased": [], "registered_after_plane_close": 0}
