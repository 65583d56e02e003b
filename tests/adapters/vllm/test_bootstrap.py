"""vllm-router's ``mooncake`` mode (issue 29): P answers the router's bootstrap ``/query`` over
real HTTP, D looks P's address up off the scheduler's thread, and both sides' schedulers turn
the router's parameters into kvbridge's concurrent dispatch, with vLLM's own Request class."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from collections.abc import Iterator

import pytest
from vllm.v1.request import RequestStatus

from kvbridge.adapters.vllm.scheduler import PARAMS_KEY, GroupInfo, SchedulerState
from kvbridge.control.requests import Mode, RankAddress, TransferParams
from kvbridge.core import GroupKind
from kvbridge.router.bootstrap import (
    BootstrapError,
    BootstrapLookups,
    BootstrapServer,
    query_answer,
)
from tests.adapters.vllm.conftest import make_request

DENSE = [GroupInfo(0, GroupKind.ATTENTION, block_size=16)]
TRANSFER = "xfer-2f1f5bbf-6a43-4a8e-9d0b-1f0c6c1e9e55"  # vllm-router's form


def prefill(mode: Mode = Mode.PUSH) -> SchedulerState:
    ranks = [RankAddress("p-engine", "tcp://127.0.0.1:5790")]
    return SchedulerState(DENSE, engine_id="p-engine", ranks=ranks, transport="nixl", mode=mode)


def decode() -> SchedulerState:
    ranks = [RankAddress("d-engine", "tcp://127.0.0.1:5800")]
    return SchedulerState(DENSE, engine_id="d-engine", ranks=ranks, transport="nixl")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def served() -> Iterator[BootstrapServer]:
    """P's bootstrap, as the connector starts it with option bootstrap_port."""
    p = prefill()
    server = BootstrapServer("127.0.0.1", 0, query_answer("p-engine", p.prefill_address()))
    yield server
    server.close()


def wait_found(lookups: BootstrapLookups, addr: str, engine: str | None = None) -> dict:
    deadline = time.monotonic() + 10
    while (found := lookups.get(addr, engine)) is None:
        assert time.monotonic() < deadline, "the lookup never ended"
        time.sleep(0.02)
    return found


def test_p_answers_the_routers_query_with_its_engine_id_and_side_channel(served) -> None:
    with urllib.request.urlopen(served.address + "/query", timeout=5) as reply:
        data = json.loads(reply.read())
    # what vllm-router reads: an engine id per data-parallel rank
    assert data["0"]["engine_id"] == "p-engine"
    assert data["0"]["kvbridge"] == {
        "engine_id": "p-engine",
        "endpoint": "tcp://127.0.0.1:5790",
        "transport": "nixl",
        "ranks": [],
        "pp_size": 1,
        "mode": "push",
    }
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(served.address + "/register", timeout=5)
    assert err.value.code == 404


def test_a_taken_bootstrap_port_is_refused_in_one_line(served) -> None:
    port = int(served.address.rsplit(":", 1)[1])
    with pytest.raises(ValueError, match=f"bootstrap_port={port}: cannot listen"):
        BootstrapServer("127.0.0.1", port, {})


def test_d_looks_p_up_once_off_the_schedulers_thread(served) -> None:
    lookups = BootstrapLookups()
    assert lookups.get(served.address, "p-engine") is None  # running: the request waits
    found = wait_found(lookups, served.address, "p-engine")
    assert found["endpoint"] == "tcp://127.0.0.1:5790" and found["mode"] == "push"
    assert lookups.get(served.address, "p-engine") is found  # asked once
    with pytest.raises(BootstrapError, match="not http://host:port"):
        lookups.get("tcp://127.0.0.1:1")


def test_a_failed_lookup_fails_in_one_line_then_is_tried_again() -> None:
    lookups = BootstrapLookups(timeout=2, retry=0.3)
    addr = f"http://127.0.0.1:{free_port()}"  # nothing listens
    assert lookups.get(addr) is None
    deadline = time.monotonic() + 10
    while True:
        try:
            assert lookups.get(addr) is None
        except BootstrapError as err:
            assert f"bootstrap {addr}/query" in str(err) and "\n" not in str(err)
            break
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(0.35)
    assert lookups.get(addr) is None  # tried again after the retry interval


@pytest.mark.parametrize(
    "addr", ["http://127.0.0.1:99999", "http://127.0.0.1:port", "http://[::1", "ftp://h:1", "h:1"]
)
def test_a_bootstrap_address_that_is_no_http_host_port_is_refused_in_one_line(addr) -> None:
    """A client's ``remote_bootstrap_addr`` (a port out of range raised ``ValueError`` out of
    the scheduler: D's engine died)."""
    with pytest.raises(BootstrapError, match="is not http://host:port"):
        BootstrapLookups().get(addr)


def test_another_engines_bootstrap_is_not_taken(served) -> None:
    lookups = BootstrapLookups(retry=60)
    lookups.get(served.address, "another-engine")
    deadline = time.monotonic() + 10
    with pytest.raises(BootstrapError, match="no kvbridge prefill with engine id"):
        while time.monotonic() < deadline:
            lookups.get(served.address, "another-engine")
            time.sleep(0.02)


def test_p_serves_the_routers_request_under_its_transfer_id_in_its_own_mode() -> None:
    p = prefill(Mode.PUSH)
    params = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": TRANSFER}
    req = make_request("r1", 40, params)
    p.on_new_request(req)
    req.num_computed_tokens = req.num_prompt_tokens
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, answer = p.request_finished(req, ([3, 4, 5],))
    assert delay and answer is not None
    transfer = TransferParams.from_dict(answer[PARAMS_KEY])
    # the router's id is the request's id and its capability: D knows no other
    assert (transfer.request_id, transfer.token, transfer.mode) == (TRANSFER, TRANSFER, Mode.PUSH)
    (pub,) = p.build_step().publishes
    assert pub.plane_id == TRANSFER


def test_d_turns_the_routers_parameters_into_a_layerwise_load(served) -> None:
    d = decode()
    params = {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "transfer_id": TRANSFER,
        "remote_bootstrap_addr": served.address,
        "remote_engine_id": "p-engine",
    }
    req = make_request("d1", 40, params)
    assert d.get_num_new_matched_tokens(req, 0) == (None, False)  # looking P up
    wait_found(d.bootstrap, served.address, "p-engine")
    assert d.get_num_new_matched_tokens(req, 0) == (40, True)  # every token, from its prompt
    transfer = TransferParams.from_dict(req.kv_transfer_params[PARAMS_KEY])
    assert transfer.layerwise and transfer.block_ids == {}
    assert (transfer.request_id, transfer.token) == (TRANSFER, TRANSFER)
    assert (transfer.engine_id, transfer.endpoint) == ("p-engine", "tcp://127.0.0.1:5790")
    assert transfer.mode is Mode.PUSH  # P's, from its bootstrap


def test_d_prefills_itself_when_p_serves_no_bootstrap(caplog) -> None:
    d = decode()
    d.bootstrap = BootstrapLookups(timeout=2, retry=60)
    addr = f"http://127.0.0.1:{free_port()}"
    params = {"do_remote_prefill": True, "transfer_id": TRANSFER, "remote_bootstrap_addr": addr}
    req = make_request("d1", 40, params)
    deadline = time.monotonic() + 10
    while (got := d.get_num_new_matched_tokens(req, 0)) == (None, False):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert got == (0, False) and d.foreign_params == 1
    assert any("mooncake mode" in r.getMessage() for r in caplog.records)
    assert d.get_num_new_matched_tokens(req, 0) == (0, False)  # said once
