"""End-to-end runs on real vLLM engines: opt-in (``KVBRIDGE_E2E=1``) until they join ``make test``."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "e2e: end-to-end run on real vLLM engines (KVBRIDGE_E2E=1)")
