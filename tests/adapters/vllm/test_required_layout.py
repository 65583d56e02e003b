"""The physical layout kvbridge asks vLLM for, resolved by vLLM's own code."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest
from vllm.config import VllmConfig
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvbridge.adapters.vllm.connector import KVBridgeConnector
from kvbridge.adapters.vllm.options import Options, required_layout
from kvbridge.adapters.vllm.plugin import register
from tests.adapters.vllm.vllm_caches import build_caches

#: What a CUDA worker with FlashAttention reports: every layout, LBNHC first (vLLM's default).
EVERY_LAYOUT = [["LBNHC", "LBHNC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"]]


def _config(**extra: object) -> VllmConfig:
    register()
    ktc = KVTransferConfig(
        kv_connector="KVBridgeConnector",
        kv_role="kv_both",
        engine_id="e",
        kv_connector_extra_config={"transport": "mooncake", **extra},
    )
    return VllmConfig(kv_transfer_config=ktc)


def test_auto_asks_for_lbhnc_and_vllm_resolves_it() -> None:
    config = _config()
    assert KVBridgeConnector.get_required_kvcache_layout(config) == "LBHNC"
    assert resolve_kv_cache_layout(config, EVERY_LAYOUT) is KVCacheLayout.LBHNC


def test_mla_leaves_the_choice_to_the_backends() -> None:
    assert required_layout(Options(), use_mla=True) is None
    assert required_layout(Options.from_extra({"kv_layout": "BLHNC"}, None), use_mla=True) == (
        "BLHNC"
    )


def test_an_explicit_layout_is_asked_for() -> None:
    config = _config(kv_layout="blhnc")
    assert KVBridgeConnector.get_required_kvcache_layout(config) == "BLHNC"
    assert resolve_kv_cache_layout(config, EVERY_LAYOUT) is KVCacheLayout.BLHNC


def test_an_unknown_layout_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match=r"kv_layout='HND'.*'auto'.*LBHNC"):
        Options.from_extra({"kv_layout": "HND"}, None)


#: The block format the connector reads from the views vLLM allocates under each layout.
FORMATS = {
    "LBHNC": "[H,N,C]",
    "BLHNC": "[H,N,C]",
    "LBNHC": "[N,H,C]",
    "BLNHC": "[N,H,C]",
    "LHBNC": "per head [N,C]",
    "BHLNC": "per head [N,C]",
}


@pytest.mark.parametrize("layout", list(FORMATS))
def test_the_connector_registers_every_layout_vllm_resolves(layout: str) -> None:
    caches = build_caches("sliding", layout)
    ktc = KVTransferConfig(
        kv_connector="KVBridgeConnector",
        kv_role="kv_both",
        engine_id=f"e-{layout}",
        kv_connector_extra_config={"transport": "cma", "port": _free_port(), "kv_split": "opaque"},
    )
    vllm_config = SimpleNamespace(
        kv_transfer_config=ktc,
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        cache_config=SimpleNamespace(kv_cache_layout=layout),
    )
    worker = KVBridgeConnector(vllm_config, KVConnectorRole.WORKER, caches.config)
    try:
        worker.register_kv_caches(caches.views)
        assert worker.plane is not None
        spec = worker.plane.layout.spec
        assert spec.engine_layout == layout
        assert spec.block_format == "; ".join(
            f"{kind} {FORMATS[layout]} opaque" for kind in ("ATTENTION", "SLIDING_WINDOW")
        )
    finally:
        worker.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
