"""What a request is to the control plane: its transfer parameters, statistics and outcome.

Shared by both sides: P publishes ``TransferParams``, D loads from them, and each side ends the
request in a ``RequestOutcome`` that carries the ``RequestStats`` of where its time went.
"""

from __future__ import annotations

import contextlib
import enum
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import numpy as np

from kvbridge.control.messages import BlockIds, TransferFigures
from kvbridge.core.block_mapping import CheckedBlockIds, check_group_ids
from kvbridge.core.errors import KvbridgeError, MessageError
from kvbridge.core.layout import Layout
from kvbridge.core.transpose import Transpose

_K = TypeVar("_K")
_V = TypeVar("_V")


class Mode(str, enum.Enum):
    """Who moves the bytes."""

    PULL = "pull"  # D reads from P, then tells P to release
    PUSH = "push"  # D sends its block ids, P writes, then tells D it is done


class RankAddress(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """How to reach one prefill TP rank: its control plane's engine id and side channel."""

    engine_id: str
    endpoint: str


class TransferParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What P publishes for a request and D needs to fetch it (kv_transfer_params in vLLM).

    ``engine_id``/``endpoint`` are P's TP rank 0; ``ranks`` every P rank in order when P runs
    TP > 1 or pipeline stages (empty: rank 0 alone): stage-major, ``pp_size`` stages of
    ``tp_size`` ranks (``LayoutSpec.flat_rank``). ``token`` is the request's capability: an
    unguessable value P made for this request alone; P serves a claim, a read or a push of it
    only to a peer that sends it (beside the shared secret), and it grants nothing once P's
    hold of the request ended. Never logged.
    """

    request_id: str
    engine_id: str
    endpoint: str
    block_ids: BlockIds
    num_tokens: int
    transport: str
    mode: Mode = Mode.PULL
    ranks: list[RankAddress] = []
    token: str = msgspec.field(default="")
    #: The concurrent dispatch (layer-wise push): D got the request while P computes it, so
    #: ``block_ids`` is empty and ``num_tokens`` unknown (0); D counts the tokens it loads from
    #: its own prompt, and P writes each layer as it is computed (``ControlPlane.stream``).
    layerwise: bool = False
    #: P's wall clock (``time.time()``) when it answered the request: its forward pass for the
    #: prompt ended and it published the blocks (0: not stamped). The start of
    #: ``RequestStats.landed_after_s``.
    published_at: float = 0.0
    #: P's pipeline stages (``ranks`` holds every stage's TP ranks, stage by stage)
    pp_size: int = 1

    @property
    def tp_size(self) -> int:
        """P's TP size."""
        return len(self.ranks) // self.pp_size or 1

    def rank(self, p_rank: int) -> RankAddress:
        """How to reach P's worker ``p_rank`` (its TP rank, stage-major across stages)."""
        if not self.ranks:
            if p_rank:
                raise KvbridgeError(f"prefill rank {p_rank} of a TP 1 prefill")
            return RankAddress(self.engine_id, self.endpoint)
        return self.ranks[p_rank]

    def __post_init__(self) -> None:
        if self.ranks and (self.ranks[0].engine_id, self.ranks[0].endpoint) != (
            self.engine_id,
            self.endpoint,
        ):
            raise msgspec.ValidationError("ranks[0] must be engine_id and endpoint (P's rank 0)")
        if self.pp_size < 1 or (self.pp_size > 1 and len(self.ranks) % self.pp_size):
            raise msgspec.ValidationError(
                f"pp_size {self.pp_size} does not divide the {len(self.ranks)} prefill ranks"
            )

    def __repr__(self) -> str:
        # The token is a credential: a logged repr must not hand it out.
        shown = ", ".join(
            f"{name}={getattr(self, name)!r}" for name in self.__struct_fields__ if name != "token"
        )
        return f"TransferParams({shown}, token=<{'set' if self.token else 'unset'}>)"

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)  # type: ignore[no-any-return]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TransferParams:
        """Validate params that came back through the serving engine (keys may be strings)."""
        try:
            return msgspec.convert(dict(data), cls, strict=False)
        except msgspec.ValidationError as err:
            raise MessageError("invalid", f"invalid transfer parameters: {err}") from None

    @classmethod
    def layerwise_of(
        cls, address: Mapping[str, Any], request_id: str, token: str, mode: Mode
    ) -> TransferParams:
        """D's parameters in a concurrent dispatch: P's ``address`` (``ADDRESS_FIELDS`` of an
        earlier answer of P's, or of its bootstrap ``/query``), the router's id and token, no
        block ids (P has computed nothing yet)."""
        return cls.from_dict(
            {
                **{k: address[k] for k in ADDRESS_FIELDS if k in address},
                "request_id": request_id,
                "block_ids": {},
                "num_tokens": 0,
                "mode": Mode(mode).value,
                "token": token,
                "layerwise": True,
            }
        )


