"""Whatever a client puts in ``kv_transfer_params``, the scheduler side fails that request at
most, never the engine: generated parameters through every scheduler-side call vLLM makes, with
vLLM's own ``Request`` objects."""

from __future__ import annotations

import logging

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.v1.request import RequestStatus

from kvbridge.adapters.vllm.scheduler import PARAMS_KEY, PROCESSED_KEY, GroupInfo, SchedulerState
from kvbridge.control.requests import Mode, RankAddress, TransferParams
from kvbridge.core import GroupKind
from tests.adapters.vllm.conftest import make_request
from tests.adapters.vllm.kv_params_strategies import transfer_params

GROUPS = [GroupInfo(0, GroupKind.ATTENTION, block_size=32), GroupInfo(1, GroupKind.STATE)]
GOOD = TransferParams(
    "r1", "p", "tcp://127.0.0.1:1", {0: [3, 4], 1: [7]}, 63, "mooncake", Mode.PULL, token="t" * 24
).to_dict()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(params=transfer_params(GOOD), prompt=st.integers(1, 130), computed=st.integers(0, 64))
def test_no_kv_transfer_params_raise_out_of_the_scheduler(params, prompt, computed) -> None:
    logging.getLogger("kvbridge").setLevel(logging.CRITICAL)  # the refusals are logged: quiet
    ranks = [RankAddress("p", "tcp://127.0.0.1:1")]
    sched = SchedulerState(GROUPS, engine_id="e", ranks=ranks, transport="mooncake")
    req = make_request("r", prompt, dict(params))
    sched.on_new_request(req)
    count, load_async = sched.get_num_new_matched_tokens(req, min(computed, prompt - 1))
    assert count is None or 0 <= count <= prompt
    assert load_async == bool(count)
    sched.may_load_async(req)
    sched.update_state_after_alloc(req, ([1, 2, 3, 4, 5], [6]), count or 0)
    req.num_computed_tokens = req.num_prompt_tokens
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    sched.request_finished(req, ([1, 2, 3, 4, 5], [6]))
    plan = sched.build_step()
    for load in plan.loads:  # what reaches the worker is well formed
        TransferParams.from_dict(load.params)


def test_malformed_block_ids_fail_the_load_and_are_counted() -> None:
    """The report of the issue: block ids ``["x", -5]`` from a client killed D's engine."""
    sched = SchedulerState(
        GROUPS, engine_id="d", ranks=[RankAddress("d", "tcp://127.0.0.1:2")], transport="mooncake"
    )
    bad = dict(GOOD, block_ids={"0": ["x", -5]})
    req = make_request("r", 64, {"do_remote_prefill": True, PARAMS_KEY: bad})
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert req.kv_transfer_params[PROCESSED_KEY] and sched.foreign_params == 1
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # said once per request
    assert sched.foreign_params == 1 and not sched.build_step()
