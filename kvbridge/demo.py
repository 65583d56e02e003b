"""``kvbridge demo``: a real prefill -> decode KV transfer between two processes on loopback.

Each process holds a synthetic KV cache laid out like a Qwen3.5-style hybrid model (full
attention + GDN groups sharing tensors, real bytes per block) and runs a ``ControlPlane``. The
prefill process publishes a request; its transfer parameters reach the decode process the way a
proxy would pass them; decode pulls (or asks prefill to push) through the chosen transport and
checks every byte of its cache against what the prefill cache held (and that nothing else
changed).
"""

from __future__ import annotations

import bisect
import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
from rich.console import Console

from kvbridge.control.plane import ControlPlane, Mode, TransferParams
from kvbridge.core.boundary import blocks_for_tokens, remote_prefill_token_count
from kvbridge.core.groups import GroupKind
from kvbridge.core.layout import Layout
from kvbridge.core.planning import TransferPlan, plan_transfers
from kvbridge.core.registry import load_transport
from kvbridge.workloads.layouts import request_block_ids
from kvbridge.workloads.shapes import SHAPES, bump_allocator, layout_spec

PAGE = 4096
REQUEST_ID = "demo-request-0"
#: Copies of one engine's cache the demo holds at once: prefill's, and in the decode process its
#: own and prefill's rebuilt to check it against (the bytes it must hold are rebuilt one buffer
#: at a time).
CACHE_COPIES = 3


