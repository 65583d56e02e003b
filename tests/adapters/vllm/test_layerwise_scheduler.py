"""The concurrent dispatch's scheduler side (issue 29), with vLLM's own Request and
SchedulerOutput classes: P streams a request's layers in the step that ends its prefill, and
publishes it under the router's id and token; D counts what it loads from its own prompt."""

from __future__ import annotations

import logging

import pytest
from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
from vllm.v1.request import RequestStatus

from kvbridge.adapters.vllm.scheduler import LAYERWISE_KEY, PARAMS_KEY, GroupInfo, SchedulerState
from kvbridge.control.requests import Mode, RankAddress, TransferParams
from kvbridge.core import GroupKind
from tests.adapters.vllm.conftest import make_request, new_request_data

HYBRID = [GroupInfo(0, GroupKind.ATTENTION, block_size=32), GroupInfo(1, GroupKind.STATE)]
WINDOWED = [
    GroupInfo(0, GroupKind.ATTENTION),
    GroupInfo(1, GroupKind.SLIDING_WINDOW, window_blocks=2),
]
ROUTER = {"id": "transfer-1", "token": "t" * 24}


def state(groups=HYBRID) -> SchedulerState:
    ranks = [RankAddress("p", "tcp://127.0.0.1:1")]
    return SchedulerState(groups, engine_id="p", ranks=ranks, transport="mooncake")


def step_new(req, block_ids, scheduled: int) -> SchedulerOutput:
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [new_request_data(req, block_ids)]
    out.num_scheduled_tokens = {req.request_id: scheduled}
    return out


def step_cached(req, new_block_ids, computed: int, scheduled: int) -> SchedulerOutput:
    out = SchedulerOutput.make_empty()
    cached = CachedRequestData.make_empty()
    cached.req_ids = [req.request_id]
    cached.new_block_ids = [new_block_ids]
    cached.num_computed_tokens = [computed]
    cached.num_output_tokens = [0]
    out.scheduled_cached_reqs = cached
    out.num_scheduled_tokens = {req.request_id: scheduled}
    return out


def test_p_streams_each_chunk_of_a_chunked_prefill_as_it_is_computed() -> None:
    sched = state()
    req = make_request("r1", 100, {"do_remote_decode": True, LAYERWISE_KEY: dict(ROUTER)})
    sched.on_new_request(req)  # N-1 = 99 tokens to prefill (a STATE group): 4 blocks of 32
    # chunked prefill: 40 tokens (block 0 complete), 40 more (block 1), then the other 19
    first = sched.build_step(step_new(req, ([3, 4], [0]), 40))
    (step,) = first.layerwise
    assert step.transfer_id == "transfer-1" and step.token == ROUTER["token"]
    assert (step.block_ids, step.first, step.total) == ({0: [3]}, {0: 0}, {0: 4})
    assert "t" * 24 not in repr(step)  # a credential is never in a log line
    (step,) = sched.build_step(step_cached(req, ([5],), 40, 40)).layerwise
    assert (step.block_ids, step.first) == ({0: [4]}, {0: 1})  # block 2 is not complete yet
    (step,) = sched.build_step(step_cached(req, ([6], [9]), 80, 19)).layerwise
    # the last chunk: every block left; the STATE group goes at publish, once final
    assert (step.block_ids, step.first, step.total) == ({0: [5, 6]}, {0: 2}, {0: 4})
    assert sched.build_step(step_cached(req, None, 99, 1)).layerwise == []  # streamed once


def test_p_streams_a_one_step_prefill_whole_and_a_window_at_its_last_step() -> None:
    groups = [GroupInfo(0, GroupKind.ATTENTION, block_size=32), *WINDOWED[1:]]
    sched = state(groups)
    req = make_request("r1", 100, {"do_remote_decode": True, LAYERWISE_KEY: dict(ROUTER)})
    sched.on_new_request(req)
    first = sched.build_step(step_new(req, ([3, 4], [7, 8]), 64))
    assert [s.block_ids for s in first.layerwise] == [{0: [3, 4]}]  # the window waits
    (step,) = sched.build_step(step_cached(req, ([5, 6], [9, 10]), 64, 36)).layerwise
    # the window's blocks whole (the plan pairs its tail with what D asks for)
    assert step.block_ids == {0: [5, 6], 1: [7, 8, 9, 10]}
    assert (step.first, step.total) == ({0: 2}, {0: 4})
    # one step, no chunks: the whole part (from 0, every block)
    again = state()
    one = make_request("r2", 100, {"do_remote_decode": True, LAYERWISE_KEY: dict(ROUTER)})
    again.on_new_request(one)
    (step,) = again.build_step(step_new(one, ([3, 4, 5, 6], [9]), 99)).layerwise
    assert (step.block_ids, step.first, step.total) == ({0: [3, 4, 5, 6]}, {0: 0}, {0: 4})


