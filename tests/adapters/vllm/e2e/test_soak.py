"""The vLLM soak's short version (``make soak`` runs the long one for each transport).

Real prefill and decode vLLM engines under random faults (freeze or kill P or D, a late write
after a failed transfer), some waves layer-wise (P and D at once, P streaming), and one CPU hog: every answer equals the single instance's, every armed
late write landed without changing one, and no KV block is left held at the end.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.adapters.vllm.e2e.marks import E2E
from tests.adapters.vllm.e2e.run_pd import Reference
from tests.soak.vllm_soak import FAULTS, problems, run

pytestmark = E2E


@pytest.mark.timeout(1200)
def test_short_vllm_soak(
    reference: Callable[[str], Reference], capsys: pytest.CaptureFixture[str]
) -> None:
    row = run(
        reference("llama"), "mooncake", requests=28, hogs=1, seed=5, port=6400, log=lambda s: None
    )
    with capsys.disabled():
        print(f"\nvLLM soak mooncake: {row}")
    assert set(row["faults"]) == set(FAULTS)  # every kind of fault was injected
    assert row["late_landed"] >= 1  # a late write really landed in D's blocks
    assert row["d_failed"] >= 1 and row["d_loaded"] >= 1  # both outcomes happened
    assert row["layerwise_waves"] >= 1  # the concurrent dispatch ran under the faults too
    assert problems(row) == []
