"""Planning cost per model shape and request size (median of repeated runs), as a table.

.venv/bin/python benchmarks/plan_cost.py [--tokens 1024 8192 32768 131072] [--repeat 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from rich.console import Console
from rich.table import Table

from kvbridge.core import Layout, plan_transfers
from kvbridge.example_layouts import request_block_ids
from kvbridge.model_shapes import SHAPES, bump_allocator, layout_spec


def measure(shape_name: str, tokens: int, repeat: int) -> dict[str, float]:
    shape = SHAPES[shape_name]
    blocks = max(4096, 2 * tokens // 16 + 16)
    p = Layout(layout_spec(shape, blocks, bump_allocator(0x7F00_0000_0000)))
    d = Layout(layout_spec(shape, blocks, bump_allocator(0x6F00_0000_0000)))
    rng = np.random.default_rng(0)
    p_ids = request_block_ids(p, tokens, rng)
    d_ids = request_block_ids(d, tokens, rng)
    plan = plan_transfers(p, d, p_ids, d_ids)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        plan_transfers(p, d, p_ids, d_ids)
        times.append(time.perf_counter() - start)
    return {
        "groups": len(p.groups),
        "median_ms": statistics.median(times) * 1e3,
        "before": plan.unmerged,
        "after": plan.count,
        "gb": plan.nbytes / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192, 32768, 131072])
    parser.add_argument("--shapes", nargs="+", default=sorted(SHAPES))
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    table = Table(title="kvbridge planning cost (fragmented block ids, runs of 1-8 blocks)")
    for col in (
        "shape",
        "tokens",
        "groups",
        "median ms",
        "ms/group",
        "desc. before",
        "after",
        "GB",
    ):
        table.add_column(col, justify="right")
    for name in args.shapes:
        for tokens in args.tokens:
            r = measure(name, tokens, args.repeat)
            table.add_row(
                name, f"{tokens:,}", str(r["groups"]), f"{r['median_ms']:.2f}",
                f"{r['median_ms'] / r['groups']:.2f}", f"{r['before']:,}", f"{r['after']:,}",
                f"{r['gb']:.2f}",
            )  # fmt: skip
    Console().print(table)


if __name__ == "__main__":
    main()
