"""``kvbridge demo``: a real P->D transfer of a model's KV cache between two processes."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvbridge.cli.arguments import positive_int, positive_seconds
from kvbridge.cli.plan import boundary_text
from kvbridge.cli_errors import CliError
from kvbridge.core.errors import KvbridgeError, TransportNotFoundError, TransportUnavailableError
from kvbridge.core.layout import Layout
from kvbridge.core.registry import TransportInfo, available_transports, load_transport_class
from kvbridge.workloads.shapes import SHAPES

#: The order ``kvbridge demo`` picks its default transport in: engines built for the job, then
#: the host-only fallback, then any other installed one by name.
TRANSPORT_PREFERENCE = ("mooncake", "nixl", "cma")
#: More prompt tokens than any shipped model's context: a typo, refused before sizing anything.
MAX_PROMPT_TOKENS = 1 << 21


def _demo_tables(results: list[Any], config: Any) -> list[Table]:
    from kvbridge.demo import cache_bytes

    first = results[0]
    pool = cache_bytes(config.shape, config.blocks, config.num_layers)
    groups = Table(
        title=f"request: {escape(config.shape)} KV cache, prompt {config.prompt_tokens:,} tokens; "
        f"each engine's cache {config.blocks:,} blocks per tensor, {_gib(pool)}"
    )
    for column in ("group", "kind", "regions", "blocks", "descriptors", "bytes"):
        groups.add_column(column, justify="right")
    for g in first.groups:
        groups.add_row(
            str(g["group_index"]),
            g["kind"],
            str(g["regions"]),
            str(g["blocks"]),
            f"{g['descriptors']:,}",
            f"{g['nbytes']:,}",
        )
    how = "decode reads from prefill" if first.mode == "pull" else "prefill writes to decode"
    transfer = Table(title=f"{how}: two processes on 127.0.0.1, control plane over zmq")
    transfer.add_column("")
    for r in results:
        transfer.add_column(escape(r.transport), justify="right")
    rows: list[tuple[str, Callable[[Any], str]]] = [
        ("descriptors before merging", lambda r: f"{r.descriptors_before:,}"),
        ("descriptors after merging", lambda r: f"{r.descriptors_after:,}"),
        ("bytes", lambda r: f"{r.nbytes:,}"),
        ("handshake (ms)", lambda r: f"{r.handshake_seconds * 1e3:.1f}"),
        ("plan (ms)", lambda r: f"{r.plan_seconds * 1e3:.2f}"),
        ("transfer (s)", lambda r: f"{r.transfer_seconds:.3f}"),
        ("throughput (GB/s)", lambda r: f"{r.gbps:.2f}"),
        ("decode bytes verified", lambda r: f"{r.verified_bytes:,}"),
        ("prefill blocks", lambda r: escape(r.prefill_outcome)),
    ]
    for label, cell in rows:
        transfer.add_row(label, *(cell(r) for r in results))
    return [groups, transfer]


def _preferred(names: list[str]) -> list[str]:
    rank = {name: i for i, name in enumerate(TRANSPORT_PREFERENCE)}
    return sorted(names, key=lambda n: (rank.get(n, len(rank)), n))


def _usable_names(infos: list[TransportInfo]) -> list[str]:
    return _preferred([info.name for info in infos if info.usable])


def _usable_transports_hint() -> str:
    usable = _usable_names(available_transports())
    return (
        f"usable transports here: {', '.join(usable) or 'none'}; pass one with --transport "
        "(or --transport all); `kvbridge transports` shows why others are not usable"
    )


def _demo_transports(choice: str | None) -> list[str]:
    """The transports the demo runs: ``--transport``'s, or the first usable one."""
    if choice is not None and choice != "all":
        _check_demo_transport(choice)
        return [choice]
    names = _usable_names(available_transports())
    if not names:
        raise CliError(
            "no usable transport is installed; `kvbridge transports` shows why, and "
            "pip install 'kvbridge[mooncake]' adds one"
        )
    return names if choice == "all" else names[:1]


def _check_demo_transport(name: str) -> None:
    """Refuse, before any process starts, a transport that is not installed or cannot run."""
    try:
        load_transport_class(name)
    except TransportNotFoundError:
        raise CliError(f"no transport named {name!r}; {_usable_transports_hint()}") from None
    except TransportUnavailableError as err:
        raise CliError(
            f"transport {name!r} cannot run here: {err}; {_usable_transports_hint()}"
        ) from None
    except KvbridgeError as err:
        raise CliError(f"transport {name!r}: {err}") from None


def _available_memory() -> int | None:
    """Bytes of memory available to new processes (``MemAvailable``), if the system says."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def _gib(nbytes: int) -> str:
    """A byte count in GiB, MiB or KiB, whichever reads best."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= size:
            return f"{nbytes / size:,.1f} {unit}"
    return f"{nbytes / 1024:,.0f} KiB"


