"""Layer-wise transfer: the layers of a request that move while P still computes the rest.

A decode instance that knows a request while P computes it (the concurrent dispatch) asks P for a
push before P published it; P keeps that request (``Leases``' pending pushes). As each layer of
the request is computed, the engine adapter calls ``ControlPlane.stream`` with the layers done:
P writes them to every D rank that asked, right away, from one plan per request cut by layer
(``plan_transfers(..., by_layer=True)``), while the engine computes the next layer. When P
publishes the request, the push writes only the layers not streamed yet (the recurrent state
among them: the adapter streams paged layers only), then waits for every write of the request,
streamed or not, before it tells D how it ended.

In a layer-wise pull D asks before P published (``StreamRequest``); P tells D which layers are
computed (``LayersReady``, at most one message in flight per D rank: the layers that became
ready meanwhile go together in the next, ``ReadyNotices``) and D reads them at once (a
``Stream`` of reads), then, once P published, whatever it has not read yet.

Failures are fenced as for a whole transfer: a stream write that fails, or that an abort or an
expiry ends, is released and fenced with all the request's other writes before D hears the
outcome, so no byte lands in a block D got back; D fences its own streamed reads likewise
before it gives its blocks back.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvbridge.control.context import PlaneContext
from kvbridge.control.handshakes import RemoteEngine
from kvbridge.control.messages import LayersReady
from kvbridge.control.requests import RequestStats, checked_ids
from kvbridge.control.transfers import Transfers
from kvbridge.core.block_mapping import CheckedBlockIds
from kvbridge.core.planning import TransferPlan
from kvbridge.core.tp import plan_tp_pair
from kvbridge.core.transport import Fence, TransferHandle, TransferOp

log = logging.getLogger("kvbridge.control")

#: A D rank's push of a request, as P keeps it: (request id, D rank, capability token).
PushKey = tuple[str, int, str]


@dataclass
class Stream:
    """What one side moved of one request, layer by layer, before P published it: P's writes
    to one D rank (``op`` WRITE, layer-wise push), or one D rank's reads from one P rank (READ,
    layer-wise pull). ``remote`` is the other side."""

    remote: RemoteEngine
    op: TransferOp = TransferOp.WRITE
    #: P's block ids the plan was made from (the groups streamed), and the plan cut by layer
    src_ids: dict[int, list[int]] = field(default_factory=dict)
    plan: TransferPlan | None = None
    #: layers submitted, and the writes carrying them (fenced together on failure)
    sent: set[str] = field(default_factory=set)
    handles: list[TransferHandle] = field(default_factory=list)
    #: why a write could not be submitted: the push then fails, fenced
    failed: str = ""
    nbytes: int = 0
    #: the ids object the plan was last checked against (a step hands the same one per layer)
    _src_obj: object = field(default=None, repr=False)
    #: held while writing and while the push (or the end) takes the stream over: a write
    #: either lands in ``handles`` before the taker reads them or finds ``closed`` and does
    #: nothing, so no write escapes the wait and the fence
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    closed: bool = False

    def take(self) -> list[TransferHandle]:
        """Close the stream to further writes and return every write it made."""
        with self.lock:
            self.closed = True
            return list(self.handles)

    def send(
        self,
        ctx: PlaneContext,
        block_ids: Mapping[int, Any],
        dst_ids: Mapping[int, Any],
        layers: list[str],
    ) -> int:
        """Submit these layers' descriptors (those not sent yet); returns the bytes submitted.

        ``block_ids``: P's, as the engine hands them or as P said them (checked here against
        P's layout; ``MessageError`` before anything moves when they do not fit). Plans once
        per request: again only if P's block ids changed (then every layer is sent again from
        the new ids, which a later transfer would overwrite with the same bytes anyway).
        """
        if self.plan is not None and block_ids is self._src_obj:
            return self._submit(ctx, layers)  # a step's layers share its ids: the same plan
        writing = self.op is TransferOp.WRITE
        src_layout, dst_layout = (
            (ctx.layout, self.remote.layout) if writing else (self.remote.layout, ctx.layout)
        )
        src_ids = checked_ids(src_layout, block_ids, "streamed")
        groups = [g for g in src_ids if g in dst_ids]
        mine = {g: list(src_ids[g]) for g in groups}
        self._src_obj = block_ids
        if self.plan is None or mine != self.src_ids:
            if self.plan is not None:
                log.warning("stream of a request: prefill's block ids changed; sending again")
            self.plan = plan_tp_pair(
                src_layout,
                dst_layout,
                src_ids.only(groups),
                _only(dst_ids, groups),
                by_layer=True,
            )
            self.src_ids, self.sent = mine, set()
        return self._submit(ctx, layers)

    def rest(
        self, plan: TransferPlan | None, src_ids: Mapping[int, Any]
    ) -> tuple[TransferPlan | None, int]:
        """What of ``plan`` (the request's whole plan, cut by layer, from P's final ``src_ids``)
        is still to move once the stream ended, and the streamed bytes that count: the layers
        not streamed, or everything if P's ids changed since."""
        if plan is None:
            return None, 0
        same = {g: list(src_ids.get(g, ())) for g in self.src_ids} == self.src_ids
        if not same:
            return plan, 0
        return plan.for_layers(n for n in plan.layers if n not in self.sent), self.nbytes

    def _submit(self, ctx: PlaneContext, layers: list[str]) -> int:
        if self.plan is None:
            return 0
        known = self.plan.layer_index
        new = [name for name in layers if name not in self.sent and name in known]
        if not new:
            return 0
        self.sent.update(new)
        cut = self.plan.for_layers(new)
        if not cut.count:
            return 0
        local, remote, lengths = cut.local_remote(self.op)
        handle = ctx.transport.submit(self.op, self.remote.engine_id, local, remote, lengths)
        self.handles.append(handle)
        self.nbytes += cut.nbytes
        return cut.nbytes

    def release(self, ctx: PlaneContext) -> list[TransferHandle]:
        """Close the stream and stop every write still moving (an abort): the fence then waits
        for them to drain. Returns them."""
        handles = self.take()
        for handle in handles:
            ctx.transport.release(handle)
        return handles


