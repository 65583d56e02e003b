"""``kvbridge demo``: a real prefill -> decode KV transfer between two processes on loopback.

Each process holds a synthetic KV cache laid out like a Qwen3.5-style hybrid model (full
attention + GDN groups sharing tensors, real bytes per block). The decode process plans the
request with the core planner, reads it through the chosen transport and checks every byte of
its cache against what the prefill cache held (and that nothing else changed).
"""

from __future__ import annotations

import bisect
import itertools
import multiprocessing as mp
import os
import time
import traceback
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvbridge.core.boundary import remote_prefill_token_count
from kvbridge.core.layout import Layout
from kvbridge.core.planning import TransferPlan, plan_transfers
from kvbridge.core.registry import load_transport
from kvbridge.core.transport import TransferOp, Transport
from kvbridge.example_layouts import request_block_ids
from kvbridge.model_shapes import SHAPES, layout_spec

PAGE = 4096


@dataclass
class DemoConfig:
    """What both processes need to build the same model and request."""

    transport: str = "mooncake"
    transport_options: dict[str, Any] = field(default_factory=dict)
    shape: str = "qwen3.5-hybrid"
    num_layers: int | None = None
    num_blocks: int = 32
    prompt_tokens: int = 8192
    seed: int = 0
    timeout: float = 60.0
    chunks: int = 16
    #: where each process's stderr (the engine's log) goes; ``None`` keeps it on the terminal
    log_dir: str | None = None


@dataclass
class DemoResult:
    """What the decode process reports back."""

    transport: str
    groups: list[dict[str, Any]]
    regions: int
    descriptors_before: int
    descriptors_after: int
    nbytes: int
    plan_seconds: float
    transfer_seconds: float
    verified_bytes: int
    remote_prefill_tokens: int

    @property
    def gbps(self) -> float:
        return self.nbytes / self.transfer_seconds / 1e9 if self.transfer_seconds else 0.0


class Arena:
    """Page-aligned numpy allocations whose addresses a layout can name."""

    def __init__(self) -> None:
        self.buffers: list[np.ndarray] = []

    def allocate(self, size: int) -> int:
        raw = np.empty(size + PAGE, dtype=np.uint8)
        start = (-raw.ctypes.data) % PAGE
        view = raw[start : start + size]
        self.buffers.append(view)
        return int(view.ctypes.data)

    def fill(self, seed: int) -> None:
        """Deterministic contents, so the other side can regenerate them to check bytes."""
        for i, buf in enumerate(self.buffers):
            buf[:] = np.random.default_rng([seed, i]).integers(0, 256, buf.size, dtype=np.uint8)

    @property
    def bases(self) -> list[int]:
        return [int(buf.ctypes.data) for buf in self.buffers]


def _redirect_engine_log(config: DemoConfig, role: str) -> None:
    """Send this process's stderr (where engines log every batch) to a file in ``log_dir``."""
    if config.log_dir:
        fd = os.open(os.path.join(config.log_dir, f"{role}.log"), os.O_WRONLY | os.O_CREAT, 0o644)
        os.dup2(fd, 2)
        os.close(fd)


def _build(config: DemoConfig, role_seed: int) -> tuple[Arena, Layout, dict[int, list[int]]]:
    arena = Arena()
    spec = layout_spec(
        SHAPES[config.shape], config.num_blocks, arena.allocate, num_layers=config.num_layers
    )
    layout = Layout(spec)
    arena.fill(role_seed)
    ids = request_block_ids(layout, config.prompt_tokens, np.random.default_rng(role_seed))
    return arena, layout, ids


def _prefill_main(config: DemoConfig, conn: Connection) -> None:
    transport: Transport | None = None
    _redirect_engine_log(config, "prefill")
    try:
        arena, layout, ids = _build(config, config.seed)
        transport = load_transport(config.transport, **config.transport_options)
        transport.register(layout.registration)
        conn.send(("ready", layout.to_json(), transport.metadata(), ids, arena.bases))
        # Serve until the parent says the decode side is done (the transport moves the bytes).
        if conn.poll(config.timeout * 4):
            conn.recv()
        transport.close()
        transport = None
        conn.send(("closed",))
    except BaseException as err:  # report, never hang the parent
        conn.send(("error", f"{type(err).__name__}: {err}", traceback.format_exc()))
    finally:
        conn.close()
        # Some engines crash in their own atexit teardown; everything is released by now.
        os._exit(0)


