"""The command blocks of the README and the getting-started pages, and how a test checks each.

Every fenced ``sh``/``bash``/``shell``/``console`` block in those pages is preceded by one line
``<!-- check: KIND -->``; KIND says which test runs it (``tests/test_doc_blocks.py``, and the
served quick start in ``tests/adapters/vllm/e2e/test_quickstart.py``):

- ``run``: run verbatim with ``bash -e`` in a fresh folder, this checkout's ``.venv/bin`` first
  on the PATH;
- ``install``: run verbatim in a fresh virtualenv where ``kvbridge`` resolves to a wheel built
  from this checkout;
- ``make``: ``make TARGET`` lines only; each target must exist;
- ``serve``: the one-host quick start, run verbatim against real vLLM engines (e2e);
- ``static``: what needs hosts this machine is not (GPUs, two real hosts): bash syntax, and every
  script it names exists.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("run", "install", "make", "serve", "static")
SHELLS = ("sh", "bash", "shell", "console")
#: The pages whose command blocks a newcomer runs first.
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs" / "getting-started").glob("*.md")))

_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
_CHECK = re.compile(r"<!--\s*check:\s*([\w-]+)\s*-->")


@dataclass(frozen=True)
class Block:
    """One fenced command block: where it is, how it is checked, its text."""

    page: Path
    line: int
    kind: str | None
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The shell blocks of ``page`` with the check named on the line before each."""
    lines = page.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        opened = _FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        indent, fence, lang = opened.groups()
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j])
            j += 1
        if lang.lower() in SHELLS:
            before = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
            tag = _CHECK.search(before)
            out.append(Block(page, i + 1, tag.group(1) if tag else None, "\n".join(body) + "\n"))
        i = j + 1
    return out


def all_blocks() -> list[Block]:
    """Every shell block of ``PAGES``."""
    return [block for page in PAGES for block in blocks(page)]


def of_kind(kind: str) -> list[Block]:
    """The blocks checked as ``kind``."""
    return [block for block in all_blocks() if block.kind == kind]


def run_block(
    block: Block, cwd: Path, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """Run ``block`` as a reader pastes it: ``bash -e`` (pipefail) in ``cwd``, output captured."""
    script = cwd / "block.sh"
    script.write_text(block.text)
    return subprocess.run(
        ["bash", "-e", "-o", "pipefail", str(script)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
