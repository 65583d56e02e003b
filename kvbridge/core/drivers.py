"""The two engine models, as drivers: how a submitted batch reaches the engine and comes back.

The kit (``kvbridge.core.transport``) picks one driver at construction from the plugin's
``blocking_engine`` and leaves to it everything that differs between the models; the kit keeps
what they share (registration, peers, the metadata envelope, handles' checks, close's order).

* ``BlockingDriver``: one ``Lane`` thread per peer makes every engine call that moves bytes;
  ``poll`` and ``wait`` read the handle, which the lane updates.
* ``PolledDriver``: chunks are started from ``submit`` and checked from ``poll``/``wait``/
  ``fence``, every engine call under the kit's lock; chunks an engine still moves after their
  batch finished are watched until the engine ends them (see ``cancel_is_fence``).

A driver reaches its transport through a weak reference, as lanes do, so a transport dropped
without ``close`` is collected at once (the blocking driver's finalizer then stops its lanes).
"""

from __future__ import annotations

import abc
import threading
import time
import weakref
from collections.abc import Callable, Collection, Hashable
from contextlib import suppress
from functools import partial
from typing import Any

from kvbridge.core.batches import Chunk, TransferHandle
from kvbridge.core.engine_hooks import EngineHooks
from kvbridge.core.errors import TransportError
from kvbridge.core.lanes import Lane

__all__ = ["BlockingDriver", "EngineDriver", "PolledDriver"]


class EngineDriver(abc.ABC):
    """What the kit asks of an engine model. "Lock held": the kit holds its lock when calling."""

    def __init__(self, transport: EngineHooks, lock: threading.RLock) -> None:
        self._ref = weakref.ref(transport)
        self._lock = lock  # the kit's lock (reentrant), shared

    @property
    def _hooks(self) -> EngineHooks:
        transport = self._ref()
        if transport is None:  # only the kit calls a driver, and it is alive then
            raise ReferenceError("the transport was collected")
        return transport

    def opened(self) -> None:
        """The engine runs: the transport accepts calls from now on."""

    def connected(self, state: Any) -> None:
        """A peer's state was stored (lock held)."""

    @abc.abstractmethod
    def forget(self, peer: str, state: Any, remaining: Collection[Any], reason: str) -> None:
        """A peer name was dropped (lock held; ``remaining``: the other peers' states): fail its
        batches. The engine forgets the peer after this returns."""

    @abc.abstractmethod
    def start(
        self, state: Any, handle: TransferHandle, chunks: list[Chunk]
    ) -> Callable[[], None] | None:
        """Hand a batch's chunks (at least one) to the engine (lock held); return what must run
        once the lock is released, if anything."""

    @abc.abstractmethod
    def poll(self, h: TransferHandle) -> None:
        """Move an unfinished batch on as far as it can without blocking; fail it when late."""

    @abc.abstractmethod
    def wait_finished(self, h: TransferHandle, limit: float) -> None:
        """Block until the batch finishes or the monotonic ``limit`` passes."""

    @abc.abstractmethod
    def release(self, h: TransferHandle, reason: str) -> None:
        """Fail an unfinished batch with ``reason``; no further chunk of it starts."""

    @abc.abstractmethod
    def wait_drained(self, h: TransferHandle, timeout: float) -> None:
        """Block up to ``timeout`` s until a released batch is drained (its ``fence`` decides)."""

    @abc.abstractmethod
    def close(self) -> None:
        """The transport closes (lock held): fail pending batches, stop the engine's work."""

    def join(self, timeout: float) -> None:
        """After ``close``, lock released: wait up to ``timeout`` s for work the engine holds."""


