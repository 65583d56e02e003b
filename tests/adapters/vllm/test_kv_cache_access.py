"""vLLM 0.34's ``kv_cache_access``: what each transport declares, asked through vLLM's own config
path (``KVTransferConfig.kv_cache_access()`` -> ``KVConnectorFactory`` -> the connector class),
and the worker readying the transport for the extensible (driver-mapped) KV cache."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

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
from tests.adapters.vllm.e2e.models import llama_config

REPO = Path(__file__).resolve().parents[3]

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
    # Abstract and unnamed (a named class must write every engine hook): only its class is asked.
    class Undeclared(Transport):
        pass

    register_transport("undeclared", Undeclared)
    try:
        ktc = _asked("KVBridgeConnector", {"transport": "undeclared"})
        assert ktc.kv_cache_access() == _flags({"REGISTERS"})
    finally:
        unregister_transport("undeclared")


WRONG = [
    ({"transport": "no-such-transport"}, "kvbridge: no transport named 'no-such-transport'; "),
    ({"transport": "cma", "timeout": "ten"}, "kvbridge option timeout='ten': expected "),
    (
        {"transport": "cma", "bogus": 1},
        "kvbridge: kv_connector_extra_config has no kvbridge option",
    ),
]


@needs_kv_cache_access
@pytest.mark.parametrize(("extra", "line"), WRONG)
def test_a_wrong_setting_stops_vllms_config_in_one_line(
    extra: dict[str, object], line: str, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """vLLM 0.34 asks ``kv_cache_access`` while it builds its config, before any engine starts:
    a program building the config gets the error (inside pydantic's report); vLLM's command
    line prints the one line and exits 2, with no traceback (``preflight.check_vllm_config``)."""
    from kvbridge.adapters.vllm import preflight

    ktc = _asked("KVBridgeConnector", {**extra, "port": _port()})
    with pytest.raises(ValueError, match=re.escape(line)):
        VllmConfig(kv_transfer_config=ktc)
    monkeypatch.setattr(preflight, "_vllm_command_line", lambda: True)
    with pytest.raises(SystemExit) as stopped:
        VllmConfig(kv_transfer_config=ktc)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(line), err


@needs_kv_cache_access
@pytest.mark.timeout(180)
def test_vllm_serve_with_a_wrong_setting_exits_2_before_any_engine(tmp_path: Path) -> None:
    """The user's path: vLLM's own API server module, a kvbridge transport name misspelt. It
    ends with kvbridge's line and exit 2 before an engine process starts (no model load)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(llama_config()))
    config = {
        "kv_connector": "KVBridgeConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"transport": "mooncak", "port": _port()},
    }
    serve = (
        "import runpy; from tests.vllm_triton_cpu import allow_x86_without_triton; "
        "allow_x86_without_triton(); "
        "runpy.run_module('vllm.entrypoints.openai.api_server', run_name='__main__', "
        "alter_sys=True)"
    )
    args = ["--model", str(model), "--skip-tokenizer-init", "--port", str(_port())]
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", serve, *args, "--kv-transfer-config", json.dumps(config)],
        capture_output=True, text=True, timeout=150, cwd=REPO,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
    )  # fmt: skip
    took = time.monotonic() - started
    last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
    assert done.returncode == 2, done.stderr[-3000:]
    assert last.startswith("kvbridge: no transport named 'mooncak'"), done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "EngineCore" not in done.stderr, done.stderr[-3000:]
    print(f"vllm serve stopped after {took:.1f} s: {last}")


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
