"""Probes: what ``kvbridge check`` asks of a running engine, through scratch memory only.

The plane registers one small scratch buffer (``SCRATCH_BYTES``, host memory) with its transport
at start and frees it in ``close``. A checker (an authenticated side-channel peer, as every
request is) asks ``Describe`` (versions, the engine's handshake), then ``ProbeConnect`` (the
engine connects its transport to the checker's, under a peer name of its own), then ``Probe``s:
the engine writes fresh random bytes from its scratch into the checker's scratch, or digests what
the checker wrote into its scratch. Every range a probe names is an offset and a length inside
both scratch buffers, checked here: a probe never reads or writes a byte of the KV cache.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from importlib import metadata as _metadata

import numpy as np

from kvbridge.control.context import PlaneContext
from kvbridge.control.messages import (
    PROTOCOL_VERSION,
    About,
    Handshake,
    Message,
    Ok,
    Probe,
    ProbeConnect,
    ProbeResult,
    ProbeScratch,
)
from kvbridge.core.batches import TransferOp
from kvbridge.core.errors import KvbridgeError, MessageError
from kvbridge.core.memory import MemoryKind, MemoryRange

log = logging.getLogger("kvbridge.control")

#: The engine's probe scratch: a few pages of host memory, registered once per plane.
SCRATCH_BYTES = 16 << 10
#: Checkers connected for probes at once; the oldest is disconnected beyond it.
MAX_PROBE_PEERS = 8
_PAGE = 4096


def kvbridge_version() -> str:
    """The installed distribution's version (the package's own when run from a bare tree)."""
    try:
        return _metadata.version("kvbridge")
    except _metadata.PackageNotFoundError:
        import kvbridge

        return str(getattr(kvbridge, "__version__", "unknown"))


def probe_peer_name(engine_id: str) -> str:
    """The transport peer name an engine gives a checker: never a serving peer's name."""
    return f"kvbridge-check:{engine_id}"


@dataclass(frozen=True)
class _Checker:
    name: str  # transport peer name
    scratch_addr: int
    scratch_bytes: int


