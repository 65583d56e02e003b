"""Transfer benchmark: one request moved between two processes on loopback, four ways.

For each installed, usable transport a prefill and a decode process hold a real KV cache of a
model shape (filled so that every 8-byte word is distinct) and move the same request:

* ``kvbridge``: end to end through the control plane in pull mode (decode asks prefill, plans,
  submits, waits, releases); timed on the decode side from ``pull`` to the request's outcome.
* ``verify-sample``, ``verify-full``: the same with the integrity check on (``verify``): both
  sides digest the moved bytes (a sample of the descriptors, or all) before the outcome.
* ``transport``: kvbridge without the control plane: plan, then ``Transport.transfer``.
* ``raw``: the engine's own Python API on the same descriptor arrays, no kvbridge code
  (``benchmarks/raw_engines.py`` in the source tree).
* ``memcpy``: the same descriptors copied with ``memmove`` inside the decode process, from a
  local copy of the prefill cache: what this machine's memory allows.

Each repetition runs every way once, in orders balanced so that each way runs in each position
and after each other way equally often: drift of the machine affects them alike, and ratios are
taken within a repetition. A first, untimed repetition connects the peers and checks every byte
of the decode cache (and that nothing else changed) for each way.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvbridge.bench.cases import CASES, BenchCase, load_source_module, request_ids
from kvbridge.bench.processes import WorkerProcess
from kvbridge.control.plane import ControlPlane, TransferParams
from kvbridge.core.batches import TransferOp
from kvbridge.core.boundary import remote_prefill_token_count
from kvbridge.core.integrity import Verify
from kvbridge.core.layout import Layout
from kvbridge.core.planning import plan_transfers
from kvbridge.core.registry import load_transport
from kvbridge.core.tp import plan_tp_pair
from kvbridge.core.transport import Transport
from kvbridge.demo import Arena
from kvbridge.workloads.shapes import bump_allocator

MODES = ("kvbridge", "verify-sample", "verify-full", "transport", "raw", "memcpy")
#: The raw engine baseline, in the source tree: what kvbridge is measured against.
RAW_PATH = "benchmarks/raw_engines.py"
RAW_MODULE = "kvbridge_bench_raw_engines"
PATTERN = "realistic"
_FILL_CHUNK = 1 << 21  # words filled per step, to keep temporaries small


class BenchError(RuntimeError):
    """A benchmark process failed or did not answer in time."""


@dataclass(frozen=True)
class CaseSpec:
    """What both processes need to build the same request (sent to them pickled)."""

    case: str
    prompt_tokens: int
    num_blocks: int
    num_layers: int | None
    seed: int
    timeout: float


def size_request(case: BenchCase, target_bytes: int, num_layers: int | None) -> int:
    """The smallest prompt (in whole logical blocks) whose request moves ``target_bytes``."""
    first = case.layout(1, bump_allocator(), num_layers)
    block = first.groups[min(first.groups)].block_size
    extra = 1 if first.has_state else 0  # N-1 tokens move when the model has recurrent state

    def nbytes(blocks: int) -> int:
        tokens = blocks * block + extra
        pool = case.blocks_needed(tokens, num_layers) + 2
        p = case.layout(pool, bump_allocator(0x7F00_0000_0000), num_layers)
        d = case.layout(pool, bump_allocator(0x6F00_0000_0000), num_layers)
        rng = np.random.default_rng(0)
        ids_p = request_ids(p, tokens, "contiguous", rng)
        ids_d = request_ids(d, tokens, "contiguous", rng)
        return plan_transfers(p, d, ids_p, ids_d, check=False).nbytes

    lo, hi = 1, 1
    while nbytes(hi) < target_bytes and hi < 1 << 16:
        lo, hi = hi, hi * 2
    while lo < hi:
        mid = (lo + hi) // 2
        if nbytes(mid) >= target_bytes:
            hi = mid
        else:
            lo = mid + 1
    return hi * block + extra


# -- the two processes -----------------------------------------------------------------------


def _fill(arena: Arena, seed: int) -> None:
    """Give every 8-byte word of every buffer a distinct value, so a misplaced byte shows."""
    for index, buf in enumerate(arena.buffers):
        words = buf[: buf.size // 8 * 8].view(np.uint64)
        tag = np.uint64(((seed + 1) << 56) | (index << 40))
        for start in range(0, words.size, _FILL_CHUNK):
            stop = min(start + _FILL_CHUNK, words.size)
            chunk = words[start:stop]
            chunk[:] = np.arange(start, stop, dtype=np.uint64)
            chunk |= tag
        buf[words.size * 8 :] = seed & 0xFF


def _engine_cache(spec: CaseSpec, role_seed: int) -> tuple[Arena, Layout, dict[int, list[int]]]:
    arena = Arena()
    layout = CASES[spec.case].layout(spec.num_blocks, arena.allocate, spec.num_layers)
    _fill(arena, role_seed)
    ids = request_ids(
        layout, spec.prompt_tokens, PATTERN, np.random.default_rng([spec.seed, role_seed])
    )
    return arena, layout, ids


def _ranges(layout: Layout) -> list[tuple[int, int]]:
    return [(r.addr, r.size) for r in layout.registration]


class _Side:
    """One benchmark process's engine: the transport and, beside it, the raw engine when
    ``benchmarks/raw_engines.py`` has one for it."""

    def __init__(self, transport: Transport, raw: Any) -> None:
        self.transport, self.raw = transport, raw

    def has_raw(self) -> bool:
        return self.raw is not None

    def close(self) -> None:
        if self.raw is not None:
            self.raw.close()
        self.transport.close()


class _Prefill(_Side):
    """The prefill engine: holds the request, publishes it, serves the decode side's reads."""

    def case(self, spec: CaseSpec) -> dict[str, Any]:
        self.spec = spec
        self.arena, self.layout, self.ids = _engine_cache(spec, spec.seed)
        self.tokens = remote_prefill_token_count(spec.prompt_tokens, self.layout.has_state)
        self.plane = ControlPlane(
            self.layout, self.transport, timeout=spec.timeout, lease=4 * spec.timeout
        )
        if self.raw is not None:
            self.raw.register(_ranges(self.layout))
        return {
            "spec": self.layout.to_json(),
            "ids": self.ids,
            "raw": self.raw.metadata() if self.raw is not None else None,
        }

    def publish(self, request_id: str) -> dict[str, Any]:
        self.plane.poll_finished()  # earlier requests' outcomes: their blocks are free again
        return self.plane.publish(request_id, self.ids, self.tokens).to_dict()

    def end_case(self) -> None:
        self.plane.close()
        if self.raw is not None:
            self.raw.deregister(_ranges(self.layout))
        del self.arena