class BlockingDriver(EngineDriver):
    """Engines whose completion call blocks: a lane thread per peer (``kvbridge.core.lanes``)."""

    def __init__(self, transport: EngineHooks, lock: threading.RLock) -> None:
        super().__init__(transport, lock)
        self._lanes: dict[Hashable, Lane] = {}  # lane key -> lane (lock held)
        self._stopped: list[Lane] = []  # lanes close() stopped, for join()
        self._finalizer: weakref.finalize[Any, Any] | None = None

    def opened(self) -> None:
        # A transport dropped without close() must not leave lane threads waiting forever.
        self._finalizer = weakref.finalize(self._hooks, _stop_lanes, self._lanes)

    def connected(self, state: Any) -> None:
        self._lane(state)  # starts reaching the peer in the background

    def _lane(self, state: Any) -> Lane:  # lock held
        hooks = self._hooks
        key = hooks.engine_lane_key(state)
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = Lane(hooks, state, hooks.engine_describe_peer(state))
        return lane

    def forget(self, peer: str, state: Any, remaining: Collection[Any], reason: str) -> None:
        # Peers sharing a lane key share the lane: it stops with the last of them.
        hooks = self._hooks
        key = hooks.engine_lane_key(state)
        if all(hooks.engine_lane_key(s) != key for s in remaining):
            lane = self._lanes.pop(key, None)
            if lane is not None:
                lane.stop(reason)

    def start(
        self, state: Any, handle: TransferHandle, chunks: list[Chunk]
    ) -> Callable[[], None] | None:
        # Queued once the kit's lock is released: the lane's own lock is all it needs.
        return partial(self._lane(state).put, chunks)

    def poll(self, h: TransferHandle) -> None:
        h.expire(self._hooks.timeout)

    def wait_finished(self, h: TransferHandle, limit: float) -> None:
        while not h.finished and (left := limit - time.monotonic()) > 0:
            h.wait_finished(left)

    def release(self, h: TransferHandle, reason: str) -> None:
        h.fail(reason)  # the lane skips the batch's queued chunks; those in the engine end there

    def wait_drained(self, h: TransferHandle, timeout: float) -> None:
        h.wait_drained(max(0.0, timeout))

    def close(self) -> None:
        self._stopped = list(self._lanes.values())
        _stop_lanes(self._lanes)
        if self._finalizer is not None:
            self._finalizer.detach()  # its work is done: the lanes are stopped

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        stopped, self._stopped = self._stopped, []
        for lane in stopped:
            lane.join(max(0.0, deadline - time.monotonic()))