@pytest.mark.parametrize(("router_mode", "mode"), [(None, Mode.PUSH), ("pull", Mode.PULL)])
def test_p_publishes_under_the_routers_id_token_and_mode(router_mode, mode) -> None:
    sched = state()
    router = dict(ROUTER, **({"mode": router_mode} if router_mode else {}))
    # the client's own kvbridge_mode does not override the router's dispatch
    params_in = {"do_remote_decode": True, LAYERWISE_KEY: router, "kvbridge_mode": "push"}
    if router_mode is None:
        params_in["kvbridge_mode"] = "pull"
    req = make_request("r1", 100, params_in)
    sched.on_new_request(req)
    req.num_computed_tokens = req.num_prompt_tokens
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = sched.request_finished(req, ([3, 4, 5, 6], [0, 9]))
    assert delay and params is not None
    transfer = TransferParams.from_dict(params[PARAMS_KEY])
    assert transfer.request_id == "transfer-1" and transfer.token == ROUTER["token"]
    assert transfer.mode is mode  # the router's (push by default): D asked for it
    (pub,) = sched.build_step().publishes
    assert pub.request_id == "r1" and pub.plane_id == "transfer-1"


def test_p_ignores_a_malformed_layerwise_request(caplog) -> None:
    sched = state()
    bad = {"do_remote_decode": True, LAYERWISE_KEY: {"id": "x", "token": "short"}}
    req = make_request("r1", 100, bad)
    with caplog.at_level(logging.ERROR, logger="kvbridge.vllm"):
        sched.on_new_request(req)
    assert any(LAYERWISE_KEY in r.getMessage() for r in caplog.records)
    assert sched.build_step(step_new(req, ([3, 4, 5, 6], [9]), 99)).layerwise == []
    req.num_computed_tokens = req.num_prompt_tokens
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = sched.request_finished(req, ([3, 4, 5, 6], [9]))
    transfer = TransferParams.from_dict(params[PARAMS_KEY])
    assert transfer.request_id == "r1" and transfer.token != "short"  # P's own, as usual


def d_params(layerwise: bool = True) -> dict:
    transfer = TransferParams(
        "transfer-1", "p", "tcp://127.0.0.1:1", {}, 0, "mooncake", Mode.PUSH,
        token=ROUTER["token"], layerwise=layerwise,
    )  # fmt: skip
    return {"do_remote_prefill": True, PARAMS_KEY: transfer.to_dict()}


def test_d_counts_from_its_own_prompt_and_clips_the_window_itself() -> None:
    d = state(WINDOWED)
    req = make_request("d1", 200, d_params())
    count, asynchronous = d.get_num_new_matched_tokens(req, 0)
    assert (count, asynchronous) == (200, True)  # no STATE group: every token, P's count unknown
    d.update_state_after_alloc(req, ([1, 2, 3, 4], [5, 6, 7, 8]), count)
    (load,) = d.build_step().loads
    assert load.block_ids == {0: [1, 2, 3, 4], 1: [7, 8]}  # the window's blocks, the tail
    # the classic dispatch still trusts P's count: 0 tokens published, nothing to load
    classic = make_request("d2", 200, d_params(layerwise=False))
    assert d.get_num_new_matched_tokens(classic, 0) == (0, False)


def test_p_withdraws_what_it_will_not_publish() -> None:
    from kvbridge.control.holds import HoldBudget, HoldLimits

    ranks = [RankAddress("p", "tcp://127.0.0.1:1")]
    sched = SchedulerState(
        HYBRID,
        engine_id="p",
        ranks=ranks,
        transport="mooncake",
        holds=HoldBudget(HoldLimits(max_requests=8, max_blocks=2)),
    )
    # past the hold limit: P holds nothing, and D (waiting for a push) hears it at once
    big = make_request("big", 100, {"do_remote_decode": True, LAYERWISE_KEY: dict(ROUTER)})
    sched.on_new_request(big)
    big.num_computed_tokens = big.num_prompt_tokens
    big.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, answer = sched.request_finished(big, ([3, 4, 5, 6], [9]))
    assert not delay and answer is not None and answer["do_remote_prefill"] is False
    # aborted on P
    other = {"id": "transfer-2", "token": "u" * 24}
    gone = make_request("gone", 100, {"do_remote_decode": True, LAYERWISE_KEY: other})
    sched.on_new_request(gone)
    gone.status = RequestStatus.FINISHED_ABORTED
    assert sched.request_finished(gone, ([7], [8])) == (False, None)
    assert sched.has_pending_publish  # the engine steps to deliver them
    plan = sched.build_step()
    assert [(w.transfer_id, w.token) for w in plan.withdrawals] == [
        ("transfer-1", ROUTER["token"]),
        ("transfer-2", other["token"]),
    ]
    assert "held for decode" in plan.withdrawals[0].reason and not plan.publishes
    assert ROUTER["token"] not in repr(plan)


