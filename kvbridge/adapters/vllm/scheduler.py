"""Scheduler-side bookkeeping of the vLLM connector: which requests load, publish or release.

Pure logic over vLLM's ``Request`` objects (duck-typed: ``request_id``, ``kv_transfer_params``,
``prompt_token_ids``, ``num_prompt_tokens``, ``num_computed_tokens``, ``status``); the token
boundary comes from the core. What a step decided reaches the workers as a ``StepPlan``.

vLLM's P/D convention: P's request carries ``{"do_remote_decode": True}``; P returns
``kv_transfer_params`` from ``request_finished``; the proxy hands them to D with
``do_remote_prefill: True``. Our own parameters travel under the ``"kvbridge"`` key (the core's
``TransferParams``), beside vLLM's flags, so proxies that only look at vLLM's keys keep working.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvbridge.adapters.vllm.versions import drop_prompt_tail, resumed_req_ids
from kvbridge.control import auth
from kvbridge.control.holds import HoldBudget
from kvbridge.control.refusals import RefusalLog
from kvbridge.control.requests import Mode, RankAddress, TransferParams, address_of
from kvbridge.core.block_mapping import GroupBlockIds, held_block_ids, tail_block_ids
from kvbridge.core.boundary import prefill_token_count, remote_prefill_token_count
from kvbridge.core.errors import MessageError
from kvbridge.core.groups import GroupKind
from kvbridge.router.bootstrap import BootstrapError, BootstrapLookups

# The keys a router writes into ``kv_transfer_params`` (re-exported: the connector's names).
from kvbridge.router.dispatch import LAYERWISE_KEY as LAYERWISE_KEY
from kvbridge.router.dispatch import PARAMS_KEY as PARAMS_KEY

#: Optional on P's request: ``"pull"`` or ``"push"``, overriding the configured mode for it.
MODE_KEY = "kvbridge_mode"
#: Set on P's params once its prompt was truncated, so a preempted request is not cut twice.
TRUNCATED_KEY = "_kvbridge_truncated"
#: Set on D's params once the load was planned, so a rescheduled request does not load twice.
PROCESSED_KEY = "_kvbridge_processed"
#: Set on D's params when vLLM asks how much to load: the tokens D holds already (its local
#: prefix hit), where the load's blocks start (``LoadRequest.first_token``).
LOCAL_HIT_KEY = "_kvbridge_local_tokens"
#: Set on P's answer when P held nothing for decode (over its hold limit): why.
DECLINED_KEY = "kvbridge_declined"
#: vLLM's null block (the first block of the pool), a placeholder in STATE/SW block lists.
NULL_BLOCK_ID = 0
#: Bounds on the router's transfer id and token (the token must be as unguessable as P's own).
_ID_MAX = 256
_TOKEN_MIN = 16
#: vllm-router's ``mooncake`` mode: its transfer id on both requests, and P's bootstrap address
#: on D's (``kvbridge.router.bootstrap``)
ROUTER_TRANSFER_KEY = "transfer_id"
BOOTSTRAP_KEY = "remote_bootstrap_addr"

log = logging.getLogger("kvbridge.vllm")


@dataclass
class LoadRequest:
    """D: fetch a request's blocks from P into these local blocks."""

    request_id: str
    params: dict[str, Any]  # TransferParams.to_dict()
    block_ids: GroupBlockIds
    #: the request's token at which ``block_ids`` start: the tokens D held already (P and D of
    #: different block sizes pair tokens from there)
    first_token: int = 0


@dataclass
class PublishRequest:
    """P: hold a finished prefill's blocks under a lease for D."""

    request_id: str
    block_ids: GroupBlockIds
    num_tokens: int
    mode: str
    #: the request's capability token, the same for every TP rank (``TransferParams.token``)
    token: str = ""
    #: the id the plane knows it by, when not vLLM's (the router's, in the concurrent dispatch)
    transfer_id: str = ""
    #: when the scheduler finished the prefill (``TransferParams.published_at``)
    published_at: float = 0.0

    @property
    def plane_id(self) -> str:
        return self.transfer_id or self.request_id


