"""Tables of benchmark results, for the terminal (rich) and for Markdown (the README)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rich import box
from rich.markup import escape
from rich.table import Table


@dataclass
class Grid:
    """A titled table of strings: the one form both renderers take."""

    title: str
    headers: list[str]
    rows: list[list[str]]
    notes: list[str]
    #: column indices to align left (the rest are numbers)
    left: tuple[int, ...] = (0,)

    def rich(self) -> Table:
        # Every text escaped: engine names and notes may hold brackets ("kvbridge[mooncake]")
        # that rich would take for markup and swallow (or fail on).
        caption = escape(" ".join(self.notes)) or None
        table = Table(title=escape(self.title), caption=caption, box=box.SIMPLE_HEAD)
        for i, header in enumerate(self.headers):
            table.add_column(escape(header), justify="left" if i in self.left else "right")
        for row in self.rows:
            table.add_row(*map(escape, row))
        return table

    def markdown(self) -> str:
        align = ["---" if i in self.left else "---:" for i in range(len(self.headers))]
        lines = [f"**{self.title}**", ""]
        lines.append("| " + " | ".join(self.headers) + " |")
        lines.append("| " + " | ".join(align) + " |")
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        if self.notes:
            lines += ["", *self.notes]
        return "\n".join(lines)


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else f"{n:,}"


def planning_grid(doc: dict[str, Any]) -> Grid:
    """One row per case, size and block-id pattern."""
    rows = []
    for r in doc["results"]:
        above = r["descriptors_after"] != r["minimum"]  # marked: merging missed a run
        merged = f"{r['descriptors_after']:,}" + (" ✗" if above else "")
        rows.append(
            [
                r["case"],
                _tokens(r["prompt_tokens"]),
                r["pattern"],
                str(r["groups"]),
                f"{r['blocks']:,}",
                _num(r["median_ms"], 3),
                _num(r["ms_per_group"], 3),
                _num(r["ns_per_descriptor"], 0),
                f"{r['descriptors_before']:,}",
                merged,
                f"{r['minimum']:,}",
                "-" if r["reference_speedup"] is None else f"{r['reference_speedup']:,.0f}x",
            ]
        )
    settings = doc["settings"]
    reference = settings.get("reference_tokens") or 0
    notes = [
        "Median of repeated `plan_transfers` calls (compatibility and overlap checks on, as the "
        "control plane plans). ns/desc: time per descriptor before merging. minimum: descriptors "
        "no other descriptor continues into, counted on the unmerged plan by an independent "
        "method; ✗ marks a merged count above it.",
        (
            f"vs ref.: how many times faster than the tests' block-by-block reference "
            f"planner (one descriptor per token), timed up to {reference:,} tokens only (it is "
            "slow)."
            if reference
            else "The reference planner was not timed (no source tree)."
        ),
    ]
    headers = [
        "shape",
        "tokens",
        "ids",
        "groups",
        "blocks",
        "plan ms",
        "ms/group",
        "ns/desc",
        "desc. before",
        "merged",
        "minimum",
        "vs ref.",
    ]
    return Grid("Planning one request", headers, rows, notes, left=(0, 2))


def growth_grid(doc: dict[str, Any]) -> Grid:
    """Planning time against request size, with the fitted exponent (1 = linear)."""
    sizes = doc["settings"]["prompt_tokens"]
    rows = []
    for g in doc["growth"]:
        cells = [_num(g["ms"].get(str(s)), 3) for s in sizes]
        rows.append([g["case"], g["pattern"], *cells, _num(g["exponent"], 2)])
    headers = ["shape", "ids", *[f"{_tokens(s)} ms" for s in sizes], "exponent"]
    notes = [
        "exponent: slope of log(time) against log(blocks) from the second size on; 1 is linear, "
        "below 1 means fixed per-request costs still dominate."
    ]
    return Grid("Planning time against request size", headers, rows, notes, left=(0, 1))


def transfer_grid(doc: dict[str, Any]) -> Grid:
    """One row per transport and case."""
    rows = []
    for r in doc["results"]:
        g, q = r["gbps"], r["ratios"]
        rows.append(
            [
                r["transport"],
                r["case"],
                f"{r['bytes'] / 2**20:,.1f}",
                f"{r['descriptors']:,}",
                _num(g.get("memcpy")),
                _num(g.get("raw")),
                _num(g.get("kvbridge")),
                _num(g.get("kvbridge_transfer")),
                _num(g.get("transport")),
                _num(q.get("kvbridge/raw")),
                _num(q.get("raw/memcpy")),
                _num(r["plan_ms"], 2),
                _num(g.get("verify-sample")),
                _num(g.get("verify-full")),
                _num((r.get("verify_ms") or {}).get("verify-full"), 1),
            ]
        )
    s = doc["settings"]
    notes = [
        f"MiB: the request moved, --transfer-mib {s['target_mib']:g} rounded up to whole blocks "
        "of each shape.",
        f"Throughput in GB/s: median of {s['reps']} repetitions after a verified warm-up, two "
        "processes on "
        f"127.0.0.1, block ids in runs of random length ({s['pattern']}). memcpy: the same "
        "descriptors copied in one process. raw: the engine's own API on the same descriptor "
        "arrays. kvbridge: end to end through the control plane (pull: request, plan, submit, "
        "wait, release); transfer only: its submit and wait. no ctl. plane: kvbridge's plan + "
        "`Transport.transfer` alone. Ratios are medians of per-repetition ratios. verify "
        "sample/full: kvbridge with the integrity check on (xxh3 digests of 1 in 16 / all "
        "descriptors on both sides); verify ms: the full check's own time.",
    ]
    headers = [
        "transport",
        "shape",
        "MiB",
        "desc.",
        "memcpy",
        "raw",
        "kvbridge",
        "transfer only",
        "no ctl. plane",
        "kvbridge/raw",
        "raw/memcpy",
        "plan ms",
        "verify sample",
        "verify full",
        "verify ms",
    ]
    title = "Moving one request between two processes (GB/s)"
    return Grid(title, headers, rows, notes, left=(0, 1))


def grids(doc: dict[str, Any]) -> list[Grid]:
    """Every table a results document has, in reading order."""
    makers: list[tuple[str, Callable[[dict[str, Any]], Grid]]] = [
        ("planning", planning_grid),
        ("planning", growth_grid),
        ("transfer", transfer_grid),
    ]
    return [make(doc[key]) for key, make in makers if doc.get(key)]


def _spread(reps: int, span: list[float] | None) -> str:
    """How far a median ratio of ``reps`` repetitions can be trusted, in words."""
    if reps < 2 or span is None:
        return f"from {reps} repetition: no spread measured, so the noise is unknown"
    low, high = span
    if low <= 1 <= high:
        verdict = "a range that holds 100%: no difference beyond the noise"
    else:
        verdict = "all repetitions on one side of 100%"
        if reps < 5:
            verdict += f", but {reps} are few: --reps 5 or more for a firmer figure"
    return f"median of {reps} repetitions ranging {low:.1%} to {high:.1%}, {verdict}"


def targets(doc: dict[str, Any]) -> list[str]:
    """The issue's measured targets, each with what this run found."""
    lines = []
    planning = doc.get("planning")
    if planning:
        rows = planning["results"]
        bad = [r for r in rows if r["descriptors_after"] != r["minimum"]]
        lines.append(
            f"descriptors after merging equal the minimum: {len(rows) - len(bad)}/{len(rows)} "
            "cases" + (f" (not: {', '.join(r['case'] for r in bad)})" if bad else "")
        )
        hybrid = [r for r in rows if r["case"] == "qwen3.5-hybrid" and r["prompt_tokens"] == 32768]
        if hybrid:
            worst = max(r["ms_per_group"] for r in hybrid)
            lines.append(
                f"32k-token hybrid request: at most {worst:.3f} ms per cache group "
                f"({len(hybrid)} block-id patterns)"
            )
    transfer = doc.get("transfer")
    if transfer:
        target = transfer["settings"]["target_mib"]
        sizes = sorted({r["bytes"] for r in transfer["results"]})
        if sizes and sizes[-1] > target * 2**20:
            moved = ", ".join(f"{n / 2**20:,.1f}" for n in sizes)
            lines.append(
                f"request size: --transfer-mib {target:g} rounded up to whole blocks: {moved} MiB"
            )
        for r in transfer["results"]:
            ratio = r["ratios"].get("kvbridge/raw")
            if ratio is not None:
                g = r["gbps"]
                alone = g["kvbridge_transfer"] / g["raw"] if g.get("raw") else None
                spread = _spread(r["reps"], (r.get("ratio_ranges") or {}).get("kvbridge/raw"))
                lines.append(
                    f"{r['transport']} {r['case']}: kvbridge end to end at {ratio:.1%} of the "
                    f"raw engine's throughput, {spread} (its transfer alone {_pct(alone)}; "
                    "kvbridge's own "
                    f"cost {_num(r.get('own_ms'), 1)} ms per request: planning "
                    f"{_num(r['plan_ms'], 1)} ms ({_num(r.get('plan_warm_ms'), 2)} ms planned "
                    f"again with warm caches), the control plane "
                    f"{_num(r.get('control_ms'), 1)} ms beside it)"
                )
    return lines