class PolledDriver(EngineDriver):
    """Engines asked without blocking: every engine call under the kit's lock."""

    def __init__(self, transport: EngineHooks, lock: threading.RLock) -> None:
        super().__init__(transport, lock)
        self._closed = False
        self._live: set[TransferHandle] = set()  # handles with chunks in the engine
        self._stuck: list[Chunk] = []  # chunks whose engine handle refused release; retried

    def forget(self, peer: str, state: Any, remaining: Collection[Any], reason: str) -> None:
        for handle in [h for h in self._live if h.peer == peer]:
            handle.fail(f"{handle.describe()} failed: {reason}")
            # Released with the peer: a proof only where a cancel is one.
            self._abandon(handle, unproven=not self._hooks.cancel_is_fence)

    def start(
        self, state: Any, handle: TransferHandle, chunks: list[Chunk]
    ) -> Callable[[], None] | None:
        """Hand every chunk to the engine now; errors reach the caller of ``submit``."""
        hooks = self._hooks
        for chunk in chunks:
            if not handle.enter_engine():
                break
            try:
                chunk.token = hooks.engine_start_chunk(state, chunk)
            except BaseException as err:
                handle.leave_engine()
                handle.fail(f"{handle.describe()} could not start: {err}")
                if handle.has_active:  # chunks started before it move on, watched by fence
                    self._live.add(handle)
                    self._settle(handle)
                raise
            if chunk.token is None:  # finished inside the call
                handle.leave_engine()
                handle.chunk_done()
            else:
                handle.track(chunk)
        if handle.has_active:
            self._live.add(handle)
        return None

    def poll(self, h: TransferHandle) -> None:
        self._check(h)

    def _check(self, h: TransferHandle) -> None:
        """Check the engine's chunks of a batch (also after the batch finished: chunks the
        engine still moves are watched until it ends them; see ``cancel_is_fence``)."""
        hooks = self._hooks
        with self._lock:
            if not h.has_active:
                if not h.finished and self._closed:  # close() finished every handle of ours
                    h.fail(f"{h.describe()}: the transport is closed")
                return
            for chunk in h.active:
                result = hooks.engine_check_chunk(chunk)
                if result is None:
                    continue
                h.untrack(chunk)
                self._give_back(chunk, unproven=result.unproven)
                if result.ok:
                    h.chunk_done()
                else:
                    h.fail(f"{h.describe()} failed: {result.reason}")
            if not h.finished and time.monotonic() >= h.deadline:
                h.fail(
                    f"{h.describe()} did not finish within {hooks.timeout:g} s (peer frozen, "
                    "overloaded or unreachable); the batch was given up",
                    timed_out=True,
                )
            if h.finished:
                self._settle(h)

    def wait_finished(self, h: TransferHandle, limit: float) -> None:
        def finished() -> bool:
            if not h.finished:
                self._check(h)
            return h.finished

        # The engine progresses while asked: a short cap keeps the wait's overshoot small (each
        # check is a few microseconds).
        _poll_until(finished, limit, 1e-5, 2e-4)

    def release(self, h: TransferHandle, reason: str) -> None:
        with self._lock:
            h.fail(reason)
            self._settle(h)

    def wait_drained(self, h: TransferHandle, timeout: float) -> None:
        def drained() -> bool:  # the engine moves (and ends) what it holds only when asked
            self._check(h)
            return h.drained

        _poll_until(drained, time.monotonic() + max(0.0, timeout), 1e-4, 0.02)

    def close(self) -> None:
        self._closed = True
        for h in list(self._live):
            h.fail(f"{h.describe()}: the transport was closed")
            self._abandon(h)
        stuck, self._stuck = self._stuck, []
        for chunk in stuck:  # the engine goes below: nothing of these can move after it
            with suppress(TransportError):
                self._hooks.engine_release_chunk(chunk)
            chunk.handle.leave_engine()

    def _settle(self, h: TransferHandle) -> None:
        """A finished batch's chunks still in the engine (lock held): cancel them where a
        cancel is a fence; otherwise they stay watched until the engine ends them."""
        if self._hooks.cancel_is_fence:
            self._abandon(h)
        elif not h.has_active:
            self._live.discard(h)

    def _give_back(self, chunk: Chunk, *, unproven: bool) -> None:
        """Free the engine's handle of a chunk (lock held); a refusal keeps it in the engine."""
        if self._hooks.engine_release_chunk(chunk):
            chunk.token = None
            chunk.handle.leave_engine(unproven=unproven)
        else:
            self._stuck.append(chunk)

    def _abandon(self, h: TransferHandle, *, unproven: bool = False) -> None:
        """Release every chunk a batch has in the engine (lock held): for a peer forgotten in
        the engine, and on close, where the engine itself goes below."""
        for chunk in h.take_active():
            self._give_back(chunk, unproven=unproven)
        self._live.discard(h)


def _poll_until(done: Callable[[], bool], limit: float, first: float, cap: float) -> None:
    """Call ``done`` until it returns True or the monotonic ``limit`` passes, sleeping between
    calls from ``first`` s, doubling up to ``cap`` s."""
    delay = first
    while not done() and (left := limit - time.monotonic()) > 0:
        time.sleep(min(delay, left))
        delay = min(delay * 2, cap)


def _stop_lanes(lanes: dict[Hashable, Lane]) -> None:
    for lane in list(lanes.values()):
        lane.stop("the transport was closed")
    lanes.clear()