@dataclass
class LayerwiseStep:
    """P: a request of the concurrent dispatch whose prefill this step computes (a chunk of it,
    or all); each layer the step computes streams to D (``ControlPlane.stream``) as soon as it
    is computed. Paged groups only: a recurrent state is final only after the whole prefill
    and goes at publish.

    ``block_ids``: the blocks this step completed per group (its last step: every one left),
    from position ``first`` of the group's blocks on, of the ``total`` it has once the prefill
    ends (absent: from 0, all of them; ``kvbridge.control.streams.ComputedBlocks``)."""

    transfer_id: str
    token: str = field(repr=False)  # a credential: never logged
    block_ids: dict[int, list[int]] = field(default_factory=dict)
    first: dict[int, int] = field(default_factory=dict)
    total: dict[int, int] = field(default_factory=dict)


@dataclass
class Withdrawal:
    """P: a request of the concurrent dispatch it will not publish, and why."""

    transfer_id: str
    token: str = field(repr=False)  # a credential: never logged
    reason: str = ""


@dataclass
class StepPlan:
    """Everything the workers must start this step (vLLM's connector metadata carries it)."""

    loads: list[LoadRequest] = field(default_factory=list)
    publishes: list[PublishRequest] = field(default_factory=list)
    #: D: requests that will not load (aborted, nothing left to load): tell P to free at once.
    releases: list[dict[str, Any]] = field(default_factory=list)
    #: P: requests whose layers stream to D during this step's forward pass
    layerwise: list[LayerwiseStep] = field(default_factory=list)
    #: P: requests of the concurrent dispatch it will not publish: tell the waiting D ranks
    withdrawals: list[Withdrawal] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(
            self.loads or self.publishes or self.releases or self.layerwise or self.withdrawals
        )


@dataclass(frozen=True)
class GroupInfo:
    """What the scheduler needs to know about one vLLM cache group."""

    index: int
    kind: GroupKind
    #: Trailing scratch slots a Mamba group holds for speculative decoding.
    speculative_slots: int = 0
    transfer: bool = True
    #: SLIDING_WINDOW: the blocks a window keeps (``sliding_window_blocks``)
    window_blocks: int | None = None
    #: Tokens per block (0: unknown; then a chunked prefill streams only at its last step)
    block_size: int = 0


@dataclass
class _Layerwise:
    """P: a request of the concurrent dispatch, tracked until its prefill's last step."""

    transfer_id: str
    token: str
    prompt_tokens: int
    blocks: list[list[int]] = field(default_factory=list)
    #: per group streamed by chunk, the position of the first block not streamed yet
    streamed: dict[int, int] = field(default_factory=dict)


def router_transfer_id(params: Mapping[str, Any]) -> str | None:
    """vllm-router's transfer id in its ``mooncake`` mode (kvbridge's own keys absent), if it
    fits: it is the request's id and capability token there (``bootstrap``)."""
    if LAYERWISE_KEY in params or PARAMS_KEY in params:
        return None
    tid = params.get(ROUTER_TRANSFER_KEY)
    return tid if isinstance(tid, str) and _TOKEN_MIN <= len(tid) <= _ID_MAX else None


def layerwise_of(params: Mapping[str, Any]) -> tuple[str, str] | None:
    """The router's ``(transfer id, token)`` on P's request (kvbridge's concurrent dispatch, or
    vllm-router's ``mooncake`` mode), or ``None`` if absent or unfit (then P serves the request
    as usual: published under its own id, with its own token)."""
    raw = params.get(LAYERWISE_KEY)
    if not isinstance(raw, Mapping):
        tid = router_transfer_id(params)
        return (tid, tid) if tid is not None and params.get("do_remote_decode") else None
    tid, token = raw.get("id"), raw.get("token")
    if not isinstance(tid, str) or not isinstance(token, str):
        return None
    if not 0 < len(tid) <= _ID_MAX or not _TOKEN_MIN <= len(token) <= _ID_MAX:
        return None
    return tid, token