@dataclass
class ReadyNotices:
    """P's word to one D rank of a layer-wise pull, in order, one message in flight: the layers
    computed so far (``LayersReady``), told as they come (those that became ready meanwhile go
    together in the next), then P's last word (published, or it will not be). D reads what it
    was told as each notice arrives, so the last word finds every told layer's read submitted."""

    remote: RemoteEngine
    #: P's block ids of the streamed groups (as the message carries them), and layers not told
    src_ids: dict[int, list[int]] = field(default_factory=dict)
    layers: list[str] = field(default_factory=list)
    told: set[str] = field(default_factory=set)
    #: P's last word, sent after every layer notice
    last: LayersReady | None = None
    #: a sender is running (it sends what ``take`` gives until it gives None)
    busy: bool = False
    closed: bool = False
    _src_obj: object = field(default=None, repr=False)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, ctx: PlaneContext, block_ids: Mapping[int, Any], layers: list[str]) -> bool:
        """Note these computed layers; True when the caller must start a sender. Raises
        ``MessageError`` when the ids do not fit P's layout."""
        with self.lock:
            if self.closed:
                return False
            if block_ids is not self._src_obj:
                ids = checked_ids(ctx.layout, block_ids, "streamed")
                src = {g: list(v) for g, v in ids.items()}
                if self.src_ids and src != self.src_ids:
                    self.told = set()  # D reads every layer again from the new ids
                self.src_ids, self._src_obj = src, block_ids
            new = [n for n in layers if n not in self.told]
            self.told.update(new)
            self.layers.extend(new)
            return self._start()

    def finish(self, last: LayersReady) -> bool:
        """P's last word goes after the layers told so far; True when the caller must start
        a sender."""
        with self.lock:
            self.closed, self.last = True, last
            return self._start()

    def _start(self) -> bool:
        if self.busy or not (self.layers or self.last):
            return False
        self.busy = True
        return True

    def take(self, request_id: str) -> LayersReady | None:
        """The next message to send, or None (and the sender stops) when nothing is left."""
        with self.lock:
            if self.layers:
                layers, self.layers = self.layers, []
                return LayersReady(request_id, self.src_ids, layers)
            last, self.last = self.last, None
            self.busy = last is not None
            return last

    def close(self) -> None:
        """Tell nothing more (D aborted, or the request is forgotten)."""
        with self.lock:
            self.closed, self.layers, self.last = True, [], None


def fence_all(
    transfers: Transfers, handles: list[TransferHandle], rid: str, stats: RequestStats
) -> Fence:
    """Fence every write of a request; ``UNPROVEN`` if any one cannot be proven stopped."""
    fences = [transfers.fence(h, rid, stats) for h in handles]
    if Fence.UNPROVEN in fences:
        return Fence.UNPROVEN
    if Fence.PENDING in fences:
        return Fence.PENDING
    return Fence.DRAINED


def _only(ids: Mapping[int, Any], groups: list[int]) -> Mapping[int, Any]:
    """These groups' ids, kept checked where they were (``CheckedBlockIds``)."""
    if isinstance(ids, CheckedBlockIds):
        return ids.only(groups)
    return {g: ids[g] for g in groups}