class _Decode(_Side):
    """The decode engine: moves the request each way and checks the bytes it received."""

    def __init__(self, transport: Transport, raw: Any) -> None:
        super().__init__(transport, raw)
        self.peer = ""

    def case(self, spec: CaseSpec, prefill: dict[str, Any]) -> dict[str, Any]:
        self.spec = spec
        self.arena, self.layout, self.ids = _engine_cache(spec, spec.seed + 1)
        self.p_layout = Layout.from_json(prefill["spec"])
        self.p_ids = {int(k): v for k, v in prefill["ids"].items()}
        plan = plan_transfers(self.p_layout, self.layout, self.p_ids, self.ids)
        self.plan = plan
        self.arrays = plan.local_remote(TransferOp.READ)
        # The memcpy ceiling copies the same request from a local copy of the prefill cache.
        self.copy, copy_layout, _ = _engine_cache(spec, spec.seed)
        local = plan_transfers(copy_layout, self.layout, self.p_ids, self.ids)
        self.copies = list(
            zip(local.dst.tolist(), local.src.tolist(), local.lengths.tolist(), strict=True)
        )
        self.plane = ControlPlane(
            self.layout, self.transport, timeout=spec.timeout, lease=4 * spec.timeout
        )
        if self.raw is not None:
            self.raw.register(_ranges(self.layout))
            self.raw.connect(prefill["raw"])
        self._zero()
        self._memcpy(None)
        self.expected = self._digest()
        return {
            "bytes": plan.nbytes,
            "descriptors": plan.count,
            "descriptors_before": plan.unmerged,
            "cache_bytes": sum(b.size for b in self.arena.buffers),
        }

    def run(self, mode: str, payload: Any, verify: bool) -> dict[str, float]:
        if verify:
            self._zero()
        result: dict[str, float] = getattr(self, f"_{mode.replace('-', '_')}")(payload)
        if verify and self._digest() != self.expected:
            raise BenchError(
                f"{mode}: the decode cache differs from what the prefill cache holds after "
                "the transfer"
            )
        return result

    def _verify_sample(self, params: dict[str, Any]) -> dict[str, float]:
        return self._kvbridge(params, Verify.SAMPLE)

    def _verify_full(self, params: dict[str, Any]) -> dict[str, float]:
        return self._kvbridge(params, Verify.FULL)

    def _kvbridge(self, params: dict[str, Any], verify: Verify = Verify.OFF) -> dict[str, float]:
        self.plane.verify = verify
        request = TransferParams.from_dict(params)
        start = time.perf_counter()
        self.plane.pull(request, self.ids)
        outcome = self.plane.wait(request.request_id, 3 * self.spec.timeout)
        seconds = time.perf_counter() - start
        if not outcome.ok:
            raise BenchError(f"kvbridge pull failed: {outcome.reason}")
        self.peer = request.engine_id  # the control plane connected the transport under it
        stats = outcome.stats
        return {
            "seconds": seconds,
            "transfer_seconds": stats.transfer_s,
            "plan_seconds": stats.plan_s,
            "plan_warm_seconds": self._plan_warm(request),
            "handshake_seconds": stats.handshake_s,
            "verify_seconds": stats.verify_s,
            "queued_seconds": stats.queued_s,
            "ask_seconds": stats.ask_s,
        }

    def _plan_warm(self, request: TransferParams) -> float:
        """Seconds to plan the request once more right after planning it (off the clock).

        Inside the run the plan starts with CPU caches that the previous transfer just swept
        (on this machine the bytes pass through them); this is its cost with them warm.
        """
        plan_tp_pair(self.p_layout, self.layout, request.block_ids, self.ids)
        start = time.perf_counter()
        plan_tp_pair(self.p_layout, self.layout, request.block_ids, self.ids)
        return time.perf_counter() - start

    def _transport(self, _: object) -> dict[str, float]:
        start = time.perf_counter()
        plan = plan_transfers(self.p_layout, self.layout, self.p_ids, self.ids)
        planned = time.perf_counter()
        self.transport.transfer(TransferOp.READ, self.peer, *plan.local_remote(TransferOp.READ))
        end = time.perf_counter()
        return {"seconds": end - start, "plan_seconds": planned - start}

    def _raw(self, _: object) -> dict[str, float]:
        start = time.perf_counter()
        self.raw.read(*self.arrays)
        return {"seconds": time.perf_counter() - start}

    def _memcpy(self, _: object) -> dict[str, float]:
        memmove, copies = ctypes.memmove, self.copies
        start = time.perf_counter()
        for dst, src, n in copies:
            memmove(dst, src, n)
        return {"seconds": time.perf_counter() - start}

    def _zero(self) -> None:
        for buf in self.arena.buffers:
            buf.fill(0)

    def _digest(self) -> bytes:
        h = hashlib.blake2b(digest_size=32)
        for buf in self.arena.buffers:
            h.update(buf.data)
        return h.digest()

    def end_case(self) -> None:
        self.plane.close()
        if self.raw is not None:
            self.raw.deregister(_ranges(self.layout))
        del self.arena, self.copy, self.copies