def layerwise_mode(params: Mapping[str, Any]) -> Mode:
    """The mode the router gave P's request in the concurrent dispatch (push if none or not
    a mode: D's own request, not this label, decides what moves)."""
    raw = params.get(LAYERWISE_KEY)
    asked = raw.get("mode") if isinstance(raw, Mapping) else None
    return Mode(asked) if asked in {m.value for m in Mode} else Mode.PUSH


def _remote_params(params: Mapping[str, Any]) -> TransferParams | None:
    """kvbridge's parameters on D's request, checked (``MessageError`` when malformed), or
    ``None`` when there are none."""
    raw = params.get(PARAMS_KEY)
    return TransferParams.from_dict(raw) if isinstance(raw, Mapping) else None


class SchedulerState:
    """The connector's scheduler-side state for one engine.

    ``engine_id`` is the engine's (vLLM's) id; ``ranks`` (one per worker: TP ranks of each
    of ``pp_size`` pipeline stages, stage-major) and ``transport`` must be what the workers'
    ``ControlPlane``s report (each worker binds a fixed port so the scheduler can name it before
    it exists); ``endpoint`` is rank 0's. ``holds`` bounds what P holds for decode
    (``HoldBudget``; None: no bound).
    """

    def __init__(
        self,
        groups: Sequence[GroupInfo],
        *,
        engine_id: str,
        ranks: Sequence[RankAddress],
        transport: str,
        mode: Mode = Mode.PULL,
        holds: HoldBudget | None = None,
        pp_size: int = 1,
    ) -> None:
        if not ranks or len(ranks) % pp_size:
            raise ValueError(
                "SchedulerState needs the address of every worker (ranks: the TP ranks of each "
                "pipeline stage)"
            )
        self.pp_size = pp_size
        self.groups = list(groups)
        self.has_state = any(g.kind is GroupKind.STATE and g.transfer for g in self.groups)
        self.ranks = list(ranks)
        self.engine_id = engine_id
        self.endpoint = ranks[0].endpoint
        self.transport = transport
        self.mode = Mode(mode)
        self.holds = holds
        self._declined_log = RefusalLog(log, interval=30.0)
        self._plan = StepPlan()
        #: P: request ids published and not yet reported freed by the worker.
        self.sending: set[str] = set()
        #: D: requests marked for a remote prefill without kvbridge's parameters (prefilled here)
        self.foreign_params = 0
        #: P: requests of the concurrent dispatch not past their last prefill step, by vLLM id
        self._layerwise: dict[str, _Layerwise] = {}
        #: D: P's addresses behind vllm-router's bootstrap addresses (its mooncake mode)
        self.bootstrap = BootstrapLookups()

    # -- P: prompt truncation ---------------------------------------------------------------------
    def on_new_request(self, request: Any) -> None:
        """On P, cut the prompt to what P must prefill (N-1 with STATE groups), exactly once."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_decode") or params.get(TRUNCATED_KEY):
            return
        params[TRUNCATED_KEY] = True  # set before any early return: never revisit this request
        total = int(request.num_prompt_tokens)
        keep = prefill_token_count(total, self.has_state)
        layerwise = layerwise_of(params)
        if layerwise is not None:
            self._layerwise[request.request_id] = _Layerwise(*layerwise, keep)
        elif params.get(LAYERWISE_KEY) is not None:
            log.error(
                "request %s: %s must be {'id': <1-%d chars>, 'token': <%d-%d chars>}; "
                "served without layer-wise transfer",
                request.request_id,
                LAYERWISE_KEY,
                _ID_MAX,
                _TOKEN_MIN,
                _ID_MAX,
            )
        if keep == total:
            return
        if request.prompt_token_ids is None:  # prompt embeddings: nothing we can cut safely
            return
        drop_prompt_tail(request, total - keep)
        request.max_tokens = 1

    # -- D: how much to load ----------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens D loads beyond its local hit, and whether asynchronously (always, when > 0);
        None while P's address is being looked up (vllm-router's mooncake mode: vLLM asks
        again at its next step)."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or params.get(PROCESSED_KEY):
            return 0, False
        try:
            remote = _remote_params(params)
            if remote is None and params.get(BOOTSTRAP_KEY) is not None:
                if not self._from_bootstrap(request, params):
                    return (None, False) if not params.get(PROCESSED_KEY) else (0, False)
                remote = _remote_params(params)
        except MessageError as err:
            # A client sent them (D's API takes any kv_transfer_params): one request fails,
            # never the engine.
            self._prefill_locally(request, params, f"malformed {PARAMS_KEY} parameters: {err}", "")
            return 0, False
        if remote is None:
            self._foreign_params(request, params)
            return 0, False
        prompt_len = len(request.prompt_token_ids or ())
        params[LOCAL_HIT_KEY] = int(num_computed_tokens)  # where the load's blocks will start
        count = remote_prefill_token_count(prompt_len, self.has_state, num_computed_tokens)
        if not remote.layerwise:  # P computes the same prompt at once: D knows its count
            # Never ask for more than P computed (a P configured differently, or a shorter prompt).
            count = min(count, max(0, remote.num_tokens - num_computed_tokens))
        return count, count > 0

    def may_load_async(self, request: Any) -> bool:
        """Whether ``get_num_new_matched_tokens`` may answer a load for this request (vLLM
        0.34 asks it, cheaply, as the request enters a waiting queue, and with
        ``--max-num-inflight-kv-loads`` lets such requests start their loads while the running
        batch is full). Exactly the requests that may load: marked for a remote prefill, not
        loaded yet, with kvbridge's parameters or vllm-router's bootstrap address; a request
        whose parameters are not ours is prefilled here and must not take a load's slot."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or params.get(PROCESSED_KEY):
            return False
        return isinstance(params.get(PARAMS_KEY), Mapping) or params.get(BOOTSTRAP_KEY) is not None

    def _from_bootstrap(self, request: Any, params: dict[str, Any]) -> bool:
        """vllm-router's mooncake mode: D's kvbridge parameters from P's bootstrap ``/query``
        (looked up once per P) and the router's transfer id; False while the lookup runs, or
        (marked processed: D prefills the prompt) when it failed or the id does not fit."""
        tid = router_transfer_id(params)
        engine = params.get("remote_engine_id")
        try:
            if tid is None:
                raise BootstrapError(f"{ROUTER_TRANSFER_KEY} missing or not a fitting string")
            address = self.bootstrap.get(str(params[BOOTSTRAP_KEY]), engine)
        except BootstrapError as err:
            self._prefill_locally(request, params, f"vllm-router's mooncake mode: {err}", "")
            return False
        if address is None:
            return False
        try:
            mode = Mode(address.get("mode") or Mode.PULL.value)
            params[PARAMS_KEY] = TransferParams.layerwise_of(address, tid, tid, mode).to_dict()
        except (ValueError, MessageError) as err:  # what P's bootstrap answered does not fit
            why = f"vllm-router's mooncake mode: P's bootstrap answer does not fit: {err}"
            self._prefill_locally(request, params, why, "")
            return False
        return True

    def prefill_address(self) -> dict[str, Any]:
        """P: what names it to a decode instance (engine id, side channel, TP ranks, transport)
        and the mode it publishes in, as its answers' parameters carry them."""
        params = TransferParams(
            "-",
            self.ranks[0].engine_id,
            self.endpoint,
            {},
            0,
            self.transport,
            self.mode,
            self.ranks if len(self.ranks) > 1 else [],
            pp_size=self.pp_size,
        ).to_dict()
        return address_of(params)

    def _foreign_params(self, request: Any, params: dict[str, Any]) -> None:
        """A request marked for a remote prefill whose parameters are not kvbridge's."""
        self._prefill_locally(
            request,
            params,
            "kv_transfer_params ask for a remote prefill but carry no kvbridge parameters "
            f"(keys {sorted(params)})",
            "; route requests so that decode gets prefill's kv_transfer_params as prefill "
            "returned them (vllm-router's default nixl P/D mode does), or use its mooncake mode "
            "with prefill's option bootstrap_port",
        )

    def _prefill_locally(
        self, request: Any, params: dict[str, Any], why: str, what_to_do: str
    ) -> None:
        """D prefills all of a request it was told P would prefill. Said once per request (the
        processed mark: vLLM asks again each step it waits), with a count: a router that writes
        parameters of its own, a P served by another connector or a failed bootstrap lookup
        would otherwise cost every prompt's prefill unseen."""
        params[PROCESSED_KEY] = True
        self.foreign_params += 1
        log.error(
            "request %s: %s: decode prefills the whole prompt itself (%d such requests since "
            "start)%s",
            request.request_id,
            why,
            self.foreign_params,
            what_to_do,
        )

    def update_state_after_alloc(
        self, request: Any, block_ids: Sequence[Sequence[int]], num_external_tokens: int
    ) -> None:
        """D: plan the load into the blocks just allocated (non-null blocks not cached locally).

        Called again after the load finished (more blocks for the rest of the prompt): the
        processed mark makes that a no-op.
        """
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or params.get(PROCESSED_KEY):
            return
        params[PROCESSED_KEY] = True
        params["do_remote_prefill"] = False  # vLLM's own convention: one transfer per request
        raw = params.get(PARAMS_KEY)
        if not isinstance(raw, Mapping):
            return
        if num_external_tokens <= 0:
            # Full local hit, or nothing loadable (a one-token prompt with STATE): P still holds
            # the blocks, so tell it to free them now instead of at lease expiry.
            self._plan.releases.append(dict(raw))
            return
        remote = TransferParams.from_dict(raw)
        local = self.transfer_block_ids(block_ids)
        for g in self.groups:
            if g.kind is GroupKind.SLIDING_WINDOW and g.index in local:
                # P's list was already cut to the window: D loads only that tail (in the
                # concurrent dispatch P's list is not known yet: the window's own length).
                held = len(remote.block_ids.get(g.index, ()))
                if remote.layerwise and g.window_blocks is not None:
                    held = min(len(local[g.index]), g.window_blocks)
                local[g.index] = tail_block_ids(local[g.index], held)
        first = int(params.get(LOCAL_HIT_KEY) or 0)
        self._plan.loads.append(LoadRequest(request.request_id, dict(raw), local, first))

    # -- both: the end of a request ---------------------------------------------------------------
    def request_finished(
        self, request: Any, block_ids: Sequence[Sequence[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Whether vLLM must keep the blocks (P published them), and the params for D."""
        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill") and not params.get(PROCESSED_KEY):
            # D aborted the request before it was ever scheduled: P still holds its blocks.
            params["do_remote_prefill"] = False
            params[PROCESSED_KEY] = True
            raw = params.get(PARAMS_KEY)
            if isinstance(raw, Mapping):
                self._plan.releases.append(dict(raw))
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        self._layerwise.pop(request.request_id, None)
        layerwise = layerwise_of(params)
        if not _finished_normally(request):
            # aborted or errored on P: free the blocks now, publish nothing
            return False, self._withdrawn(layerwise, "the request ended on prefill", None)
        ids = {g: b for g, b in self.transfer_block_ids(block_ids).items() if b}
        if not ids:
            return False, self._withdrawn(layerwise, "prefill holds nothing to send", None)
        if self.holds is not None:
            # What vLLM keeps while P holds the request: every real block of every group.
            kept = sum(sum(1 for b in group if b != NULL_BLOCK_ID) for group in block_ids)
            why = self.holds.admit(request.request_id, kept)
            if why is not None:
                declined = self._declined(request.request_id, why)
                return False, self._withdrawn(layerwise, f"prefill declined: {why}", declined)
        return True, self._publish(request, params, ids, layerwise)

    def _publish(
        self,
        request: Any,
        params: Mapping[str, Any],
        ids: dict[int, list[int]],
        layerwise: tuple[str, str] | None,
    ) -> dict[str, Any]:
        """P publishes a finished request's blocks: the workers' part, and the params for D."""
        num_tokens = int(request.num_computed_tokens)
        mode = _request_mode(params, self.mode, request.request_id)
        # The concurrent dispatch: D asked for a push or a layer-wise pull under the router's id
        # and token already (what D asked decides; the answer names the router's mode).
        transfer_id, token = layerwise or ("", auth.new_token())
        if layerwise is not None:  # vllm-router's mooncake mode names none: P's own
            mode = layerwise_mode(params) if LAYERWISE_KEY in params else self.mode
        transfer = TransferParams(
            transfer_id or request.request_id,
            self.ranks[0].engine_id,
            self.endpoint,
            ids,
            num_tokens,
            self.transport,
            mode,
            self.ranks if len(self.ranks) > 1 else [],
            token=token,
            published_at=time.time(),
            pp_size=self.pp_size,
        )
        self._plan.publishes.append(
            PublishRequest(
                request.request_id,
                ids,
                num_tokens,
                mode.value,
                transfer.token,
                transfer_id,
                transfer.published_at,
            )
        )
        self.sending.add(request.request_id)
        out = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_num_tokens": num_tokens,
            PARAMS_KEY: transfer.to_dict(),
        }
        return out

    def _withdrawn(
        self, layerwise: tuple[str, str] | None, why: str, answer: dict[str, Any] | None
    ) -> dict[str, Any] | None:
        """P publishes nothing for a request of the concurrent dispatch: its workers tell the
        decode ranks waiting for it (``ControlPlane.withdraw``), which compute it themselves."""
        if layerwise is not None:
            self._plan.withdrawals.append(Withdrawal(*layerwise, why))
        return answer

    def finished_sending(self, request_ids: set[str]) -> None:
        """The worker freed these published requests."""
        self.sending -= request_ids
        if self.holds is not None:
            self.holds.release(request_ids)

    def _declined(self, request_id: str, why: str) -> dict[str, Any]:
        """P holds nothing for this request: decode must compute the whole prompt itself."""
        self._declined_log.warning(
            "hold_limit",
            "",
            f"request {request_id}: prefill holds nothing for decode, which computes the prompt "
            f"itself: {why} ({self.holds.declined if self.holds else 0} declined since start)",
        )
        return {"do_remote_prefill": False, "do_remote_decode": False, DECLINED_KEY: why}

    # -- steps ------------------------------------------------------------------------------------
    def build_step(self, scheduler_output: Any = None) -> StepPlan:
        """What the workers must start now; the state is reset for the next step.

        ``scheduler_output`` (vLLM's ``SchedulerOutput`` of this step) tells which requests of
        the concurrent dispatch finish their prefill in this step: their layers stream.
        """
        if scheduler_output is not None and self._layerwise:
            self._plan.layerwise.extend(self._layerwise_steps(scheduler_output))
        plan, self._plan = self._plan, StepPlan()
        return plan

    def _layerwise_steps(self, out: Any) -> list[LayerwiseStep]:
        """Follow the tracked requests' block lists through the step's output (new requests
        bring theirs whole, running ones the blocks added, resumed ones theirs anew) and name
        those whose prompt this step completes.

        A preempted request resumes with new blocks: vLLM 0.34 sends it among the new requests
        with its whole block table, 0.32 and 0.33 among the cached ones, named in
        ``resumed_req_ids``. Either way every chunk streams again from block 0 (the stream then
        sees P's ids change and fails the transfer, fenced: ``kvbridge.control.streams``).
        """
        scheduled: dict[str, int] = out.num_scheduled_tokens
        seen: list[tuple[str, int]] = []
        for new in out.scheduled_new_reqs:
            tracked = self._layerwise.get(new.req_id)
            if tracked is not None:
                tracked.blocks = [list(b) for b in new.block_ids]
                tracked.streamed = {}  # a no-op for a new request; a resumed one starts over
                seen.append((new.req_id, int(new.num_computed_tokens)))
        cached = out.scheduled_cached_reqs
        resumed = resumed_req_ids(cached)
        for i, rid in enumerate(cached.req_ids):
            tracked = self._layerwise.get(rid)
            if tracked is None:
                continue
            added = cached.new_block_ids[i]
            if rid in resumed:  # preempted: its blocks are new, every chunk streams again
                tracked.blocks = [list(b) for b in (added or ())]
                tracked.streamed = {}
            elif added is not None:
                if not tracked.blocks:
                    tracked.blocks = [[] for _ in added]
                for group, ids in zip(tracked.blocks, added, strict=False):
                    group.extend(ids)
            seen.append((rid, int(cached.num_computed_tokens[i])))
        steps = []
        for rid, computed in seen:
            tracked = self._layerwise[rid]
            step = self._layerwise_step(rid, tracked, computed + int(scheduled.get(rid, 0)))
            if step is not None:
                steps.append(step)
        return steps

    def _layerwise_step(self, rid: str, tracked: _Layerwise, end: int) -> LayerwiseStep | None:
        """What of a tracked request streams in a step that computes its prompt up to token
        ``end``: the full-attention and MLA blocks it completed (an earlier chunk of a chunked
        prefill), or every block left (its last step; a sliding window's whole then, as the
        window has dropped what it will)."""
        last = end >= tracked.prompt_tokens
        if last:
            del self._layerwise[rid]
        held = self.transfer_block_ids(tracked.blocks) if last else {}
        ids: dict[int, list[int]] = {}
        first: dict[int, int] = {}
        total: dict[int, int] = {}
        for g in self.groups:
            if not g.transfer or g.kind is GroupKind.STATE or g.index >= len(tracked.blocks):
                continue
            raw = tracked.blocks[g.index]
            size = g.block_size
            chunked = size > 0 and g.kind in (GroupKind.ATTENTION, GroupKind.MLA)
            if chunked and NULL_BLOCK_ID not in raw:
                n = -(-tracked.prompt_tokens // size)
                lo = tracked.streamed.get(g.index, 0)
                hi = n if last else min(end // size, n)
                if hi > lo and len(raw) >= hi:
                    ids[g.index], first[g.index], total[g.index] = raw[lo:hi], lo, n
                    tracked.streamed[g.index] = hi
            elif last and held.get(g.index):
                ids[g.index] = held[g.index]
        if not ids:
            return None
        return LayerwiseStep(tracked.transfer_id, tracked.token, ids, first, total)

    @property
    def has_pending_publish(self) -> bool:
        """A publish waits for the next step: the engine must step even when idle."""
        return bool(self._plan.publishes or self._plan.releases or self._plan.withdrawals)

    def transfer_block_ids(self, block_ids: Sequence[Sequence[int]]) -> dict[int, list[int]]:
        """Block ids per transferable group, null placeholders and scratch slots dropped.

        STATE groups keep only the running state slot: Mamba groups append speculative
        scratch slots after it and hold superseded states and nulls before it (the core's
        ``held_block_ids``, given vLLM's null block).
        """
        return {
            g.index: held_block_ids(g.kind, block_ids[g.index], NULL_BLOCK_ID, g.speculative_slots)
            for g in self.groups
            if g.transfer and g.index < len(block_ids)
        }


def _request_mode(params: Mapping[str, Any], default: Mode, request_id: str) -> Mode:
    """The request's own mode if it names a valid one; a bad value must not stop the engine."""
    asked = params.get(MODE_KEY)
    if asked is None:
        return default
    try:
        return Mode(asked)
    except ValueError:
        log.error(
            "request %s: %s=%r is not one of %s; using the configured mode %r",
            request_id,
            MODE_KEY,
            asked,
            [m.value for m in Mode],
            default.value,
        )
        return default


def _finished_normally(request: Any) -> bool:
    """Stopped or length-capped: the prefill is complete (not aborted, not errored)."""
    name = getattr(request.status, "name", str(request.status))
    return name in ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")
