"""An engine process for control-plane tests: a real cache, transport and ``ControlPlane``.

Run as ``python -m tests.control.engine CONFIG_JSON``; it answers one JSON command per stdin line
with one JSON line on stdout. ``EngineProcess`` is the test side. Cache contents derive from a
seed, so any process can regenerate another engine's cache to check bytes.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvbridge.control.plane import ControlPlane, Mode, TransferParams
from kvbridge.core import Layout, plan_transfers
from kvbridge.core.boundary import blocks_for_tokens, remote_prefill_token_count
from kvbridge.core.errors import TransportError
from kvbridge.core.groups import GroupKind
from kvbridge.core.layout import KVLayout
from kvbridge.demo import AddressMap, Arena
from kvbridge.testing.reply_stream import take_stdout
from kvbridge.workloads.shapes import ModelShape, layout_spec
from tests.core.tp_layouts import build_rank
from tests.core.tp_reference import TPModel, reference_tp

TINY_HYBRID = ModelShape(
    name="tiny-hybrid", source="test shape", num_layers=8, num_kv_heads=2, head_dim=64,
    full_attention_interval=4, linear_num_key_heads=2, linear_num_value_heads=2,
    linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
)  # fmt: skip
ROOT = Path(__file__).resolve().parents[2]


def tp_model(config: dict[str, Any]) -> TPModel:
    """The test model of a TP engine (``config["tp"]``: ``model`` fields, ``rank``, ``size``)."""
    fields = dict(config["tp"]["model"])
    if "kv_layout" in fields:
        fields["kv_layout"] = KVLayout(fields["kv_layout"])
    return TPModel(**fields)


#: The whole engine's layout of a pipeline stage's worker, by ``id`` of its arena (verify_tp).
_WHOLE: dict[int, Layout] = {}


def build_cache(config: dict[str, Any], seed: int, whole: bool = False) -> tuple[Arena, Layout]:
    """The engine's cache; ``kv_heads``/``head_dim``/``layers`` in ``config`` resize the model.

    With ``tp`` in ``config``: TP rank ``tp.rank`` of ``tp.size`` of a ``TPModel``, its tensors
    carrying shards as vLLM shards them (``tests.core.tp_layouts``), over real memory; with
    ``tp.pp`` (``rank``, ``size``) too, pipeline stage ``pp.rank``'s layers of it alone (vLLM's
    split, ``tests.core.test_stages.stage_of``) unless ``whole``: the bytes of every layer are
    the same either way.
    """
    arena = Arena()
    if "tp" in config:
        tp = config["tp"]
        model = tp_model(config)
        layout = build_rank(
            model,
            tp["rank"],
            tp["size"],
            tp.get("kernel", 4),
            arena,
            config["num_blocks"],
        )
        arena.fill(seed)
        if "pp" in tp and not whole:
            from tests.core.test_stages import stage_of

            _WHOLE[id(arena)] = layout
            layout = stage_of(layout, model.layers, tp["pp"]["rank"], tp["pp"]["size"])
        return arena, layout
    shape = dataclasses.replace(
        TINY_HYBRID,
        num_kv_heads=config.get("kv_heads", TINY_HYBRID.num_kv_heads),
        head_dim=config.get("head_dim", TINY_HYBRID.head_dim),
        num_layers=config.get("layers", TINY_HYBRID.num_layers),
    )
    layout = Layout(layout_spec(shape, config["num_blocks"], arena.allocate))
    arena.fill(seed)
    return arena, layout


class BlockAllocator:
    """Hands out disjoint block ids of one engine's shared pool, as vLLM's allocator does."""

    def __init__(self, layout: Layout, seed: int) -> None:
        self.layout = layout
        pool = min(g.num_blocks for g in layout.groups.values())
        self.free = [int(b) for b in np.random.default_rng(seed).permutation(np.arange(1, pool))]

    def request(self, prompt_tokens: int) -> dict[int, list[int]]:
        tokens = remote_prefill_token_count(prompt_tokens, self.layout.has_state)
        ids: dict[int, list[int]] = {}
        for index, group in sorted(self.layout.groups.items()):
            count = blocks_for_tokens(tokens, group.block_size)
            if group.kind is GroupKind.STATE:
                ids[index] = [group.null_block_id] * max(0, count - 1) + [self.free.pop()]
            else:
                ids[index] = [self.free.pop() for _ in range(count)]
        return ids


def main() -> None:
    global _replies
    _replies = take_stdout()
    config = json.loads(sys.argv[1])
    if "log_level" in config:  # kvbridge's own lines into the engine's log file (stderr)
        import logging

        logging.basicConfig(level=logging.WARNING)
        logging.getLogger("kvbridge").setLevel(config["log_level"])
    arena, layout = build_cache(config, config["seed"])
    original = [b.copy() for b in arena.buffers]
    import kvbridge

    # One timeout for the control plane and the transport, as the adapters configure them.
    options = dict(config.get("options", {}))
    timeout = float(config.get("timeout", options.get("timeout", 10.0)))
    options["timeout"] = timeout
    transport = kvbridge.load_transport(config["transport"], **options)
    # ``host``: the side channel's address (the plane's own default unless the test sets one).
    where = {"host": config["host"]} if "host" in config else {}
    plane = ControlPlane(
        layout,
        transport,
        engine_id=config.get("engine_id"),
        secret=config.get("secret"),
        timeout=timeout,
        lease=config.get("lease", 30.0),
        handshake_timeout=config.get("handshake_timeout", 5.0),
        verify=config.get("verify", "off"),
        claim_timeout=config.get("claim_timeout"),
        insecure=config.get("insecure", False),
        **where,
    )
    for fault in config.get("faults", ()):
        inject_fault(plane, fault)
    reply({"endpoint": plane.endpoint, "engine_id": plane.engine_id, "pid": os.getpid()})
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            reply(handle(cmd, plane, config, arena, layout, original))
        except Exception as err:
            reply({"error": f"{type(err).__name__}: {err}"})
        if cmd["cmd"] == "close":
            break
    # Engines may crash in their own atexit teardown; everything is released by now.
    os._exit(0)


def handle(
    cmd: dict[str, Any],
    plane: ControlPlane,
    config: dict[str, Any],
    arena: Arena,
    layout: Layout,
    original: list[np.ndarray],
) -> Any:
    name = cmd["cmd"]
    if name == "publish":
        mode = Mode(cmd.get("mode", "pull"))
        ids = {int(k): v for k, v in cmd["block_ids"].items()}
        token = cmd.get("token")
        return plane.publish(cmd["request_id"], ids, cmd["num_tokens"], mode, token).to_dict()
    if name == "withdraw":  # P: a request it will not publish (declined, ended on P)
        plane.withdraw(cmd["request_id"], cmd["token"], cmd.get("reason", "test withdrawal"))
        return {"withdrawn": True}
    if name == "stream":  # P: layers of a request computed before publish (layer-wise push)
        ids = {int(k): v for k, v in cmd["block_ids"].items()}
        first = {int(k): v for k, v in (cmd.get("first") or {}).items()}
        total = {int(k): v for k, v in (cmd.get("total") or {}).items()}
        return plane.stream(cmd["request_id"], cmd["token"], ids, cmd["layers"], first, total)
    if name in ("pull", "push"):
        params = TransferParams.from_dict(cmd["params"])
        ids = {int(k): v for k, v in cmd["block_ids"].items()}
        (plane.pull if name == "pull" else plane.push)(params, ids)
        return {"started": True}
    if name == "abort":
        plane.abort(TransferParams.from_dict(cmd["params"]), cmd.get("reason", "test abort"))
        return {"aborted": True}
    if name == "wait":
        out = plane.wait(cmd["request_id"], cmd.get("timeout", 30))
        reply = {
            "request_id": out.request_id,
            "ok": out.ok,
            "reason": out.reason,
            "stats": out.stats.__dict__,
        }
        if cmd.get("reuse"):  # the moment of the outcome, as vLLM reuses (recomputes into) blocks
            for buf in arena.buffers:
                buf.fill(0)
            reply["digest"] = [hashlib.sha256(b.tobytes()).hexdigest() for b in arena.buffers]
        return reply
    if name == "finished":
        return [
            {"request_id": o.request_id, "ok": o.ok, "reason": o.reason}
            for o in plane.poll_finished()
        ]
    if name == "leased":
        return plane.leased
    if name == "withdrawn":  # requests D gave up before P published them
        with plane._lock:
            return sorted({rid for rid, _token in plane._leases._withdrawn})
    if name == "pullers":
        with plane._lock:
            return {
                r: next((reader.engine_id for reader in lease.readers.values()), None)
                for r, lease in plane._leases._leases.items()
            }
    if name == "readers":  # P: which D ranks took their part of each lease
        with plane._lock:
            return {r: sorted(lease.readers) for r, lease in plane._leases._leases.items()}
    if name == "verify":
        return verify(cmd, config, arena, layout, original)
    if name == "verify_tp":
        return verify_tp(cmd, config, arena, layout, original)
    if name == "fault":  # switch an injected fault on or off while the engine runs
        if cmd.get("on", True):
            inject_fault(plane, cmd["name"])
        else:
            remove_faults(plane)
        return {"fault": cmd["name"], "on": cmd.get("on", True)}
    if name == "check":  # the destination bytes of one request, against its source's cache
        return check_request(cmd, layout, arena)
    if name == "digest":  # what every buffer holds now
        return [hashlib.sha256(b.tobytes()).hexdigest() for b in arena.buffers]
    if name == "held":
        return plane.held
    if name == "connect_early":  # D: handshake with these side channels now; who answered
        futures = plane.connect_early(cmd["endpoints"], cmd.get("patience", 300.0))
        return [None if r is None else r.engine_id for r in (f.result(60) for f in futures)]
    if name == "reading":  # D: loads whose transfer is in the transport, or that have ended
        with plane._loads._lock:
            reading = [
                r
                for r, p in plane._loads._book.pending.items()
                if any(part.handle is not None for part in p.parts.values())
            ]
        with plane._finished_cond:
            return sorted([*reading, *plane._finished])
    if name == "transport":  # what the transport announces to peers (Mooncake: its session)
        return {"name": plane.transport.name, "session": getattr(plane.transport, "session", None)}
    if name == "transport_peers":  # the engines this one's transport is connected to
        with plane.transport._lock:
            return sorted(plane.transport._peers)
    if name == "pending_push":
        with plane._lock:
            return sorted(rid for rid, *_ in plane._leases._pending_push)
    if name == "close":
        plane.close()
        registered = getattr(plane.transport, "registered", None)
        plane.transport.close()
        return {"leased": plane.leased, "registered_after_plane_close": len(registered or [])}
    raise ValueError(f"unknown command {name}")


#: (object, attribute) of every injected fault: instance attributes shadowing real methods
_INJECTED: list[tuple[Any, str]] = []


def remove_faults(plane: ControlPlane) -> None:
    """Undo every injected fault (the instance attributes shadowing the real methods go)."""
    for owner, attr in _INJECTED:
        owner.__dict__.pop(attr, None)
    _INJECTED.clear()


def inject_fault(plane: ControlPlane, fault: str) -> None:
    """Faults the real parts cannot produce on demand; the rest of the plane stays real."""
    prefill, decode = plane._leases, plane._loads
    if fault == "drop_push_done":  # P never manages to tell D how a push ended
        prefill._deliver = lambda endpoint, done: None  # type: ignore[method-assign]
        _INJECTED.append((prefill, "_deliver"))
    elif fault == "corrupt_received":  # D: a byte of each descriptor changes after it landed
        submit, wait, on_push_done = (
            plane.transport.submit,
            plane.transport.wait,
            decode.on_push_done,
        )
        first: dict[int, list[int]] = {}

        def flip(addrs: list[int]) -> None:
            for addr in addrs:
                cell = ctypes.c_uint8.from_address(addr)
                cell.value ^= 0xFF

        def submit_(op, peer, local, remote, lengths):  # type: ignore[no-untyped-def]
            handle = submit(op, peer, local, remote, lengths)
            first[id(handle)] = [int(a) for a in local]
            return handle

        def wait_(handle, timeout=None):  # type: ignore[no-untyped-def]
            wait(handle, timeout)
            flip(first[id(handle)])

        def on_push_done_(body, sender=None):  # type: ignore[no-untyped-def]
            pending = decode._book.pending.get(body.request_id)
            if pending is not None and body.ok:
                remote = next(iter(plane._handshakes._by_endpoint.values()))
                plan = plan_transfers(
                    remote.layout, plane.layout, pending.params.block_ids, pending.block_ids
                )
                flip(plan.dst.tolist())
            on_push_done(body, sender)

        plane.transport.submit = submit_  # type: ignore[method-assign]
        plane.transport.wait = wait_  # type: ignore[method-assign]
        decode.on_push_done = on_push_done_  # type: ignore[method-assign]
        _INJECTED.extend(
            [(plane.transport, "submit"), (plane.transport, "wait"), (decode, "on_push_done")]
        )
    elif fault == "fail_next_submit":  # P: the engine refuses the next batch it is handed
        submit = plane.transport.submit

        def refuse(op, peer, local, remote, lengths):  # type: ignore[no-untyped-def]
            plane.transport.__dict__.pop("submit", None)  # once
            raise TransportError("injected: the engine refused the batch")

        plane.transport.submit = refuse  # type: ignore[method-assign]
        _INJECTED.append((plane.transport, "submit"))
        del submit
    else:
        raise ValueError(f"unknown fault {fault!r}")


_SOURCES: dict[str, tuple[Arena, Layout]] = {}


def check_request(cmd: dict[str, Any], layout: Layout, arena: Arena) -> dict[str, Any]:
    """Compare what one request's plan put in this engine with its source engine's bytes."""
    key = json.dumps(cmd["source"], sort_keys=True)
    if key not in _SOURCES:
        _SOURCES[key] = build_cache(cmd["source"], cmd["source"]["seed"])
    p_arena, p_layout = _SOURCES[key]
    plan = plan_transfers(
        p_layout,
        layout,
        {int(k): v for k, v in cmd["p_ids"].items()},
        {int(k): v for k, v in cmd["d_ids"].items()},
    )
    src, dst = AddressMap(p_arena.bases, p_arena.buffers), AddressMap(arena.bases, arena.buffers)
    for s, d, n in zip(plan.src.tolist(), plan.dst.tolist(), plan.lengths.tolist(), strict=True):
        if not np.array_equal(src.view(s, n), dst.view(d, n)):
            return {"ok": False, "descriptor": [s, d, n]}
    return {"ok": True, "bytes": int(plan.nbytes)}


def verify(
    cmd: dict[str, Any],
    config: dict[str, Any],
    arena: Arena,
    layout: Layout,
    original: list[np.ndarray],
) -> dict[str, Any]:
    """Regenerate each source engine's cache and check every byte of this one."""
    expected = [b.copy() for b in original]
    target = AddressMap(arena.bases, expected)
    for source in cmd["sources"]:
        p_arena, p_layout = build_cache(source["config"], source["config"]["seed"])
        src = AddressMap(p_arena.bases, p_arena.buffers)
        for p_ids, d_ids in source["pairs"]:
            plan = plan_transfers(
                p_layout,
                layout,
                {int(k): v for k, v in p_ids.items()},
                {int(k): v for k, v in d_ids.items()},
            )
            for s, d, n in zip(
                plan.src.tolist(), plan.dst.tolist(), plan.lengths.tolist(), strict=True
            ):
                target.view(d, n)[:] = src.view(s, n)
    return _compared(arena, expected, int(sum(b.size for b in arena.buffers)))


