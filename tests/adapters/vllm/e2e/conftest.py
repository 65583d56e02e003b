"""End-to-end runs on real vLLM engines (marker ``e2e``; ``make test`` runs them)."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from tests.adapters.vllm.e2e.references import References
from tests.adapters.vllm.e2e.run_pd import Reference

_SESSION_START = time.time()


#: The session's references (``references.References``), for the summary.
_REFERENCES: list[References] = []


@pytest.fixture(scope="session")
def reference() -> Callable[..., Reference]:
    """Each model with its single-instance outputs (shared by cases), as ``make
    e2e-references`` left them in ``.e2e-cache``, or built now and kept there; ``tp``: the
    single instance at that TP size (D's, when D runs TP > 1)."""
    refs = References()
    _REFERENCES.append(refs)
    return refs.get


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line per P/D run of this session: matches and D's time to first token per mode."""
    import json
    from statistics import median

    from tests.adapters.vllm.e2e.test_pd import RESULTS

    for refs in _REFERENCES:
        built = ", ".join(f"{n} (TP {t}, {s:.0f} s)" for n, t, s in refs.built) or "none"
        terminalreporter.write_line(
            f"single-instance references: {len(refs.loaded)} read from {refs.root}; "
            f"built in this session: {built}"
        )
    files = sorted(RESULTS.glob("pd-*.json")) if RESULTS.is_dir() else []
    runs = [json.loads(f.read_text()) for f in files if f.stat().st_mtime >= _SESSION_START]
    if not runs:
        return
    terminalreporter.section("kvbridge P/D runs (D's time to first token, ms)")
    for s in runs:
        for mode in sorted({r["mode"] for r in s["results"]}):
            rows = [r for r in s["results"] if r["mode"] == mode]
            counts = {
                k: sum(r["match"] == k for r in rows) for k in ("exact", "near-tie", "mismatch")
            }
            ttft = [r["d_ttft_s"] * 1e3 for r in rows if r["d_ttft_s"] is not None]
            terminalreporter.write_line(
                f"{s['model']:>12} {s['transport']:>8} {mode:>4}: {counts}, TTFT median "
                f"{median(ttft):.0f} first {ttft[0]:.0f} max {max(ttft):.0f}; "
                f"control {s['control']['loaded']}, P frozen {s.get('p_frozen', {}).get('match')}, "
                f"P killed {s.get('p_killed', {}).get('match')}"
            )
