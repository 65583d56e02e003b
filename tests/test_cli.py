"""The ``kvbridge`` command line: plan output, JSON output, and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvbridge.cli import main
from kvbridge.core import Layout, plan_transfers
from kvbridge.example_layouts import example_files
from kvbridge.model_shapes import SHAPES

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def example(name: str) -> list[str]:
    folder = EXAMPLES / name
    return [str(folder / f) for f in ("prefill.json", "decode.json", "blocks.json")]


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_shipped_examples_match_their_generator(name):
    for filename, doc in example_files(SHAPES[name]).items():
        shipped = json.loads((EXAMPLES / name / filename).read_text())
        assert shipped == json.loads(json.dumps(doc)), f"run `make examples`: {name}/{filename}"


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_plan_prints_groups_and_merged_counts(name, capsys):
    assert main(["plan", *example(name)]) == 0
    out = capsys.readouterr().out
    p, d, blocks = (Path(f) for f in example(name))
    ids = json.loads(blocks.read_text())
    plan = plan_transfers(
        Layout.from_json(p.read_bytes()), Layout.from_json(d.read_bytes()),
        {int(k): v for k, v in ids["prefill"].items()},
        {int(k): v for k, v in ids["decode"].items()},
    )  # fmt: skip
    assert f"descriptors: {plan.unmerged} before merging, {plan.count} after" in out
    assert f"{plan.nbytes:,} bytes" in out
    for g in plan.groups:
        assert g.kind.value in out


def test_plan_json_gives_the_descriptors_for_the_submitting_side(capsys):
    assert main(["plan", *example("qwen3.5-hybrid"), "--json", "--op", "write"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["op"] == "write" and doc["submitter"] == "prefill"
    assert len(doc["local"]) == len(doc["remote"]) == len(doc["length"]) == doc["descriptors"]
    assert sum(doc["length"]) == doc["bytes"]
    prefill = Layout.from_json((EXAMPLES / "qwen3.5-hybrid" / "prefill.json").read_bytes())
    # prefill writes: local addresses are prefill's
    starts = np.array(doc["local"], dtype=np.uint64)
    assert all(any(r.addr <= a < r.end for r in prefill.registration) for a in starts.tolist())
    assert doc["descriptors_before_merge"] > doc["descriptors"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvbridge.cli", *args], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    ("make_args", "message"),
    [
        (lambda t: [str(t / "missing.json"), *example("deepseek-mla")[1:]], "cannot read prefill layout"),
        (lambda t: [str(t / "bad.json"), *example("deepseek-mla")[1:]], "not valid JSON"),
        (lambda t: [str(t / "nogroups.json"), *example("deepseek-mla")[1:]], "missing required field `groups`"),
        (lambda t: [*example("deepseek-mla")[:2], str(t / "badblocks.json")], "block-id file"),
        (lambda t: [*example("deepseek-mla")[:2], str(t / "outofrange.json")], "outside [0, 2048)"),
        (lambda t: [example("deepseek-mla")[0], *example("llama3-70b-dense")[1:]], "layouts are incompatible"),
    ],
)  # fmt: skip
def test_bad_input_gives_one_line_error_and_exit_2(tmp_path, make_args, message):
    (tmp_path / "bad.json").write_text("{ not json")
    (tmp_path / "nogroups.json").write_text('{"tensors": []}')
    (tmp_path / "badblocks.json").write_text('{"prefill": {"0": ["x"]}, "decode": {}}')
    (tmp_path / "outofrange.json").write_text('{"prefill": {"0": [1]}, "decode": {"0": [5000]}}')
    result = _run("plan", *make_args(tmp_path))
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("kvbridge: error:") and message in lines[0]
    assert "Traceback" not in result.stderr


def test_transports_lists_the_entry_points():
    result = _run("transports", "--json")
    assert result.returncode == 0
    names = {t["name"] for t in json.loads(result.stdout)}
    assert "mooncake" in names
