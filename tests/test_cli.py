"""The ``kvbridge`` command line: plan output, JSON output, and one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

from kvbridge import cli
from kvbridge.cli import main
from kvbridge.core import Layout, plan_transfers
from kvbridge.core.registry import TransportInfo
from kvbridge.workloads.layouts import example_files
from kvbridge.workloads.shapes import SHAPES

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
        Layout.from_json(p.read_bytes()),
        Layout.from_json(d.read_bytes()),
        {int(k): v for k, v in ids["prefill"].items()},
        {int(k): v for k, v in ids["decode"].items()},
    )
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


# --- issue 15, item 4: what a new operator ran into ---

# A missing engine, as a process sees it: ``import mooncake`` fails.
NO_MOONCAKE = "import sys; sys.modules['mooncake'] = None; from kvbridge.cli import main; sys.exit(main({args!r}))"


def _run_without_mooncake(*args: str) -> subprocess.CompletedProcess[str]:
    code = NO_MOONCAKE.format(args=list(args))
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "400"},
    )


def test_transports_prints_a_missing_engines_install_hint_as_written():
    result = _run_without_mooncake("transports")
    assert result.returncode == 0, result.stderr
    # rich took `[mooncake]` for markup and printed `pip install 'kvbridge'`
    assert "pip install 'kvbridge[mooncake]'" in result.stdout


def test_transports_prints_plugin_text_that_looks_like_markup(monkeypatch, capsys):
    texts = ("odd[bold]", "pkg[x] 1.0", "needs [/] and [red]this[/red]; pip install 'p[e]'")
    info = TransportInfo(texts[0], texts[1], False, texts[2])
    monkeypatch.setattr(cli, "available_transports", lambda: [info])
    monkeypatch.setenv("COLUMNS", "400")
    assert main(["transports"]) == 0  # `[/]` alone made rich raise MarkupError
    out = capsys.readouterr().out
    for text in texts:
        assert text in out


def _assert_one_line_usage_error(result: subprocess.CompletedProcess[str], *words: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("kvbridge: error:")
    for word in words:
        assert word in lines[0]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--transport", "nosuch"], ["'nosuch'", "usable transports here: cma", "--transport"]),
        (["--shape", "nosuch"], ["'nosuch'", "qwen3.5-hybrid", "--shape"]),
        (["--prompt-tokens", "100000", "--num-blocks", "8"], ["--num-blocks 8", "--prompt-tokens 100000"]),
        (["--secret", ""], ["--secret is empty", "authentication off"]),
    ],
)  # fmt: skip
def test_demo_refuses_what_it_cannot_run_before_starting_processes(args, words):
    # It used to start both processes and print a child's traceback; that no process starts is
    # checked without a clock below (test_demo_starts_no_process_for_a_bad_request).
    result = _run("demo", *args, "--timeout", "30")
    _assert_one_line_usage_error(result, *words)


def test_demo_without_the_engine_names_what_to_install():
    result = _run_without_mooncake("demo", "--timeout", "30")
    _assert_one_line_usage_error(
        result, "'mooncake' cannot run here", "kvbridge[mooncake]", "usable transports here: cma"
    )


@pytest.mark.parametrize(
    "args", [["--transport", "nosuch"], ["--shape", "nosuch"], ["--num-blocks", "1"]]
)
def test_demo_starts_no_process_for_a_bad_request(args, monkeypatch, capsys):
    import kvbridge.demo

    def run_demo(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the demo started its processes")

    monkeypatch.setattr(kvbridge.demo, "run_demo", run_demo)
    assert main(["demo", *args]) == 2
    assert "kvbridge: error:" in capsys.readouterr().err


def test_version_prints_the_installed_version():
    result = _run("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"kvbridge {metadata.version('kvbridge')}"


def test_the_installed_metadata_declares_the_extras_and_the_proxy_command():
    meta = metadata.metadata("kvbridge")
    assert meta["License-Expression"] == "Apache-2.0"
    extras = set(meta.get_all("Provides-Extra") or [])
    assert {"mooncake", "mooncake-cuda", "proxy", "nixl", "testing", "dev"} <= extras
    proxy_reqs = [r for r in metadata.requires("kvbridge") or [] if 'extra == "proxy"' in r]
    names = {r.split(">")[0].split(";")[0].strip() for r in proxy_reqs}
    assert names == {"httpx", "fastapi", "uvicorn", "prometheus-client"}
    (script,) = metadata.entry_points(group="console_scripts", name="kvbridge-proxy")
    assert script.value == "kvbridge.adapters.vllm.proxy:main"
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")
    assert (Path(cli.__file__).parent / "py.typed").is_file()


def test_kvbridge_proxy_command_runs():
    for module in ("httpx", "fastapi", "uvicorn"):
        pytest.importorskip(module, reason="the proxy extra is not installed")
    script = Path(sys.executable).parent / "kvbridge-proxy"
    assert script.is_file(), "run `pip install -e .` to install the console scripts"
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "--prefill" in result.stdout and "--decode" in result.stdout
