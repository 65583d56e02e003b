"""Scheduler-side bookkeeping with real vLLM Request objects."""

from __future__ import annotations

import logging

from vllm.v1.request import RequestStatus

from kvbridge.adapters.vllm.scheduler import MODE_KEY, PARAMS_KEY, GroupInfo, SchedulerState
from kvbridge.control.holds import HoldBudget, HoldLimits
from kvbridge.control.requests import RankAddress
from kvbridge.core import GroupKind
from tests.adapters.vllm.conftest import blocks_of, make_request

HYBRID = [GroupInfo(0, GroupKind.ATTENTION), GroupInfo(1, GroupKind.STATE, speculative_slots=1)]
DENSE = [GroupInfo(0, GroupKind.ATTENTION)]


def state(groups=HYBRID) -> SchedulerState:
    ranks = [RankAddress("p", "tcp://127.0.0.1:1")]
    return SchedulerState(groups, engine_id="p", ranks=ranks, transport="mooncake")


def prefill(sched: SchedulerState, prompt_len: int, block_ids, rid: str = "r1") -> dict:
    """P: new request, prefill done, finished → the params D receives."""
    req = make_request(rid, prompt_len, {"do_remote_decode": True})
    sched.on_new_request(req)
    req.num_computed_tokens = req.num_prompt_tokens
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = sched.request_finished(req, block_ids)
    assert delay and params is not None
    return params


def test_p_truncates_once_with_state_groups() -> None:
    sched = state()
    req = make_request("r1", 10, {"do_remote_decode": True})
    sched.on_new_request(req)
    sched.on_new_request(req)  # a preempted, rescheduled request must not lose another token
    assert req.num_prompt_tokens == 9 and len(req.prompt_token_ids) == 9
    assert len(req.all_token_ids) == 9 and req.max_tokens == 1


def test_p_keeps_the_prompt_without_state_and_for_one_token() -> None:
    dense = make_request("a", 10, {"do_remote_decode": True})
    state(DENSE).on_new_request(dense)
    one = make_request("b", 1, {"do_remote_decode": True})
    state().on_new_request(one)
    assert dense.num_prompt_tokens == 10 and one.num_prompt_tokens == 1


def test_p_publishes_without_null_placeholders_or_scratch_slots() -> None:
    sched = state()
    # STATE group: nulls, the running slot 7, then one speculative scratch slot 9.
    params = prefill(sched, 130, ([3, 4, 5], [0, 0, 7, 9]))
    transfer = params[PARAMS_KEY]
    assert transfer["block_ids"] == {0: [3, 4, 5], 1: [7]}
    assert transfer["num_tokens"] == 129 and params["do_remote_prefill"] is True
    plan = sched.build_step()
    assert [p.request_id for p in plan.publishes] == ["r1"] and not sched.build_step()


def test_p_aborted_request_is_not_published() -> None:
    sched = state()
    req = make_request("r1", 10, {"do_remote_decode": True})
    req.status = RequestStatus.FINISHED_ABORTED
    assert sched.request_finished(req, ([1], [2])) == (False, None)
    assert not sched.build_step()


def test_d_loads_n_minus_1_into_its_unhashed_blocks() -> None:
    p, d = state(), state()
    params = prefill(p, 130, ([3, 4, 5], [0, 0, 7]))
    req = make_request("d1", 130, params)
    assert d.get_num_new_matched_tokens(req, 0) == (129, True)
    d.update_state_after_alloc(
        req, blocks_of([[10, 11, 12], [0, 0, 8]]).get_unhashed_block_ids_all_groups(), 129
    )
    d.update_state_after_alloc(req, [[13], [0]], 0)  # the second call after the load: no-op
    (load,) = d.build_step().loads
    assert load.block_ids == {0: [10, 11, 12], 1: [8]}
    assert d.get_num_new_matched_tokens(req, 0) == (0, False)  # never loads twice


