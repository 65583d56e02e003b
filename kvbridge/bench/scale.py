"""Scale benchmark: what one prefill rank costs as the fleet of decode ranks grows, and one
decode rank as the prefill ranks it loads from grow.

Real control planes with real side channels and a real transport move small requests between
OS processes. A *hub* process holds the one plane under study; *crowd* processes hold the many
peers, several control planes each (a plane is what one vLLM worker runs), so that this
2-core machine reaches hundreds of peers:

* fan-out: the hub is P (TP 1), every crowd plane a D rank pulling from it;
* fan-in: the hub is D (TP 1), the crowd P ranks: instances of ``tp`` ranks each, every rank
  holding its shard of the KV heads as vLLM shards them, so a request reads from every rank
  of its P instance (TP 8 -> TP 1: eight reads per request).

Each point measures the handshakes (every peer's, concurrently), the hub's threads, open file
descriptors, sockets and resident memory against the peer count, a round of requests whose
bytes every D checks, then requests at a number in flight: the rate, the hub's CPU time per
request, and kvbridge's own time per request on D (its total, less the transport's transfer
and the wait for a worker). Finally half the peers leave: the hub's side-channel connections
to them are released once quiet (``Deadlines.quiet``, set short here) and what the hub holds
returns towards its start.

The cache is a Llama-3-70B attention layer's (8 KV heads of 128, fp16, blocks of 16 tokens)
over a few layers and blocks: requests are small, so the control plane, not the copy, is
what is measured.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from kvbridge.adapters.vllm.shards import attention_shards
from kvbridge.bench.processes import WorkerProcess, gather
from kvbridge.control import auth
from kvbridge.control.plane import ControlPlane, TransferParams
from kvbridge.control.requests import rank_engine_id
from kvbridge.core import lanes
from kvbridge.core.groups import CacheGroup, GroupKind
from kvbridge.core.layout import CacheTensor, KVLayout, Layout, LayoutSpec
from kvbridge.core.registry import load_transport
from kvbridge.core.tp import plan_tp_pair
from kvbridge.demo import AddressMap, Arena

#: Llama-3-70B's attention cache: KV heads, bytes of one head's token, tokens per block.
KV_HEADS, HEAD_TOKEN_BYTES, BLOCK = 8, 128 * 2, 16


class ScaleError(RuntimeError):
    """A benchmark process failed or did not answer in time."""


@dataclass(frozen=True)
class ScaleSpec:
    """What every process needs to build its planes (sent to them pickled)."""

    transport: str = "cma"
    layers: int = 2
    blocks: int = 8
    #: blocks of one request (per layer, each K and V)
    request_blocks: int = 2
    timeout: float = 20.0
    #: planes per crowd process
    per_process: int = 32
    #: how long a hub's unused side-channel connection lives in the leave phase
    quiet_s: float = 1.0


def rank_layout(spec: ScaleSpec, allocate: Any, tp_rank: int, tp_size: int) -> Layout:
    """One rank's cache of ``tp_size``: its share of the KV heads, K-first (vLLM's CPU and
    FlashAttention layout ``[2, blocks, heads, block, head]`` per layer), shards as vLLM's."""
    local = KV_HEADS // tp_size
    head = BLOCK * HEAD_TOKEN_BYTES
    part = local * head
    tensors = []
    for layer in range(spec.layers):
        addr = allocate(2 * spec.blocks * part)
        tensors.append(
            CacheTensor(
                f"model.layers.{layer}.self_attn",
                0,
                addr,
                part,
                part,
                KVLayout.K_FIRST,
                v_addr=addr + spec.blocks * part,
                token_major=False,
                shards=attention_shards(KV_HEADS, tp_rank, tp_size, head),
            )
        )
    group = CacheGroup(0, GroupKind.ATTENTION, BLOCK, spec.blocks)
    return Layout(LayoutSpec([group], tensors, tp_rank=tp_rank, tp_size=tp_size))


def request_ids(spec: ScaleSpec) -> dict[int, list[int]]:
    """The blocks of every request, the same on both sides (the benchmark's requests are alike)."""
    return {0: list(range(1, spec.request_blocks + 1))}


def _seed(instance: int, rank: int) -> int:
    return 1000 + 97 * instance + rank


# -- what a process holds ----------------------------------------------------------------------


