"""What each transport declares about how its engine reaches registered memory (``MemoryAccess``),
and the hook that readies an engine for driver-mapped memory. No vLLM here: the adapter's
translation to vLLM's flags is tested in ``tests/adapters/vllm/test_kv_cache_access.py``."""

from __future__ import annotations

import os
from importlib.metadata import distribution
from typing import Any

import pytest

import kvbridge.core
import kvbridge.plugin
from kvbridge.core.contract import MemoryAccess, TransportContract
from kvbridge.core.errors import TransportError
from kvbridge.core.registry import NAMESPACE
from kvbridge.core.transport import Transport
from kvbridge.transports.mooncake.transport import PEERMEM_ENV, MooncakeTransport

#: kvbridge's own transports and what each declares
DECLARED = {
    "cma": MemoryAccess.BY_ADDRESS,
    "mooncake": MemoryAccess.REGISTERS,
    "nixl": MemoryAccess.REGISTERS | MemoryAccess.EXPORTS_WITHIN_HOST,
}


def _shipped() -> dict[str, Any]:
    """kvbridge's own entry points of the transport group (third-party ones may rely on the
    default), their classes imported as the registry imports them; no engine is imported."""
    eps = distribution("kvbridge").entry_points.select(group=NAMESPACE)
    return {ep.name: ep.load() for ep in eps}


def test_every_shipped_transport_declares_its_access_itself() -> None:
    shipped = _shipped()
    assert set(shipped) == set(DECLARED), "a new transport: add what it declares to DECLARED"
    for name, cls in shipped.items():
        assert "memory_access" in vars(cls), f"{name} relies on the default"
        assert cls.memory_access == DECLARED[name], name
        assert isinstance(cls.memory_access, MemoryAccess)


def test_a_plugin_that_declares_nothing_gets_the_safe_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Abstract and unnamed (a named class must write every engine hook): only its class is asked.
    class Undeclared(Transport):
        pass

    monkeypatch.delenv(PEERMEM_ENV, raising=False)
    assert Undeclared.memory_access is MemoryAccess.REGISTERS
    assert TransportContract.memory_access is MemoryAccess.REGISTERS
    assert Undeclared.prepare_for_driver_mapped_memory() is None  # the default does nothing
    assert PEERMEM_ENV not in os.environ


def test_the_flags() -> None:
    assert MemoryAccess(0) is MemoryAccess.BY_ADDRESS and not MemoryAccess.BY_ADDRESS
    both = MemoryAccess.REGISTERS | MemoryAccess.EXPORTS_WITHIN_HOST
    assert MemoryAccess.REGISTERS in both and MemoryAccess.EXPORTS_WITHIN_HOST in both
    assert MemoryAccess.EXPORTS_WITHIN_HOST not in MemoryAccess.REGISTERS
    # exported where the contract's other names are, and where plugins import from
    assert kvbridge.core.MemoryAccess is MemoryAccess
    assert kvbridge.plugin.MemoryAccess is MemoryAccess
    assert "MemoryAccess" in kvbridge.core.__all__
    assert "MemoryAccess" in kvbridge.plugin.__all__


# -- Mooncake: DMA-BUF for driver-mapped memory -------------------------------------------------


def test_mooncake_registers_driver_mapped_memory_through_dma_buf(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(PEERMEM_ENV, raising=False)
    MooncakeTransport.prepare_for_driver_mapped_memory()
    assert os.environ[PEERMEM_ENV] == "0"
    MooncakeTransport.prepare_for_driver_mapped_memory()  # again: no harm
    assert os.environ[PEERMEM_ENV] == "0"


def test_mooncake_keeps_a_zero_the_user_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PEERMEM_ENV, "0")
    MooncakeTransport.prepare_for_driver_mapped_memory()
    assert os.environ[PEERMEM_ENV] == "0"


@pytest.mark.parametrize("value", ["1", "true", ""])
def test_mooncake_refuses_nvidia_peermem_in_one_line(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(PEERMEM_ENV, value)
    with pytest.raises(TransportError) as err:
        MooncakeTransport.prepare_for_driver_mapped_memory()
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{PEERMEM_ENV}={value!r} makes Mooncake register GPU memory ")
    assert f"unset {PEERMEM_ENV}" in message and "DMA-BUF" in message
    assert "--no-enable-extensible-kv-cache" in message
    assert os.environ[PEERMEM_ENV] == value  # the user's setting is left as it is


@pytest.mark.parametrize("name", ["cma", "nixl"])
def test_the_other_transports_need_nothing_for_driver_mapped_memory(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    monkeypatch.delenv(PEERMEM_ENV, raising=False)
    cls = _shipped()[name]
    before = dict(os.environ)
    cls.prepare_for_driver_mapped_memory()
    assert dict(os.environ) == before
