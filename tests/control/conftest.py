"""Fixtures for control-plane tests: engine processes that are always reaped."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

import kvbridge
from tests.control.engine import EngineProcess

TRANSPORT_OPTIONS: dict[str, dict[str, Any]] = {
    "mooncake": {"timeout": 8},
    "nixl": {"timeout": 8},
    "cma": {"timeout": 8},
}
#: kvbridge's own transports that can run here (cma needs no engine package, so never none);
#: third-party ones installed beside (the README's example plugin) run their own suites.
USABLE = [
    t.name for t in kvbridge.available_transports() if t.usable and t.name in TRANSPORT_OPTIONS
]

#: (case, seconds until its outcome), printed after the run for the closing note.
FAULT_TIMINGS: list[tuple[str, float]] = []


@pytest.fixture(params=USABLE)
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def engines(tmp_path: Any) -> Iterator[Callable[..., EngineProcess]]:
    started: list[EngineProcess] = []

    def start(role: str, transport: str, **config: Any) -> EngineProcess:
        config.setdefault("options", TRANSPORT_OPTIONS.get(transport, {}))
        engine = EngineProcess.start(tmp_path, role, transport=transport, **config)
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.stop()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if FAULT_TIMINGS:
        terminalreporter.section("control-plane fault timings")
        for case, seconds in FAULT_TIMINGS:
            terminalreporter.write_line(f"{case:60} {seconds:7.3f} s")
