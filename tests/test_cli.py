"""The ``kvbridge`` command line: plan output, JSON output, and one-line errors."""

from __future__ import annotations

import importlib.util
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
from kvbridge.core.registry import TransportInfo, available_transports
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
    monkeypatch.setattr(cli.transports, "available_transports", lambda: [info])
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
        (["--transport", "nosuch"], ["'nosuch'", "usable transports here:", "cma", "--transport"]),
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
    result = _run_without_mooncake("demo", "--transport", "mooncake", "--timeout", "30")
    _assert_one_line_usage_error(
        result, "'mooncake' cannot run here", "kvbridge[mooncake]", "usable transports here:", "cma"
    )


@pytest.mark.parametrize(
    "args",
    [
        ["--transport", "nosuch"],
        ["--shape", "nosuch"],
        ["--num-blocks", "1"],
        ["--shape", "deepseek-mla", "--layers", "96"],
        ["--layers", "100000"],
        ["--prompt-tokens", "100000000"],
        ["--shape", "llama3-70b-dense", "--num-blocks", "100000000"],
    ],
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
    assert script.value == "kvbridge.router.proxy:main"
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")
    assert (Path(cli.__file__).parent.parent / "py.typed").is_file()  # the kvbridge package


def test_kvbridge_proxy_command_runs():
    for module in ("httpx", "fastapi", "uvicorn"):
        pytest.importorskip(module, reason="the proxy extra is not installed")
    script = Path(sys.executable).parent / "kvbridge-proxy"
    assert script.is_file(), "run `pip install -e .` to install the console scripts"
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "--prefill" in result.stdout and "--decode" in result.stdout


# --- what a new user ran into with the defaults, pipes and input files ---


def _usable_in_preference(*without: str) -> list[str]:
    usable = {t.name for t in available_transports() if t.usable} - set(without)
    ranked = [n for n in cli.demo.TRANSPORT_PREFERENCE if n in usable]
    return ranked + sorted(usable - set(ranked))


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_demo_defaults_hold_the_default_request_of_every_shape(name):
    from kvbridge.demo import CACHE_COPIES, cache_bytes, pool_blocks

    args = cli.build_parser().parse_args(["demo", "--shape", name])
    held = CACHE_COPIES * cache_bytes(name, pool_blocks(name, 8192))
    available = cli.demo._available_memory()
    if available is not None and held > available:
        with pytest.raises(cli.CliError, match="of memory is available; lower --layers"):
            cli.demo._check_demo_request(args)
        return
    # 32 blocks were the default: "--prompt-tokens 8192 needs more blocks than --num-blocks 32
    # holds" for every shape but the hybrid
    cli.demo._check_demo_request(args)
    assert args.num_blocks == pool_blocks(name, 8192)
    assert held < 9 * 2**30  # the largest, llama3-70b-dense: 3 copies of a 2.8 GiB cache


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_demo_sizes_its_pool_and_says_what_the_boundary_is_for_every_shape(name):
    # No --num-blocks: 32 were too few for 1,024 tokens but for the hybrid's 544-token blocks.
    result = _run("demo", "--shape", name, "--layers", "4", "--prompt-tokens", "1024")
    assert result.returncode == 0, result.stderr
    out = " ".join(result.stdout.split())  # tables are as wide as their cells, text one line
    assert "every byte of the decode cache checked" in out
    if SHAPES[name].is_hybrid:
        assert "remote prefill tokens: 1,023 of the 1,024-token prompt (N-1: the model has " in out
    else:  # "(N-1 for a model with recurrent state)" was printed for every model
        assert "remote prefill tokens: 1,024, the whole 1,024-token prompt" in out
        assert "N-1" not in out
    assert "…" not in result.stdout


@pytest.mark.timeout(120)
def test_demo_defaults_to_the_first_usable_transport():
    fallback = _usable_in_preference("mooncake")
    if not fallback:
        pytest.skip("no transport but mooncake is usable here")
    # mooncake, the hard-coded default, cannot be imported: the next one in order runs
    result = _run_without_mooncake("demo", "--layers", "4", "--prompt-tokens", "600", "--json")
    assert result.returncode == 0, result.stderr
    (run,) = json.loads(result.stdout)
    assert run["transport"] == fallback[0]
    help_text = " ".join(_run("demo", "--help").stdout.split())
    assert "default: the first usable of mooncake, nixl, cma" in help_text


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["demo", "--timeout", "-1"], ["--timeout", "above 0, got -1", "kvbridge demo --help"]),
        (["demo", "--timeout", "0"], ["--timeout", "above 0"]),
        (["demo", "--timeout", "nan"], ["--timeout", "above 0"]),
        (["demo", "--shape", "deepseek-mla", "--layers", "96"], ["--layers 96", "61 layers", "at most 61"]),
        (["demo", "--layers", "100000"], ["--layers 100000", "48 layers", "at most 48"]),
        (["demo", "--prompt-tokens", "100000000"], ["--prompt-tokens 100,000,000", "at most"]),
        (["demo", "--prompt-tokens", "0"], ["--prompt-tokens", "at least 1"]),
        (["demo", "--num-blocks", "-3"], ["--num-blocks", "at least 1"]),
        (["demo", "--shape", "llama3-70b-dense", "--num-blocks", "100000000"], ["of memory is available", "lower --num-blocks"]),
        (["demo", "--num-blocks", "2"], ["--num-blocks 2", "leave --num-blocks out"]),
        (["check", "tcp://127.0.0.1:9", "--timeout", "-1"], ["--timeout", "above 0"]),
        (["bench", "transfer", "--timeout", "0"], ["--timeout", "above 0"]),
        (["bench", "planning", "--layers", "62", "--shapes", "deepseek-mla"], ["--layers 62", "61 layers"]),
    ],
)  # fmt: skip
def test_impossible_requests_are_refused_in_one_line(args, words):
    # --timeout -1 started both processes, then failed; --layers 96 built 96 layers of a
    # 61-layer model; --layers 100000 waited for the timeout.
    result = _run(*args)
    _assert_one_line_usage_error(result, *words)