def _compared(arena: Arena, expected: list[np.ndarray], nbytes: int) -> dict[str, Any]:
    """The first byte of this engine's cache that differs from ``expected``, or ``ok``."""
    for i, (got, want) in enumerate(zip(arena.buffers, expected, strict=True)):
        if not np.array_equal(got, want):
            return {"ok": False, "buffer": i, "byte": int(np.flatnonzero(got != want)[0])}
    return {"ok": True, "bytes": nbytes}


def verify_tp(
    cmd: dict[str, Any],
    config: dict[str, Any],
    arena: Arena,
    layout: Layout,
    original: list[np.ndarray],
) -> dict[str, Any]:
    """Check every byte of this D rank against the slow per-unit reference (not the planner):
    regenerate every P rank's cache (``cmd["sources"]``: their configs in rank order), and for
    each request (``cmd["requests"]``: P ids, D ids) put where the reference says each byte of
    D comes from; every other byte must be unchanged."""
    p_caches = [build_cache(source, source["seed"], whole=True) for source in cmd["sources"]]
    p_layouts = [layout for _, layout in p_caches]
    expected = [b.copy() for b in original]
    target = AddressMap(arena.bases, expected)
    # A pipeline stage receives what the whole engine's reference puts in its own layers.
    mine = [(r.addr, r.end) for r in layout.registration]
    moved = 0
    for p_ids, d_ids in cmd["requests"]:
        ref = reference_tp(
            tp_model(config),
            p_layouts,
            _WHOLE.get(id(arena), layout),
            {int(k): v for k, v in p_ids.items()},
            {int(k): v for k, v in d_ids.items()},
        )
        for q, descriptors in ref.items():
            src = AddressMap(p_caches[q][0].bases, p_caches[q][0].buffers)
            for s, d, n in descriptors:
                if any(a <= d and d + n <= e for a, e in mine):
                    target.view(d, n)[:] = src.view(s, n)
                    moved += n
    return _compared(arena, expected, moved)


