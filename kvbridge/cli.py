"""The ``kvbridge`` command line: list transports, show what a request would move, check a
deployment (``kvbridge check``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvbridge.bench import add_parser as add_bench_parser
from kvbridge.cli_errors import CliError
from kvbridge.core.errors import KvbridgeError, TransportNotFoundError, TransportUnavailableError
from kvbridge.core.layout import Layout
from kvbridge.core.planning import TransferPlan, plan_transfers
from kvbridge.core.registry import available_transports, load_transport_class
from kvbridge.core.transport import TransferOp
from kvbridge.core.transpose import received_transposes
from kvbridge.workloads.shapes import SHAPES


def _version() -> str:
    """The installed distribution's version (the package's own when run from a bare tree)."""
    from importlib import metadata

    try:
        return metadata.version("kvbridge")
    except metadata.PackageNotFoundError:
        import kvbridge

        return str(getattr(kvbridge, "__version__", "unknown"))


def _read_json(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise CliError(f"cannot read {what} {str(path)!r}: {err.strerror}") from None


def _read_layout(path: Path, what: str) -> Layout:
    try:
        return Layout.from_json(_read_json(path, what))
    except KvbridgeError as err:
        raise CliError(f"{what} {str(path)!r}: {err}") from None


class RequestBlocks(msgspec.Struct, forbid_unknown_fields=True):
    """The block-id file of ``kvbridge plan``: logical ids per group index, for each side."""

    prefill: dict[int, list[int]]
    decode: dict[int, list[int]]
    prompt_tokens: int | None = None


def _read_blocks(path: Path) -> RequestBlocks:
    try:
        return msgspec.json.decode(_read_json(path, "block-id file"), type=RequestBlocks)
    except (msgspec.ValidationError, msgspec.DecodeError) as err:
        raise CliError(f"block-id file {str(path)!r}: {err}") from None


def cmd_transports(args: argparse.Namespace, console: Console) -> int:
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


def _plan_table(plan: TransferPlan, title: str) -> Table:
    table = Table(title=title)
    for column in ("group", "kind", "regions", "blocks", "descriptors", "bytes"):
        table.add_column(column, justify="right")
    for g in plan.groups:
        table.add_row(
            str(g.group_index),
            g.kind.value,
            str(g.regions),
            str(g.blocks),
            str(g.descriptors),
            f"{g.nbytes:,}",
        )
    table.add_section()
    table.add_row(
        "all",
        "",
        str(sum(g.regions for g in plan.groups)),
        "",
        str(plan.unmerged),
        f"{plan.nbytes:,}",
    )
    return table


def _plan_summary(plan: TransferPlan, elapsed: float) -> str:
    return (
        f"descriptors: {plan.unmerged} before merging, {plan.count} after; "
        f"{plan.nbytes:,} bytes; planned in {elapsed * 1e3:.2f} ms"
    )


def cmd_plan(args: argparse.Namespace, console: Console) -> int:
    prefill = _read_layout(args.prefill, "prefill layout")
    decode = _read_layout(args.decode, "decode layout")
    blocks = _read_blocks(args.blocks)
    op = TransferOp(args.op)
    try:
        plan = plan_transfers(
            prefill, decode, blocks.prefill, blocks.decode, merge=not args.no_merge
        )
    except KvbridgeError as err:
        raise CliError(str(err)) from None
    # Time a second, warm call: the first pays for numpy's lazy imports.
    start = time.perf_counter()
    plan_transfers(prefill, decode, blocks.prefill, blocks.decode, merge=not args.no_merge)
    elapsed = time.perf_counter() - start
    transposes = received_transposes(prefill, decode, blocks.prefill, blocks.decode)
    if args.json:
        local, remote, lengths = plan.local_remote(op)
        doc: dict[str, Any] = {
            "op": op.value,
            "submitter": "decode" if op is TransferOp.READ else "prefill",
            "descriptors_before_merge": plan.unmerged,
            "descriptors": plan.count,
            "bytes": plan.nbytes,
            "groups": [{**g.__dict__, "kind": g.kind.value} for g in plan.groups],
            # kernel blocks decode permutes after the transfer, per group (token- vs head-major)
            "transposed_on_receive": {
                str(t.group_index): int(t.kernel_block_ids.size) for t in transposes
            },
            "local": local.tolist(),
            "remote": remote.tolist(),
            "length": lengths.tolist(),
        }
        print(json.dumps(doc))
        return 0
    side = "decode reads from prefill" if op is TransferOp.READ else "prefill writes to decode"
    console.print(_plan_table(plan, f"transfer plan ({side})"))
    console.print(_plan_summary(plan, elapsed), soft_wrap=True)
    for t in transposes:
        order = "[N,H,C] into its heads" if t.to_head_major else "[H,N,C] into [N,H,C]"
        console.print(
            f"group {t.group_index}: decode transposes {t.kernel_block_ids.size} kernel blocks "
            f"after the transfer (prefill's {order})",
            soft_wrap=True,
        )
    return 0


def _demo_tables(results: list[Any], config: Any) -> list[Table]:
    first = results[0]
    groups = Table(
        title=f"request: {escape(config.shape)} KV cache, prompt {config.prompt_tokens:,} tokens"
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


def _usable_transports_hint() -> str:
    usable = [info.name for info in available_transports() if info.usable]
    return (
        f"usable transports here: {', '.join(usable) or 'none'}; pass one with --transport "
        "(or --transport all); `kvbridge transports` shows why others are not usable"
    )


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


def _check_demo_request(args: argparse.Namespace) -> None:
    """Refuse, before any process starts, a shape or request the demo cannot build."""
    import numpy as np

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
    try:
        spec = layout_spec(
            SHAPES[args.shape], args.num_blocks, bump_allocator(1 << 40), num_layers=args.layers
        )
        request_block_ids(Layout(spec), args.prompt_tokens, np.random.default_rng(0))
    except PoolExhaustedError:
        raise CliError(
            f"--prompt-tokens {args.prompt_tokens} needs more blocks than --num-blocks "
            f"{args.num_blocks} holds; raise --num-blocks or lower --prompt-tokens"
        ) from None
    except (KvbridgeError, ValueError) as err:
        raise CliError(f"demo request: {err}") from None


def cmd_demo(args: argparse.Namespace, console: Console) -> int:
    from kvbridge.control.plane import Mode
    from kvbridge.demo import DemoConfig, DemoError, run_demo

    _check_demo_request(args)
    if args.transport == "all":
        names = [info.name for info in available_transports() if info.usable]
        if not names:
            raise CliError("no usable transport is installed; see `kvbridge transports`")
    else:
        names = [args.transport]
        _check_demo_transport(args.transport)
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
        console.print(
            f"remote prefill tokens: {results[0].remote_prefill_tokens:,} "
            f"(N-1 for a model with recurrent state); every byte of the decode cache checked; "
            f"engine logs in {escape(log_dir)}",
            soft_wrap=True,
        )
    return 0


def cmd_check(args: argparse.Namespace, console: Console) -> int:
    from kvbridge.check import CheckConfig, as_json, read_secret, run_check

    try:
        secret = read_secret(args.secret_file, os.environ)
        options = json.loads(args.transport_options)
    except json.JSONDecodeError as err:
        raise CliError(f"--transport-options is not JSON: {err}") from None
    except ValueError as err:
        raise CliError(str(err)) from None
    if not isinstance(options, dict):
        raise CliError("--transport-options must be a JSON object")
    config = CheckConfig(
        peer=args.peer,
        secret=secret,
        local=args.local,
        role=args.role,
        timeout=args.timeout,
        transport_options=options,
        host=args.host,
        probe_bytes=args.probe_bytes,
    )
    utf8 = (getattr(sys.stdout, "encoding", "") or "").lower().replace("-", "") == "utf8"
    marks = {True: "✓", False: "✗", None: "-"} if utf8 else {True: "ok", False: "FAIL", None: "--"}
    width = max(len(m) for m in marks.values())

    def show(check: Any) -> None:
        if not args.json:
            print(f"{marks[check.ok]:{width}} {check.name:9}  {check.detail}", flush=True)

    start = time.monotonic()
    try:
        results = run_check(config, show)
    except ValueError as err:
        raise CliError(str(err)) from None
    seconds = time.monotonic() - start
    failed = next((r for r in results if r.ok is False), None)
    if args.json:
        print(json.dumps(as_json(config, results, seconds)))
    elif failed is not None:
        print(f"fix: {failed.fix}", flush=True)
    else:
        skipped = [r.name for r in results if r.ok is None]
        note = f" ({', '.join(skipped)} not checked)" if skipped else ""
        print(f"all checks passed in {seconds:.2f} s{note}", flush=True)
    return 0 if failed is None else 1


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvbridge", description="KV-cache transfer for prefill/decode disaggregation."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("transports", help="list installed transports and whether they are usable")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_transports)

    p = sub.add_parser("plan", help="show what a request would move between two layouts")
    p.add_argument("prefill", type=Path, help="prefill (source) layout JSON")
    p.add_argument("decode", type=Path, help="decode (destination) layout JSON")
    p.add_argument("blocks", type=Path, help="block ids JSON: {prefill: {group: [ids]}, decode: …}")
    p.add_argument(
        "--op",
        choices=[o.value for o in TransferOp],
        default="read",
        help="read: decode pulls (default); write: prefill pushes",
    )
    p.add_argument("--no-merge", action="store_true", help="do not merge adjacent descriptors")
    p.add_argument("--json", action="store_true", help="print the descriptors as JSON")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("demo", help="move a hybrid model's KV cache between two processes")
    p.add_argument("--transport", default="mooncake", help="transport name, or 'all'")
    p.add_argument(
        "--shape", default="qwen3.5-hybrid", help=f"model shape: {', '.join(sorted(SHAPES))}"
    )
    p.add_argument("--prompt-tokens", type=_positive_int, default=8192)
    p.add_argument("--num-blocks", type=_positive_int, default=32, help="blocks per cache tensor")
    p.add_argument(
        "--layers", type=_positive_int, default=None, help="keep only the first N layers"
    )
    p.add_argument(
        "--mode",
        choices=["pull", "push"],
        default="pull",
        help="pull: decode reads (default); push: prefill writes",
    )
    p.add_argument("--secret", default=None, help="shared secret both engines authenticate with")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds for each step")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser(
        "check",
        allow_abbrev=False,  # `--secret X` must not pass for `--secret-file X`
        help="preflight: can this host exchange KV caches with the engine at PEER?",
        description=(
            "Check, in a few seconds, that the engine whose side channel is PEER answers, "
            "accepts the secret, speaks this protocol, has a layout this host's engine can "
            "exchange blocks with (--local), and that its transport moves bytes both ways (a "
            "few KiB between scratch buffers, never the KV cache). One line per check; stops "
            "at the first failure with what to fix. Exit status 0: all passed, 1: a check "
            "failed, 2: bad arguments. The secret comes from --secret-file, else "
            "KVBRIDGE_SECRET_FILE or KVBRIDGE_SECRET (never from the command line)."
        ),
    )
    p.add_argument("peer", help="the peer engine's side channel, tcp://host:port")
    p.add_argument("--secret-file", default=None, help="file holding the shared secret")
    p.add_argument(
        "--local",
        default=None,
        metavar="tcp://host:port",
        help="side channel of this host's running engine: check its layout against the peer's",
    )
    p.add_argument(
        "--role",
        choices=["decode", "prefill"],
        default="decode",
        help="this host's role (default decode: the peer is a prefill engine)",
    )
    p.add_argument("--timeout", type=float, default=5.0, help="seconds for each step (5)")
    p.add_argument(
        "--transport-options",
        default="{}",
        metavar="JSON",
        help="options of this side's probe transport, as the engine's (KVB_TRANSPORT_OPTIONS)",
    )
    p.add_argument(
        "--host",
        default=None,
        help="address this host's probe transport announces (default: the one that reached "
        "the peer)",
    )
    p.add_argument(
        "--probe-bytes", type=_positive_int, default=4096, help="bytes the probe moves each way"
    )
    p.add_argument("--json", action="store_true", help="one JSON object, for scripts")
    p.set_defaults(func=cmd_check)

    add_bench_parser(sub)  # `kvbridge bench`: options and logic live in kvbridge/bench/
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    console = Console()
    try:
        return int(args.func(args, console))
    except CliError as err:
        print(f"kvbridge: error: {err}", file=sys.stderr)
        return 2
    except KvbridgeError as err:
        print(f"kvbridge: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
