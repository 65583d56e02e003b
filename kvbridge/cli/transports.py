"""``kvbridge transports``: the installed transports and whether each is usable."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvbridge.core.registry import available_transports


def run(args: argparse.Namespace, console: Console) -> int:
    infos = available_transports()
    if args.json:
        print(json.dumps([info.__dict__ for info in infos], indent=1))
        return 0
    table = Table(title="kvbridge transports (entry-point group kvbridge.transports)")
    for column in ("name", "package", "usable", "why not"):
        table.add_column(column)
    for info in infos:
        # Plugin names, packages and engine messages are text, not rich markup: an install hint
        # such as `pip install 'kvbridge[mooncake]'` must print as written.
        table.add_row(
            escape(info.name),
            escape(info.package),
            "yes" if info.usable else "no",
            escape(info.reason),
        )
    console.print(table if infos else "no transport is installed")
    return 0


def add_parser(sub: Any) -> None:
    """Add this command to the ``kvbridge`` parser's subcommands."""
    p = sub.add_parser("transports", help="list installed transports and whether they are usable")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)
