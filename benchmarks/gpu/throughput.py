"""One request moved between two processes whose caches lie on one device, four ways in one run.

A prefill and a decode process each hold a KV cache of a model shape (``kvbridge.bench.cases``:
caches in vLLM's shapes, allocated here as torch tensors on the device, filled with seeded random
bytes) and move the same request, each repetition every way once, in rotating order:

* ``kvbridge``: the control plane's pull over NIXL (D asks P, plans, reads, releases);
* ``transport``: kvbridge's plan and ``Transport.transfer``, no control plane;
* ``raw``: NIXL's own Python API on the same descriptor arrays (``benchmarks/raw_engines.py``);
* ``copy``: one device copy of as many bytes inside the decode process: what the device's memory
  allows (the limit; on a GPU, device to device).

The first repetition checks every byte D received (against P's cache regenerated from its seed,
descriptor by descriptor) at the smallest request of each shape. ``kvbridge_us`` is kvbridge's
own cost per request: its time less the raw engine's.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from kvbridge.bench.processes import WorkerProcess

WAYS = ("kvbridge", "transport", "raw", "copy")
#: (bench case, layers kept): two processes of 128k tokens must fit one 80 GB GPU together.
SHAPES = (("llama3-70b-dense", 8), ("deepseek-mla", 16), ("qwen3.5-hybrid", 8))
TOKENS = (1024, 4096, 16384, 65536, 131072)
PAGE = 1 << 16


class ThroughputError(RuntimeError):
    """A process failed, or the bytes D received are not P's."""


class DeviceArena:
    """Allocations of one device's memory (torch tensors) whose addresses a layout can name."""

    def __init__(self, device: str) -> None:
        import torch

        self.torch, self.device = torch, torch.device(device)
        self.buffers: list[tuple[int, Any]] = []

    def allocate(self, size: int) -> int:
        raw = self.torch.empty(size + PAGE, dtype=self.torch.uint8, device=self.device)
        start = (-raw.data_ptr()) % PAGE
        view = raw[start : start + size]
        self.buffers.append((int(view.data_ptr()), view))
        return int(view.data_ptr())

    def fill(self, seed: int) -> None:
        torch = self.torch
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        for _, view in self.buffers:
            view.copy_(
                torch.randint(
                    0, 256, view.shape, dtype=torch.uint8, device=self.device, generator=gen
                )
            )
        self.sync()

    def view(self, addr: int, size: int) -> Any:
        for base, buf in self.buffers:
            if base <= addr and addr + size <= base + buf.numel():
                return buf[addr - base : addr - base + size]
        raise ThroughputError(f"address {addr:#x} (+{size}) is in no buffer of this arena")

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    @property
    def vram_device(self) -> int:
        return int(self.device.index or 0) if self.device.type == "cuda" else -1


@dataclass(frozen=True)
class Case:
    shape: str
    layers: int
    tokens: int
    device: str
    seed: int
    timeout: float
    verify: bool


def _cache(case: Case, seed: int) -> tuple[DeviceArena, Any, dict[int, list[int]]]:
    from kvbridge.bench.cases import CASES, request_ids
    from kvbridge.core.layout import Layout

    bench = CASES[case.shape]
    arena = DeviceArena(case.device)
    blocks = bench.blocks_needed(case.tokens, case.layers) + 2
    layout = bench.layout(blocks, arena.allocate, case.layers)
    layout = Layout(msgspec.structs.replace(layout.spec, vram_device=arena.vram_device))
    arena.fill(seed)
    # ids as a serving engine's pool hands them out after a while (kvbridge.bench's pattern)
    ids = request_ids(layout, case.tokens, "realistic", np.random.default_rng(seed))
    return arena, layout, ids


def _ranges(layout: Any) -> list[tuple[int, int]]:
    return [(r.addr, r.size) for r in layout.registration]


class _Side:
    """One process's engine: kvbridge's transport (NIXL) and the raw engine beside it."""

    def __init__(self, transport: Any, raw: Any) -> None:
        self.transport, self.raw = transport, raw

    def close(self) -> None:
        self.transport.close()