def process_usage() -> dict[str, float]:
    """This process's OS threads, open descriptors (sockets among them), resident memory and CPU
    time so far."""
    fds = os.listdir("/proc/self/fd")
    sockets = 0
    for fd in fds:
        with contextlib.suppress(OSError):
            sockets += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    rss_kib = 0
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                rss_kib = int(line.split()[1])
    return {
        "threads": len(os.listdir("/proc/self/task")),
        "fds": len(fds),
        "sockets": sockets,
        "rss_mib": rss_kib / 1024,
        "cpu_s": time.process_time(),
    }


@dataclass
class _Plane:
    plane: ControlPlane
    arena: Arena
    instance: int
    rank: int
    tp_size: int


class _Host:
    """The planes of one benchmark process, and the commands the coordinator sends them."""

    def __init__(self, spec: ScaleSpec) -> None:
        self.spec = spec
        self.planes: list[_Plane] = []
        self.sources: dict[int, tuple[Layout, Arena]] = {}  # copies of P ranks, by seed
        self.role = ""
        self.finished = 0
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, daemon=True)
        self._poller.start()

    def _poll(self) -> None:
        # As an engine's step would: P frees the blocks of requests that ended.
        while not self._stop.wait(0.01):
            if self.role == "p":
                for p in list(self.planes):
                    self.finished += len(p.plane.poll_finished())

    def start(self, role: str, ranks: Sequence[tuple[int, int, int]]) -> list[dict[str, Any]]:
        """Planes for ``ranks`` (instance, tp rank, tp size); P planes' memory filled from
        their seed. Their endpoints and engine ids."""
        self.role = role
        out = []
        for instance, rank, tp_size in ranks:
            arena = Arena()
            layout = rank_layout(self.spec, arena.allocate, rank, tp_size)
            if role == "p":
                arena.fill(_seed(instance, rank))
            plane = ControlPlane(
                layout,
                load_transport(self.spec.transport, timeout=self.spec.timeout),
                engine_id=rank_engine_id(f"{role}{instance}", rank, tp_size),
                timeout=self.spec.timeout,
                lease=4 * self.spec.timeout,
            )
            self.planes.append(_Plane(plane, arena, instance, rank, tp_size))
            out.append({"engine_id": plane.engine_id, "endpoint": plane.endpoint})
        return out

    def usage(self) -> dict[str, Any]:
        live = [p.plane for p in self.planes if not p.plane.closed]
        names = collections.Counter(
            t.name.split("[")[0].split("_")[0].rstrip("-0123456789") for t in threading.enumerate()
        )
        return {
            **process_usage(),
            "python_threads": dict(names),
            "planes": len(live),
            "side_channels": sum(p._handshakes.open_connections for p in live),
            "finished": self.finished,
        }

    def handshake(self, endpoints: Sequence[str]) -> float:
        """Every plane handshakes with every endpoint, all at once; seconds until all did."""
        start = time.monotonic()
        futures = [f for p in self.planes for f in p.plane.connect_early(endpoints, patience=60)]
        met = [f.result(timeout=120) for f in futures]
        if any(m is None for m in met):
            raise ScaleError(f"{sum(m is None for m in met)} handshakes failed")
        return time.monotonic() - start

    def publish(self, requests: Sequence[tuple[str, str, int]]) -> list[list[dict[str, Any]]]:
        """P: publish each ``(request id, token, instance)`` on every rank of that P instance
        held here; per request, those ranks' parameters."""
        tokens = BLOCK * self.spec.request_blocks
        ids = request_ids(self.spec)
        return [
            [
                p.plane.publish(rid, ids, tokens, token=token).to_dict()
                for p in self.planes
                if p.instance == instance and not p.plane.closed
            ]
            for rid, token, instance in requests
        ]

    def pull(self, work: Sequence[tuple[int, dict[str, Any]]], check: bool) -> dict[str, Any]:
        """D: plane ``index`` pulls each request of ``work``, all at once; the outcomes'
        own times, and with ``check`` whether every byte landed where it belongs."""
        ids = request_ids(self.spec)
        own: list[float] = []
        queued: list[float] = []
        moved: list[float] = []
        failed: list[str] = []
        wrong = 0
        # Checked requests one at a time: a plane's requests share its blocks.
        for batch in [[w] for w in work] if check else [work]:
            for index, params in batch:
                self.planes[index].plane.pull(TransferParams.from_dict(params), ids)
            for index, params in batch:
                plane = self.planes[index].plane
                outcome = plane.wait(params["request_id"], 4 * self.spec.timeout)
                stats = outcome.stats
                if not outcome.ok:
                    failed.append(f"{params['request_id']}: {outcome.reason}")
                own.append(stats.total_s - stats.transfer_s - stats.queued_s)
                queued.append(stats.queued_s)
                moved.append(stats.transfer_s)
                if check:
                    wrong += self._wrong_bytes(self.planes[index], params)
        return {
            "own_s": own,
            "queued_s": queued,
            "transfer_s": moved,
            "failed": failed,
            "wrong_bytes": wrong,
        }

    def _wrong_bytes(self, d: _Plane, params: dict[str, Any]) -> int:
        """Bytes of a pulled request that differ from what its P ranks hold (regenerated here
        from their seeds, planned with the same TP slicing)."""
        ranks = params.get("ranks") or [[params["engine_id"], params["endpoint"]]]
        tp = len(ranks)
        instance = int(params["engine_id"].split(".")[0][1:])
        ids = request_ids(self.spec)
        mine = AddressMap(d.arena.bases, d.arena.buffers)
        wrong = 0
        for rank in range(tp):
            layout, arena = self._source(instance, rank, tp)
            plan = plan_tp_pair(layout, d.plane.layout, ids, ids)
            if plan is None:
                continue
            theirs = AddressMap(arena.bases, arena.buffers)
            for src, dst, size in zip(plan.src, plan.dst, plan.lengths, strict=True):
                got = mine.view(int(dst), int(size))
                want = theirs.view(int(src), int(size))
                wrong += int(np.count_nonzero(got != want))
        return wrong

    def _source(self, instance: int, rank: int, tp: int) -> tuple[Layout, Arena]:
        key = _seed(instance, rank) * 64 + tp
        if key not in self.sources:
            arena = Arena()
            layout = rank_layout(self.spec, arena.allocate, rank, tp)
            arena.fill(_seed(instance, rank))
            self.sources[key] = (layout, arena)
        return self.sources[key]

    def leave(self, count: int) -> None:
        """The first ``count`` live planes close (their engines go away)."""
        for p in [p for p in self.planes if not p.plane.closed][:count]:
            p.plane.close()

    def set_quiet(self, seconds: float) -> None:
        for p in self.planes:
            p.plane.deadlines = replace(p.plane.deadlines, quiet_timeout=seconds)

    def close(self) -> None:
        self._stop.set()
        for p in self.planes:
            p.plane.close()


