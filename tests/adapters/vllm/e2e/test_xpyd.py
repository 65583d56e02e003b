"""xPyD behind vllm-router: two prefill and two decode servers (``serve_xpyd``), 32 requests in
flight with one prefill killed and restarted, D's partial and full prefix hits, a repeated
prompt, and a client that leaves after P answered. Marked ``e2e``; one deployment, a few
minutes."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from tests.adapters.vllm.e2e.marks import E2E
from tests.adapters.vllm.e2e.run_pd import Reference
from tests.adapters.vllm.e2e.test_pd import RESULTS

pytestmark = E2E


@pytest.mark.timeout(900)
def test_two_prefills_two_decodes_behind_vllm_router(
    reference: Callable[[str], Reference], tmp_path: object
) -> None:
    from tests.adapters.vllm.e2e.serve_xpyd import IN_FLIGHT, LEASE_S, PARTIAL_PREFIX, run_xpyd

    ref = reference("llama_xpyd")
    summary = run_xpyd(ref, transport="mooncake", mode="pull", work_dir=str(tmp_path))
    tails = summary.pop("tails")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "xpyd-llama-mooncake.json").write_text(json.dumps(summary, indent=1))

    # Every request answered as the single instance, the ones the router could not place while
    # prefill 1 was down included (sent again, as a client does, once it was back).
    flight = summary["in_flight"]
    assert flight["answered"] == IN_FLIGHT and not flight["mismatches"], (flight, tails)
    # ... and prefill 1 died with requests in flight (what the phase is for).
    assert flight["answered_before_kill"] < IN_FLIGHT, flight

    # D loads only what its prefix cache lacks: the yardstick moves the whole prompt; with
    # D holding its first PARTIAL_PREFIX tokens, the rest; held whole, its last block.
    edge = summary["edge"]
    every = [*edge["repeated"], *(edge[k] for k in ("no_hit", "partial_hit", "full_hit"))]
    assert all(r["match"] for r in every), (edge, tails)
    # No load failed: the first one after prefill 1's restart included (D's side channel to it
    # authenticates again with the new engine at the old address).
    assert not any(r["failed"] for r in every), (edge, tails)
    block = 32  # vllm_args' --block-size
    blocks = -(-edge["no_hit"]["prompt_len"] // block)
    block_bytes = edge["no_hit"]["bytes"] / blocks
    assert block_bytes > 0 and block_bytes == int(block_bytes), edge
    assert edge["partial_hit"]["bytes"] == (blocks - PARTIAL_PREFIX // block) * block_bytes, edge
    assert edge["full_hit"]["bytes"] == block_bytes, edge
    # Round robin takes the repeated prompt once to the D that served it (a hit: one block
    # of its two) and once to the other.
    assert min(r["bytes"] for r in edge["repeated"]) == block_bytes, edge

    # The client left after P answered: D's engine, resumed only once its API server had
    # aborted the request, ended it and told P to free its blocks, long before the lease
    # (``disconnect`` waits for that within LEASE_S). The resumed engine finds the request and
    # its abort queued together; where it drains the request before the abort has been read
    # off its socket, it schedules it for one step and its load starts (seen once in two CI
    # runs): at most that one load, and P's blocks freed all the same.
    gone = summary["disconnect"]
    assert gone["p_usage_held"] > 0 and gone["d_loads_meanwhile"] <= 1, gone
    assert gone["freed_after_resume_s"] < LEASE_S, gone

    # Nothing stays held: KV usage back to 0 everywhere, no lease ended by its timer.
    assert summary["lease_expiries"] == 0, summary