#: The fields of P's published parameters that name P (its rank 0, its TP ranks, its transport).
ADDRESS_FIELDS = ("engine_id", "endpoint", "transport", "ranks", "pp_size")


def address_of(params: Mapping[str, Any]) -> dict[str, Any]:
    """What of P's published parameters ``params`` names P (``ADDRESS_FIELDS``) and the mode it
    publishes in: what a concurrent dispatch gives D before P has computed anything."""
    return {name: params[name] for name in (*ADDRESS_FIELDS, "mode") if name in params}


def rank_engine_id(
    engine_id: str, tp_rank: int, tp_size: int, pp_rank: int = 0, pp_size: int = 1
) -> str:
    """The engine id of one worker's control plane: every worker (TP rank of a pipeline stage)
    is its own peer to the other side (its own transport connection and leases); a worker alone
    in its engine keeps the engine's id."""
    stage = f".pp{pp_rank}" if pp_size > 1 else ""
    rank = f".tp{tp_rank}" if tp_size > 1 else ""
    return f"{engine_id}{stage}{rank}"


@dataclass
class RequestStats:
    """Where a request's time went, and what it moved."""

    #: from handing the request to the plane until it ended here (D: the load; P: the push)
    total_s: float = 0.0
    #: waiting for a free worker of the plane
    queued_s: float = 0.0
    handshake_s: float = 0.0
    #: D's request to P (pull: ``PullStart``, push: ``PushRequest``) until P's answer was read
    #: (a pull reads it once it planned: the wait for P is what exceeds ``plan_s``)
    ask_s: float = 0.0
    plan_s: float = 0.0
    transfer_s: float = 0.0
    nbytes: int = 0
    descriptors: int = 0
    descriptors_before_merge: int = 0
    #: time between giving a transfer up and the fence (no byte of it can still land)
    fence_s: float = 0.0
    #: no fence proves the transfer's bytes stopped (the request's blocks stay held for good)
    unproven: bool = False
    #: time spent on the integrity check (``verify``), and whether it found a difference
    verify_s: float = 0.0
    verify_failed: bool = False
    #: P: the lease ran out before D released the blocks (P freed them unclaimed)
    lease_expired: bool = False
    #: P: of those, no D rank had claimed it (freed at ``Deadlines.claim``, before the lease)
    unclaimed: bool = False
    #: D: the load failed because P and D cannot pair (their layouts, models, block sizes,
    #: transports or TP ranks differ): every load between them fails alike
    incompatible: bool = False
    #: of ``nbytes``, what moved layer by layer while P still computed the request (P's writes
    #: in a layer-wise push, D's reads in a layer-wise pull)
    streamed_nbytes: int = 0
    #: the prefill steps those bytes came in (one per chunk of a chunked prefill, or one)
    streamed_parts: int = 0
    #: from P's answer (``TransferParams.published_at``) until the last byte landed in D: P's
    #: clock for a push (its writes ended), D's for a pull (its reads, and its integrity check
    #: when ``verify`` is on, ended); what the transfer adds to D's time to first token after
    #: P's forward pass. 0 when P stamped no time.
    landed_after_s: float = 0.0

    def landed(self, published_at: float) -> None:
        """The last byte landed now: ``landed_after_s`` from P's stamp
        (``TransferParams.published_at``), if it made one."""
        if published_at:
            self.landed_after_s = time.time() - published_at

    def figures(self) -> TransferFigures:
        """What this side's transfer moved and took, as P tells D (``PushDone``)."""
        return TransferFigures(
            nbytes=self.nbytes,
            descriptors=self.descriptors,
            descriptors_before_merge=self.descriptors_before_merge,
            plan_s=self.plan_s,
            transfer_s=self.transfer_s,
            unproven=self.unproven,
            streamed_nbytes=self.streamed_nbytes,
            streamed_parts=self.streamed_parts,
            landed_after_s=self.landed_after_s,
        )

    def add_pushed(self, figures: TransferFigures) -> None:
        """Count one P rank's push into this load (D, from several P ranks): what they moved
        adds up; they planned and wrote at once (the longest counts); unproven if one was."""
        self.nbytes += figures.nbytes
        self.descriptors += figures.descriptors
        self.descriptors_before_merge += figures.descriptors_before_merge
        self.plan_s = max(self.plan_s, figures.plan_s)
        self.transfer_s = max(self.transfer_s, figures.transfer_s)
        self.unproven = self.unproven or figures.unproven
        self.streamed_nbytes += figures.streamed_nbytes
        self.streamed_parts = max(self.streamed_parts, figures.streamed_parts)
        self.landed_after_s = max(self.landed_after_s, figures.landed_after_s)


