"""The ``kvbridge`` pytest plugin (entry point ``pytest11``): after a run of the conformance suite,
how long each injected fault took to surface as an error, beside its allowed time.

It is loaded in every pytest session where kvbridge is installed, so it imports nothing until a
run has imported the suite (``pytest -p no:kvbridge`` turns it off).
"""

from __future__ import annotations

import sys

import pytest


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    suite = sys.modules.get("kvbridge.testing.conformance")
    timings: list[tuple[str, str, float, float]] = getattr(suite, "FAULT_TIMINGS", [])
    if not timings:
        return
    terminalreporter.section("transport fault timings")
    for name, case, elapsed, limit in timings:
        terminalreporter.write_line(f"{name:14} {case:40} {elapsed:7.3f} s (limit {limit:.1f} s)")
