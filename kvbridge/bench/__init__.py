"""``kvbridge bench``: planning cost and transfer throughput, with a table or JSON at the end.

``kvbridge bench planning`` times planning one request per model shape, request size and
block-id pattern; ``kvbridge bench transfer`` moves a request between two processes through
every usable transport, beside the raw engine call and memcpy; ``kvbridge bench`` runs both.
Both go through kvbridge's own API only.

Planning beside vLLM's own Mooncake connector code (on the same vLLM-allocated caches and block
ids, per vLLM KV layout) builds vLLM's private worker by hand, so it is a script of the source
tree, not a subcommand: ``python benchmarks/vllm_planning.py --help`` (needs vLLM; see the README).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import kvbridge
from kvbridge.bench.cases import CASES, PATTERN_HELP, PATTERNS
from kvbridge.bench.report import grids, targets
from kvbridge.cli_errors import CliError
from kvbridge.core.registry import available_transports

DEFAULT_TOKENS = (1024, 8192, 32768, 131072)


class BenchUsageError(ValueError):
    """Options that cannot run (an unknown shape, an unusable transport)."""


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``bench`` on the ``kvbridge`` command's subparsers."""
    p: argparse.ArgumentParser = sub.add_parser(
        "bench",
        help="benchmark planning and transfers (progress bar, table or --json at the end)",
        description=(__doc__ or "").replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "what",
        nargs="?",
        choices=["all", "planning", "transfer"],
        default="all",
        help="which benchmark to run (default: all = planning and transfer; beside vLLM's own "
        "planning code: python benchmarks/vllm_planning.py in a source tree)",
    )
    p.add_argument(
        "--shapes",
        nargs="+",
        default=None,
        metavar="SHAPE",
        help=f"model shapes (default: all): {', '.join(CASES)}",
    )
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        metavar="N",
        help="keep only the first N layers of each model (quicker, smaller runs)",
    )
    _add_planning_options(p.add_argument_group("planning"))
    _add_transfer_options(p.add_argument_group("transfer"))
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the results as JSON, no tables")
    out.add_argument("--output", type=Path, default=None, help="also write the JSON to a file")
    out.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    p.set_defaults(func=cmd_bench)
    return p


def _add_planning_options(plan: Any) -> None:
    """The options of the planning benchmark."""
    plan.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=list(DEFAULT_TOKENS),
        metavar="N",
        help="prompt lengths to plan (default: 1k 8k 32k 128k)",
    )
    plan.add_argument(
        "--patterns",
        nargs="+",
        choices=list(PATTERNS),
        default=None,
        help=f"{PATTERN_HELP} (default: these three)",
    )
    plan.add_argument(
        "--plan-runs",
        type=int,
        default=7,
        metavar="N",
        help="timed runs per measurement, at least (default 7)",
    )
    plan.add_argument(
        "--plan-seconds",
        type=float,
        default=0.3,
        metavar="S",
        help="keep timing a measurement while S seconds last (default 0.3; at most 200 runs)",
    )
    plan.add_argument(
        "--reference-tokens",
        type=int,
        default=1024,
        metavar="N",
        help="time the slow reference planner on requests up to N tokens (default 1024; 0: never)",
    )


def _add_transfer_options(move: Any) -> None:
    """The options of the transfer benchmark."""
    move.add_argument(
        "--transports",
        nargs="+",
        default=None,
        metavar="NAME",
        help="transports to measure (default: every installed, usable one)",
    )
    move.add_argument(
        "--transfer-mib",
        type=float,
        default=256,
        metavar="MIB",
        help="size of the request moved, in MiB (default 256)",
    )
    move.add_argument(
        "--reps",
        type=int,
        default=8,
        metavar="N",
        help="timed repetitions of each way of moving it, after a verified warm-up (default 8)",
    )
    move.add_argument("--timeout", type=float, default=60.0, help="seconds for each step")


def machine_info() -> dict[str, Any]:
    """The machine a run measured (the results document's ``machine``)."""
    import numpy

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": numpy.__version__,
    }


def _transports(requested: Sequence[str] | None) -> tuple[list[str], list[dict[str, str]]]:
    """Transports to measure, and those installed but skipped with the reason."""
    infos = {info.name: info for info in available_transports()}
    if requested is None:
        usable = [name for name, info in infos.items() if info.usable]
        skipped = [{"name": n, "reason": i.reason} for n, i in infos.items() if not i.usable]
        return usable, skipped
    for name in requested:
        info = infos.get(name)
        if info is None:
            raise BenchUsageError(
                f"no transport named {name!r}; installed: {', '.join(infos) or 'none'}"
            )
        if not info.usable:
            raise BenchUsageError(f"transport {name!r} is not usable: {info.reason}")
    return list(requested), []


