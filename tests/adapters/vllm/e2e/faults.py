"""Faults the real parts cannot produce on demand, injected inside a vLLM engine's connector.

``install(directory, role, transport)`` runs where vLLM's worker registers its KV caches with the
connector (``faulty_connector``, which vLLM loads through ``kv_connector_module_path``), just
before the connector loads its transport. It registers a wrapping class under the transport's name
(``kvbridge.register_transport(..., replace=True)``), so the transport the connector loads is
wrapped, and records every outcome the control plane reaches, so that a driver in another
process can:

- **arm a late write** (``arm(directory, op, delay_ms)``): the next batch of that operation
  (``read`` on D in pull mode, ``write`` on P in push mode) is reported failed at once, as when
  an engine gives up on its own clock, while one part of it is still "in the engine": ``delay_ms``
  later, bytes that are *not* the request's (0x7f in every byte: huge floats) land in the
  destination blocks: a read's by the engine writing local memory, a write's through the real
  transport from a buffer of such bytes. Until they landed the batch's fence is ``PENDING``, as
  the real engines report it. If the control plane reported the failure before the fence, vLLM
  would hand the blocks to the recompute and the late bytes would corrupt its KV: D's tokens
  would differ from the single instance's. ``unfenced=True`` reports the fence ``DRAINED`` at
  once, to show that the check catches exactly that;
- **read what happened**: ``outcomes(directory)`` (one JSON object per request outcome per
  process: role, ok, reason, fence time) and ``fired(directory)`` (the late writes that landed).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvbridge.core.batches import Fence, TransferHandle, TransferOp, TransferState, TransferStatus
from kvbridge.core.memory import MemoryRange
from kvbridge.core.transport import Transport

#: The environment variable naming the fault directory in the engine's processes.
ENV = "KVBRIDGE_TEST_FAULTS"
ARM = "arm.json"
GARBAGE = 0x7F


def _armed_seq(directory: Path) -> int:
    try:
        return int(json.loads((directory / ARM).read_text())["seq"])
    except (OSError, ValueError, KeyError):
        return 0


def arm(directory: Path, op: str, delay_ms: float, unfenced: bool = False) -> int:
    """Arm one late write of ``op`` (``read``/``write``) in every engine of ``directory``."""
    path = directory / ARM
    seq = _armed_seq(directory) + 1
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"seq": seq, "op": op, "delay_ms": delay_ms, "unfenced": unfenced}))
    tmp.replace(path)  # atomic: an engine reads the old or the new arming, never half of one
    return seq


def disarm(directory: Path) -> None:
    """Let an armed fault that did not fire lapse (its seq counts as fired)."""
    path = directory / ARM
    if path.exists():
        arm(directory, "none", 0)


def _lines(directory: Path, prefix: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for f in sorted(directory.glob(f"{prefix}-*.jsonl")):
        out += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return out


def outcomes(directory: Path) -> list[dict[str, Any]]:
    """Every outcome the control planes of ``directory``'s engines recorded so far."""
    return _lines(directory, "outcomes")


def fired(directory: Path) -> list[dict[str, Any]]:
    """Every late write that landed so far (seq, op, delay, bytes, when)."""
    return _lines(directory, "fired")


@dataclass(eq=False)
class _LateHandle(TransferHandle):
    landed: threading.Event = field(default_factory=threading.Event)
    unfenced: bool = False


