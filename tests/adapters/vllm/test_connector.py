"""The connector end to end in one process: P and D workers over Mooncake (TCP), bytes checked."""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace

import pytest
import torch
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.request import RequestStatus

from kvbridge.adapters.vllm.connector import KVBridgeConnector, KVBridgeMetadata
from kvbridge.adapters.vllm.plugin import register, transport_connector
from kvbridge.core.registry import available_transports
from tests.adapters.vllm.conftest import BLOCK, allocate, blocks_of, hybrid_config, make_request

if not any(t.name == "mooncake" and t.usable for t in available_transports()):
    pytest.skip("the mooncake transport is not usable here", allow_module_level=True)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(engine_id: str, role: str, port: int, host: str) -> SimpleNamespace:
    ktc = KVTransferConfig(
        kv_connector="KVBridgeConnector",
        kv_role=role,
        engine_id=engine_id,
        kv_connector_extra_config={
            "transport": "mooncake",
            "host": host,
            "port": port,
            "timeout": 10,
        },
    )
    return SimpleNamespace(
        kv_transfer_config=ktc, parallel_config=SimpleNamespace(tensor_parallel_size=1)
    )


def _pair(
    engine_id: str, role: str, host: str = "127.0.0.1", layout: str = "LBHNC", kernel: int = 32
):
    config, kernels = hybrid_config(kernel=kernel)
    vcfg = _config(engine_id, role, _port(), host)
    sched = KVBridgeConnector(vcfg, KVConnectorRole.SCHEDULER, config)
    worker = KVBridgeConnector(vcfg, KVConnectorRole.WORKER, config)
    caches = allocate(config, kernels, layout)
    worker.register_kv_caches(caches)
    return sched, worker, caches


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Random bytes contain NaNs, which torch.equal on floats would call unequal.
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _step(sched, worker) -> None:
    worker.bind_connector_metadata(sched.build_connector_meta(None))
    worker.start_load_kv(None)
    worker.clear_connector_metadata()


def _results(worker, want: str, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        res = worker.get_transfer_results(set())
        if want in res.finished_recving or want in res.finished_sending:
            return res
        time.sleep(0.02)
    raise AssertionError(f"{want} did not finish")


@pytest.mark.timeout(60)
def test_hybrid_pull_moves_the_right_bytes() -> None:
    # P and D on different addresses (every 127.x address is this host's loopback): each side
    # announces its own `host`, the Mooncake engine included, so D reaches P and not itself.
    p_sched, p_worker, p_caches = _pair("prefill-1", "kv_producer", host="127.0.0.2")
    d_sched, d_worker, d_caches = _pair("decode-1", "kv_consumer", host="127.0.0.3")
    try:
        assert p_worker.plane.endpoint.startswith("tcp://127.0.0.2:")
        assert p_worker.plane.transport.session.startswith("127.0.0.2:")
        assert d_worker.plane.transport.session.startswith("127.0.0.3:")
        # Random bytes in P's one backing buffer (every layer's view shares it).
        raw = torch.empty(0, dtype=torch.uint8).set_(p_caches["a0"].untyped_storage())
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
        # P: prompt of 130 tokens → prefills 129 in blocks 3,4,5 (attention), state slot 7.
        req = make_request("r1", 130, {"do_remote_decode": True})
        p_sched.on_new_request(req)
        req.num_computed_tokens = req.num_prompt_tokens
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        delay, params = p_sched.request_finished_all_groups(req, ([3, 4, 5], [0, 0, 7]))
        assert delay and p_sched.has_pending_push_work()
        _step(p_sched, p_worker)

        dreq = make_request("d1", 130, params)
        assert d_sched.get_num_new_matched_tokens(dreq, 0) == (129, True)
        d_sched.update_state_after_alloc(dreq, blocks_of([[10, 11, 12], [0, 0, 8]]), 129)
        meta = d_sched.build_connector_meta(None)
        assert isinstance(meta, KVBridgeMetadata) and len(meta.plan.loads) == 1
        d_worker.bind_connector_metadata(meta)
        d_worker.start_load_kv(None)  # returns at once; the pull runs in the background
        res = _results(d_worker, "d1")
        assert res.failed_recving == set()
        assert "r1" in _results(p_worker, "r1").finished_sending  # D released P's blocks

        for layer in ("a0", "a1"):
            p_kv, d_kv = p_caches[layer], d_caches[layer]  # [kernel blocks, H, N, C]
            for p_b, d_b in ((3, 10), (4, 11), (5, 12)):
                assert _same_bytes(p_kv[2 * p_b : 2 * p_b + 2], d_kv[2 * d_b : 2 * d_b + 2])
        # Nothing else on D was written (state slot 8 overlays attention block 8: kernels 16, 17).
        untouched = [b for b in range(2 * 16) if b not in (16, 17, 20, 21, 22, 23, 24, 25)]
        assert not d_caches["a0"][untouched].view(torch.int16).any()
        for layer in ("m0", "m1"):
            assert _same_bytes(p_caches[layer][7], d_caches[layer][8])

        # vLLM's stats hook: exactly the bytes compared above, once, then nothing new.
        moved = sum(3 * p_caches[a][0:2].nbytes for a in ("a0", "a1"))
        moved += sum(p_caches[m][7].nbytes for m in ("m0", "m1"))
        stats = d_worker.get_kv_connector_stats()
        assert stats is not None and stats.data["nbytes"] == [moved]
        reduced = KVBridgeConnector.build_kv_connector_stats(stats.to_dict()).reduce()
        assert reduced["transfers"] == 1 and reduced["failed"] == 0
        assert reduced["descriptors"] >= 1 and reduced["MiB"] == round(moved / 2**20, 3)
        assert d_worker.get_kv_connector_stats() is None
    finally:
        p_worker.shutdown()
        d_worker.shutdown()


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("p_layout", "d_layout", "kernel"),
    # vLLM splits 64-token blocks into kernel blocks only under LBHNC and LBNHC, and allocates
    # this hybrid's shared pages in no per-head layout (test_layout_matrix moves those through
    # vLLM's views)
    [("LBNHC", "LBHNC", 32), ("BLHNC", "BLNHC", 64)],
)
def test_token_major_and_head_major_sides_meet_transposed_on_receive(
    p_layout: str, d_layout: str, kernel: int
) -> None:
    """P and D on layouts whose blocks keep their cells in the other order (another attention
    backend or GPU): pulled and pushed over Mooncake, D's blocks read through vLLM's own views
    equal P's, cell for cell, and D's blocks outside the request are untouched."""
    p_sched, p_worker, p_caches = _pair("prefill-t", "kv_producer", layout=p_layout, kernel=kernel)
    d_sched, d_worker, d_caches = _pair("decode-t", "kv_consumer", layout=d_layout, kernel=kernel)
    r = BLOCK // kernel  # kernel blocks per block
    try:
        raw = torch.empty(0, dtype=torch.uint8).set_(p_caches["a0"].untyped_storage())
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
        for n, (mode, p_ids, d_ids) in enumerate(
            (("pull", [3, 4, 5], [10, 11, 12]), ("push", [6, 2, 9], [13, 1, 15]))
        ):
            params = {"do_remote_decode": True, "kvbridge_mode": mode}
            req = make_request(f"r{n}", 130, params)
            p_sched.on_new_request(req)
            req.num_computed_tokens = req.num_prompt_tokens
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            _, d_params = p_sched.request_finished_all_groups(req, (p_ids, [0, 0, 7]))
            _step(p_sched, p_worker)
            dreq = make_request(f"d{n}", 130, d_params)
            assert d_sched.get_num_new_matched_tokens(dreq, 0) == (129, True)
            d_sched.update_state_after_alloc(dreq, blocks_of([d_ids, [0, 0, 8]]), 129)
            _step(d_sched, d_worker)
            res = _results(d_worker, f"d{n}")
            assert res.failed_recving == set(), mode
            _results(p_worker, f"r{n}")
            for layer in ("a0", "a1"):
                p_kv, d_kv = p_caches[layer], d_caches[layer]  # [kernel blocks, H, N, C]
                for p_b, d_b in zip(p_ids, d_ids, strict=True):
                    assert _same_bytes(p_kv[r * p_b : r * p_b + r], d_kv[r * d_b : r * d_b + r]), (
                        f"{mode}: {layer} D block {d_b} differs from P block {p_b}"
                    )
            for layer in ("m0", "m1"):
                assert _same_bytes(p_caches[layer][7], d_caches[layer][8])
        # Nothing else of D's attention was written (state slot 8 overlays block 8).
        written = {r * b + k for b in (1, 8, 10, 11, 12, 13, 15) for k in range(r)}
        untouched = [k for k in range(r * 16) if k not in written]
        assert not d_caches["a0"][untouched].contiguous().view(torch.int16).any()
    finally:
        p_worker.shutdown()
        d_worker.shutdown()


