"""``kvbridge deploy-scripts``: copy the launch scripts that ship in the package."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console

from kvbridge.cli_errors import CliError


def run(args: argparse.Namespace, console: Console) -> int:
    from kvbridge.deploy import copy_scripts

    try:
        copies = copy_scripts(args.dir)
    except FileExistsError as err:
        raise CliError(f"{err}; give an empty or new folder") from None
    except OSError as err:
        raise CliError(f"cannot copy the deploy scripts into {str(args.dir)!r}: {err}") from None
    names = " ".join(p.name for p in copies)
    print(
        f"copied {names} into {args.dir}; start with: MODEL=... {args.dir / 'one-host.sh'} --wait"
    )
    return 0


def add_parser(sub: Any) -> None:
    """Add this command to the ``kvbridge`` parser's subcommands."""
    p = sub.add_parser(
        "deploy-scripts",
        help="copy the launch scripts (one-host.sh, prefill.sh, decode.sh, ...) into a folder",
        description="Copy the launch scripts that ship in the package into DIR: one-host.sh "
        "(P, D and a router on one host), prefill.sh, decode.sh, router.sh, proxy.sh and "
        "common.sh. Every variable they read is in the header of each.",
    )
    p.add_argument("dir", type=Path, help="the folder to copy them into (made if missing)")
    p.set_defaults(func=run)
