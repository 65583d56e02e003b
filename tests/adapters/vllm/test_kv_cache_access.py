"""vLLM 0.34's ``kv_cache_access``: what each transport declares, asked through vLLM's own config
path (``KVTransferConfig.kv_cache_access()`` -> ``KVConnectorFactory`` -> the connector class),
and the worker readying the transport for the extensible (driver-mapped) KV cache."""

from __future__ import annotations

import os
import socket

import pytest
import vllm.config.kv_transfer as kv_transfer
from vllm.config import VllmConfig
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvbridge.adapters.vllm.connector import KVBridgeConnector
from kvbridge.adapters.vllm.memory_access import VLLM_FLAGS
from kvbridge.adapters.vllm.plugin import register
from kvbridge.core.contract import MemoryAccess
from kvbridge.core.errors import TransportError
from kvbridge.core.registry import available_transports, register_transport, unregister_transport
from kvbridge.core.transport import Transport
from kvbridge.transports.mooncake.transport import PEERMEM_ENV
from tests.adapters.vllm.conftest import allocate, attn_spec, single_group_config

needs_kv_cache_access = pytest.mark.skipif(
    not hasattr(kv_transfer, "KVCacheAccess"), reason="vLLM < 0.34 has no kv_cache_access"
)

#: transport -> the names of vLLM's KVCacheAccess flags kvbridge answers for it
EXPECTED = {
    "mooncake": {"REGISTERS"},
    "nixl": {"REGISTERS", "EXPORTS_FABRIC"},
    "cma": set(),  # IN_PROCESS
}


def _flags(names: set[str]) -> object:
    access = kv_transfer.KVCacheAccess.IN_PROCESS
    for name in names:
        access |= kv_transfer.KVCacheAccess[name]
    return access


def _asked(kv_connector: str, extra: dict[str, object]) -> KVTransferConfig:
    register()
    return KVTransferConfig(
        kv_connector=kv_connector, kv_role="kv_both", kv_connector_extra_config=extra
    )


@needs_kv_cache_access
@pytest.mark.parametrize("transport", list(EXPECTED))
@pytest.mark.parametrize("by_name", [False, True], ids=["option", "connector-name"])
def test_vllm_reads_what_the_transport_declares(transport: str, by_name: bool) -> None:
    if by_name:  # KVBridgeConnector-<transport>: the name fixes the transport
        ktc = _asked(f"KVBridgeConnector-{transport}", {})
    else:
        ktc = _asked("KVBridgeConnector", {"transport": transport})
    access = ktc.kv_cache_access()
    assert access == _flags(EXPECTED[transport])
    assert ktc.registers_kv_cache_memory() is bool(EXPECTED[transport])


@needs_kv_cache_access
def test_the_default_transport_is_asked_without_an_option() -> None:
    assert _asked("KVBridgeConnector", {}).kv_cache_access() == _flags({"REGISTERS"})  # mooncake


@needs_kv_cache_access
def test_every_core_flag_has_its_vllm_flag() -> None:
    every = {member for member in MemoryAccess if member.value}
    assert set(VLLM_FLAGS) == every
    for name in VLLM_FLAGS.values():
        assert kv_transfer.KVCacheAccess[name].needs_single_chunk()


@needs_kv_cache_access
def test_a_plugin_that_declares_nothing_is_answered_registers() -> None:
    class Undeclared(Transport):  # abstract: only its class is asked
        name = "undeclared"

    register_transport("undeclared", Undeclared)
    try:
        ktc = _asked("KVBridgeConnector", {"transport": "undeclared"})
        assert ktc.kv_cache_access() == _flags({"REGISTERS"})
    finally:
        unregister_transport("undeclared")


@needs_kv_cache_access
def test_what_cannot_be_loaded_is_answered_registers_and_refused_by_the_connector() -> None:
    # vLLM asks inside VllmConfig's validation: raising there would bury the connector's one
    # line in pydantic's report. The safe answer, then the connector's own refusal.
    unknown = _asked("KVBridgeConnector", {"transport": "no-such-transport", "port": _port()})
    assert unknown.kv_cache_access() == _flags({"REGISTERS"})
    config = VllmConfig(kv_transfer_config=unknown)  # asks kv_cache_access, does not raise
    caches, kernels = single_group_config(attn_spec())
    worker = KVBridgeConnector(config, KVConnectorRole.WORKER, caches)
    try:
        with pytest.raises(TransportError, match=r"^no transport named 'no-such-transport'; "):
            worker.register_kv_caches(allocate(caches, kernels))
    finally:
        worker.shutdown()
    bad = _asked("KVBridgeConnector", {"transport": "cma", "timeout": "ten"})
    assert bad.kv_cache_access() == _flags({"REGISTERS"})
    bad_config = VllmConfig(kv_transfer_config=bad)
    with pytest.raises(ValueError, match=r"^kvbridge option timeout='ten': expected "):
        KVBridgeConnector.get_required_kvcache_layout(bad_config)


# -- the worker: the transport readied for driver-mapped memory ---------------------------------

mooncake_usable = pytest.mark.skipif(
    not any(t.name == "mooncake" and t.usable for t in available_transports()),
    reason="the mooncake transport is not usable here",
)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _register_mooncake_worker(extensible: bool) -> KVBridgeConnector:
    """A worker connector over the real Mooncake transport, from a real ``VllmConfig`` whose
    extensible KV cache is set as vLLM 0.34 settles it on a GPU; its caches registered."""
    register()
    ktc = KVTransferConfig(
        kv_connector="KVBridgeConnector",
        kv_role="kv_both",
        engine_id=f"e-{extensible}",
        kv_connector_extra_config={"transport": "mooncake", "port": _port(), "timeout": 10},
    )
    config = VllmConfig(kv_transfer_config=ktc)
    config.cache_config.enable_extensible_kv_cache = extensible  # vLLM < 0.34: an extra field
    caches, kernels = single_group_config(attn_spec())
    worker = KVBridgeConnector(config, KVConnectorRole.WORKER, caches)
    try:
        worker.register_kv_caches(allocate(caches, kernels))
    except BaseException:
        worker.shutdown()
        raise
    return worker


@mooncake_usable
def test_the_worker_readies_mooncake_for_the_extensible_kv_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(PEERMEM_ENV, raising=False)
    worker = _register_mooncake_worker(extensible=True)
    try:
        assert worker.plane is not None  # the engine started after the hook
        assert os.environ[PEERMEM_ENV] == "0"  # DMA-BUF
    finally:
        worker.shutdown()


@mooncake_usable
def test_the_worker_leaves_the_engine_alone_without_the_extensible_kv_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(PEERMEM_ENV, raising=False)
    worker = _register_mooncake_worker(extensible=False)
    try:
        assert worker.plane is not None
        assert PEERMEM_ENV not in os.environ
    finally:
        worker.shutdown()


@mooncake_usable
def test_the_worker_refuses_nvidia_peermem_before_the_engine_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(PEERMEM_ENV, "1")
    with pytest.raises(TransportError, match=rf"^{PEERMEM_ENV}='1' makes Mooncake register "):
        _register_mooncake_worker(extensible=True)
    worker = _register_mooncake_worker(extensible=False)  # nvidia-peermem is fine without it
    try:
        assert worker.plane is not None
    finally:
        worker.shutdown()