def _side(role: str, transport: str, options: dict[str, Any]) -> _Side:
    """A benchmark process's engine (``WorkerProcess`` builds it in the process)."""
    t = load_transport(transport, **options)
    module = load_source_module(RAW_PATH, RAW_MODULE)
    engines = getattr(module, "ENGINES", {})
    raw = engines[transport]() if transport in engines else None
    return _Prefill(t, raw) if role == "prefill" else _Decode(t, raw)


# -- the coordinator -------------------------------------------------------------------------


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _summary(
    transport: str,
    case: BenchCase,
    spec: CaseSpec,
    info: dict[str, Any],
    samples: dict[str, list[dict[str, float]]],
) -> dict[str, Any]:
    nbytes = info["bytes"]
    seconds = {mode: [s["seconds"] for s in runs] for mode, runs in samples.items()}
    gbps: dict[str, float | None] = {
        mode: _median([nbytes / s / 1e9 for s in values]) for mode, values in seconds.items()
    }
    kv = samples.get("kvbridge", [])
    gbps["kvbridge_transfer"] = _median([nbytes / s["transfer_seconds"] / 1e9 for s in kv])

    reps = _per_rep_ratios(seconds)
    return {
        "transport": transport,
        "case": case.name,
        "model": case.shape.source.split()[0],
        "prompt_tokens": spec.prompt_tokens,
        "num_layers": spec.num_layers or case.shape.num_layers,
        **info,
        "reps": len(seconds.get("kvbridge", [])),
        "seconds": seconds,
        **_own_costs(kv),
        "gbps": gbps,
        "ratios": {key: _median(values) for key, values in reps.items()},
        # The spread of each ratio over the repetitions, [min, max]: a ratio whose range holds
        # 1 shows no difference beyond this machine's noise.
        "ratio_ranges": {
            key: [min(values), max(values)] if values else None for key, values in reps.items()
        },
        "verify_ms": {
            mode: _median([s["verify_seconds"] * 1e3 for s in samples.get(mode, [])])
            for mode in ("verify-sample", "verify-full")
        },
        "verified": True,
    }