def _decode_main(config: DemoConfig, conn: Connection, progress: bool) -> None:
    _redirect_engine_log(config, "decode")
    try:
        arena, layout, d_ids = _build(config, config.seed + 1)
        original = [buf.copy() for buf in arena.buffers]
        if not conn.poll(config.timeout):
            raise TimeoutError("no prefill layout arrived")
        p_json, p_meta, p_ids, p_bases = conn.recv()
        p_layout = Layout.from_json(p_json)

        plan = plan_transfers(p_layout, layout, p_ids, d_ids)
        # Time a second, warm call: the first in a process pays for numpy's lazy set-up.
        start = time.perf_counter()
        plan_transfers(p_layout, layout, p_ids, d_ids)
        plan_seconds = time.perf_counter() - start

        with load_transport(config.transport, **config.transport_options) as transport:
            transport.register(layout.registration)
            transport.connect("prefill", p_meta)
            local, remote, lengths = plan.local_remote(TransferOp.READ)
            # A few chunks in flight at once: the engine still sees large batches, and the
            # progress bar moves as each finishes.
            bounds = np.linspace(0, plan.count, min(config.chunks, plan.count) + 1, dtype=int)
            start = time.perf_counter()
            handles = [
                transport.submit(TransferOp.READ, "prefill", local[a:b], remote[a:b], lengths[a:b])
                for a, b in itertools.pairwise(bounds)
            ]
            _wait_with_progress(transport, handles, plan.nbytes, progress)
            transfer_seconds = time.perf_counter() - start

        verified = _verify(config, arena, original, p_bases, plan)
        result = DemoResult(
            transport=config.transport,
            groups=[{**asdict(g), "kind": g.kind.value} for g in plan.groups],
            regions=len(layout.regions),
            descriptors_before=plan.unmerged,
            descriptors_after=plan.count,
            nbytes=plan.nbytes,
            plan_seconds=plan_seconds,
            transfer_seconds=transfer_seconds,
            verified_bytes=verified,
            remote_prefill_tokens=remote_prefill_token_count(
                config.prompt_tokens, layout.has_state
            ),
        )
        conn.send(("done", asdict(result)))
    except BaseException as err:
        conn.send(("error", f"{type(err).__name__}: {err}", traceback.format_exc()))
    finally:
        conn.close()
        os._exit(0)


def _wait_with_progress(transport: Transport, handles: list[Any], total: int, show: bool) -> None:
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    with Progress(
        "[progress.description]{task.description}", BarColumn(), DownloadColumn(),
        TransferSpeedColumn(), disable=not show, transient=True,
    ) as bar:  # fmt: skip
        task = bar.add_task("decode <- prefill", total=total)
        for handle in handles:
            transport.wait(handle)
            bar.advance(task, handle.nbytes)


def _verify(
    config: DemoConfig,
    arena: Arena,
    original: list[np.ndarray],
    p_bases: list[int],
    plan: TransferPlan,
) -> int:
    """Rebuild what D's cache must hold and compare every byte of every D buffer.

    P's buffers are regenerated here from the same seed (same order, same contents, other
    addresses); ``p_bases`` are their addresses in P, which the plan's sources refer to.
    """
    p_copy, _, _ = _build(config, config.seed)
    source = AddressMap(p_bases, p_copy.buffers)
    expected = [buf.copy() for buf in original]
    target = AddressMap([int(b.ctypes.data) for b in arena.buffers], expected)
    for s, d, n in zip(plan.src.tolist(), plan.dst.tolist(), plan.lengths.tolist(), strict=True):
        target.view(d, n)[:] = source.view(s, n)
    for got, want in zip(arena.buffers, expected, strict=True):
        if not np.array_equal(got, want):
            bad = int(np.flatnonzero(got != want)[0])
            raise AssertionError(f"decode cache differs from what prefill held at byte {bad}")
    return int(sum(buf.size for buf in arena.buffers))


class AddressMap:
    """Views into buffers by the addresses they have (or had) in some process."""

    def __init__(self, bases: list[int], buffers: list[np.ndarray]) -> None:
        order = sorted(range(len(bases)), key=bases.__getitem__)
        self.bases = [bases[i] for i in order]
        self.buffers = [buffers[i] for i in order]

    def view(self, addr: int, size: int) -> np.ndarray:
        i = bisect.bisect_right(self.bases, addr) - 1
        if i < 0 or addr + size > self.bases[i] + self.buffers[i].size:
            raise ValueError(f"[{addr:#x}, +{size}) is outside every buffer")
        offset = addr - self.bases[i]
        return self.buffers[i][offset : offset + size]


class DemoError(RuntimeError):
    """One of the demo processes failed or did not answer in time."""


def _receive(conn: Connection, proc: Any, timeout: float, side: str) -> tuple[Any, ...]:
    deadline = time.monotonic() + timeout
    while not conn.poll(0.1):
        if not proc.is_alive() and not conn.poll(0):
            raise DemoError(f"the {side} process exited (code {proc.exitcode}) without answering")
        if time.monotonic() > deadline:
            raise DemoError(f"the {side} process did not answer within {timeout:.0f} s")
    message: tuple[Any, ...] = conn.recv()
    if message[0] == "error":
        raise DemoError(f"the {side} process failed: {message[1]}\n{message[2]}")
    return message


def run_demo(config: DemoConfig, progress: bool = True) -> DemoResult:
    """Start a prefill and a decode process, move one request, verify it, return the figures."""
    ctx = mp.get_context("spawn")  # a fresh interpreter each: no engine state is inherited
    p_conn, p_child = ctx.Pipe()
    d_conn, d_child = ctx.Pipe()
    prefill = ctx.Process(target=_prefill_main, args=(config, p_child), name="kvbridge-prefill")
    decode = ctx.Process(
        target=_decode_main, args=(config, d_child, progress), name="kvbridge-decode"
    )
    prefill.start()
    decode.start()
    p_child.close()
    d_child.close()
    try:
        ready = _receive(p_conn, prefill, config.timeout, "prefill")
        d_conn.send(ready[1:])
        done = _receive(d_conn, decode, config.timeout, "decode")
        p_conn.send(("stop",))
        _receive(p_conn, prefill, config.timeout, "prefill")
        return DemoResult(**done[1])
    finally:
        for proc in (prefill, decode):
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
