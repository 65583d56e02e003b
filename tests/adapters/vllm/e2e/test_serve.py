"""P → D as users deploy it: two ``vllm serve`` servers, kvbridge's proxy, the OpenAI client.

Marked ``e2e`` (run by ``make test`` with ``KVBRIDGE_E2E=1``): two servers start, a few minutes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.adapters.vllm.e2e.marks import E2E
from tests.adapters.vllm.e2e.run_pd import Reference

pytestmark = E2E


@pytest.mark.timeout(600)
def test_served_pd_through_proxy_matches_single_instance(
    reference: Callable[[str], Reference], tmp_path: Path
) -> None:
    from tests.adapters.vllm.e2e.serve_pd import run_serve, tail

    summary = run_serve(reference("llama"), transport="mooncake", mode="pull", work_dir=tmp_path)
    logs = "\n".join(f"--- {k} ---\n{tail(Path(p))}" for k, p in summary["logs"].items())
    bad = [r for r in summary["results"] if not r["match"]]
    assert summary["results"], "no prompt was answered"
    assert not bad, f"D differs from the single instance: {bad}\n{logs}"
    assert summary["p_params_seen"], f"P returned no kv_transfer_params: {summary['results']}"
    assert summary["stream_match"], f"the streamed answer differs from the reference\n{logs}"
    assert summary["control"]["loaded"], f"D did not decode over P's KV: {summary['control']}"
    # vLLM logged our stats hook's numbers: every answered request loaded from P, none failed.
    stats = summary["stats"]
    assert stats["transfers"] >= len(summary["results"]) and stats["failed"] == 0, stats
    assert stats["MiB"] > 0 and stats["descriptors"] >= stats["transfers"], stats
