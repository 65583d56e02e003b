"""What a token-major P and a head-major D cost: descriptors, and D's permute after the transfer.

    .venv/bin/python benchmarks/transpose_on_receive.py [--shape llama3-70b-dense]
        [--layers 8] [--tokens 1024 4096 16384] [--layouts LBNHC:LBHNC LBNHC:LHBNC LBHNC:LBNHC]

vLLM's own functions configure and allocate both workers' caches on the CPU (as
``benchmarks/vllm_planning.py`` does), a request's blocks are scattered over the pool, and for
each pair of layouts one run prints, side by side:

* ``descriptors``: what kvbridge submits (the source's order into the destination's blocks),
  against ``per-cell descriptors``, what moving every ``(token, head)`` cell to its place would
  need (``N x H`` runs of ``C`` bytes per kernel block, layer and part, none of them contiguous on
  both sides when a block holds several heads);
* ``permute ms``: D's ``transpose_received`` over the request's blocks (median of 5), against
  ``copy ms``: one ``copy_`` of the same number of bytes in this process (what a memory-bound
  permute cannot beat), on this machine's CPU. On a GPU the permute is a device kernel per layer.

Only ``--layers`` of the model's layers are allocated (caches are real memory); descriptors and
times grow with the layer count.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from kvbridge.adapters.vllm.layout import build_layout_spec
from kvbridge.adapters.vllm.transpose import transpose_received
from kvbridge.core import Layout, plan_transfers
from kvbridge.core.transpose import received_transposes
from kvbridge.workloads.shapes import SHAPES

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, run as a script

from benchmarks.vllm_planning import allocate, block_sizes, kv_cache_config


def _median_ms(fn: object, runs: int = 5) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure(shape_name: str, layers: int, tokens: int, p_layout: str, d_layout: str) -> dict:
    shape = SHAPES[shape_name]
    blocks = -(-tokens // block_sizes(shape)[0])
    pool = 2 * blocks + 1
    p_cfg = kv_cache_config(shape, p_layout, layers, pool)
    d_cfg = kv_cache_config(shape, d_layout, layers, pool)
    p, d = allocate(p_cfg, p_layout), allocate(d_cfg, d_layout)
    rng = np.random.default_rng(0)
    groups = range(len(p_cfg.kv_cache_groups))
    p_ids = {g: [int(b) for b in rng.permutation(np.arange(1, pool))[:blocks]] for g in groups}
    d_ids = {g: [int(b) for b in rng.permutation(np.arange(1, pool))[:blocks]] for g in groups}
    p_layout_obj = Layout(build_layout_spec(p.config, p.views))
    d_layout_obj = Layout(build_layout_spec(d.config, d.views))
    plan = plan_transfers(p_layout_obj, d_layout_obj, p_ids, d_ids)
    transposes = received_transposes(p_layout_obj, d_layout_obj, p_ids, d_ids)
    names = [g.layer_names for g in d.config.kv_cache_groups]
    cells = 0
    for g, layer_names in enumerate(names):
        for name in layer_names:
            _, heads, n, _ = d.views[name].shape
            cells += len(d_ids[g]) * d.ratio * heads * n
    permute = _median_ms(lambda: transpose_received(d.views, names, transposes))
    src = torch.empty(plan.nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy = _median_ms(lambda: dst.copy_(src))
    return {
        "pair": f"{p_layout}->{d_layout}",
        "tokens": tokens,
        "MiB": round(plan.nbytes / 2**20, 1),
        "descriptors": plan.count,
        "per-cell descriptors": cells,
        "transposed blocks": sum(int(t.kernel_block_ids.size) for t in transposes),
        "permute ms": round(permute, 2),
        "copy ms": round(copy, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="llama3-70b-dense", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument(
        "--layouts", nargs="+", default=["LBNHC:LBHNC", "LBNHC:LHBNC", "LBHNC:LBNHC"]
    )
    args = parser.parse_args()
    rows = [
        measure(args.shape, args.layers, tokens, *pair.split(":"))
        for pair in args.layouts
        for tokens in args.tokens
    ]
    print(f"{args.shape}, {args.layers} layers, torch {torch.__version__} on the CPU")
    keys = list(rows[0])
    print(" | ".join(keys))
    for row in rows:
        print(" | ".join(str(row[k]) for k in keys))


if __name__ == "__main__":
    main()
