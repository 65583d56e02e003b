"""What the deploy scripts check before vLLM starts (``python -m kvbridge.adapters.vllm.preflight``):
what the connector would refuse at start, in seconds, without vLLM and before the model loads."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import ClassVar

import pytest

import kvbridge
from kvbridge.adapters.vllm.preflight import connector_transport, main, preflight
from kvbridge.core.errors import TransportNotFoundError, TransportUnavailableError
from kvbridge.transports.cma.transport import CmaTransport


def config(connector: str = "KVBridgeConnector", **extra: object) -> dict[str, object]:
    return {"kv_connector": connector, "kv_role": "kv_producer", "kv_connector_extra_config": extra}


def test_connector_names() -> None:
    assert connector_transport("KVBridgeConnector") == (True, None)
    assert connector_transport("KVBridgeConnector-nixl") == (True, "nixl")
    assert connector_transport("NixlConnector") == (False, None)


@pytest.mark.parametrize(
    ("cfg", "error", "words"),
    [
        (config(transport="mooncak"), TransportNotFoundError, "no transport named 'mooncak'"),
        (config(transprt="mooncake"), ValueError, "(did you mean 'transport'?)"),
        (config("KVBridgeConnector-nixl", transport_options={"porrt_range": [1, 2]}), ValueError,
         "transport 'nixl' has no option 'porrt_range'"),
        (config(timeout=-1), ValueError, "timeout"),
        (config("KVBridgeConnector-cma", transport="nixl"), ValueError,
         "connector for transport 'cma' configured with transport 'nixl'"),
    ],
)  # fmt: skip
def test_a_wrong_setting_is_one_line(cfg, error, words) -> None:
    with pytest.raises(error) as err:
        preflight(cfg)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_a_good_config_passes_and_another_connector_is_not_checked() -> None:
    options = preflight(config("KVBridgeConnector-cma", mode="push"))
    assert options is not None and options.transport == "cma"
    assert (
        preflight({"kv_connector": "NixlConnector", "kv_connector_extra_config": {"x": 1}}) is None
    )


class _NoEngine(CmaTransport):
    """The fault the real engines cannot produce on demand: an engine library that does not
    import (``pip install`` forgotten)."""

    name: ClassVar[str] = "no-engine"

    @classmethod
    def check_available(cls) -> None:
        raise TransportUnavailableError("no-engine's engine is not installed: pip install it")


def test_a_missing_engine_is_one_line() -> None:
    kvbridge.register_transport("no-engine", _NoEngine)
    try:
        with pytest.raises(TransportUnavailableError, match="pip install it"):
            preflight(config(transport="no-engine"))
    finally:
        kvbridge.unregister_transport("no-engine")


def test_the_command_exits_2_with_one_line(capsys) -> None:
    assert main([json.dumps(config(transport="mooncak"))]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvbridge: no transport named 'mooncak'")
    assert main(["{"]) == 2 and "is not JSON" in capsys.readouterr().err
    assert main([json.dumps(config("KVBridgeConnector-cma"))]) == 0


def test_the_command_needs_no_vllm() -> None:
    code = (
        "import sys\nfrom kvbridge.adapters.vllm.preflight import main\n"
        f"rc = main([{json.dumps(json.dumps(config('KVBridgeConnector-cma')))}])\n"
        "print(rc, 'vllm' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["0", "False"], out.stderr
