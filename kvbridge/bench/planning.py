"""Planning benchmark: time to plan one request, descriptors before and after merging, the
minimum possible, and kvbridge's speed beside the slow block-by-block reference planner."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvbridge.bench.cases import CASES, BenchCase, load_source_module, pool_size, request_ids
from kvbridge.core.layout import Layout
from kvbridge.core.planning import plan_transfers
from kvbridge.workloads.shapes import bump_allocator

#: Where the reference planner the core tests check against lives, in the source tree.
REFERENCE_PATH = "tests/core/reference.py"

#: Fake, far-apart address ranges for the two engines: planning never touches memory.
P_BASE, D_BASE = 0x7F00_0000_0000, 0x6F00_0000_0000


@dataclass
class PlanningRow:
    """One measurement: a case, a request size and a block-id pattern."""

    case: str
    model: str
    block_size: int
    kernel_block_size: int
    groups: int
    prompt_tokens: int
    pattern: str
    blocks: int  # logical blocks (state slots included) the decode side receives
    bytes: int
    runs: int
    median_ms: float
    descriptors_before: int
    descriptors_after: int
    minimum: int
    reference_ms: float | None = None
    reference_minimum: int | None = None

    @property
    def ms_per_group(self) -> float:
        return self.median_ms / self.groups

    @property
    def ns_per_descriptor(self) -> float:
        """Planning time per descriptor before merging: the per-unit constant."""
        return self.median_ms * 1e6 / max(1, self.descriptors_before)

    @property
    def reference_speedup(self) -> float | None:
        """How many times faster than the reference planner kvbridge plans this request."""
        return self.reference_ms / self.median_ms if self.reference_ms else None

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "ms_per_group": self.ms_per_group,
            "ns_per_descriptor": self.ns_per_descriptor,
            "reference_speedup": self.reference_speedup,
        }


def minimum_descriptors(
    src: npt.NDArray[np.uint64], dst: npt.NDArray[np.uint64], lengths: npt.NDArray[np.uint64]
) -> int:
    """Fewest descriptors that move the same bytes, counted on an unmerged plan.

    Descriptors can only merge into runs adjacent on both sides, so the minimum is the number of
    descriptors that no other descriptor continues into. Found by looking each one up by its
    destination among the others' destination ends (unique, since destinations never overlap):
    independent of the planner, which merges by sorting sources.
    """
    if src.size == 0:
        return 0
    ends = dst + lengths
    order = np.argsort(ends)
    sorted_ends = ends[order]
    if bool(np.any(sorted_ends[1:] == sorted_ends[:-1])):
        raise ValueError("two descriptors end at the same destination byte: the plan overlaps")
    pos = np.minimum(np.searchsorted(sorted_ends, dst), src.size - 1)
    prev = order[pos]
    continued = (sorted_ends[pos] == dst) & (src[prev] + lengths[prev] == src)
    return int(src.size - np.count_nonzero(continued))


def _time(fn: Callable[[], object], min_runs: int, budget_s: float) -> tuple[float, int]:
    """Median seconds of ``fn`` over at least ``min_runs`` runs (more while ``budget_s`` lasts)."""
    fn()  # warm: first calls pay for lazy imports and allocator growth
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < min_runs or (time.perf_counter() < deadline and len(times) < 200):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), len(times)


def measure(
    case: BenchCase,
    prompt_tokens: int,
    pattern: str,
    *,
    num_layers: int | None = None,
    min_runs: int = 7,
    budget_s: float = 0.3,
    reference: bool = False,
    seed: int = 0,
) -> PlanningRow:
    """Plan one request between two engines of ``case`` and time it (checks on, as in serving)."""
    blocks = pool_size(case, prompt_tokens, pattern, num_layers)
    p = case.layout(blocks, bump_allocator(P_BASE), num_layers)
    d = case.layout(blocks, bump_allocator(D_BASE), num_layers)
    p_ids = request_ids(p, prompt_tokens, pattern, np.random.default_rng([seed, 0]))
    d_ids = request_ids(d, prompt_tokens, pattern, np.random.default_rng([seed, 1]))
    plan = plan_transfers(p, d, p_ids, d_ids)
    unmerged = plan_transfers(p, d, p_ids, d_ids, merge=False)
    seconds, runs = _time(lambda: plan_transfers(p, d, p_ids, d_ids), min_runs, budget_s)
    attention = d.groups[min(d.groups)]
    row = PlanningRow(
        case=case.name,
        model=case.shape.source.split()[0],
        block_size=attention.block_size,
        kernel_block_size=attention.kernel_size,
        groups=len(d.groups),
        prompt_tokens=prompt_tokens,
        pattern=pattern,
        blocks=sum(g.blocks for g in plan.groups),
        bytes=plan.nbytes,
        runs=runs,
        median_ms=seconds * 1e3,
        descriptors_before=plan.unmerged,
        descriptors_after=plan.count,
        minimum=minimum_descriptors(unmerged.src, unmerged.dst, unmerged.lengths),
    )
    if reference:
        _add_reference(row, p, d, p_ids, d_ids)
    return row


def _add_reference(
    row: PlanningRow, p: Layout, d: Layout, p_ids: dict[int, list[int]], d_ids: dict[int, list[int]]
) -> None:
    """Time the tests' reference planner (one descriptor per token) on the same request."""
    ref = load_source_module(REFERENCE_PATH, "kvbridge_bench_reference")
    if ref is None:
        return
    # Three runs and no more: it takes up to seconds per call.
    seconds, _ = _time(lambda: ref.reference_descriptors(p, d, p_ids, d_ids), 3, 0.0)
    row.reference_ms = seconds * 1e3
    row.reference_minimum = int(
        ref.minimum_descriptor_count(ref.reference_descriptors(p, d, p_ids, d_ids))
    )