def _check_demo_request(args: argparse.Namespace) -> Layout:
    """Refuse, before any process starts, a request the demo cannot build or hold; size the
    pool when ``--num-blocks`` is left out. The layout of one engine is returned."""
    import numpy as np

    from kvbridge.demo import CACHE_COPIES, cache_bytes, pool_blocks
    from kvbridge.workloads.layouts import PoolExhaustedError, request_block_ids
    from kvbridge.workloads.shapes import bump_allocator, layout_spec

    if args.secret is not None and not args.secret:
        raise CliError(
            "--secret is empty, which would turn authentication off; give a non-empty secret "
            "or leave --secret out (the demo's side channels are on this host only)"
        )
    if args.shape not in SHAPES:
        raise CliError(
            f"no model shape named {args.shape!r}; pass one of {', '.join(sorted(SHAPES))} "
            "with --shape"
        )
    shape = SHAPES[args.shape]
    if args.layers is not None and args.layers > shape.num_layers:
        raise CliError(
            f"--layers {args.layers} is more than the {shape.num_layers} layers {args.shape} "
            f"has; pass at most {shape.num_layers}, or leave --layers out for all of them"
        )
    if args.prompt_tokens > MAX_PROMPT_TOKENS:
        raise CliError(
            f"--prompt-tokens {args.prompt_tokens:,} is more than any model's context; pass at "
            f"most {MAX_PROMPT_TOKENS:,} (the default is 8192)"
        )
    sized = args.num_blocks is None
    if sized:
        args.num_blocks = pool_blocks(args.shape, args.prompt_tokens, args.layers)
    held = CACHE_COPIES * cache_bytes(args.shape, args.num_blocks, args.layers)
    available = _available_memory()
    if available is not None and held > available:
        cut = (
            "--layers or --prompt-tokens" if sized else "--num-blocks, --layers or --prompt-tokens"
        )
        raise CliError(
            f"the demo would hold {_gib(held)} ({CACHE_COPIES} copies of one engine's "
            f"{args.num_blocks:,}-block cache) but {_gib(available)} of memory is available; "
            f"lower {cut}"
        )
    try:
        spec = layout_spec(shape, args.num_blocks, bump_allocator(1 << 40), num_layers=args.layers)
        layout = Layout(spec)
        request_block_ids(layout, args.prompt_tokens, np.random.default_rng(0))
    except PoolExhaustedError:
        need = pool_blocks(args.shape, args.prompt_tokens, args.layers)
        raise CliError(
            f"--prompt-tokens {args.prompt_tokens} needs more blocks than --num-blocks "
            f"{args.num_blocks} holds; raise --num-blocks (to {need}, say), lower "
            "--prompt-tokens, or leave --num-blocks out to size the pool from the request"
        ) from None
    except (KvbridgeError, ValueError) as err:
        raise CliError(f"demo request: {err}") from None
    return layout


def run(args: argparse.Namespace, console: Console) -> int:
    from kvbridge.control.plane import Mode
    from kvbridge.demo import DemoConfig, DemoError, run_demo

    layout = _check_demo_request(args)
    names = _demo_transports(args.transport)
    results = []
    log_dir = tempfile.mkdtemp(prefix="kvbridge-demo-")
    for name in names:
        config = DemoConfig(
            transport=name,
            mode=Mode(args.mode),
            shape=args.shape,
            num_layers=args.layers,
            num_blocks=args.num_blocks,
            prompt_tokens=args.prompt_tokens,
            timeout=args.timeout,
            transport_options={"timeout": args.timeout},
            log_dir=os.path.join(log_dir, name),
            secret=args.secret,
        )
        os.makedirs(config.log_dir or log_dir, exist_ok=True)
        try:
            results.append(run_demo(config, progress=console.is_terminal))
        except DemoError as err:
            raise CliError(f"{name}: {err} (engine logs in {config.log_dir})") from None
    if args.json:
        print(json.dumps([{**r.__dict__, "gbps": r.gbps} for r in results]))
    else:
        for table in _demo_tables(results, config):
            console.print(table)
        boundary = boundary_text(
            args.prompt_tokens, results[0].remote_prefill_tokens, layout.has_state
        )
        console.print(
            f"{boundary}; every byte of the decode cache checked; engine logs in {escape(log_dir)}",
            soft_wrap=True,
        )
    return 0


def add_parser(sub: Any) -> None:
    """Add this command to the ``kvbridge`` parser's subcommands."""
    p = sub.add_parser("demo", help="move a hybrid model's KV cache between two processes")
    p.add_argument(
        "--transport",
        default=None,
        help="transport name, or 'all' (default: the first usable of "
        f"{', '.join(TRANSPORT_PREFERENCE)}, then any other installed one; see "
        "`kvbridge transports`)",
    )
    p.add_argument(
        "--shape", default="qwen3.5-hybrid", help=f"model shape: {', '.join(sorted(SHAPES))}"
    )
    p.add_argument(
        "--prompt-tokens", type=positive_int, default=8192, help="prompt length (default 8192)"
    )
    p.add_argument(
        "--num-blocks",
        type=positive_int,
        default=None,
        help="blocks per cache tensor (default: sized from the shape and prompt, an eighth spare)",
    )
    p.add_argument(
        "--layers",
        type=positive_int,
        default=None,
        help="keep only the first N layers (at most the model's)",
    )
    p.add_argument(
        "--mode",
        choices=["pull", "push"],
        default="pull",
        help="pull: decode reads (default); push: prefill writes",
    )
    p.add_argument("--secret", default=None, help="shared secret both engines authenticate with")
    p.add_argument(
        "--timeout", type=positive_seconds, default=60.0, help="seconds for each step (60)"
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)