def test_transports_imports_no_torch():
    # `import nixl` asked torch for the CUDA version: 3.5-6.6 s for `kvbridge transports`.
    code = (
        "import json, sys; from kvbridge.cli import main; main(['transports', '--json']); "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    listing, torch_modules = result.stdout.rsplit("\n[", 1)
    assert json.loads("[" + torch_modules) == []
    nixl = [t for t in json.loads(listing) if t["name"] == "nixl"]
    if nixl and importlib.util.find_spec("nixl") is not None:
        assert nixl[0]["usable"], nixl[0]["reason"]  # the engine was probed, not skipped


@pytest.mark.parametrize(
    "args",
    [["plan", *example("llama3-70b-dense"), "--json"], ["plan", *example("llama3-70b-dense")], ["transports"]],
)  # fmt: skip
def test_a_reader_that_goes_away_ends_the_command_quietly(args):
    # `kvbridge plan ... --json | head -1` ended in a BrokenPipeError traceback
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbridge.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    proc.stdout.close()  # the reader is gone before the command writes anything
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 141, err  # 128 + SIGPIPE, as a tool the signal ends
    assert err == ""


def test_piped_tables_cut_no_cell():
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    code = NO_MOONCAKE.format(args=["transports"])
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert result.returncode == 0, result.stderr
    # at 80 columns the reason was wrapped over lines and names were cut to "…"
    assert "…" not in result.stdout
    assert "pip install 'kvbridge[mooncake]'" in result.stdout
    assert max(len(line) for line in result.stdout.splitlines()) > 80


def test_plan_uses_prompt_tokens_for_the_boundary(capsys):
    assert main(["plan", *example("qwen3.5-hybrid"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["prompt_tokens"] == 4096 and doc["remote_prefill_tokens"] == 4095
    assert main(["plan", *example("deepseek-mla")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "remote prefill tokens: 4,096, the whole 4,096-token prompt" in out


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda b, layout: b.update(prompt_tokens=8000), "prefill group 0 holds 256 block ids, but prompt_tokens 8,000 (decode loads all) takes 500 blocks"),
        (lambda b, layout: b.update(prompt_tokens=0), "prompt_tokens must be at least 1"),
        (lambda b, layout: b.update(tokens=4096), "unknown field `tokens`"),
        (lambda b, layout: layout.update(page_size=4096), "unknown field `page_size`"),
        (lambda b, layout: layout["groups"][0].update(bogus=1), "unknown field `bogus` - at `$.groups[0]`"),
    ],
)  # fmt: skip
def test_plan_refuses_what_it_would_ignore_in_its_files(tmp_path, edit, message):
    prefill, decode, blocks_path = (Path(f) for f in example("deepseek-mla"))
    blocks = json.loads(blocks_path.read_text())
    layout = json.loads(decode.read_text())
    edit(blocks, layout)
    (tmp_path / "blocks.json").write_text(json.dumps(blocks))
    (tmp_path / "decode.json").write_text(json.dumps(layout))
    result = _run(
        "plan", str(prefill), str(tmp_path / "decode.json"), str(tmp_path / "blocks.json")
    )
    _assert_one_line_usage_error(result, message)
