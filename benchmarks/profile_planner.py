"""Profile ``plan_transfers`` on one benchmark case with pyinstrument (how the planner's costs
were found; see docs/results/planning.md).

    .venv/bin/python benchmarks/profile_planner.py llama3-70b-dense 131072 fragmented [--runs 10]

Needs ``pip install pyinstrument``.
"""

from __future__ import annotations

import argparse

import numpy as np

from kvbridge.bench.cases import CASES, PATTERNS, pool_size, request_ids
from kvbridge.core import plan_transfers
from kvbridge.workloads.shapes import bump_allocator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=list(CASES))
    parser.add_argument("tokens", type=int)
    parser.add_argument("pattern", choices=PATTERNS)
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    from pyinstrument import Profiler

    case = CASES[args.shape]
    blocks = pool_size(case, args.tokens, args.pattern, None)
    p = case.layout(blocks, bump_allocator(0x7F00_0000_0000))
    d = case.layout(blocks, bump_allocator(0x6F00_0000_0000))
    p_ids = request_ids(p, args.tokens, args.pattern, np.random.default_rng(0))
    d_ids = request_ids(d, args.tokens, args.pattern, np.random.default_rng(1))
    plan_transfers(p, d, p_ids, d_ids)  # warm
    profiler = Profiler(interval=0.0005)
    with profiler:
        for _ in range(args.runs):
            plan_transfers(p, d, p_ids, d_ids)
    print(profiler.output_text(unicode=True, color=False))


if __name__ == "__main__":
    main()