def step_resumed(req, block_ids, scheduled: int) -> SchedulerOutput:
    """A preempted request scheduled again, as the installed vLLM says it: 0.34 among the new
    requests with its whole block table; 0.32 and 0.33 among the cached ones, named in
    ``resumed_req_ids``, their new blocks in place of the old."""
    if "resumed_req_ids" not in CachedRequestData.__dataclass_fields__:
        return step_new(req, block_ids, scheduled)
    out = step_cached(req, block_ids, req.num_computed_tokens, scheduled)
    out.scheduled_cached_reqs.resumed_req_ids = {req.request_id}
    return out


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_preempted_prefill_streams_again_from_block_0_in_its_new_blocks(mode) -> None:
    """Preempted mid-prefill (its blocks freed, its computed tokens reset), then scheduled again
    in other blocks: every chunk streams again from position 0 with the new ids (the stream
    then sees P's ids change and fails the transfer, fenced), in both layer-wise modes."""
    sched = state()
    router = dict(ROUTER, mode=mode)
    req = make_request("r1", 100, {"do_remote_decode": True, LAYERWISE_KEY: router})
    sched.on_new_request(req)  # 99 tokens to prefill: 4 blocks of 32
    (step,) = sched.build_step(step_new(req, ([3, 4], [0]), 40)).layerwise
    assert (step.block_ids, step.first) == ({0: [3]}, {0: 0})
    req.num_computed_tokens = 0  # preempted: vLLM frees its blocks and starts it over
    (step,) = sched.build_step(step_resumed(req, ([11, 12], [0]), 40)).layerwise
    assert (step.block_ids, step.first, step.total) == ({0: [11]}, {0: 0}, {0: 4})
    (step,) = sched.build_step(step_cached(req, ([13, 14], [15]), 40, 59)).layerwise
    assert (step.block_ids, step.first) == ({0: [12, 13, 14]}, {0: 1})


def test_a_preempted_prefill_publishes_its_final_blocks_once_in_pull_and_push() -> None:
    """The classic dispatch (pull or push): nothing streams, and a request preempted and
    resumed publishes the blocks it holds when it finishes, its prompt cut only once."""
    for mode in ("pull", "push"):
        sched = state()
        req = make_request("r1", 100, {"do_remote_decode": True, "kvbridge_mode": mode})
        sched.on_new_request(req)
        assert sched.build_step(step_new(req, ([3, 4], [0]), 40)).layerwise == []
        req.num_computed_tokens = 0
        assert sched.build_step(step_resumed(req, ([11, 12], [0]), 40)).layerwise == []
        sched.on_new_request(req)  # vLLM never asks again; were it to, nothing more is cut
        assert req.num_prompt_tokens == 99
        req.num_computed_tokens = 99
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        _, params = sched.request_finished(req, ([11, 12, 13, 14], [0, 15]))
        transfer = TransferParams.from_dict(params[PARAMS_KEY])
        assert transfer.block_ids == {0: [11, 12, 13, 14], 1: [15]}
        assert transfer.mode is Mode(mode) and transfer.num_tokens == 99


def test_a_resumed_decode_request_never_loads_again() -> None:
    """D: a request preempted after its load comes back (0.34: as a new request) and computes
    on from its blocks; the connector neither loads it again nor tells vLLM it may."""
    d = state()
    req = make_request("d1", 100, d_params(layerwise=False))
    req.kv_transfer_params[PARAMS_KEY]["num_tokens"] = 99
    assert d.may_load_async(req)
    assert d.get_num_new_matched_tokens(req, 0) == (99, True)
    d.update_state_after_alloc(req, ([1, 2, 3, 4], [5]), 99)
    assert len(d.build_step().loads) == 1
    assert d.get_num_new_matched_tokens(req, 0) == (0, False)
    assert not d.may_load_async(req)