# -- one point ---------------------------------------------------------------------------------


@dataclass
class Point:
    """What one hub measured with ``peers`` peers (see the module docstring)."""

    direction: str
    peers: int
    tp: int
    handshake_s: float
    hub_start: dict[str, float]
    hub_connected: dict[str, float]
    crowd_per_plane: dict[str, float]
    #: requests (D checks every byte of each)
    checked: int
    wrong_bytes: int
    failed: list[str]
    #: by number in flight: requests per second, the hub's CPU per request, own time on D
    load: list[dict[str, float]] = field(default_factory=list)
    #: the hub's CPU seconds per handshake it answered or made
    hub_cpu_per_handshake_ms: float = 0.0
    hub_after_leave: dict[str, float] = field(default_factory=dict)
    left: int = 0

    def per_peer(self, key: str) -> float:
        """What the hub holds per peer beyond its start."""
        return (self.hub_connected[key] - self.hub_start[key]) / self.peers


def _percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def run_point(
    spec: ScaleSpec,
    direction: str,
    peers: int,
    *,
    tp: int = 1,
    in_flight: Sequence[int] = (),
    rounds: int = 3,
    min_requests: int = 200,
    leave: bool = True,
) -> Point:
    """One hub and ``peers`` peer ranks (fan-out: D ranks; fan-in: P ranks, ``peers / tp``
    instances of ``tp``), measured as the module docstring says."""
    if direction not in ("fan-out", "fan-in"):
        raise ValueError(f"direction must be fan-out or fan-in, not {direction!r}")
    if peers % tp or (direction == "fan-out" and tp != 1):
        raise ValueError("fan-in peers must be whole instances of tp ranks; fan-out is TP 1")
    hub_role, crowd_role = ("p", "d") if direction == "fan-out" else ("d", "p")
    if direction == "fan-out":
        ranks = [(i, 0, 1) for i in range(peers)]
    else:
        ranks = [(i, r, tp) for i in range(peers // tp) for r in range(tp)]
    chunks = [ranks[i : i + spec.per_process] for i in range(0, len(ranks), spec.per_process)]
    hub = WorkerProcess(_Host, spec, name="hub", error=ScaleError)
    crowd = [
        WorkerProcess(_Host, spec, name=f"crowd {i}", error=ScaleError) for i in range(len(chunks))
    ]
    try:
        hub_planes = hub.call("start", hub_role, [(0, 0, 1)])
        crowd_planes = gather(crowd, "start", [(crowd_role, c) for c in chunks])
        point = _handshake_all(hub, crowd, direction, peers, tp, hub_planes, crowd_planes)
        # One request per D rank (fan-out), or one per P instance read by the hub (fan-in):
        # every byte checked.
        counter = iter(range(1 << 30))
        first = peers if direction == "fan-out" else peers // tp
        _one_wave(point, hub, crowd, chunks, direction, tp, first, counter, check=True)
        for target in in_flight:
            waves = max(rounds, -(-min_requests // target))
            point.load.append(_load_row(point, hub, crowd, chunks, target, waves, counter))
        if leave:
            # Half the peers go away; the hub releases what it held for them once quiet.
            leaving = [len(c) // 2 for c in chunks]
            hub.call("set_quiet", spec.quiet_s)
            gather(crowd, "leave", [(n,) for n in leaving])
            # Past the quiet bound and the lanes' idle exit: what the hub holds at rest.
            time.sleep(max(2.5 * spec.quiet_s, lanes.IDLE_EXIT_S + 3))
            point.left = sum(leaving)
            point.hub_after_leave = hub.call("usage")
        return point
    finally:
        hub.stop()
        for proc in crowd:
            proc.stop()


def _handshake_all(
    hub: WorkerProcess,
    crowd: Sequence[WorkerProcess],
    direction: str,
    peers: int,
    tp: int,
    hub_planes: Any,
    crowd_planes: Any,
) -> Point:
    """D ranks handshake with their P ranks, all at once: the point's handshake figures."""
    before = gather(crowd, "usage", [()] * len(crowd))
    hub_start = hub.call("usage")
    t0 = time.monotonic()
    if direction == "fan-out":
        gather(crowd, "handshake", [([hub_planes[0]["endpoint"]],)] * len(crowd))
    else:
        endpoints = [p["endpoint"] for planes in crowd_planes for p in planes]
        hub.call("handshake", endpoints)
    handshake_s = time.monotonic() - t0
    hub_connected = hub.call("usage")
    # P opens its side channel to each D that handshook in the background: wait for it.
    settle = time.monotonic() + 10
    while hub_connected["side_channels"] < peers and time.monotonic() < settle:
        time.sleep(0.1)
        hub_connected = hub.call("usage")
    after = gather(crowd, "usage", [()] * len(crowd))
    crowd_per_plane = {
        key: sum(a[key] - b[key] for a, b in zip(after, before, strict=True)) / peers
        for key in ("threads", "fds", "sockets", "rss_mib")
    }
    return Point(
        direction,
        peers,
        tp,
        handshake_s,
        hub_start,
        hub_connected,
        crowd_per_plane,
        0,
        0,
        [],
        hub_cpu_per_handshake_ms=1e3
        * (hub_connected["cpu_s"] - hub_start["cpu_s"])
        / max(1, peers),
    )


def _load_row(
    point: Point,
    hub: WorkerProcess,
    crowd: Sequence[WorkerProcess],
    chunks: Sequence[Sequence[tuple[int, int, int]]],
    target: int,
    waves: int,
    counter: Any,
) -> dict[str, float]:
    """``waves`` waves of ``target`` requests in flight: throughput, the hub's CPU, latencies."""
    usage0 = hub.call("usage")
    start = time.monotonic()
    got: dict[str, list[float]] = {"own_s": [], "queued_s": [], "transfer_s": []}
    done = 0
    for _ in range(waves):
        wave = _one_wave(
            point, hub, crowd, chunks, point.direction, point.tp, target, counter, False
        )
        for key, values in got.items():
            values += wave[key]
        done += target
    wall = time.monotonic() - start
    usage1 = hub.call("usage")
    return {
        "in_flight": target,
        "requests": done,
        "per_s": done / wall,
        "hub_cpu_ms": 1e3 * (usage1["cpu_s"] - usage0["cpu_s"]) / done,
        "own_p50_ms": 1e3 * _percentile(got["own_s"], 50),
        "own_p99_ms": 1e3 * _percentile(got["own_s"], 99),
        "transfer_p50_ms": 1e3 * _percentile(got["transfer_s"], 50),
        "queued_p99_ms": 1e3 * _percentile(got["queued_s"], 99),
    }


def _one_wave(
    point: Point,
    hub: WorkerProcess,
    crowd: Sequence[WorkerProcess],
    chunks: Sequence[Sequence[tuple[int, int, int]]],
    direction: str,
    tp: int,
    count: int,
    counter: Any,
    check: bool,
) -> dict[str, list[float]]:
    """``count`` requests at once: published on P, pulled by D; the D side's figures."""
    if direction == "fan-out":
        requests = [(f"s{next(counter)}", auth.new_token(), 0) for _ in range(count)]
        params = [each[0] for each in hub.call("publish", requests)]
        # Request k goes to D rank k (round robin over the crowd's planes).
        work: list[list[tuple[int, dict[str, Any]]]] = [[] for _ in crowd]
        flat = [(c, i) for c, chunk in enumerate(chunks) for i in range(len(chunk))]
        for k, prm in enumerate(params):
            c, i = flat[k % len(flat)]
            work[c].append((i, prm))
        results = gather(crowd, "pull", [(w, check) for w in work])
    else:
        # Request k is P instance k's: every rank of it publishes (the same token), the hub
        # reads from all of them.
        instances = sum(len(c) for c in chunks) // tp
        requests = [(f"s{next(counter)}", auth.new_token(), k % instances) for k in range(count)]
        mine = [
            [(k, req) for k, req in enumerate(requests) if req[2] in _instances(c)] for c in chunks
        ]
        published = gather(crowd, "publish", [([req for _, req in reqs],) for reqs in mine])
        ranks: dict[int, list[dict[str, Any]]] = {}
        for c, reqs in enumerate(mine):
            for (k, _), planes in zip(reqs, published[c], strict=True):
                ranks.setdefault(k, []).extend(planes)
        params = []
        for k in range(count):
            each = sorted(ranks[k], key=lambda p: p["engine_id"])
            prm = dict(each[0])
            if tp > 1:
                prm["ranks"] = [[p["engine_id"], p["endpoint"]] for p in each]
            params.append(prm)
        results = [hub.call("pull", [(0, prm) for prm in params], check)]
    got: dict[str, list[float]] = {"own_s": [], "queued_s": [], "transfer_s": []}
    for res in results:
        for key, values in got.items():
            values += res[key]
        if check:
            point.checked += len(res["own_s"])
            point.wrong_bytes += res["wrong_bytes"]
        point.failed += res["failed"]
    return got


def _instances(chunk: Sequence[tuple[int, int, int]]) -> set[int]:
    return {instance for instance, _, _ in chunk}


def point_dict(point: Point) -> dict[str, Any]:
    """The JSON form of a point, with the per-peer figures derived."""
    out = asdict(point)
    out["hub_per_peer"] = {
        key: point.per_peer(key) for key in ("threads", "fds", "sockets", "rss_mib")
    }
    return out


def summarise(points: Sequence[Point]) -> str:
    """A plain-text table of points, for the terminal."""
    lines = []
    for p in points:
        load = ", ".join(
            f"{x['in_flight']}: {x['per_s']:.0f}/s cpu {x['hub_cpu_ms']:.2f} ms "
            f"own p50/p99 {x['own_p50_ms']:.2f}/{x['own_p99_ms']:.2f} ms"
            for x in p.load
        )
        lines.append(
            f"{p.direction} tp{p.tp} peers {p.peers}: handshakes {p.handshake_s:.2f} s, hub per "
            f"peer threads {p.per_peer('threads'):.2f} fds {p.per_peer('fds'):.2f} rss "
            f"{p.per_peer('rss_mib') * 1024:.0f} KiB; checked {p.checked} wrong "
            f"{p.wrong_bytes} failed {len(p.failed)}; {load}"
        )
    return "\n".join(lines)


__all__ = ["Point", "ScaleError", "ScaleSpec", "point_dict", "run_point", "summarise"]