class Probes:
    """One engine's probe scratch and the checkers connected to it."""

    def __init__(self, ctx: PlaneContext) -> None:
        self._ctx = ctx
        self._gate = threading.Lock()  # one probe at a time: they share the scratch
        self._checkers: OrderedDict[str, _Checker] = OrderedDict()  # by side-channel engine id
        raw = np.zeros(SCRATCH_BYTES + _PAGE, dtype=np.uint8)
        start = (-raw.ctypes.data) % _PAGE
        self._raw = raw
        self._scratch = raw[start : start + SCRATCH_BYTES]
        self._range: MemoryRange | None = MemoryRange(
            int(self._scratch.ctypes.data), SCRATCH_BYTES, MemoryKind.DRAM
        )
        try:
            ctx.transport.register([self._range])
        except KvbridgeError as err:  # the plane still serves; only probes are refused
            log.info("no probe scratch for `kvbridge check`: %s", err)
            self._range = None
        # after the scratch's registration: an engine whose metadata lists its registered
        # memory (NIXL) names the scratch in it, so a checker can write there
        self._metadata = ctx.transport.metadata()

    @property
    def size(self) -> int:
        """Bytes of probe scratch (0: this engine serves no probe)."""
        return 0 if self._range is None else SCRATCH_BYTES

    def about(self) -> About:
        ctx = self._ctx
        own = Handshake(
            ctx.engine_id, ctx.layout.spec, ctx.transport.name, self._metadata, ctx.endpoint
        )
        return About(kvbridge_version(), PROTOCOL_VERSION, own, self.size)

    def connect(self, peer: str, body: ProbeConnect) -> Future[Message]:
        """Connect the transport to a checker's (off the endpoint's thread: NIXL takes ms)."""
        ctx = self._ctx
        if self._range is None:
            raise MessageError("probe_unavailable", "this engine has no probe scratch (see log)")
        if body.transport != ctx.transport.name:
            raise MessageError(
                "transport_mismatch",
                f"checker uses transport {body.transport!r}, this engine {ctx.transport.name!r}",
            )
        # A probe writes only into [scratch_addr, + scratch_bytes) of the checker's agent: were
        # that agent this engine itself, the range must not be memory it registered (its KV
        # cache), so such a range is refused whoever the agent is.
        if body.metadata == self._metadata:
            raise MessageError("probe_refused", "the checker named this engine's own transport")
        end = body.scratch_addr + body.scratch_bytes
        if any(r.addr < end and body.scratch_addr < r.end for r in ctx.transport.registered):
            raise MessageError(
                "probe_refused",
                "the checker's scratch overlaps memory this engine registered: a probe never "
                "writes there",
            )
        checker = _Checker(probe_peer_name(peer), body.scratch_addr, body.scratch_bytes)

        def run() -> Message:
            with self._gate:
                ctx.transport.connect(checker.name, body.metadata)
                old = self._checkers.pop(peer, None)
                if old is not None and old.name != checker.name:
                    ctx.transport.disconnect(old.name)
                self._checkers[peer] = checker
                while len(self._checkers) > MAX_PROBE_PEERS:
                    _, gone = self._checkers.popitem(last=False)
                    ctx.transport.disconnect(gone.name)
            assert self._range is not None
            return ProbeScratch(self._range.addr, self._range.size)

        return ctx.peer_waits.submit(run)

    def probe(self, peer: str, body: Probe) -> Message | Future[Message]:
        with self._gate:
            checker = self._checkers.get(peer)
        if checker is None or self._range is None:
            raise MessageError("probe_unconnected", "send probe_connect before a probe")
        if body.action == "end":
            with self._gate:
                if self._checkers.pop(peer, None) is not None:
                    self._ctx.transport.disconnect(checker.name)
            return Ok()
        end = body.offset + body.length
        if body.length < 1 or end > self.size or end > checker.scratch_bytes:
            raise MessageError(
                "probe_bounds",
                f"probe range [{body.offset}, {end}) is empty or beyond the scratch (this "
                f"engine's: {self.size} bytes, the checker's: {checker.scratch_bytes} bytes)",
            )
        if body.action == "digest":
            with self._gate:
                value = hashlib.sha256(self._scratch[body.offset : end].tobytes()).digest()
            return ProbeResult(value)
        return self._ctx.peer_waits.submit(self._write, checker, body.offset, body.length)

    def _write(self, checker: _Checker, offset: int, length: int) -> Message:
        """Fresh random bytes from this scratch into the checker's, bounded like any call."""
        ctx = self._ctx
        assert self._range is not None
        with self._gate:
            view = self._scratch[offset : offset + length]
            view[:] = np.frombuffer(os.urandom(length), dtype=np.uint8)
            value = hashlib.sha256(view.tobytes()).digest()

            def arr(value: int) -> np.ndarray:
                return np.array([value], dtype=np.uint64)

            start = time.monotonic()
            handle = ctx.transport.submit(
                TransferOp.WRITE,
                checker.name,
                arr(self._range.addr + offset),
                arr(checker.scratch_addr + offset),
                arr(length),
            )
            try:
                ctx.transport.wait(handle, ctx.deadlines.call)
            except KvbridgeError as err:
                ctx.transport.release(handle)
                raise MessageError("probe_failed", f"the probe's write failed: {err}") from None
            return ProbeResult(value, time.monotonic() - start)

    def close(self) -> None:
        """Disconnect the checkers and free the scratch (the plane's endpoint is closed)."""
        transport = self._ctx.transport
        with self._gate:
            for checker in self._checkers.values():
                transport.disconnect(checker.name)
            self._checkers.clear()
            if self._range is not None:
                transport.deregister([self._range])
                self._range = None
