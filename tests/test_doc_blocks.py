"""The README's and the getting-started pages' command blocks, each run as a reader runs it.

What each block's ``<!-- check: KIND -->`` means is in ``tests/doc_blocks.py``; the served quick
start (``serve``) runs in ``tests/adapters/vllm/e2e/test_quickstart.py``. The README is also the
wheel's long description on a package index, so its links are absolute and must name files of
this tree.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvbridge.deploy import SCRIPTS
from tests.doc_blocks import KINDS, PAGES, ROOT, Block, all_blocks, of_kind, run_block

VENV_BIN = Path(sys.executable).parent
#: Where the README's absolute links point: this repository's files, and their raw bytes.
BASES = (
    "https://github.com/kvbridge/kvbridge/blob/main/",
    "https://github.com/kvbridge/kvbridge/tree/main/",
    "https://raw.githubusercontent.com/kvbridge/kvbridge/main/",
)
README_MAX_LINES = 150
#: Where the install lines take kvbridge from until it has a release on PyPI.
REPO_URL = "git+https://github.com/kvbridge/kvbridge"


def _ids(blocks: list[Block]) -> list[str]:
    return [block.where for block in blocks]


def _env(bin_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env.pop("VIRTUAL_ENV", None)
    env["NO_COLOR"] = "1"
    return env


def _run(block: Block, cwd: Path, env: dict[str, str], timeout: float) -> None:
    done = run_block(block, cwd, env, timeout)
    assert done.returncode == 0, (
        f"{block.where} failed ({done.returncode}):\n{block.text}\n"
        f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    )


def test_every_command_block_names_its_check() -> None:
    blocks = all_blocks()
    assert any(b.page.name == "README.md" for b in blocks), "the README shows no command"
    assert len(PAGES) > 1, "docs/getting-started/ has no page"
    unnamed = [f"{b.where} ({b.kind!r})" for b in blocks if b.kind not in KINDS]
    assert not unnamed, f"blocks without a known <!-- check: {'|'.join(KINDS)} -->: {unnamed}"
    assert of_kind("run") and of_kind("install") and of_kind("serve")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("block", of_kind("run"), ids=_ids(of_kind("run")))
def test_run_block(block: Block, tmp_path: Path) -> None:
    _run(block, tmp_path, _env(VENV_BIN), timeout=840)


@pytest.mark.parametrize("block", of_kind("make"), ids=_ids(of_kind("make")))
def test_make_block_names_real_targets(block: Block) -> None:
    for line in block.text.splitlines():
        command = line.split("#", 1)[0].strip()
        if not command:
            continue
        words = command.split()
        assert words[0] == "make", f"{block.where}: a make block holds only make lines: {line!r}"
        for target in words[1:]:
            dry = subprocess.run(
                ["make", "-n", "-C", str(ROOT), target], capture_output=True, text=True
            )
            assert dry.returncode == 0, f"{block.where}: make {target}: {dry.stderr.strip()}"


@pytest.mark.parametrize("block", of_kind("static"), ids=_ids(of_kind("static")))
def test_static_block_parses_and_names_real_scripts(block: Block) -> None:
    syntax = subprocess.run(["bash", "-n"], input=block.text, capture_output=True, text=True)
    assert syntax.returncode == 0, f"{block.where}: {syntax.stderr.strip()}"
    for name in re.findall(r"[\w./$-]*?([\w-]+\.sh)\b", block.text):
        assert name in SCRIPTS, f"{block.where}: no deploy script named {name!r}"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("block", of_kind("install"), ids=_ids(of_kind("install")))
def test_install_block_in_a_fresh_virtualenv(block: Block, tmp_path: Path) -> None:
    """The block as written, where the repository it installs kvbridge from is this checkout's
    wheel (no network but the package index here); then the CLI runs, and what it installed has
    no torch and no vLLM (the lean install the README promises)."""
    assert f"@ {REPO_URL}'" in block.text, f"{block.where}: kvbridge not installed from {REPO_URL}"
    wheels = tmp_path / "wheels"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = wheels.glob("kvbridge-*.whl")
    block = dataclasses.replace(block, text=block.text.replace(REPO_URL, wheel.as_uri()))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    env = _env(venv / "bin")
    shim = tmp_path / "shim"
    shim.mkdir()
    if os.geteuid() == 0 and shutil.which("sudo") is None:
        # root without sudo (containers, CI): `sudo cmd` is `cmd`
        (shim / "sudo").write_text('#!/bin/sh\nexec "$@"\n')
        (shim / "sudo").chmod(0o755)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{shim}{os.pathsep}{os.environ.get('PATH', '')}"
    _run(block, tmp_path, env, timeout=840)
    python = venv / "bin" / "python"
    listed = subprocess.run(
        [str(venv / "bin" / "kvbridge"), "transports", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert listed.returncode == 0, listed.stderr
    assert '"usable": true' in listed.stdout, listed.stdout
    copied = subprocess.run(
        [str(venv / "bin" / "kvbridge"), "deploy-scripts", str(tmp_path / "d")],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert copied.returncode == 0, copied.stderr
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == sorted(SCRIPTS)
    for heavy in ("torch", "vllm"):
        found = subprocess.run(
            [str(python), "-c", f"import importlib.util as u; print(u.find_spec({heavy!r}))"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert found.stdout.strip() == "None", f"the install pulled {heavy}: {found.stdout}"


def test_readme_fits_a_page_and_its_links_name_files_of_this_tree() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    links = re.findall(r"\]\(([^)\s]+)", text) + re.findall(r"src=\"([^\"]+)\"", text)
    assert links, "the README links nowhere"
    for link in links:
        assert link.startswith(("https://", "#")), f"README link {link!r} is not absolute"
        for base in BASES:
            if link.startswith(base):
                path = link[len(base) :].split("#", 1)[0]
                assert (ROOT / path).exists(), f"README link {link!r}: no {path} in the tree"
