"""``kvbridge bench``: its JSON on the smallest settings, and the pieces it is built from."""

from __future__ import annotations

import json
import subprocess
import sys
from itertools import pairwise

import numpy as np
import pytest

from kvbridge.bench.cases import CASES, PATTERNS, load_source_module, pool_size, request_ids
from kvbridge.bench.planning import minimum_descriptors
from kvbridge.bench.report import _spread, grids, targets
from kvbridge.bench.transfer import MODES, balanced_orders
from kvbridge.cli import main
from kvbridge.core import plan_transfers
from kvbridge.core.registry import available_transports
from kvbridge.workloads.shapes import bump_allocator

from .core.reference import minimum_descriptor_count, reference_descriptors


@pytest.fixture(scope="module")
def small_run():
    """One run of every benchmark on the smallest settings (a few seconds)."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvbridge.cli",
            "bench",
            "--tokens",
            "1024",
            "--layers",
            "4",
            "--plan-runs",
            "2",
            "--plan-seconds",
            "0",
            "--transfer-mib",
            "2",
            "--reps",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.timeout(180)
def test_planning_results_merge_to_the_minimum_in_every_case(small_run):
    planning = small_run["planning"]
    rows = planning["results"]
    assert {(r["case"], r["pattern"]) for r in rows} == {(c, p) for c in CASES for p in PATTERNS}
    for r in rows:
        assert r["prompt_tokens"] == 1024 and r["runs"] >= 2 and r["median_ms"] > 0
        assert r["descriptors_after"] == r["minimum"] <= r["descriptors_before"]
        # the reference planner ran (1k tokens) and counts the same minimum on its own
        assert r["reference_minimum"] == r["minimum"] and r["reference_speedup"] > 0
    assert {(g["case"], g["pattern"]) for g in planning["growth"]} == {
        (r["case"], r["pattern"]) for r in rows
    }
    assert small_run["command"].startswith("kvbridge bench all --shapes")


@pytest.mark.timeout(180)
def test_transfer_results_cover_every_usable_transport_and_were_verified(small_run):
    transfer = small_run["transfer"]
    usable = [t.name for t in available_transports() if t.usable]
    rows = transfer["results"]
    assert [(r["transport"], r["case"]) for r in rows] == [(t, c) for t in usable for c in CASES]
    for r in rows:
        assert r["verified"] and r["reps"] == 1 and r["bytes"] >= 2 * 2**20
        assert r["descriptors"] <= r["descriptors_before"]
        modes = set(r["seconds"])
        assert {"kvbridge", "transport", "memcpy"} <= modes <= set(MODES)
        assert all(r["gbps"][m] > 0 for m in modes) and r["gbps"]["kvbridge_transfer"] > 0
        assert set(r["ratios"]) == {
            "kvbridge/raw",
            "transport/raw",
            "raw/memcpy",
            "verify-sample/kvbridge",
            "verify-full/kvbridge",
        }
        assert {"verify-sample", "verify-full"} <= modes
        assert all(r["verify_ms"][m] > 0 for m in ("verify-sample", "verify-full"))
        assert r["plan_ms"] > 0 and r["plan_warm_ms"] > 0
        if "raw" in modes:  # the baseline in benchmarks/ covers mooncake and nixl
            assert r["ratios"]["kvbridge/raw"] > 0
    # the tables render from the same document
    text = "\n".join(g.markdown() for g in grids(small_run))
    assert "Planning one request" in text and ("Moving one request" in text) == bool(rows)


def test_minimum_count_agrees_with_the_reference_on_every_shape_and_pattern():
    for case in CASES.values():
        for pattern in PATTERNS:
            blocks = pool_size(case, 700, pattern, 2)
            p = case.layout(blocks, bump_allocator(0x7F00_0000_0000), num_layers=2)
            d = case.layout(blocks, bump_allocator(0x6F00_0000_0000), num_layers=2)
            p_ids = request_ids(p, 700, pattern, np.random.default_rng(0))
            d_ids = request_ids(d, 700, pattern, np.random.default_rng(1))
            unmerged = plan_transfers(p, d, p_ids, d_ids, merge=False)
            expected = minimum_descriptor_count(reference_descriptors(p, d, p_ids, d_ids))
            assert minimum_descriptors(unmerged.src, unmerged.dst, unmerged.lengths) == expected
            assert plan_transfers(p, d, p_ids, d_ids).count == expected


@pytest.mark.parametrize("n", [2, 3, 4])
def test_balanced_orders_put_every_way_everywhere_and_after_every_other(n):
    modes = [f"m{i}" for i in range(n)]
    orders = balanced_orders(modes)
    for position in range(n):
        counts = {m: sum(o[position] == m for o in orders) for m in modes}
        assert len(set(counts.values())) == 1
    follows = [(a, b) for o in orders for a, b in pairwise(o)]
    each = 1 if n % 2 == 0 else 2  # odd n needs the mirrored orders too
    assert sorted(follows) == sorted([(a, b) for a in modes for b in modes if a != b] * each)


def test_model_shapes_match_the_configs_in_benchmarks():
    configs = load_source_module("benchmarks/model_configs.py", "kvbridge_bench_model_configs")
    assert configs is not None
    for name in CASES:
        assert configs.differences(name) == [], name


def test_bad_options_are_one_line_errors(capsys):
    assert main(["bench", "planning", "--shapes", "nope"]) == 2
    assert "unknown shape" in capsys.readouterr().err
    assert main(["bench", "transfer", "--transports", "nope"]) == 2
    assert "no transport named 'nope'" in capsys.readouterr().err


def test_the_terminal_tables_show_brackets_as_written():
    # rich would read "[mooncake]" as markup and drop it, and "[/]" alone raises.
    from rich.console import Console

    from kvbridge.bench.report import Grid

    grid = Grid(
        "kvbridge[mooncake] [/]", ["way [x]"], [["pip install 'kvbridge[nixl]'"]], ["see [/note]"]
    )
    console = Console(width=200, record=True)
    console.print(grid.rich())
    text = console.export_text()
    for shown in ("kvbridge[mooncake] [/]", "way [x]", "'kvbridge[nixl]'", "see [/note]"):
        assert shown in text, text


@pytest.mark.timeout(180)
def test_the_transfer_report_says_how_it_rounded_and_how_noisy_it_is(small_run):
    rows = small_run["transfer"]["results"]
    if not rows:
        pytest.skip("no usable transport")
    lines = targets(small_run)
    (grid,) = [g for g in grids(small_run) if g.title.startswith("Moving one request")]
    # --transfer-mib 2 moved more than 2 MiB, and nothing said so
    assert "--transfer-mib 2 rounded up to whole blocks" in " ".join(grid.notes)
    moved = sorted({r["bytes"] for r in rows})
    assert moved[-1] > 2 * 2**20
    assert any(line.startswith("request size: --transfer-mib 2 rounded up") for line in lines)
    for r in rows:
        assert set(r["ratio_ranges"]) == set(r["ratios"])
        span = r["ratio_ranges"]["kvbridge/raw"]
        if span is not None:  # one repetition: min = max = the median
            assert span[0] == span[1] == r["ratios"]["kvbridge/raw"]
            (line,) = [x for x in lines if x.startswith(f"{r['transport']} {r['case']}:")]
            assert "from 1 repetition: no spread measured, so the noise is unknown" in line


def test_a_ratio_within_its_spread_is_called_noise():
    within = _spread(3, [0.93, 1.08])
    assert "ranging 93.0% to 108.0%" in within and "no difference beyond the noise" in within
    beyond = _spread(3, [1.9, 2.6])
    assert "all repetitions on one side of 100%" in beyond and "noise" not in beyond
    assert "3 are few: --reps 5 or more" in beyond
    assert "few" not in _spread(8, [1.9, 2.6])
