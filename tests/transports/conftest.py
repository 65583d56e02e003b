"""Shows how long each injected fault took to surface as an error."""

from __future__ import annotations

from typing import Any

from tests.transports.conformance import FAULT_TIMINGS


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not FAULT_TIMINGS:
        return
    terminalreporter.section("transport fault timings")
    for name, case, elapsed, limit in FAULT_TIMINGS:
        terminalreporter.write_line(f"{name:14} {case:40} {elapsed:7.3f} s (limit {limit:.1f} s)")
