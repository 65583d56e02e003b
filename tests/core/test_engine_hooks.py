"""The engine hooks: declared once, public, and the required ones checked when a plugin's class is
defined (a class that sets ``name``) or, for an unnamed one, when it is built."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from kvbridge.core.contract import TransportLimits
from kvbridge.core.engine_hooks import REQUIRED_HOOKS, EngineHooks, missing_engine_hooks
from kvbridge.core.transport import Transport
from kvbridge.plugin import CHUNK_OK, ChunkResult


class _Common(Transport):
    """Every required hook but the engine model's; unnamed, so not checked when defined."""

    def __init__(self) -> None:
        super().__init__(timeout=1.0)
        self.open(TransportLimits())

    def engine_register(self, device: Any, ranges: Any) -> None:
        pass

    def engine_deregister(self, device: Any, ranges: Any) -> None:
        pass

    def engine_metadata(self) -> bytes:
        return b""

    def engine_connect(self, peer: str, payload: bytes, old: Any) -> Any:
        return payload

    def engine_check_remote(self, state: Any, remote: Any, lengths: Any, peer: str) -> None:
        pass

    def engine_start_chunk(self, state: Any, chunk: Any) -> Any:
        return None


def test_every_hook_is_public_documented_and_declared_once() -> None:
    hooks = [n for n in vars(EngineHooks) if n.startswith("engine_")]
    assert set(REQUIRED_HOOKS) < set(hooks)
    for name in hooks:
        assert inspect.getdoc(getattr(EngineHooks, name)), f"{name} has no duty written"
    # The kit implements none of them again: a default lives only in EngineHooks.
    assert not [n for n in vars(Transport) if n.startswith("engine_")]
    # No hook is left under its old private name.
    assert not [n for n in dir(Transport) if n.startswith("_") and n.endswith(("_chunk", "_group"))]


def test_a_named_plugin_missing_required_hooks_is_refused_when_defined() -> None:
    with pytest.raises(TypeError) as err:

        class Half(Transport):  # its definition is what fails
            name = "half"

            def engine_metadata(self) -> bytes:
                return b""

    message = str(err.value)
    assert "\n" not in message and "Half (polled engine)" in message
    for hook in ("engine_register", "engine_connect", "engine_check_remote", "engine_check_chunk"):
        assert hook in message.split(";")[0]
    assert "engine_metadata," not in message.split(";")[0]  # written: not named as missing


@pytest.mark.parametrize(
    ("blocking", "needed"), [(True, "engine_wait_chunk"), (False, "engine_check_chunk")]
)
def test_each_engine_model_requires_its_own_hook(blocking: bool, needed: str) -> None:
    with pytest.raises(TypeError, match=rf"does not implement the engine hook {needed};"):
        type("Model", (_Common,), {"name": "model", "blocking_engine": blocking})

    def result(self: Any, chunk: Any) -> ChunkResult:
        return CHUNK_OK

    complete = type(
        "Model", (_Common,), {"name": "model", "blocking_engine": blocking, needed: result}
    )
    assert missing_engine_hooks(complete) == []
    other = "engine_check_chunk" if blocking else "engine_wait_chunk"
    assert missing_engine_hooks(
        type("Other", (_Common,), {"blocking_engine": blocking, other: result})
    ) == [needed]


def test_an_unnamed_class_is_checked_when_built() -> None:
    class Unnamed(_Common):  # defined fine: it names no transport
        pass

    with pytest.raises(TypeError, match=r"Unnamed .*engine_check_chunk"):
        Unnamed()

    class Whole(Unnamed):
        def engine_check_chunk(self, chunk: Any) -> ChunkResult | None:
            return CHUNK_OK

    transport = Whole()
    try:
        assert not transport.closed and transport.peer_count == 0
    finally:
        transport.close()
    assert transport.closed