@dataclass
class RequestOutcome:
    """The definite end of a request on this side."""

    request_id: str
    ok: bool
    reason: str = ""
    stats: RequestStats = field(default_factory=RequestStats)
    #: D, a load that succeeded from a peer whose blocks keep their cells in the other order
    #: (token-major against head-major): the blocks this side must permute before the engine
    #: reads them (``kvbridge.core.transpose``; the vLLM adapter does it in ``get_finished``)
    transposes: list[Transpose] = field(default_factory=list)


@contextlib.contextmanager
def timed(stats: RequestStats, name: str) -> Iterator[None]:
    """Record the block's duration in ``stats.<name>``, also when it raised or timed out: that
    is where a slow request's time went."""
    start = time.monotonic()
    try:
        yield
    finally:
        setattr(stats, name, time.monotonic() - start)


def checked_ids(
    layout: Layout, block_ids: Mapping[int, Any], side: str, first_token: int | None = None
) -> CheckedBlockIds:
    """``block_ids`` checked against ``layout``'s groups, or ``MessageError`` if it cannot hold
    them: plain ints per group (as messages carry them) with the checked arrays the planner
    uses without checking them again. ``first_token``: where a destination's ids start in the
    request's tokens (``CheckedBlockIds.first_token``); by default what ``block_ids`` says
    when they were checked already."""
    if first_token is None:
        first_token = getattr(block_ids, "first_token", None)
    ids = CheckedBlockIds(first_token)
    for group, values in block_ids.items():
        index = int(group)
        if index not in layout.groups:
            raise MessageError("block_id", f"{side} block ids name unknown group {index}")
        arr = np.asarray(values, dtype=np.int64).reshape(-1)
        try:
            ids.add(index, check_group_ids(layout.groups[index], arr, side))
        except KvbridgeError as err:
            raise MessageError("block_id", str(err)) from None
    return ids


def forget_expired(table: dict[_K, _V], now: float, until: Callable[[_V], float]) -> None:
    """Drop the entries of a table of remembered request ids whose ``until`` time has passed.

    Call with the plane's lock held.
    """
    for key in [k for k, value in table.items() if until(value) < now]:
        del table[key]