@pytest.mark.timeout(60)
def test_failed_load_is_reported_for_recompute() -> None:
    d_sched, d_worker, _ = _pair("decode-2", "kv_consumer")
    try:
        params = {
            "do_remote_prefill": True,
            "kvbridge": {
                "request_id": "gone",
                "engine_id": "nobody",
                "endpoint": f"tcp://127.0.0.1:{_port()}",
                "block_ids": {0: [3], 1: [7]},
                "num_tokens": 63,
                "transport": "mooncake",
            },
        }
        dreq = make_request("d2", 64, params)
        assert d_sched.get_num_new_matched_tokens(dreq, 0) == (63, True)
        d_sched.update_state_after_alloc(dreq, blocks_of([[10], [8]]), 63)
        d_worker.options = d_worker.options.__class__(**{**d_worker.options.__dict__, "timeout": 1})
        d_worker.plane.timeout = d_worker.plane.handshake_timeout = 1.0
        _step(d_sched, d_worker)
        res = _results(d_worker, "d2", timeout=30)
        assert res.failed_recving == {"d2"} and "d2" in res.finished_recving
        stats = d_worker.get_kv_connector_stats()
        assert stats is not None and stats.reduce() == {"transfers": 0, "failed": 1}
    finally:
        d_worker.shutdown()


def test_plugin_registers_generic_and_per_transport_names() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    register()
    register()  # idempotent: vLLM loads plugins in every process, possibly more than once
    cls = KVConnectorFactory.get_connector_class_by_name("KVBridgeConnector")
    assert cls is KVBridgeConnector
    mooncake = KVConnectorFactory.get_connector_class_by_name("KVBridgeConnector-mooncake")
    assert issubclass(mooncake, KVBridgeConnector) and mooncake.default_transport == "mooncake"
    assert transport_connector("nixl").default_transport == "nixl"
    ktc = KVTransferConfig(kv_connector="KVBridgeConnector-mooncake", kv_role="kv_both")
    assert KVConnectorFactory.supports_hma_config(ktc)
