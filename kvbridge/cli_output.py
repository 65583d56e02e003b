"""Where the ``kvbridge`` command's output goes: a console that cuts no cell when piped, and a
quiet exit when the reader of a pipe goes away (``kvbridge plan --json | head -1``)."""

from __future__ import annotations

import os
import sys

from rich.console import Console

#: Columns of the console when stdout is a pipe or a file: wide enough that no table cell is
#: cut to "…" (rich takes 80 columns otherwise); tables are only as wide as their cells.
PIPE_WIDTH = 10_000

#: Exit status when the reader of stdout went away: 128 + SIGPIPE, as a tool killed by the
#: signal reports it (``cat``, ``yes``), so ``set -o pipefail`` scripts see the same status.
BROKEN_PIPE_STATUS = 141


class _StdoutConsole(Console):
    def on_broken_pipe(self) -> None:
        # rich exits with status 1 here; the command's main gives every broken pipe one status
        self.quiet = True
        raise BrokenPipeError


def stdout_console() -> Console:
    """The console for stdout: the terminal's width, else ``COLUMNS`` when set, else wide."""
    console = _StdoutConsole()
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        console = _StdoutConsole(width=PIPE_WIDTH)
    return console


def quiet_broken_pipe() -> int:
    """After ``BrokenPipeError`` on stdout: point stdout at /dev/null so the interpreter's
    final flush does not fail again (the Python docs' recipe, ``signal`` module), and give the
    exit status."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)
    return BROKEN_PIPE_STATUS