class _Prefill(_Side):
    def case(self, case: Case) -> dict[str, Any]:
        from kvbridge.control.plane import ControlPlane
        from kvbridge.core.boundary import remote_prefill_token_count

        self.spec = case
        self.arena, self.layout, self.ids = _cache(case, case.seed)
        self.tokens = remote_prefill_token_count(case.tokens, self.layout.has_state)
        self.plane = ControlPlane(
            self.layout, self.transport, timeout=case.timeout, lease=4 * case.timeout
        )
        self.raw.register(_ranges(self.layout))
        return {
            "spec": self.layout.to_json(),
            "ids": self.ids,
            "raw": self.raw.metadata(),
            "bases": [base for base, _ in self.arena.buffers],
            "engine_id": self.plane.engine_id,
            "endpoint": self.plane.endpoint,
            "layers": _paged_layers(self.layout),
        }

    def publish(self, request_id: str) -> dict[str, Any]:
        self.plane.poll_finished()
        return dict(self.plane.publish(request_id, self.ids, self.tokens).to_dict())

    def forward(self, hidden: int, stream: str = "", token: str = "") -> dict[str, float]:
        """P's forward pass over the request's tokens, one transformer layer of ``hidden`` per
        layer of the cache; with ``stream`` (a request D asked to have pushed layer by layer),
        each layer's KV is handed to kvbridge as soon as that layer is computed, and the request
        is published after the last. Wall-clock start and end (``time.time``)."""
        from kvbridge.control.plane import Mode

        if stream:  # D's push request must have reached P: the stream writes to it
            deadline = time.monotonic() + 30
            while not any(k.request_id == stream for k in self.plane._leases._pending_push):
                if time.monotonic() > deadline:
                    raise ThroughputError("D's layer-wise push request never reached P")
                time.sleep(0.001)
        work = _LayerWork(self.arena, self.spec.tokens, hidden)
        self.arena.sync()
        start = time.time()
        streamed = 0
        for layer in _paged_layers(self.layout):
            work.run()
            if stream:
                self.arena.sync()  # the layer's KV is written before its bytes move
                streamed += self.plane.stream(stream, token, self.ids, [layer])
        self.arena.sync()
        end = time.time()
        if stream:
            self.plane.publish(stream, self.ids, self.tokens, Mode.PUSH, token)
        return {"start": start, "end": end, "streamed": streamed}

    def end_case(self) -> None:
        self.plane.close()
        self.raw.deregister(_ranges(self.layout))
        del self.arena


def _paged_layers(layout: Any) -> list[str]:
    """The layers whose KV a forward pass computes one by one, in the layout's order."""
    from kvbridge.core.groups import GroupKind

    names: list[str] = []
    for t in layout.spec.tensors:
        if layout.groups[t.group_index].kind is not GroupKind.STATE and t.layer_name not in names:
            names.append(t.layer_name)
    return names


