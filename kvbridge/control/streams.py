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
from typing import Any, NamedTuple

import numpy as np

from kvbridge.control.context import PlaneContext
from kvbridge.control.handshakes import RemoteEngine
from kvbridge.control.messages import LayersReady
from kvbridge.control.requests import RequestStats, checked_ids
from kvbridge.control.transfers import Transfers
from kvbridge.core.batches import Fence, TransferHandle, TransferOp
from kvbridge.core.block_mapping import CheckedBlockIds, different_block_sizes
from kvbridge.core.errors import KvbridgeError
from kvbridge.core.planning import TransferPlan
from kvbridge.core.tp import plan_tp_pair

log = logging.getLogger("kvbridge.control")


class PushKey(NamedTuple):
    """A D rank's push of a request, as P keeps it."""

    request_id: str
    reader: int  #: the D rank
    token: str  #: the request's capability token


@dataclass(frozen=True)
class ComputedBlocks:
    """Which of a request's blocks one prefill step computed, as the stream is told them.

    ``block_ids``: P's ids per streamed group, from position ``first`` of the group's block list
    on (0 when absent), of the ``total`` blocks P holds for the group once the prefill ends (as
    many as named when absent). A prefill done in one step names every block (the whole part);
    a chunked prefill names, at each chunk, the blocks that chunk completed (its last chunk: the
    rest). A block is named in one part only, once every token of it is computed, so no block
    is written twice from a stream while its bytes may still change.
    """

    block_ids: Mapping[int, Any]
    first: Mapping[int, int] = field(default_factory=dict)
    total: Mapping[int, int] = field(default_factory=dict)


