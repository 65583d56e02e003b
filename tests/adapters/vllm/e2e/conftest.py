"""End-to-end runs on real vLLM engines (marker ``e2e``; ``make test`` runs them)."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from tests.adapters.vllm.e2e.run_pd import CASES, Reference, build_reference

_SESSION_START = time.time()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "e2e: end-to-end run on real vLLM engines (KVBRIDGE_E2E=1)")


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Reference]:
    """Each model built once per session, with its single-instance outputs (shared by cases);
    ``tp``: the single instance at that TP size (D's, when D runs TP > 1)."""
    cache: dict[tuple[str, int], Reference] = {}
    root = tmp_path_factory.mktemp("models")

    def get(name: str, tp: int = 1) -> Reference:
        if (name, tp) not in cache:
            cache[(name, tp)] = build_reference(CASES[name], root, tp=tp)
        return cache[(name, tp)]

    return get


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line per P/D run of this session: matches and D's time to first token per mode."""
    import json
    from statistics import median

    from tests.adapters.vllm.e2e.test_pd import RESULTS

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
