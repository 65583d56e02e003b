"""Write the site's end-to-end results page from the last ``make test-e2e`` run.

    .venv/bin/python -m tests.adapters.vllm.e2e.results_page     (or: make results-e2e)

Reads the summaries the e2e tests leave in ``.e2e-results/`` (``pd-*.json``, ``tp-*.json``) and
writes ``docs/results/vllm-e2e-runs.md``: one table per claim, dated by the newest summary.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from statistics import median
from typing import Any

from kvbridge.bench.pages import write_page

ROOT = Path(__file__).resolve().parents[4]
RESULTS = ROOT / ".e2e-results"
PAGE = ROOT / "docs" / "results" / "vllm-e2e-runs.md"
COMMAND = "make test-e2e && make results-e2e"


def _row(cells: list[Any]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _table(head: list[str], rows: list[list[Any]]) -> str:
    return "\n".join([_row(head), _row(["---"] * len(head)), *(_row(r) for r in rows)]) + "\n"


def _answers(runs: list[dict[str, Any]]) -> str:
    rows = []
    for s in runs:
        for mode in sorted({r["mode"] for r in s["results"]}):
            rs = [r for r in s["results"] if r["mode"] == mode]
            ttft = [r["d_ttft_s"] * 1e3 for r in rs if r.get("d_ttft_s") is not None]
            count = {k: sum(r["match"] == k for r in rs) for k in ("exact", "near-tie", "mismatch")}
            rows.append(
                [
                    s["model"],
                    s.get("dtype", ""),
                    s["transport"],
                    f"{s.get('tp_p', 1)} → {s.get('tp_d', 1)}",
                    mode,
                    len(rs),
                    count["exact"],
                    count["near-tie"],
                    count["mismatch"],
                    f"{median(ttft):.0f}" if ttft else "",
                ]
            )
    return _table(
        ["model", "dtype", "transport", "TP P → D", "mode", "prompts", "exact", "near tie",
         "mismatch", "D TTFT p50 (ms)"],
        rows,
    )  # fmt: skip


def _faults(runs: list[dict[str, Any]]) -> str:
    rows = [
        [
            s["model"],
            s["transport"],
            "yes" if s["control"]["loaded"] else "no",
            s.get("p_frozen", {}).get("match", "not run"),
            s.get("p_killed", {}).get("match", "not run"),
        ]
        for s in runs
    ]
    return _table(["model", "transport", "D decoded over P's KV", "P frozen", "P killed"], rows)


def _streams(runs: list[dict[str, Any]]) -> str:
    rows = []
    for s in runs:
        for mode in ("layerwise", "layerwise-pull"):
            rs = [r for r in s["results"] if r["mode"] == mode and r.get("d_loaded_bytes")]
            if not rs:
                continue
            loaded = sum(r["d_loaded_bytes"] for r in rs)
            streamed = sum(r.get("d_streamed_bytes", 0) for r in rs)
            parts = max(r.get("d_streamed_parts", 0) for r in rs)
            rows.append(
                [s["model"], s["transport"], mode, len(rs), f"{streamed / loaded:.0%}", parts]
            )
    return _table(
        ["model", "transport", "mode", "loads", "moved layer by layer", "most parts"], rows
    )


def render(runs: list[dict[str, Any]]) -> str:
    """The page's body: a table per claim, for ``runs`` (the e2e summaries)."""
    return "\n".join(
        [
            "## D answers as one instance would\n",
            "Greedy tokens of D, which decoded over P's KV cache, against one vLLM instance given "
            "the same prompt alone. float32 cases must be exact; bf16 ones may part only at a near "
            "tie (their two best tokens within the case's measured bound).\n",
            _answers(runs),
            "## A failure costs time, never correctness\n",
            "The control gives D P's parameters with a prompt of other tokens: D must answer as "
            "for P's prompt (the KV came from P). P frozen past the timeout, or killed, after a "
            "prefill: D still answers as the single instance.\n",
            _faults([s for s in runs if "p_frozen" in s]),
            "## Layer-wise loads moved while P computed\n",
            _streams(runs),
        ]
    )


def main() -> int:
    files = sorted(RESULTS.glob("pd-*.json")) + sorted(RESULTS.glob("tp-*.json"))
    if not files:
        print(f"no e2e summaries in {RESULTS}: run make test-e2e first", file=sys.stderr)
        return 1
    runs = [json.loads(f.read_text()) for f in files]
    write_page(
        PAGE,
        "vLLM end to end: the last run",
        COMMAND,
        render(runs),
        when=max(f.stat().st_mtime for f in files),
    )
    print(f"wrote {PAGE.relative_to(ROOT)} from {len(files)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