class FaultyTransport:
    """The real transport, except for the armed batch (see the module's docstring)."""

    def __init__(self, inner: Any, directory: Path, role: str) -> None:
        self.inner = inner
        self.directory = directory
        self.role = role
        # An engine started after an arming (a restarted P) must not fire it again.
        self._fired_seq = _armed_seq(directory)
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _take(self, op: TransferOp) -> dict[str, Any] | None:
        path = self.directory / ARM
        try:
            armed = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        with self._lock:
            if armed["seq"] <= self._fired_seq or armed["op"] != op.value:
                return None
            self._fired_seq = armed["seq"]
        return dict(armed)

    def submit(self, op: TransferOp, peer: str, local: Any, remote: Any, lengths: Any) -> Any:
        armed = self._take(op)
        if armed is None:
            return self.inner.submit(op, peer, local, remote, lengths)
        lengths = np.asarray(lengths, dtype=np.uint64)
        handle = _LateHandle(
            op=op,
            peer=peer,
            count=len(lengths),
            nbytes=int(lengths.sum()),
            deadline=time.monotonic() + self.inner.timeout,
            unfenced=armed["unfenced"],
        )
        args = (handle, armed, peer, np.asarray(local), np.asarray(remote), lengths)
        threading.Thread(target=self._land_late, args=args, daemon=True).start()
        return handle

    def _land_late(
        self, handle: _LateHandle, armed: dict, peer: str, local: Any, remote: Any, lengths: Any
    ) -> None:
        time.sleep(armed["delay_ms"] / 1e3)
        try:
            if handle.op is TransferOp.READ:  # the engine writes what it read into our blocks
                for addr, size in zip(local.tolist(), lengths.tolist(), strict=True):
                    ctypes.memset(addr, GARBAGE, size)
            else:  # our engine's write reaches the peer's blocks
                self._write_garbage(peer, remote, lengths)
            record = {
                "seq": armed["seq"],
                "op": handle.op.value,
                "delay_ms": armed["delay_ms"],
                "bytes": handle.nbytes,
                "role": self.role,
                "at": time.time(),
            }
            _append(self.directory / f"fired-{os.getpid()}.jsonl", record)
        finally:
            handle.landed.set()

    def _write_garbage(self, peer: str, remote: Any, lengths: Any) -> None:
        buf = np.full(int(lengths.max()), GARBAGE, dtype=np.uint8)
        rng = [MemoryRange(buf.ctypes.data, buf.nbytes)]
        self.inner.register(rng)
        try:
            local = np.full(len(lengths), buf.ctypes.data, dtype=np.uint64)
            h = self.inner.submit(TransferOp.WRITE, peer, local, remote, lengths)
            self.inner.wait(h)
        finally:
            self.inner.deregister(rng)

    def poll(self, handle: Any) -> TransferStatus:
        if isinstance(handle, _LateHandle):
            return TransferStatus(TransferState.FAILED, "injected: the engine gave the batch up")
        return self.inner.poll(handle)  # type: ignore[no-any-return]

    def wait(self, handle: Any, timeout: float | None = None) -> None:
        if isinstance(handle, _LateHandle):
            from kvbridge.core.errors import TransferTimeoutError

            handle.timed_out = True
            raise TransferTimeoutError("injected: the engine gave the batch up (late write armed)")
        self.inner.wait(handle, timeout)

    def release(self, handle: Any) -> None:
        if not isinstance(handle, _LateHandle):
            self.inner.release(handle)

    def fence_state(self, handle: Any) -> Fence:
        if isinstance(handle, _LateHandle):
            return Fence.DRAINED if handle.unfenced or handle.landed.is_set() else Fence.PENDING
        return self.inner.fence_state(handle)  # type: ignore[no-any-return]

    def fence(self, handle: Any, timeout: float) -> Fence:
        if isinstance(handle, _LateHandle):
            if not handle.unfenced:
                handle.landed.wait(timeout)
            return self.fence_state(handle)
        return self.inner.fence(handle, timeout)  # type: ignore[no-any-return]


def _append(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def faulty_class(real: type[Transport], directory: Path, role: str) -> type[Transport]:
    """A class to register in ``real``'s place: built with the transport's options, it builds
    ``real`` with them and returns that transport wrapped in a ``FaultyTransport``.

    A subclass of ``real``, so what the connector asks of the class before it builds one
    (``check_available``, ``host_option``) is ``real``'s; its ``__new__`` returns the wrapper,
    which is no instance of it, so Python does not call ``__init__`` on it.
    """

    def __new__(cls: type, **options: Any) -> Any:
        return FaultyTransport(real(**options), directory, role)

    namespace = {"__new__": __new__, "__module__": __name__, "__doc__": FaultyTransport.__doc__}
    return type(f"Faulty{real.__name__}", (real,), namespace)


_installed = False


def install(directory: Path, role: str, transport: str) -> None:
    """Wrap the transport ``transport`` names and record the plane's outcomes, in this process
    (once): the wrapper is registered under the name (``kvbridge.register_transport`` with
    ``replace=True``), so the connector's ``load_transport(transport)`` builds it."""
    global _installed
    import kvbridge
    from kvbridge.control.plane import ControlPlane
    from kvbridge.core.registry import load_transport_class

    if _installed:
        return
    _installed = True
    real = load_transport_class(transport)
    kvbridge.register_transport(transport, faulty_class(real, directory, role), replace=True)
    record = ControlPlane._record

    def record_outcome(self: ControlPlane, outcome: Any) -> None:
        record(self, outcome)
        with contextlib.suppress(OSError):
            _append(
                directory / f"outcomes-{os.getpid()}.jsonl",
                {
                    "role": role,
                    "request_id": outcome.request_id,
                    "ok": outcome.ok,
                    "reason": outcome.reason,
                    "fence_s": outcome.stats.fence_s,
                    "transfer_s": outcome.stats.transfer_s,
                    "handshake_s": outcome.stats.handshake_s,
                    "verify_failed": outcome.stats.verify_failed,
                    "at": time.time(),
                },
            )

    ControlPlane._record = record_outcome  # type: ignore[method-assign]