_replies: Any = None  # the reply stream, set by main()


def reply(obj: Any) -> None:
    _replies.write(json.dumps(obj) + "\n")
    _replies.flush()


@dataclass
class EngineProcess:
    """The test side of an engine process; always reaped by ``stop``."""

    proc: subprocess.Popen[str]
    info: dict[str, Any]
    config: dict[str, Any]
    log_path: Path | None = None

    @classmethod
    def start(
        cls, tmp_path: Path, role: str, *, netns: str | None = None, **config: Any
    ) -> EngineProcess:
        """Start an engine; ``netns``: run it in that network namespace (``ip netns exec``)."""
        config.setdefault("num_blocks", 512)
        config.setdefault("seed", abs(hash(role)) % 10_000)
        log_path = tmp_path / f"{role}.log"
        log = open(log_path, "w")  # noqa: SIM115 - closed with the process
        # ``ip netns exec`` execs the command in place: the process is still the engine itself.
        prefix = ["ip", "netns", "exec", netns] if netns else []
        proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "tests.control.engine", json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            cwd=ROOT,
        )
        engine = cls(proc, {}, config, log_path)
        engine.info = engine._read(60)
        return engine

    @property
    def layout(self) -> Layout:
        return build_cache(self.config, self.config["seed"])[1]

    def call(self, timeout: float = 60, **cmd: Any) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def _read(self, timeout: float) -> Any:
        import select

        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"engine process {self.proc.pid} did not answer in {timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"engine process exited with {self.proc.wait(5)}")
        return json.loads(line)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def stop(self) -> dict[str, Any] | None:
        """Close the plane cleanly if alive; return what it reported; reap the process."""
        result = None
        if self.proc.poll() is None:
            with contextlib.suppress(Exception):
                result = self.call(timeout=30, cmd="close")
        if self.proc.poll() is None:
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):  # a killed engine's pipe may be broken
                    stream.close()
        return result


