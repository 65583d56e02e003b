"""Per-peer lane threads for engines whose completion call blocks.

Some engines (Mooncake's ``get_batch_transfer_status``) can only report a batch by blocking until
it ends. A lane is one thread per peer that makes every engine call moving bytes to that peer, so
``submit`` and ``poll`` never block: it keeps at most ``max_in_flight`` descriptors in the engine,
waits for chunks in submission order, skips chunks of batches that already failed, timed out or
were released, and starts a failed chunk again ``retries`` times while its deadline has not passed.

A lane's thread ends once the lane has been idle for ``IDLE_EXIT_S`` (nothing queued, nothing
in the engine) and the next ``put`` starts another: a peer that is quiet holds no thread, so the
threads follow the peers being moved to now, not every peer ever connected (a D rank of a large
fleet connects to hundreds of P ranks).

The lane reaches its transport through a weak reference, so a transport dropped without ``close``
is collected (its finalizer stops the lanes); during an engine call the lane holds it. It is typed
on the hooks (``EngineHooks``), never on the kit, which imports this module.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from typing import Any

from kvbridge.core.batches import Chunk
from kvbridge.core.engine_hooks import EngineHooks
from kvbridge.core.errors import ChunkRefused, PeerError, TransportError

#: Seconds a lane's thread waits for work before it ends (a thread start costs ~0.1 ms; a peer
#: with steady traffic never waits this long).
IDLE_EXIT_S = 5.0


class _Dropped(Exception):
    """The transport was garbage-collected: the lane ends quietly."""


class Lane:
    """The thread that moves every chunk to one peer (see the module docstring)."""

    def __init__(self, transport: EngineHooks, peer_state: Any, label: str) -> None:
        self._owner = weakref.ref(transport)
        self.peer_state = peer_state
        self.label = label
        self.max_in_flight = transport.limits.max_in_flight or 1 << 62
        self.timeout = transport.timeout
        self.retries = transport.retries
        self._cond = threading.Condition()
        self._queue: deque[Chunk] = deque()
        self._stopping = False
        self._reached = False
        self._name = f"kvbridge-{transport.name}[{label}]"
        self._thread: threading.Thread | None = None
        with self._cond:
            self._start_thread()

    def _start_thread(self) -> None:  # condition held
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def put(self, chunks: list[Chunk]) -> None:
        with self._cond:
            if self._stopping:
                raise PeerError(f"peer {self.label} is being disconnected")
            self._queue.extend(chunks)
            if self._thread is None:
                self._start_thread()
            else:
                self._cond.notify()

    def stop(self, reason: str) -> None:
        """Fail queued chunks, stop accepting work; chunks in the engine are still waited for."""
        with self._cond:
            self._stopping = True
            dropped, self._queue = self._queue, deque()
            self._cond.notify()
        for chunk in dropped:
            chunk.handle.fail(f"{chunk.handle.describe()} failed: {reason}")

    def join(self, timeout: float) -> bool:
        with self._cond:
            thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        return not thread.is_alive()

    def _transport(self) -> EngineHooks:
        transport = self._owner()
        if transport is None:
            raise _Dropped
        return transport

    def _reach(self) -> str | None:
        # Engines may block here on a frozen peer (Mooncake's probe, ~60 s); other lanes go on.
        why = self._transport().engine_reach_peer(self.peer_state)
        self._reached = why is None
        return why

    def _run(self) -> None:
        inflight: deque[Chunk] = deque()
        count = 0  # descriptors handed to the engine and not yet waited for
        try:
            if not self._reached:
                self._reach()  # warm-up at connect; a failure is retried before the first chunk
            while True:
                start: list[Chunk] = []
                with self._cond:
                    while not self._queue and not inflight and not self._stopping:
                        if not self._cond.wait(IDLE_EXIT_S) and not self._queue:
                            self._thread = None  # idle: the next put starts another
                            return
                    if self._stopping and not inflight:
                        return
                    while self._queue:
                        size = len(self._queue[0].lengths)
                        if count and count + size > self.max_in_flight:
                            break
                        chunk = self._queue.popleft()
                        if chunk.handle.finished or chunk.handle.expire(self.timeout):
                            continue
                        start.append(chunk)
                        count += size
                for chunk in start:
                    # A chunk before it in this round may have failed its batch already.
                    if chunk.handle.finished or not self._start(chunk):
                        count -= len(chunk.lengths)
                    else:
                        inflight.append(chunk)
                if inflight:
                    chunk = inflight.popleft()
                    result = self._transport().engine_wait_chunk(chunk)
                    count -= len(chunk.lengths)
                    chunk.token = None
                    chunk.handle.leave_engine(unproven=result.unproven)
                    if result.ok:
                        chunk.handle.chunk_done()
                    else:
                        self._retry_or_fail(chunk, result.reason, result.retry)
        except BaseException as err:  # never die silently: fail everything this lane holds
            with self._cond:
                self._stopping = True
                left = list(self._queue)
                self._queue.clear()
            for chunk in left:
                self._fail(chunk, f"the transfer lane stopped on {err!r}")
            for chunk in inflight:  # never waited for: nobody can say what the peer got
                self._fail(chunk, f"the transfer lane stopped on {err!r}")
                chunk.handle.leave_engine(unproven=True)
            if not isinstance(err, _Dropped):
                raise

    def _start(self, chunk: Chunk) -> bool:
        """Hand one chunk to the engine; False after failing (or requeueing) it."""
        h = chunk.handle
        if not self._reached:
            why = self._reach()
            if why is not None:
                self._fail(chunk, why)
                return False
            if h.expire(self.timeout):
                return False
        if not h.enter_engine():
            return False
        chunk.started = time.monotonic()
        try:
            chunk.token = self._transport().engine_start_chunk(self.peer_state, chunk)
        except ChunkRefused as refused:  # nothing was sent
            h.leave_engine()
            self._retry_or_fail(chunk, str(refused), True)
            return False
        except TransportError as err:  # refused for good
            h.leave_engine()
            self._fail(chunk, str(err))
            return False
        except BaseException:  # a bug in the hook: nobody can say what the engine took
            h.leave_engine(unproven=True)
            raise
        return True

    def _retry_or_fail(self, chunk: Chunk, what: str, retry: bool) -> None:
        # Moving the same bytes again is harmless (reads and writes are idempotent).
        h = chunk.handle
        if (
            retry
            and chunk.attempts < self.retries
            and not h.finished
            and not h.expire(self.timeout)
        ):
            chunk.attempts += 1
            with self._cond:
                if not self._stopping:
                    self._queue.appendleft(chunk)
                    return
        self._fail(chunk, what)

    def _fail(self, chunk: Chunk, what: str) -> None:
        transport = self._owner()
        hint = f"; {transport.log_hint}" if transport is not None and transport.log_hint else ""
        chunk.handle.fail(f"{chunk.handle.describe()} failed: {what} on {chunk.describe()}{hint}")
