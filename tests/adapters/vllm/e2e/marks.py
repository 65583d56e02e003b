"""The marks every end-to-end test module carries (``pytestmark = E2E``)."""

from __future__ import annotations

import os

import pytest

E2E = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        os.environ.get("KVBRIDGE_E2E") != "1",
        reason="end-to-end vLLM runs take minutes: set KVBRIDGE_E2E=1 (make test-e2e does)",
    ),
]