if __name__ == "__main__":
    main()


def run_requests(
    p: EngineProcess,
    d: EngineProcess,
    count: int,
    mode: str,
    rng: random.Random,
    p_alloc: BlockAllocator,
    d_alloc: BlockAllocator,
    prefix: str = "r",
) -> list[tuple[dict[int, list[int]], dict[int, list[int]]]]:
    """Publish ``count`` requests of mixed sizes on P, load them all at once on D; the block
    ids of each request on both sides, for checking the bytes. Each load's ``landed_after_s``
    (from P's publish to the last byte landed) lies within what the test saw of it."""
    pairs, params = [], []
    first_publish = time.time()
    for i in range(count):
        tokens = rng.randint(1, 300)
        p_ids, d_ids = p_alloc.request(tokens), d_alloc.request(tokens)
        rid = f"{prefix}{i}"
        params.append(
            p.call(cmd="publish", request_id=rid, block_ids=p_ids, num_tokens=tokens, mode=mode)
        )
        pairs.append((p_ids, d_ids))
    for prm, (_, d_ids) in zip(params, pairs, strict=True):
        assert d.call(cmd=mode, params=prm, block_ids=d_ids) == {"started": True}
    for prm in params:
        out = d.call(cmd="wait", request_id=prm["request_id"], timeout=60)
        assert out["ok"], out["reason"]
        landed = out["stats"]["landed_after_s"]
        assert prm["published_at"] >= first_publish, prm
        assert 0 < landed <= time.time() - prm["published_at"], (landed, mode)
    return pairs