@dataclass
class Stream:
    """What one side moved of one request, layer by layer, before P published it: P's writes
    to one D rank (``op`` WRITE, layer-wise push), or one D rank's reads from one P rank (READ,
    layer-wise pull). ``remote`` is the other side.

    Each part (``ComputedBlocks``: a prefill step's blocks) is planned once and cut by layer; a
    layer counts as streamed (``rest`` skips it) once parts covering every block of its group, in
    order, were submitted for it.
    """

    remote: RemoteEngine
    op: TransferOp = TransferOp.WRITE
    #: P's block ids seen so far per streamed group, by position (-1: not seen)
    src_ids: dict[int, np.ndarray] = field(default_factory=dict)
    #: the current part's plan, cut by layer, and its layers submitted
    plan: TransferPlan | None = None
    sent: set[str] = field(default_factory=set)
    #: per layer, the P position up to which its blocks were submitted without a gap
    covered: dict[str, int] = field(default_factory=dict)
    #: the writes (or reads) submitted (fenced together on failure)
    handles: list[TransferHandle] = field(default_factory=list)
    #: why a write could not be submitted: the push then fails, fenced
    failed: str = ""
    nbytes: int = 0
    #: parts planned (one per prefill step that streamed)
    parts: int = 0
    #: the current part's positions per group: (first, end, whether it names every block)
    _span: dict[int, tuple[int, int, bool]] = field(default_factory=dict, repr=False)
    #: per group, the first P position D's blocks pair with (D's ids are P's tail)
    _from: dict[int, int] = field(default_factory=dict, repr=False)
    _layer_group: dict[str, int] = field(default_factory=dict, repr=False)
    _part_key: object = field(default=None, repr=False)
    #: the ids object the plan was last made from (a step hands the same one per layer)
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
        self, ctx: PlaneContext, part: ComputedBlocks, dst_ids: Mapping[int, Any], layers: list[str]
    ) -> int:
        """Submit these layers' descriptors of ``part`` (those not sent yet); returns the bytes
        submitted.

        ``part.block_ids``: P's, as the engine hands them or as P said them (checked here
        against P's layout; ``MessageError`` before anything moves when they do not fit). Plans
        once per part. Raises ``KvbridgeError`` if P's id of a position already seen changed
        (the caller fails the transfer, fenced).
        """
        if part.block_ids is not self._src_obj:
            self._plan_part(ctx, part, dst_ids)
        return self._submit(ctx, layers)

    def _plan_part(
        self, ctx: PlaneContext, part: ComputedBlocks, dst_ids: Mapping[int, Any]
    ) -> None:
        writing = self.op is TransferOp.WRITE
        src_layout, dst_layout = (
            (ctx.layout, self.remote.layout) if writing else (self.remote.layout, ctx.layout)
        )
        src_ids = checked_ids(src_layout, part.block_ids, "streamed")
        key = (dict(src_ids), dict(part.first), dict(part.total))
        self._src_obj = part.block_ids
        if key == self._part_key:  # the same part again (D: a second notice of one step)
            return
        if not self._layer_group:
            self._layer_group = {t.layer_name: t.group_index for t in src_layout.spec.tensors}
        self.plan, self.sent, self._span, self._part_key = None, set(), {}, key
        whole: list[int] = []
        src_cut: dict[int, list[int]] = {}
        dst_cut: dict[int, list[int]] = {}
        for g in (g for g in src_ids if g in dst_ids):
            ids = src_ids[g]
            first = int(part.first.get(g, 0))
            total = int(part.total.get(g, first + len(ids)))
            if not self._remember(g, first, src_ids.checked[g].given, total):
                # Preempted and computed again in other blocks: a write from the old ones may
                # still be on its way while they hold another request's bytes, so the transfer
                # fails (fenced: every write is waited for) and D computes the prompt.
                raise KvbridgeError(
                    f"prefill's block ids of group {g} changed while streaming (the request was "
                    "preempted and computed again)"
                )
            if first == 0 and total == len(ids):  # every block: paired as a whole transfer is
                whole.append(g)
                self._span[g] = (0, total, True)
                continue
            if different_block_sizes(src_layout.groups[g], dst_layout.groups[g]):
                # A chunk's blocks pair with D's by token, not position: the group moves once
                # P published it (``rest``), not chunk by chunk.
                continue
            dst = list(dst_ids[g])
            offset = total - len(dst)  # D's ids pair with P's last ones
            lo = max(first, offset)
            hi = first + len(ids)
            if offset < 0 or lo >= hi:
                continue  # D asks for more than P holds (the push at publish says so) or none
            self._from.setdefault(g, offset)
            src_cut[g] = ids[lo - first : hi - first]
            dst_cut[g] = dst[lo - offset : hi - offset]
            self._span[g] = (first, hi, False)
        if not self._span:
            return
        src_all: dict[int, Any] = {**src_ids.only(whole), **src_cut}
        dst_all: dict[int, Any] = {**_only(dst_ids, whole), **dst_cut}
        # ``dst_all`` merges cut lists into a plain dict: where D's blocks start goes explicitly
        first_token = getattr(dst_ids, "first_token", None)
        self.plan = plan_tp_pair(
            src_layout, dst_layout, src_all, dst_all, by_layer=True, dst_first_token=first_token
        )
        self.parts += 1

    def _remember(self, g: int, first: int, ids: np.ndarray, total: int) -> bool:
        """Note P's ids at these positions; False if a position seen before had another id."""
        known = self.src_ids.get(g)
        if known is None:
            known = self.src_ids[g] = np.full(total, -1, dtype=np.int64)
        end = first + ids.size
        if known.size != total or end > total:
            return False
        old = known[first:end]
        if np.any((old != -1) & (old != ids)):
            return False
        known[first:end] = ids
        return True

    def rest(
        self, plan: TransferPlan | None, src_ids: Mapping[int, Any]
    ) -> tuple[TransferPlan | None, int]:
        """What of ``plan`` (the request's whole plan, cut by layer, from P's final ``src_ids``)
        is still to move once the stream ended, and the streamed bytes that count: the layers
        not streamed whole, or everything if P's ids changed since."""
        if plan is None:
            return None, 0
        final = {
            g: np.asarray(src_ids.get(g, ()), dtype=np.int64).reshape(-1) for g in self.src_ids
        }
        for g, ids in final.items():
            known = self.src_ids[g]
            if known.size != ids.size or np.any((known != -1) & (known != ids)):
                return plan, 0
        group = self._layer_group
        done = {
            n
            for n in plan.layers
            if n in group and group[n] in final and self.covered.get(n, -1) >= final[group[n]].size
        }
        return plan.for_layers(n for n in plan.layers if n not in done), self.nbytes

    def _submit(self, ctx: PlaneContext, layers: list[str]) -> int:
        if self.plan is None:
            return 0
        known = self.plan.layer_index
        new = [name for name in layers if name not in self.sent and name in known]
        if not new:
            return 0
        self.sent.update(new)
        cut = self.plan.for_layers(new)
        if cut.count:
            local, remote, lengths = cut.local_remote(self.op)
            handle = ctx.transport.submit(self.op, self.remote.engine_id, local, remote, lengths)
            self.handles.append(handle)
            self.nbytes += cut.nbytes
        for name in new:  # submitted: this part's blocks of the layer are on their way
            span = self._span.get(self._layer_group.get(name, -1))
            if span is None:
                continue
            first, end, whole = span
            g = self._layer_group[name]
            if whole or self.covered.get(name, self._from.get(g, 0)) >= first:
                self.covered[name] = max(end, self.covered.get(name, 0))
        return cut.nbytes if cut.count else 0

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
    computed so far (``LayersReady``), told as they come (those of a part that became ready
    meanwhile go together in the next), then P's last word (published, or it will not be). D
    reads what it was told as each notice arrives, so the last word finds every told layer's
    read submitted."""

    remote: RemoteEngine
    #: layer notices not sent yet, per part in order: (part as the message carries it, layers)
    queue: list[tuple[dict[str, Any], list[str]]] = field(default_factory=list)
    told: set[str] = field(default_factory=set)
    #: P's last word, sent after every layer notice
    last: LayersReady | None = None
    #: a sender is running (it sends what ``take`` gives until it gives None)
    busy: bool = False
    closed: bool = False
    _src_obj: object = field(default=None, repr=False)
    _part: dict[str, Any] = field(default_factory=dict, repr=False)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, ctx: PlaneContext, part: ComputedBlocks, layers: list[str]) -> bool:
        """Note these computed layers of ``part``; True when the caller must start a sender.
        Raises ``MessageError`` when the ids do not fit P's layout."""
        with self.lock:
            if self.closed:
                return False
            if part.block_ids is not self._src_obj:
                ids = checked_ids(ctx.layout, part.block_ids, "streamed")
                self._part = {
                    "source_block_ids": {g: list(v) for g, v in ids.items()},
                    "first_blocks": {int(g): int(n) for g, n in part.first.items()},
                    "total_blocks": {int(g): int(n) for g, n in part.total.items()},
                }
                self._src_obj, self.told = part.block_ids, set()
            new = [n for n in layers if n not in self.told]
            self.told.update(new)
            if new:
                if self.queue and self.queue[-1][0] is self._part:
                    self.queue[-1][1].extend(new)
                else:
                    self.queue.append((self._part, new))
            return self._start()

    def finish(self, last: LayersReady) -> bool:
        """P's last word goes after the layers told so far; True when the caller must start
        a sender."""
        with self.lock:
            self.closed, self.last = True, last
            return self._start()

    def _start(self) -> bool:
        if self.busy or not (self.queue or self.last):
            return False
        self.busy = True
        return True

    def take(self, request_id: str) -> LayersReady | None:
        """The next message to send, or None (and the sender stops) when nothing is left."""
        with self.lock:
            if self.queue:
                part, layers = self.queue.pop(0)
                return LayersReady(request_id, layers=layers, **part)
            last, self.last = self.last, None
            self.busy = last is not None
            return last

    def close(self) -> None:
        """Tell nothing more (D aborted, or the request is forgotten)."""
        with self.lock:
            self.closed, self.queue, self.last = True, [], None


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
