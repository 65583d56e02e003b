"""P and D of different block sizes, through the connector (scheduler and worker, Mooncake over
TCP), on MLA caches vLLM itself allocated: tokens pair, not blocks.

P's blocks hold the request from its first token; D's from its local prefix hit on (vLLM's
``num_computed_tokens`` when it asks how much to load), which need not end on one of P's blocks.
Every token D asks for must land where vLLM's views say it lies, and nothing else of D may change.
MLA's latent lists its tokens in order, so kernel blocks of different sizes split into tokens;
vLLM's CPU attention does not (its K cache is ``[head_dim, N]`` per head), which is refused
(``test_layout.test_head_major_blocks_refuse_different_kernel_sizes``).
"""

from __future__ import annotations

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import MLAAttentionSpec
from vllm.v1.request import RequestStatus

from kvbridge.adapters.vllm.connector import KVBridgeConnector
from tests.adapters.vllm.conftest import allocate, blocks_of, make_request, single_group_config
from tests.adapters.vllm.test_connector import _config, _port, _results, _same_bytes, _step

PROMPT = 130


def _engine(engine_id: str, role: str, block: int, kernel: int, verify: str = "off"):
    spec = MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    config, _ = single_group_config(spec)
    vcfg = _config(engine_id, role, _port(), "127.0.0.1")
    vcfg.kv_transfer_config.kv_connector_extra_config["verify"] = verify
    sched = KVBridgeConnector(vcfg, KVConnectorRole.SCHEDULER, config)
    worker = KVBridgeConnector(vcfg, KVConnectorRole.WORKER, config)
    caches = allocate(config, [kernel])
    worker.register_kv_caches(caches)
    return sched, worker, caches


def _token(caches: dict[str, torch.Tensor], layer: str, kernel: int, block: int, block_size: int,
           token: int) -> torch.Tensor:  # fmt: skip
    """Token ``token`` of logical block ``block``, through vLLM's view ``[kernel blocks, N, C]``
    (MLA: one latent "head")."""
    view = caches[layer]
    ratio = block_size // kernel
    kernel_block = view[block * ratio + token // kernel]
    return kernel_block.reshape(kernel, -1)[token % kernel]


#: (P's block size, its kernel size, D's block size, its kernel size): D's larger with sizes
#: neither divides (a 16-token unit), and D's smaller than P's.
SIZES = [(32, 16, 48, 48), (64, 64, 32, 16)]


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("bp", "kp", "bd", "kd"), SIZES, ids=[f"{a}_{b}-{c}_{d}" for a, b, c, d in SIZES]
)
def test_pull_and_push_between_block_sizes_move_every_token_after_ds_hit(
    bp: int, kp: int, bd: int, kd: int
) -> None:
    p_sched, p_worker, p_caches = _engine("prefill-bs", "kv_producer", bp, kp)
    d_sched, d_worker, d_caches = _engine("decode-bs", "kv_consumer", bd, kd, verify="full")
    try:
        raw = torch.empty(0, dtype=torch.uint8).set_(p_caches["l0"].untyped_storage())
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
        d_raw = torch.empty(0, dtype=torch.uint8).set_(d_caches["l0"].untyped_storage())
        d_raw.zero_()
        p_blocks, d_blocks = -(-PROMPT // bp), -(-PROMPT // bd)
        cases = (
            ("pull", 0, [3, 5, 1, 7, 4][:p_blocks]),
            ("push", 1, [9, 2, 12, 10, 11][:p_blocks]),
        )
        d_pools = ([13, 15, 14, 6, 8], [10, 1, 12, 3, 11])
        written: set[int] = set()
        for n, ((mode, hit, p_ids), d_pool) in enumerate(zip(cases, d_pools, strict=True)):
            params = {"do_remote_decode": True, "kvbridge_mode": mode}
            req = make_request(f"r{n}", PROMPT, params)
            p_sched.on_new_request(req)
            req.num_computed_tokens = req.num_prompt_tokens
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            _, d_params = p_sched.request_finished_all_groups(req, (p_ids,))
            _step(p_sched, p_worker)
            # D holds its first ``hit`` blocks already (its prefix cache): it loads the rest
            first = hit * bd
            d_ids = d_pool[:d_blocks]
            dreq = make_request(f"d{n}", PROMPT, d_params)
            assert d_sched.get_num_new_matched_tokens(dreq, first) == (PROMPT - first, True)
            d_sched.update_state_after_alloc(dreq, blocks_of([d_ids], hashed=hit), PROMPT - first)
            _step(d_sched, d_worker)
            res = _results(d_worker, f"d{n}")
            assert res.failed_recving == set(), mode
            # P frees the blocks once D released them (vLLM's connector output)
            p_sched.update_connector_output(_results(p_worker, f"r{n}"))
            end = min(p_blocks * bp, d_blocks * bd)  # both lists' tokens (partial blocks too)
            for layer in ("l0", "l1"):
                for t in range(first, end):
                    src = _token(p_caches, layer, kp, p_ids[t // bp], bp, t % bp)
                    dst = _token(d_caches, layer, kd, d_ids[t // bd], bd, t % bd)
                    assert _same_bytes(src, dst), f"{mode}: {layer} token {t} differs"
            # D's cached blocks were not written
            for b in d_ids[:hit]:
                assert (
                    not d_caches["l0"][b * (bd // kd) : (b + 1) * (bd // kd)]
                    .view(torch.int16)
                    .any()
                ), f"{mode}: D's cached block {b} was written"
            written |= set(d_ids[hit:])
        # nothing outside the loaded blocks changed
        ratio = bd // kd
        untouched = [k for k in range(d_caches["l0"].shape[0]) if k // ratio not in written]
        assert not d_caches["l0"][untouched].contiguous().view(torch.int16).any()
        stats = d_worker.get_kv_connector_stats()
        assert stats is not None and len(stats.data["nbytes"]) == 2
    finally:
        p_worker.shutdown()
        d_worker.shutdown()