def _check(args: argparse.Namespace) -> None:
    """Validate the options, filling in the defaults that depend on the benchmark."""
    shapes, patterns = CASES, PATTERNS
    if args.shapes is None:
        args.shapes = list(shapes)
    if args.patterns is None:
        args.patterns = list(patterns)
    unknown = [s for s in args.shapes if s not in shapes]
    if unknown:
        raise BenchUsageError(f"unknown shape(s) {unknown}; choose from {', '.join(shapes)}")
    wrong = [p for p in args.patterns if p not in patterns]
    if wrong:
        raise BenchUsageError(
            f"pattern(s) {wrong} are not {args.what}'s; choose from {', '.join(patterns)}"
        )
    if any(t < 1 for t in args.tokens) or args.plan_runs < 1 or args.reps < 1:
        raise BenchUsageError("--tokens, --plan-runs and --reps must be positive")
    if args.plan_seconds < 0:
        raise BenchUsageError("--plan-seconds must not be negative")
    if args.layers is not None and args.layers < 1:
        raise BenchUsageError("--layers must be positive")
    if args.layers is not None:
        fewest = min(args.shapes, key=lambda s: shapes[s].shape.num_layers)
        most = shapes[fewest].shape.num_layers
        if args.layers > most:
            raise BenchUsageError(
                f"--layers {args.layers} is more than the {most} layers {fewest} has; pass at "
                f"most {most}, or leave --layers out for every model's own count"
            )
    if not (args.timeout > 0 and math.isfinite(args.timeout)):
        raise BenchUsageError(f"--timeout must be a number of seconds above 0, got {args.timeout}")
    if args.transfer_mib <= 0:
        raise BenchUsageError("--transfer-mib must be positive")


@contextmanager
def progress(total: int, enabled: bool) -> Iterator[Callable[[str], None]]:
    """A progress bar on stderr (stdout stays for the tables or JSON); ``advance(what)``."""
    console = Console(stderr=True)
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=not (enabled and console.is_terminal),
        transient=True,
    )
    task = bar.add_task("kvbridge bench", total=total)
    started = False

    def advance(what: str) -> None:
        nonlocal started
        if started:
            bar.advance(task)
        started = True
        bar.update(task, description=what)

    with bar:
        yield advance
        bar.update(task, completed=total)


def command_line(args: argparse.Namespace) -> str:
    """The command that repeats this run, every option spelled out."""
    words = ["kvbridge", "bench", args.what, "--shapes", *args.shapes]
    if args.layers is not None:
        words += ["--layers", str(args.layers)]
    if args.what in ("all", "planning"):
        words += ["--tokens", *map(str, args.tokens), "--patterns", *args.patterns]
        words += ["--plan-runs", str(args.plan_runs), "--plan-seconds", f"{args.plan_seconds:g}"]
        words += ["--reference-tokens", str(args.reference_tokens)]
    if args.what in ("all", "transfer"):
        if args.transports is not None:
            words += ["--transports", *args.transports]
        words += ["--transfer-mib", f"{args.transfer_mib:g}", "--reps", str(args.reps)]
    return shlex.join(words)


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run what ``args`` asks for; the results document (what ``--json`` prints)."""
    from kvbridge.bench.planning import run_planning
    from kvbridge.bench.transfer import TransferSettings, run_transfer, transfer_steps

    _check(args)
    doc: dict[str, Any] = {
        "kvbridge": kvbridge.__version__,
        "command": command_line(args),
        "machine": machine_info(),
        "planning": None,
        "transfer": None,
    }
    total = 0
    if args.what in ("all", "planning"):
        total += len(args.shapes) * len(args.tokens) * len(args.patterns)
    settings = None
    if args.what in ("all", "transfer"):
        names, skipped = _transports(args.transports)
        doc["skipped_transports"] = skipped
        settings = TransferSettings(
            transports=names,
            cases=list(args.shapes),
            target_mib=args.transfer_mib,
            reps=args.reps,
            num_layers=args.layers,
            timeout=args.timeout,
        )
        total += transfer_steps(settings)
    with progress(total, enabled=True) as advance:
        if args.what in ("all", "planning"):
            doc["planning"] = run_planning(
                args.shapes,
                args.tokens,
                args.patterns,
                num_layers=args.layers,
                min_runs=args.plan_runs,
                budget_s=args.plan_seconds,
                reference_tokens=args.reference_tokens,
                advance=advance,
            )
        if settings is not None:
            doc["transfer"] = run_transfer(settings, advance)
    return doc


def print_results(doc: dict[str, Any], console: Console, markdown: bool = False) -> None:
    """The tables and the targets, as rich tables or as Markdown."""
    for grid in grids(doc):
        if markdown:
            print(grid.markdown() + "\n")
        else:
            console.print(grid.rich())
    lines = targets(doc)
    if markdown:
        print("\n".join(f"- {line}" for line in lines))
    elif lines:
        console.print("\n".join(lines), soft_wrap=True)
    for s in doc.get("skipped_transports") or []:
        console.print(f"skipped transport {s['name']}: {s['reason']}", soft_wrap=True)


def cmd_bench(args: argparse.Namespace, console: Console) -> int:
    """The ``kvbridge bench`` command."""
    from kvbridge.bench.transfer import BenchError

    try:
        doc = run_bench(args)
    except (BenchUsageError, BenchError) as err:
        raise CliError(str(err)) from None
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(doc, indent=1) + "\n")
    if args.json:
        print(json.dumps(doc))
    else:
        print_results(doc, console, markdown=args.markdown)
    return 0