@dataclass
class TransferSettings:
    """Options of the transfer benchmark."""

    transports: list[str]
    cases: list[str]
    target_mib: float
    reps: int
    num_layers: int | None
    timeout: float
    seed: int = 0


#: Per-repetition ratios of the summary: name -> (the faster way, the slower way).
_RATIOS = {
    "kvbridge/raw": ("raw", "kvbridge"),
    "transport/raw": ("raw", "transport"),
    "raw/memcpy": ("memcpy", "raw"),
    "verify-sample/kvbridge": ("kvbridge", "verify-sample"),
    "verify-full/kvbridge": ("kvbridge", "verify-full"),
}


def _per_rep_ratios(seconds: dict[str, list[float]]) -> dict[str, list[float]]:
    """Each repetition's throughput of the slower way over the faster: time(fast)/time(slow)."""
    return {
        key: [f / s for f, s in zip(seconds[fast], seconds[slow], strict=True)]
        if fast in seconds and slow in seconds
        else []
        for key, (fast, slow) in _RATIOS.items()
    }


def _own_costs(kv: list[dict[str, float]]) -> dict[str, float | None]:
    """Medians of what kvbridge itself costs per request, in ms."""
    return {
        "plan_ms": _median([s["plan_seconds"] * 1e3 for s in kv]),
        # The same plan made again at once, with the CPU caches warm.
        "plan_warm_ms": _median([s["plan_warm_seconds"] * 1e3 for s in kv]),
        # kvbridge's own cost per request: everything beyond the engine's transfer (planning,
        # the round trip to P, which runs while D plans, and hand-offs between threads).
        "own_ms": _median([(s["seconds"] - s["transfer_seconds"]) * 1e3 for s in kv]),
        # What the control plane adds beyond planning and the transfer: the pull start round
        # trip where it outlasts planning, and the hand-offs between threads and processes.
        "control_ms": _median(
            [(s["seconds"] - s["transfer_seconds"] - s["plan_seconds"]) * 1e3 for s in kv]
        ),
        # Of the own cost: the wait for a plane worker, and D's claim from its send until P's
        # answer was read (sent before planning, read after it: it holds the planning).
        "queued_ms": _median([s["queued_seconds"] * 1e3 for s in kv]),
        "ask_ms": _median([s["ask_seconds"] * 1e3 for s in kv]),
    }


def transfer_steps(settings: TransferSettings, modes: int = len(MODES)) -> int:
    """Progress steps: one per transfer."""
    return len(settings.transports) * len(settings.cases) * (settings.reps + 1) * modes