def pool_blocks(shape: str, prompt_tokens: int, num_layers: int | None = None) -> int:
    """Blocks per cache tensor for a demo request: what it takes over every group (one per
    STATE group), vLLM's null block 0, and an eighth spare, as a serving engine's pool has."""
    layout = Layout(layout_spec(SHAPES[shape], 1, bump_allocator(), num_layers=num_layers))
    tokens = remote_prefill_token_count(prompt_tokens, layout.has_state)
    needed = sum(
        1 if g.kind is GroupKind.STATE else blocks_for_tokens(tokens, g.block_size)
        for g in layout.groups.values()
    )
    return needed + 1 + max(1, needed // 8)


def cache_bytes(shape: str, num_blocks: int, num_layers: int | None = None) -> int:
    """Bytes one engine's cache of ``num_blocks`` blocks per tensor allocates."""
    total = 0

    def allocate(size: int) -> int:
        nonlocal total
        total += size
        return 1 << 40

    layout_spec(SHAPES[shape], num_blocks, allocate, num_layers=num_layers)
    return total


@dataclass
class DemoConfig:
    """What both processes need to build the same model and request."""

    transport: str = "mooncake"
    transport_options: dict[str, Any] = field(default_factory=dict)
    mode: Mode = Mode.PULL
    shape: str = "qwen3.5-hybrid"
    num_layers: int | None = None
    #: blocks per cache tensor; ``None``: the smallest pool that holds the request (``pool_blocks``)
    num_blocks: int | None = None
    prompt_tokens: int = 8192
    seed: int = 0
    timeout: float = 60.0
    secret: str | None = None
    #: where each process's stderr (the engine's log) goes; ``None`` keeps it on the terminal
    log_dir: str | None = None

    def __post_init__(self) -> None:
        if self.num_blocks is None:
            self.num_blocks = pool_blocks(self.shape, self.prompt_tokens, self.num_layers)

    @property
    def blocks(self) -> int:
        assert self.num_blocks is not None  # set in __post_init__
        return self.num_blocks


@dataclass
class DemoResult:
    """What the decode process reports back."""

    transport: str
    mode: str
    groups: list[dict[str, Any]]
    regions: int
    descriptors_before: int
    descriptors_after: int
    nbytes: int
    handshake_seconds: float
    plan_seconds: float
    transfer_seconds: float
    verified_bytes: int
    remote_prefill_tokens: int
    prefill_outcome: str

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
            buf[:] = self.contents(seed, i, buf.size)

    @staticmethod
    def contents(seed: int, index: int, size: int) -> np.ndarray:
        """What ``fill(seed)`` puts in the ``index``-th buffer, of ``size`` bytes."""
        return np.random.default_rng([seed, index]).integers(0, 256, size, dtype=np.uint8)

    @property
    def bases(self) -> list[int]:
        return [int(buf.ctypes.data) for buf in self.buffers]


class AddressMap:
    """Views into buffers by their addresses."""

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


def build_engine_cache(
    config: DemoConfig, role_seed: int
) -> tuple[Arena, Layout, dict[int, list[int]]]:
    """One engine's cache (filled from ``role_seed``) and the block ids its request holds."""
    arena = Arena()
    spec = layout_spec(
        SHAPES[config.shape], config.blocks, arena.allocate, num_layers=config.num_layers
    )
    layout = Layout(spec)
    arena.fill(role_seed)
    ids = request_block_ids(layout, config.prompt_tokens, np.random.default_rng(role_seed))
    return arena, layout, ids


def verify_decode_cache(
    config: DemoConfig, arena: Arena, layout: Layout, original: list[np.ndarray] | None = None
) -> tuple[int, TransferPlan]:
    """Rebuild what D's cache must hold and compare every byte of every D buffer.

    P's cache is regenerated here from its seed (same contents, other addresses), and the
    request is planned against that copy, so the expected bytes never come from the transport.
    What each D buffer held before the transfer is ``original``'s (turned into the expected
    contents in place; doing so again gives the same bytes), or with ``None`` regenerated from
    D's seed one buffer at a time, so that no copy of D's whole cache is held.
    """
    p_arena, p_layout, p_ids = build_engine_cache(config, config.seed)
    d_ids = request_block_ids(layout, config.prompt_tokens, np.random.default_rng(config.seed + 1))
    plan = plan_transfers(p_layout, layout, p_ids, d_ids)
    source = AddressMap(p_arena.bases, p_arena.buffers)
    bases = arena.bases
    # the D buffer each descriptor lands in (AddressMap refuses one that leaves it)
    order = sorted(range(len(bases)), key=bases.__getitem__)
    starts = np.array([bases[i] for i in order], dtype=np.uint64)
    owner = np.searchsorted(starts, plan.dst, side="right") - 1
    if plan.count and int(owner.min()) < 0:
        raise ValueError("a descriptor lands below every decode buffer")
    for rank, i in enumerate(order):
        got = arena.buffers[i]
        want = original[i] if original is not None else Arena.contents(config.seed + 1, i, got.size)
        target = AddressMap([bases[i]], [want])
        mine = owner == rank
        for s, d, n in zip(
            plan.src[mine].tolist(),
            plan.dst[mine].tolist(),
            plan.lengths[mine].tolist(),
            strict=True,
        ):
            target.view(d, n)[:] = source.view(s, n)
        if not np.array_equal(got, want):
            bad = int(np.flatnonzero(got != want)[0])
            raise AssertionError(
                f"decode cache differs from what prefill held at byte {bad} of buffer {i}"
            )
    return int(sum(buf.size for buf in arena.buffers)), plan


def _redirect_engine_log(config: DemoConfig, role: str) -> None:
    """Send this process's stderr (where engines log every batch) to a file in ``log_dir``."""
    if config.log_dir:
        fd = os.open(os.path.join(config.log_dir, f"{role}.log"), os.O_WRONLY | os.O_CREAT, 0o644)
        os.dup2(fd, 2)
        os.close(fd)


@contextmanager
def _control_plane(config: DemoConfig, layout: Layout) -> Iterator[ControlPlane]:
    with load_transport(config.transport, **config.transport_options) as transport:
        plane = ControlPlane(
            layout,
            transport,
            secret=config.secret,
            timeout=config.timeout,
            lease=3 * config.timeout,
        )
        try:
            yield plane
        finally:
            plane.close()


def _prefill_main(config: DemoConfig, conn: Connection) -> None:
    _redirect_engine_log(config, "prefill")
    try:
        arena, layout, ids = build_engine_cache(config, config.seed)
        tokens = remote_prefill_token_count(config.prompt_tokens, layout.has_state)
        with _control_plane(config, layout) as plane:
            params = plane.publish(REQUEST_ID, ids, tokens, config.mode)
            conn.send(("ready", params.to_dict()))
            outcome = plane.wait(REQUEST_ID, config.timeout * 3)
            conn.send(("freed", outcome.ok, outcome.reason))
            conn.poll(config.timeout)  # until the parent is done with us
        del arena
    except BaseException as err:  # report, never hang the parent
        conn.send(("error", f"{type(err).__name__}: {err}", traceback.format_exc()))
    finally:
        conn.close()
        # Some engines crash in their own atexit teardown; everything is released by now.
        os._exit(0)


def _decode_main(config: DemoConfig, conn: Connection, progress: bool) -> None:
    _redirect_engine_log(config, "decode")
    try:
        arena, layout, d_ids = build_engine_cache(config, config.seed + 1)
        if not conn.poll(config.timeout):
            raise TimeoutError("no transfer parameters arrived from prefill")
        params = TransferParams.from_dict(conn.recv())
        status = Console().status(
            f"decode {config.mode.value}s {REQUEST_ID} from prefill ...", spinner="dots"
        )
        with _control_plane(config, layout) as plane, status if progress else nullcontext():
            if config.mode is Mode.PULL:
                plane.pull(params, d_ids)
            else:
                plane.push(params, d_ids)
            outcome = plane.wait(params.request_id, config.timeout * 3)
        if not outcome.ok:
            raise RuntimeError(f"the request failed: {outcome.reason}")
        verified, plan = verify_decode_cache(config, arena, layout)  # regenerates D's bytes
        stats = outcome.stats
        result = DemoResult(
            transport=config.transport,
            mode=config.mode.value,
            groups=[{**asdict(g), "kind": g.kind.value} for g in plan.groups],
            regions=len(layout.regions),
            descriptors_before=plan.unmerged,
            descriptors_after=stats.descriptors,
            nbytes=stats.nbytes,
            handshake_seconds=stats.handshake_s,
            plan_seconds=stats.plan_s,
            transfer_seconds=stats.transfer_s,
            verified_bytes=verified,
            remote_prefill_tokens=params.num_tokens,
            prefill_outcome="",
        )
        conn.send(("done", asdict(result)))
    except BaseException as err:
        conn.send(("error", f"{type(err).__name__}: {err}", traceback.format_exc()))
    finally:
        conn.close()
        os._exit(0)


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
        d_conn.send(ready[1])  # what a proxy passes from P's response to D's request
        done = _receive(d_conn, decode, config.timeout * 3, "decode")
        freed = _receive(p_conn, prefill, config.timeout * 3, "prefill")
        p_conn.send(("stop",))
        result = DemoResult(**done[1])
        result.prefill_outcome = ("freed: " if freed[1] else "failed: ") + freed[2]
        return result
    finally:
        for proc in (prefill, decode):
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
