"""The ``kvbridge`` command line: list transports, show what a request would move, move one
(``demo``), check a deployment (``check``), copy the deploy scripts, benchmark (``bench``).

One module per command, each adding its own subcommand to the parser (``add_parser``) and
running it (``run``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from kvbridge.bench import add_parser as add_bench_parser
from kvbridge.cli import check, demo, deploy_scripts, plan, transports
from kvbridge.cli_errors import CliError
from kvbridge.cli_output import quiet_broken_pipe, stdout_console
from kvbridge.core.errors import KvbridgeError

__all__ = ["build_parser", "main"]


def _version() -> str:
    """The installed distribution's version (the package's own when run from a bare tree)."""
    from importlib import metadata

    try:
        return metadata.version("kvbridge")
    except metadata.PackageNotFoundError:
        import kvbridge

        return str(getattr(kvbridge, "__version__", "unknown"))


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line, as every other error of the command."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"kvbridge: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``kvbridge`` parser: each command's module adds its own subcommand."""
    parser = _Parser(
        prog="kvbridge", description="KV-cache transfer for prefill/decode disaggregation."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (transports, plan, demo, check, deploy_scripts):
        command.add_parser(sub)
    add_bench_parser(sub)  # `kvbridge bench`: options and logic live in kvbridge/bench/
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kvbridge`` with ``argv`` (the process's arguments when None); the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    console = stdout_console()
    try:
        status = int(args.func(args, console))
        sys.stdout.flush()  # here, so that a reader gone away is a BrokenPipeError caught below
        return status
    except BrokenPipeError:  # `kvbridge plan --json | head -1`: the reader has what it wanted
        return quiet_broken_pipe()
    except CliError as err:
        print(f"kvbridge: error: {err}", file=sys.stderr)
        return 2
    except KvbridgeError as err:
        print(f"kvbridge: error: {err}", file=sys.stderr)
        return 2