def balanced_orders(modes: Sequence[str]) -> list[list[str]]:
    """Orders in which every way runs in every position and after every other way equally often.

    A Williams design: a plain rotation would always run each way after the same one, and a
    way that follows memcpy (which sweeps the caches) would pay for it every time.
    """
    n = len(modes)
    first = [0]
    for k in range(1, n):
        first.append((k + 1) // 2 if k % 2 else n - k // 2)
    rows = [[(i + r) % n for i in first] for r in range(n)]
    if n % 2:  # odd n needs the mirrored rows too
        rows += [row[::-1] for row in rows]
    return [[modes[i] for i in row] for row in rows]


def _measure_case(
    transport: str,
    spec: CaseSpec,
    prefill: WorkerProcess,
    decode: WorkerProcess,
    modes: list[str],
    settings: TransferSettings,
    advance: Callable[[str], None],
) -> dict[str, Any]:
    """Build one case in both processes, move it every way ``reps`` times, summarise."""
    slow = 10 * settings.timeout  # building and checking a cache takes a while on 2 cores
    offer = prefill.call("case", spec, timeout=slow)
    info = decode.call("case", spec, offer, timeout=slow)
    samples: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    orders = balanced_orders(modes)
    for rep in range(settings.reps + 1):
        # Rep 0 connects and verifies, kvbridge first: its handshake connects the transport
        # that the plain-transport way then uses.
        for mode in modes if rep == 0 else orders[(rep - 1) % len(orders)]:
            advance(f"transfer {transport} {spec.case} rep {rep}/{settings.reps} {mode}")
            payload = None
            if mode in ("kvbridge", "verify-sample", "verify-full"):
                payload = prefill.call("publish", f"bench-{spec.case}-{rep}-{mode}", timeout=slow)
            out = decode.call("run", mode, payload, rep == 0, timeout=slow)
            if rep:
                samples[mode].append(out)
        for _ in range(len(MODES) - len(modes)):
            advance(f"transfer {transport} {spec.case}: no raw baseline")
    decode.call("end_case", timeout=slow)
    prefill.call("end_case", timeout=slow)
    return _summary(transport, CASES[spec.case], spec, info, samples)


def run_transfer(settings: TransferSettings, advance: Callable[[str], None]) -> dict[str, Any]:
    """Move each case's request through each transport, every way, ``reps`` times."""
    results: list[dict[str, Any]] = []
    log_dir = tempfile.mkdtemp(prefix="kvbridge-bench-")
    raw_found = load_source_module(RAW_PATH, RAW_MODULE) is not None
    specs = []
    for name in settings.cases:
        case = CASES[name]
        tokens = size_request(case, int(settings.target_mib * 2**20), settings.num_layers)
        blocks = case.blocks_needed(tokens, settings.num_layers)
        specs.append(
            CaseSpec(
                name,
                tokens,
                blocks + blocks // 2 + 8,
                settings.num_layers,
                settings.seed,
                settings.timeout,
            )
        )
    options = {"timeout": settings.timeout}
    slow = 10 * settings.timeout  # building and checking a cache takes a while on 2 cores
    for transport in settings.transports:
        logs = {role: os.path.join(log_dir, f"{transport}-{role}.log") for role in ("p", "d")}
        prefill, decode = (
            WorkerProcess(
                _side, role, transport, options, name=role, error=BenchError, log_path=logs[role[0]]
            )
            for role in ("prefill", "decode")
        )
        try:
            has_raw = all(
                [prefill.call("has_raw", timeout=slow), decode.call("has_raw", timeout=slow)]
            )
            modes = [m for m in MODES if m != "raw" or has_raw]
            for spec in specs:
                results.append(
                    _measure_case(transport, spec, prefill, decode, modes, settings, advance)
                )
        except BenchError as err:
            raise BenchError(f"{transport}: {err} (engine logs in {log_dir})") from None
        finally:
            decode.stop()
            prefill.stop()
    shutil.rmtree(log_dir, ignore_errors=True)
    return {
        "settings": {
            **asdict(settings),
            "pattern": PATTERN,
            "modes": list(MODES),
            "raw": RAW_PATH if raw_found else None,
        },
        "results": results,
    }
