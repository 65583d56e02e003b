"""The decode side (D): loading requests from P, by pull or by push, and settling their ends.

A pull is D's own read, fenced by D's transport. A push is P's write, fenced by P, which says so
in ``PushDone``; past its deadline D aborts the push and asks P how it ended (``PushQuery``)
until P answers or is gone. Meanwhile the request's blocks stay out of use (``held``). A fence
that proves nothing (``Fence.UNPROVEN``: D's own, or P's word ``unproven`` on its write) keeps
the request held for good (``unproven``): no timer and no answer of the peer hands its blocks
back.

``Loads`` is the role the plane calls; the flows are ``pulls.Pulls`` (pull and layer-wise pull)
and ``pushes.Pushes`` (push and its settling), over one ``loadbook.LoadBook`` of the requests
being loaded.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from kvbridge.control.context import PlaneContext
from kvbridge.control.handshakes import Handshakes
from kvbridge.control.loadbook import LoadBook
from kvbridge.control.messages import Abort, LayersReady, PushDone
from kvbridge.control.pulls import Pulls
from kvbridge.control.pushes import Pushes
from kvbridge.control.requests import Mode, TransferParams, forget_expired
from kvbridge.control.transfers import Transfers
from kvbridge.core.errors import KvbridgeError

log = logging.getLogger("kvbridge.control")


class Loads:
    """D's requests being loaded, from ``pull``/``push`` until their outcome.

    Starts each flow, hands P's words to it, aborts, and keeps the time: a push past its
    deadline is settled with P, a layer-wise pull past its deadline fences its own reads.
    """

    def __init__(self, ctx: PlaneContext, handshakes: Handshakes, transfers: Transfers) -> None:
        self._ctx = ctx
        self._lock = ctx.lock
        self._book = book = LoadBook(ctx, handshakes, transfers)
        self._pulls = Pulls(ctx, handshakes, transfers, book)
        self._pushes = Pushes(ctx, handshakes, book)

    def pull(
        self, params: TransferParams, block_ids: Mapping[int, Any], first_token: int = 0
    ) -> None:
        """Start reading a request into these local blocks; the outcome comes later.

        ``first_token``: the request's token at which these blocks start (the tokens D held
        already), which groups of different block sizes pair by.
        ``params.layerwise`` (the concurrent dispatch: P computes the request now): D asks P to
        tell it each computed layer, reads it at once, and reads the rest once P published."""
        pending = self._book.begin(params, block_ids, first_token)
        run = self._pulls.run_layerwise if params.layerwise else self._pulls.run
        self._ctx.requests.submit(run, pending)

    def push(
        self, params: TransferParams, block_ids: Mapping[int, Any], first_token: int = 0
    ) -> None:
        """Ask P to write a request into these local blocks (starting at the request's token
        ``first_token``); the outcome comes later."""
        pending = self._book.begin(params, block_ids, first_token)
        self._ctx.requests.submit(self._pushes.run, pending)

    def abort(self, params: TransferParams, reason: str) -> None:
        """Give up a request, before or during its load; P is told so it frees the blocks."""
        book, rid = self._book, params.request_id
        with self._lock:
            pending = book.pending.get(rid)
            book.aborts[rid] = time.monotonic() + self._ctx.deadlines.remember
            handles = []
            if pending is not None:
                pending.aborted, pending.abort_reason = True, reason
                handles = [part.handle for part in pending.parts.values() if part.handle]
                for part in pending.parts.values():
                    if part.stream is not None:
                        handles += part.stream.take()
        if pending is None:
            try:
                addresses = [params.rank(p) for p in book.contacts(params)]
            except KvbridgeError as err:
                log.warning("request %s: abort not sent (%s); P's lease frees it", rid, err)
                return
            for address in addresses:
                self._ctx.requests.submit(
                    book.tell, address, Abort(rid, reason, **book.me, token=params.token)
                )
        elif params.mode is Mode.PUSH:
            self._pushes.settle_later(pending, reason)
        else:
            if params.layerwise:  # maybe nobody runs it now: its end fences what was read
                self._pulls.settle_layerwise(pending, reason)
            # The pull's worker sees the flag (or its wait fails on the release), fences its
            # reads, reports the outcome and tells P.
            for handle in handles:
                self._ctx.transport.release(handle)

    def on_push_done(self, body: PushDone, sender: str) -> None:
        """P's word on a push, from the P rank ``sender``."""
        self._pushes.on_push_done(body, sender)

    def on_layers_ready(self, body: LayersReady, sender: str) -> None:
        """P's word on a layer-wise pull, from the P rank ``sender``."""
        self._pulls.on_layers_ready(body, sender)

    @property
    def held(self) -> list[str]:
        """Request ids whose failure waits for a fence: their blocks stay out of use."""
        with self._lock:
            return [r for r, p in self._book.pending.items() if p.held_since]

    @property
    def unproven(self) -> list[str]:
        """Request ids held for good: nothing proves their bytes stopped landing."""
        with self._lock:
            return [r for r, p in self._book.pending.items() if p.unproven]

    def expire(self, now: float) -> None:
        """Housekeeping: settle pushes past their deadline with P; forget old aborts."""
        with self._lock:
            # A pull's worker bounds its own steps and fences its read; a push past its
            # deadline is settled with P.
            late = [
                p
                for p in self._book.pending.values()
                if p.deadline < now
                and p.params.mode is Mode.PUSH
                and any(not part.settling and not part.ended for part in p.parts.values())
            ]
            # A layer-wise pull waits for P's word: past its deadline D fences its own reads.
            waiting = [
                p
                for p in self._book.pending.values()
                if p.deadline < now
                and p.params.layerwise
                and p.params.mode is Mode.PULL
                and not p.finishing  # already reading the rest, or fencing
            ]
            forget_expired(self._book.aborts, now, lambda until: until)
        for pending in late:
            self._pushes.settle_later(pending, f"no push within {self._ctx.deadlines.timeout:g} s")
        for pending in waiting:
            self._pulls.settle_layerwise(
                pending, f"prefill published nothing within {self._ctx.deadlines.load:g} s"
            )

    def close(self) -> None:
        """Fail every load in progress (the plane is closing)."""
        with self._lock:
            pending = list(self._book.pending)
        for request_id in pending:
            self._book.finish(request_id, False, "the control plane was closed", closing=True)