def test_d_prefix_cache_hit_loads_the_rest() -> None:
    p, d = state(DENSE), state(DENSE)
    params = prefill(p, 200, ([3, 4, 5, 6],))
    req = make_request("d1", 200, params)
    assert d.get_num_new_matched_tokens(req, 128) == (72, True)
    ids = blocks_of([[20, 21, 22, 23]], hashed=2).get_unhashed_block_ids_all_groups()
    d.update_state_after_alloc(req, ids, 72)
    (load,) = d.build_step().loads
    assert load.block_ids == {0: [22, 23]}  # the core pairs them with P's tail [5, 6]


def test_d_one_token_prompt_with_state_loads_nothing_and_releases_p() -> None:
    p, d = state(), state()
    params = prefill(p, 1, ([3], [0, 7]))
    req = make_request("d1", 1, params)
    assert d.get_num_new_matched_tokens(req, 0) == (0, False)
    d.update_state_after_alloc(req, [], 0)
    plan = d.build_step()
    assert not plan.loads and [r["request_id"] for r in plan.releases] == ["r1"]


def test_d_abort_before_scheduling_releases_p() -> None:
    p, d = state(), state()
    params = prefill(p, 50, ([3], [7]))
    req = make_request("d1", 50, params)
    req.status = RequestStatus.FINISHED_ABORTED
    assert d.request_finished(req, ([], [])) == (False, None)
    assert [r["request_id"] for r in d.build_step().releases] == ["r1"]


def test_p_request_may_choose_its_mode() -> None:
    sched = state()  # configured: pull
    for rid, asked, want in (("a", "push", "push"), ("b", None, "pull"), ("c", "teleport", "pull")):
        req = make_request(rid, 10, {"do_remote_decode": True, MODE_KEY: asked})
        sched.on_new_request(req)
        req.num_computed_tokens = req.num_prompt_tokens
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        _, params = sched.request_finished(req, ([3], [7]))
        assert params is not None and params[PARAMS_KEY]["mode"] == want, rid
        assert [p.mode for p in sched.build_step().publishes] == [want]


def test_d_logs_and_counts_a_remote_prefill_without_kvbridge_parameters() -> None:
    """A router that writes its own parameters (vllm-router's mooncake mode: remote host, port
    and engine id, no ``kvbridge`` key): D prefills itself, says so once per request, counts."""
    sched = state(DENSE)
    foreign = {
        "do_remote_prefill": True,
        "remote_engine_id": "x",
        "remote_host": "10.0.0.1",
        "remote_port": 8998,
        "remote_block_ids": None,
    }
    req = make_request("d1", 130, foreign)
    # A handler on the scheduler's own logger sees each record once, wherever the kvbridge
    # logger forwards it (vLLM's handlers once the plugin has run, in this process or not).
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("kvbridge.vllm")
    logger.addHandler(handler)
    try:
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # asked again: said once
    finally:
        logger.removeHandler(handler)
    lines = [r.getMessage() for r in records]
    assert len(lines) == 1 and "carry no kvbridge parameters" in lines[0], lines
    assert "(1 such requests since start)" in lines[0] and sched.foreign_params == 1
    sched.update_state_after_alloc(req, blocks_of([[3, 4, 5]]), 0)
    assert not sched.build_step()  # nothing to load, nothing to release


# -- capability tokens and hold limits (issue 28) ----------------------------------------------


def test_each_request_gets_its_own_token_and_every_tp_rank_publishes_it() -> None:
    sched = state()
    first = prefill(sched, 130, ([3, 4, 5], [0, 0, 7, 9]), rid="a")
    second = prefill(sched, 130, ([10, 11], [0, 12]), rid="b")
    tokens = [first[PARAMS_KEY]["token"], second[PARAMS_KEY]["token"]]
    assert all(len(t) >= 32 for t in tokens) and tokens[0] != tokens[1]
    plan = sched.build_step()
    assert [p.token for p in plan.publishes] == tokens  # the workers publish the same token