def growth_exponent(rows: Sequence[PlanningRow]) -> float | None:
    """Slope of log(time) against log(blocks) over one case and pattern: 1 is linear.

    Fitted from the second size on, where per-request fixed costs no longer dominate.
    """
    points = sorted((r.blocks, r.median_ms) for r in rows)[1:]
    if len(points) < 2 or points[0][0] == points[-1][0]:
        return None
    x = np.log([b for b, _ in points])
    y = np.log([t for _, t in points])
    return float(np.polyfit(x, y, 1)[0])


def growth(rows: Sequence[PlanningRow]) -> list[dict[str, Any]]:
    """Per case and pattern: time at each size and the fitted exponent."""
    out = []
    keys = dict.fromkeys((r.case, r.pattern) for r in rows)
    for case, pattern in keys:
        mine = [r for r in rows if (r.case, r.pattern) == (case, pattern)]
        exponent = growth_exponent(mine)
        out.append(
            {
                "case": case,
                "pattern": pattern,
                "ms": {str(r.prompt_tokens): r.median_ms for r in mine},
                "exponent": None if exponent is None or math.isnan(exponent) else exponent,
            }
        )
    return out


def run_planning(
    cases: Sequence[str],
    tokens: Sequence[int],
    patterns: Sequence[str],
    *,
    num_layers: int | None,
    min_runs: int,
    budget_s: float,
    reference_tokens: int,
    advance: Callable[[str], None],
) -> dict[str, Any]:
    """Every case x size x pattern; the reference planner only up to ``reference_tokens``."""
    rows: list[PlanningRow] = []
    reference_found = load_source_module(REFERENCE_PATH, "kvbridge_bench_reference") is not None
    for name in cases:
        for size in tokens:
            for pattern in patterns:
                advance(f"planning {name} {size:,} tokens, {pattern} ids")
                rows.append(
                    measure(
                        CASES[name],
                        size,
                        pattern,
                        num_layers=num_layers,
                        min_runs=min_runs,
                        budget_s=budget_s,
                        reference=size <= reference_tokens,
                    )
                )
    return {
        "settings": {
            "cases": list(cases),
            "prompt_tokens": list(tokens),
            "patterns": list(patterns),
            "num_layers": num_layers,
            "min_runs": min_runs,
            "budget_s": budget_s,
            "reference_tokens": reference_tokens if reference_found else 0,
            "reference": REFERENCE_PATH if reference_found else None,
        },
        "results": [r.to_dict() for r in rows],
        "growth": growth(rows),
    }
