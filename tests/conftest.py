"""The whole suite's setup: one scratch temp folder for the processes a test run starts
(``tests.scratch``): one CI run left about 500 entries in /tmp, vLLM's and ``kvbridge demo``'s."""

from __future__ import annotations

import pytest

from tests.scratch import make_scratch, remove_scratch

_MADE = pytest.StashKey[tuple[str, str | None] | None]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_MADE] = make_scratch()
    config.addinivalue_line("markers", "e2e: end-to-end run on real vLLM engines (KVBRIDGE_E2E=1)")


def pytest_unconfigure(config: pytest.Config) -> None:
    remove_scratch(config.stash.get(_MADE, None))