class _LayerWork:
    """One transformer layer's work at ``tokens`` tokens and width ``hidden`` (an 8B model's
    layer at 4096): the QKV, output and MLP projections and causal attention, on one stream."""

    def __init__(self, arena: DeviceArena, tokens: int, hidden: int) -> None:
        torch = arena.torch
        dtype = torch.bfloat16 if arena.device.type == "cuda" else torch.float32
        self.torch, self.heads = torch, max(1, hidden // 128)
        make = lambda *shape: torch.randn(*shape, dtype=dtype, device=arena.device) * 0.02  # noqa: E731
        self.x = make(tokens, hidden)
        self.qkv, self.o = make(hidden, 3 * hidden), make(hidden, hidden)
        self.up, self.down = make(hidden, 7 * hidden), make(7 * hidden // 2, hidden)

    def run(self) -> None:
        torch, x = self.torch, self.x
        q, k, v = (t.reshape(1, -1, self.heads, t.shape[-1] // self.heads).transpose(1, 2)
                   for t in (x @ self.qkv).chunk(3, dim=-1))  # fmt: skip
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = att.transpose(1, 2).reshape(x.shape) @ self.o
        gate, up = (h @ self.up).chunk(2, dim=-1)
        self.out = (torch.nn.functional.silu(gate) * up) @ self.down


class _Decode(_Side):
    def __init__(self, transport: Any, raw: Any) -> None:
        super().__init__(transport, raw)
        self.peer = ""

    def case(self, case: Case, prefill: dict[str, Any]) -> dict[str, Any]:
        from kvbridge.control.plane import ControlPlane
        from kvbridge.core.batches import TransferOp
        from kvbridge.core.layout import Layout
        from kvbridge.core.planning import plan_transfers

        self.spec = case
        self.arena, self.layout, self.ids = _cache(case, case.seed + 1)
        self.p_layout = Layout.from_json(prefill["spec"])
        self.p_ids = {int(k): v for k, v in prefill["ids"].items()}
        self.p_bases: list[int] = prefill["bases"]
        self.plan = plan_transfers(self.p_layout, self.layout, self.p_ids, self.ids)
        self.arrays = self.plan.local_remote(TransferOp.READ)
        torch = self.arena.torch
        self.src = torch.empty(self.plan.nbytes, dtype=torch.uint8, device=self.arena.device)
        self.dst = torch.empty_like(self.src)
        self.plane = ControlPlane(
            self.layout, self.transport, timeout=case.timeout, lease=4 * case.timeout
        )
        self.raw.register(_ranges(self.layout))
        self.raw.connect(prefill["raw"])
        return {"bytes": self.plan.nbytes, "descriptors": self.plan.count}

    def run(self, way: str, params: dict[str, Any], check: bool) -> dict[str, float]:
        if check:
            self._zero()
        out: dict[str, float] = getattr(self, f"_{way}")(params)
        if check and way != "copy":
            self._check(way)
        return out

    def _kvbridge(self, params: dict[str, Any]) -> dict[str, float]:
        from kvbridge.control.plane import TransferParams

        request = TransferParams.from_dict(params)
        start = time.perf_counter()
        self.plane.pull(request, self.ids)
        outcome = self.plane.wait(request.request_id, 3 * self.spec.timeout)
        seconds = time.perf_counter() - start
        if not outcome.ok:
            raise ThroughputError(f"kvbridge pull failed: {outcome.reason}")
        self.peer = request.engine_id
        return {"seconds": seconds, "plan_seconds": outcome.stats.plan_s}

    def _transport(self, _: object) -> dict[str, float]:
        from kvbridge.core.batches import TransferOp
        from kvbridge.core.planning import plan_transfers

        start = time.perf_counter()
        plan = plan_transfers(self.p_layout, self.layout, self.p_ids, self.ids)
        self.transport.transfer(TransferOp.READ, self.peer, *plan.local_remote(TransferOp.READ))
        return {"seconds": time.perf_counter() - start}

    def _raw(self, _: object) -> dict[str, float]:
        start = time.perf_counter()
        self.raw.read(*self.arrays)
        return {"seconds": time.perf_counter() - start}

    def _copy(self, _: object) -> dict[str, float]:
        self.arena.sync()
        start = time.perf_counter()
        self.dst.copy_(self.src)
        self.arena.sync()
        return {"seconds": time.perf_counter() - start}

    def push_layerwise(self, params: dict[str, Any]) -> None:
        """Ask P to push the request layer by layer (before P computed it: the concurrent
        dispatch); returns at once."""
        from kvbridge.control.plane import TransferParams

        self._zero()
        self.plane.push(TransferParams.from_dict(params), self.ids)

    def pull_whole(self, params: dict[str, Any]) -> None:
        from kvbridge.control.plane import TransferParams

        self._zero()
        self.plane.pull(TransferParams.from_dict(params), self.ids)

    def wait_done(self, request_id: str) -> dict[str, float]:
        """When the load ended (``time.time``); its bytes checked against P's."""
        outcome = self.plane.wait(request_id, 3 * self.spec.timeout)
        done = time.time()
        if not outcome.ok:
            raise ThroughputError(f"load of {request_id} failed: {outcome.reason}")
        self._check("layer-wise" if outcome.stats.streamed_nbytes else "whole")
        return {"done": done, "streamed": outcome.stats.streamed_nbytes}

    def _zero(self) -> None:
        for _, buf in self.arena.buffers:
            buf.zero_()
        self.arena.sync()

    def _check(self, way: str) -> None:
        """Every descriptor's bytes on D equal P's (P's cache regenerated from its seed)."""
        source, _, _ = _cache(self.spec, self.spec.seed)  # allocated as P allocated its own
        moved = {base: here for base, (here, _) in zip(self.p_bases, source.buffers, strict=True)}
        starts = np.array(sorted(self.p_bases), dtype=np.uint64)
        for d, s, n in zip(*(a.tolist() for a in self.arrays), strict=True):
            base = int(starts[np.searchsorted(starts, s, side="right") - 1])
            theirs = source.view(moved[base] + (s - base), n)
            if not self.arena.torch.equal(self.arena.view(d, n), theirs):
                raise ThroughputError(f"{way}: D's bytes at {d:#x} (+{n}) are not P's")
        del source

    def end_case(self) -> None:
        self.plane.close()
        self.raw.deregister(_ranges(self.layout))
        del self.arena, self.src, self.dst


def _side(role: str, device: str) -> _Side:
    """A benchmark process's engine (``WorkerProcess`` builds it in the process)."""
    from kvbridge.bench.cases import load_source_module
    from kvbridge.core.registry import load_transport

    kind = "VRAM" if device.startswith("cuda") else "DRAM"
    index = int(device.split(":")[1]) if ":" in device else 0
    engines = load_source_module("benchmarks/raw_engines.py", "kvbridge_gpu_raw_engines")
    if engines is None:
        raise ThroughputError("run from the source tree: benchmarks/raw_engines.py is the raw side")
    raw = engines.RawNixl(kind, index)
    transport = load_transport("nixl")
    return (_Prefill if role == "prefill" else _Decode)(transport, raw)


def _start(device: str) -> tuple[WorkerProcess, WorkerProcess]:
    """The prefill and decode processes, started together, both ready."""
    sides = tuple(
        WorkerProcess(_side, role, device, name=role, error=ThroughputError)
        for role in ("prefill", "decode")
    )
    for side in sides:
        side.ready(120)
    return sides[0], sides[1]


def run(
    device: str,
    shapes: tuple[tuple[str, int], ...] = SHAPES,
    tokens: tuple[int, ...] = TOKENS,
    reps: int = 5,
    deadline: float = float("inf"),
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """One row per shape and request size: bytes, descriptors, median seconds and GB/s per way,
    kvbridge's own cost; stops adding sizes once ``deadline`` (``time.monotonic``) passed."""
    rows: list[dict[str, Any]] = []
    prefill, decode = _start(device)
    try:
        for shape, layers in shapes:
            for n, count in enumerate(tokens):
                if time.monotonic() > deadline:
                    log(f"throughput: out of time before {shape} at {count} tokens")
                    return rows
                case = Case(shape, layers, count, device, 7, 30.0, verify=n == 0)
                offer = prefill.call("case", case, timeout=300)
                info = decode.call("case", case, offer, timeout=300)
                times: dict[str, list[float]] = {w: [] for w in WAYS}
                for rep in range(reps + 1):
                    order = WAYS[rep % len(WAYS) :] + WAYS[: rep % len(WAYS)]
                    for way in order:
                        params = prefill.call("publish", f"{shape}-{count}-{rep}-{way}", timeout=60)
                        got = decode.call("run", way, params, rep == 0 and case.verify, timeout=300)
                        if rep:  # the first repetition connects and checks
                            times[way].append(got["seconds"])
                # D first: closing its plane waits for its last release to reach P.
                decode.call("end_case", timeout=120)
                prefill.call("end_case", timeout=120)
                med = {w: statistics.median(v) for w, v in times.items()}
                row = {
                    "shape": shape,
                    "layers": layers,
                    "tokens": count,
                    **info,
                    **{f"{w}_s": med[w] for w in WAYS},
                    **{f"{w}_gbps": info["bytes"] / med[w] / 1e9 for w in WAYS},
                    "kvbridge_us": (med["kvbridge"] - med["raw"]) * 1e6,
                    "checked": case.verify,
                }
                rows.append(row)
                log(
                    f"throughput: {shape} {count} tokens, {info['bytes'] / 2**20:.1f} MiB in "
                    f"{info['descriptors']} descriptors: "
                    + ", ".join(f"{w} {row[f'{w}_gbps']:.2f} GB/s" for w in WAYS)
                )
    finally:
        prefill.stop()
        decode.stop()
    return rows


#: The capability token of the layer-wise runs (a router's, given to P and D up front).
STREAM_TOKEN = "gpu-check-stream"
#: Layer-wise streaming: the dense shape at prompt sizes where P's forward pass takes long enough
#: to hide a transfer behind, with an 8B model's layer as each layer's work.
STREAM_TOKENS = (2048, 8192, 16384)
HIDDEN = 4096


def run_streaming(
    device: str,
    shape: tuple[str, int] = SHAPES[0],
    tokens: tuple[int, ...] = STREAM_TOKENS,
    hidden: int = HIDDEN,
    deadline: float = float("inf"),
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Per prompt size: P's forward pass alone; the forward pass, then the whole request moved
    (kvbridge's pull); the forward pass with each layer pushed to D as it is computed. Times to
    D's last byte from the start of the forward pass (wall clock, one host), second runs (the
    first ones connect)."""
    from kvbridge.core.boundary import remote_prefill_token_count

    rows: list[dict[str, Any]] = []
    prefill, decode = _start(device)
    try:
        for count in tokens:
            if time.monotonic() > deadline:
                log(f"streaming: out of time before {count} tokens")
                break
            case = Case(shape[0], shape[1], count, device, 11, 30.0, verify=False)
            info = prefill.call("case", case, timeout=300)
            decode.call("case", case, info, timeout=300)
            runs: dict[str, float] = {}
            for attempt in range(2):
                fwd = prefill.call("forward", hidden, timeout=300)
                runs["forward"] = fwd["end"] - fwd["start"]
                rid = f"whole-{count}-{attempt}"
                fwd = prefill.call("forward", hidden, timeout=300)
                decode.call("pull_whole", prefill.call("publish", rid, timeout=60), timeout=60)
                done = decode.call("wait_done", rid, timeout=300)
                runs["then_whole"] = done["done"] - fwd["start"]
                rid = f"stream-{count}-{attempt}"
                layerwise = {
                    "request_id": rid,
                    "engine_id": info["engine_id"],
                    "endpoint": info["endpoint"],
                    "block_ids": {},
                    "num_tokens": remote_prefill_token_count(count, False),
                    "transport": "nixl",
                    "mode": "push",
                    "token": STREAM_TOKEN,
                    "layerwise": True,
                }
                decode.call("push_layerwise", layerwise, timeout=60)
                fwd = prefill.call("forward", hidden, rid, STREAM_TOKEN, timeout=300)
                done = decode.call("wait_done", rid, timeout=300)
                runs["layerwise"] = done["done"] - fwd["start"]
                runs["streamed_bytes"] = float(done["streamed"])
            decode.call("end_case", timeout=120)  # D first, as in ``run``
            prefill.call("end_case", timeout=120)
            row = {"shape": shape[0], "layers": shape[1], "tokens": count, "hidden": hidden}
            row.update({f"{k}_s" if k != "streamed_bytes" else k: v for k, v in runs.items()})
            row["then_whole_x"] = runs["then_whole"] / runs["forward"]
            row["layerwise_x"] = runs["layerwise"] / runs["forward"]
            rows.append(row)
            log(
                f"streaming: {count} tokens: forward {runs['forward'] * 1e3:.1f} ms; then the "
                f"whole request {row['then_whole_x']:.2f}x; layer by layer "
                f"{row['layerwise_x']:.2f}x"
            )
    finally:
        prefill.stop()
        decode.stop()
    return rows