def held_state(max_requests: int, max_blocks: int) -> SchedulerState:
    ranks = [RankAddress("p", "tcp://127.0.0.1:1")]
    holds = HoldBudget(HoldLimits(max_requests, max_blocks))
    return SchedulerState(HYBRID, engine_id="p", ranks=ranks, transport="mooncake", holds=holds)


def finish(sched: SchedulerState, rid: str, block_ids) -> tuple[bool, dict | None]:
    req = make_request(rid, 130, {"do_remote_decode": True})
    sched.on_new_request(req)
    req.num_computed_tokens = req.num_prompt_tokens
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    return sched.request_finished(req, block_ids)


def test_past_the_hold_limit_p_holds_nothing_and_decode_computes(caplog) -> None:
    sched = held_state(max_requests=100, max_blocks=10)
    # 4 real blocks each (nulls are not held): two fit under 10, the third does not.
    ids = ([3, 4, 5], [0, 0, 7])
    assert finish(sched, "a", ids)[0] and finish(sched, "b", ids)[0]
    assert sched.holds is not None and sched.holds.held_blocks == 8
    with caplog.at_level(logging.WARNING, logger="kvbridge.vllm"):
        for rid in ("c", "d"):
            delay, params = finish(sched, rid, ids)
            assert not delay and params is not None
            assert params["do_remote_prefill"] is False and PARAMS_KEY not in params
            assert "exceed its bound of 10" in params["kvbridge_declined"]
    assert sched.holds.declined == 2 and sched.holds.held_blocks == 8
    assert [p.request_id for p in sched.build_step().publishes] == ["a", "b"]
    lines = [r.getMessage() for r in caplog.records if "holds nothing for decode" in r.message]
    # rate-limited: one line for the burst (the first decline's; vLLM 0.33's logging setup may
    # hand caplog the same record twice)
    assert set(lines) == {lines[0]} and "(1 declined since start)" in lines[0], lines
    # D's scheduler reads the declined params as "prefill it here": nothing to load
    d = state()
    req = make_request("c", 130, params)
    assert d.get_num_new_matched_tokens(req, 0) == (0, False)
    # once P frees a hold, the next request fits again
    sched.finished_sending({"a"})
    assert sched.holds.held_blocks == 4 and finish(sched, "e", ids)[0]


def test_the_request_bound_counts_requests_not_blocks() -> None:
    sched = held_state(max_requests=1, max_blocks=1000)
    assert finish(sched, "a", ([3], [0, 7]))[0]
    delay, params = finish(sched, "b", ([4], [0, 8]))
    assert not delay and "holds 1 requests for decode" in params["kvbridge_declined"]


def test_only_requests_that_may_load_count_as_async_loads() -> None:
    """vLLM 0.34's ``may_load_async`` (read with ``--max-num-inflight-kv-loads``): a request
    with kvbridge's parameters or vllm-router's bootstrap address may load; one whose
    parameters are not ours (prefilled here), or already loaded, must not take a load's slot,
    where vLLM's default (the bare ``do_remote_prefill`` flag) would count it."""
    p, d = state(), state()
    ours = make_request("d1", 130, prefill(p, 130, ([3, 4, 5], [0, 7])))
    foreign = make_request("d2", 130, {"do_remote_prefill": True, "remote_host": "x"})
    router = make_request("d3", 130, {"do_remote_prefill": True, "remote_bootstrap_addr": "h:1"})
    local = make_request("d4", 130, None)
    assert [d.may_load_async(r) for r in (ours, foreign, router, local)] == [
        True,
        False,
        True,
        False,
    ]
    d.get_num_new_matched_tokens(foreign, 0)  # D prefills it: marked processed
    d.update_state_after_alloc(ours, [[10, 11, 12], [8]], 129)
    assert not d.may_load_async(ours) and not d.may_load_async(foreign)
