"""``benchmarks/vllm_planning.py``: kvbridge's planner beside vLLM's own Mooncake connector code.

A script of the source tree (it builds vLLM's private worker by hand), so its tests live beside
the adapter's: ``make test-vllm033`` runs them against vLLM 0.33 too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks.vllm_planning import main, vllm_planning_grid
from kvbridge.cli import main as kvbridge_main

ROOT = Path(__file__).resolve().parents[1]


def _byte_map(src, dst, lengths):
    """Every byte a plan moves as (source address, destination address), sorted by source."""
    src, dst, n = (np.asarray(a, dtype=np.int64) for a in (src, dst, lengths))
    offsets = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    s, d = np.repeat(src, n) + offsets, np.repeat(dst, n) + offsets
    order = np.argsort(s, kind="stable")
    return s[order], d[order]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("shape", "layout"),
    [("llama3-70b-dense", "LBHNC"), ("deepseek-mla", "BLHNC"), ("qwen3.5-hybrid", "LBHNC")],
)
def test_vllm_planning_moves_the_bytes_vllms_own_mooncake_planner_moves(shape, layout):
    """One tiny cell per shape: kvbridge's plan and vLLM's Mooncake connector's transfers, on
    the same vLLM-allocated views and block ids, move the same bytes to the same places."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from benchmarks.vllm_planning import (
        VLLM_SHAPES,
        layer_unit,
        measure_cells,
        measure_layers,
        pool_blocks,
    )

    model = VLLM_SHAPES[shape]
    layers, tokens = max(2, layer_unit(model)), 700
    setup, [m] = measure_layers(
        model, layout, layers, pool_blocks(model, tokens), tokens, ["runs"], runs=1, seed=3
    )
    assert setup.layers == layers and m.kvbridge_ms > 0 and m.vllm_ms > 0
    plan, (v_src, v_dst, v_len) = m.plan, m.vllm
    k_src, k_dst = _byte_map(plan.src, plan.dst, plan.lengths)
    v_src_b, v_dst_b = _byte_map(v_src, v_dst, v_len)
    assert np.all(np.diff(k_src) > 0) and np.all(np.diff(v_src_b) > 0)  # no byte read twice
    if model.is_hybrid:
        # vLLM copies a GDN layer's whole page, padding included; kvbridge only its states.
        at = np.searchsorted(v_src_b, k_src)
        assert np.array_equal(v_src_b[at], k_src) and np.array_equal(v_dst_b[at], k_dst)
        gdn_layers = layers - layers // model.full_attention_interval
        padding = 2 * model.attention_bytes_per_token * 544 - (
            model.conv_state_bytes + model.ssm_state_bytes
        )
        assert sum(v_len) == plan.nbytes + gdn_layers * padding
    else:
        assert sum(v_len) == plan.nbytes
        assert np.array_equal(k_src, v_src_b) and np.array_equal(k_dst, v_dst_b)
        assert plan.count <= len(v_len)  # kvbridge merges to the minimum
    # the row the benchmark reports for the same cell says the same
    [row] = measure_cells(
        shape, layout, tokens, ["runs"], runs=1, max_layers=layers, estimate=False, seed=3
    )
    assert row.refused is None and row.fit_layers is None
    assert row.vllm_bytes - row.kvbridge_bytes == sum(v_len) - plan.nbytes
    assert row.same_ranges is not model.is_hybrid and row.vllm_covers_kvbridge


def test_the_table_renders_the_published_run():
    published = ROOT / "benchmarks" / "results" / "vllm-planning.json"
    doc = json.loads(published.read_text())["vllm_planning"]
    grid = vllm_planning_grid(doc)
    assert len(grid.rows) == len(doc["results"])
    assert all(len(row) == len(grid.headers) for row in grid.rows)
    text = grid.markdown()
    assert "kvbridge beside vLLM's Mooncake connector" in text and "refused (1)" in text


def test_the_script_runs_from_the_source_tree_and_refuses_bad_options(capsys):
    for command in (
        [sys.executable, "benchmarks/vllm_planning.py", "--help"],
        [sys.executable, "-m", "benchmarks.vllm_planning", "--help"],
    ):
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert "--layouts" in done.stdout and "--memory-gib" in done.stdout
    assert main(["--vllm-runs", "0"]) == 2
    assert "--vllm-runs and --memory-gib must be positive" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--shapes", "nope"])


def test_kvbridge_bench_has_no_vllm_planning_subcommand(capsys):
    with pytest.raises(SystemExit):
        kvbridge_main(["bench", "vllm-planning"])
    assert "invalid choice: 'vllm-planning'" in capsys.readouterr().err
