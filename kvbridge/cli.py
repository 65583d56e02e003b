"""The ``kvbridge`` command line: list transports, show what a request would move, check a
deployment (``kvbridge check``)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import msgspec
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvbridge.bench import add_parser as add_bench_parser
from kvbridge.cli_errors import CliError
from kvbridge.cli_output import quiet_broken_pipe, stdout_console
from kvbridge.core.boundary import blocks_for_tokens, remote_prefill_token_count
from kvbridge.core.errors import KvbridgeError, TransportNotFoundError, TransportUnavailableError
from kvbridge.core.groups import GroupKind
from kvbridge.core.layout import Layout
from kvbridge.core.planning import TransferPlan, plan_transfers
from kvbridge.core.registry import TransportInfo, available_transports, load_transport_class
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
    """The block-id file of ``kvbridge plan``: logical ids per group index, for each side.

    ``prompt_tokens``, when given, is checked against the ids: each group must hold the blocks
    the tokens decode loads take (N-1 of them with recurrent state, ``kvbridge.core.boundary``).
    """

    prefill: dict[int, list[int]]
    decode: dict[int, list[int]]
    prompt_tokens: int | None = None


def _read_blocks(path: Path) -> RequestBlocks:
    try:
        return msgspec.json.decode(_read_json(path, "block-id file"), type=RequestBlocks)
    except (msgspec.ValidationError, msgspec.DecodeError) as err:
        raise CliError(f"block-id file {str(path)!r}: {err}") from None


def _loaded_tokens(blocks: RequestBlocks, prefill: Layout, decode: Layout, path: Path) -> int:
    """The tokens decode loads for ``blocks.prompt_tokens``, once every group's ids on both
    sides are checked to hold just the blocks those tokens take."""
    prompt = blocks.prompt_tokens
    assert prompt is not None
    where = f"block-id file {str(path)!r}"
    if prompt < 1:
        raise CliError(f"{where}: prompt_tokens must be at least 1, got {prompt}")
    loaded = remote_prefill_token_count(prompt, prefill.has_state)
    why = f"decode loads N-1 = {loaded:,}" if prefill.has_state else "decode loads all"
    for side, layout, ids in (
        ("prefill", prefill, blocks.prefill),
        ("decode", decode, blocks.decode),
    ):
        for index, group in sorted(layout.groups.items()):
            if index not in ids:
                continue  # the planner names a missing group
            want = blocks_for_tokens(loaded, group.block_size)
            got = len(ids[index])
            if got != want and not (group.kind is GroupKind.STATE and want == 0 and got <= 1):
                raise CliError(
                    f"{where}: {side} group {index} holds {got} block ids, but prompt_tokens "
                    f"{prompt:,} ({why}) takes {want} blocks of {group.block_size} tokens; fix "
                    "the ids or prompt_tokens, or leave prompt_tokens out"
                )
    return loaded


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
    loaded = None
    if blocks.prompt_tokens is not None:
        loaded = _loaded_tokens(blocks, prefill, decode, args.blocks)
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
            "prompt_tokens": blocks.prompt_tokens,
            "remote_prefill_tokens": loaded,
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
    if blocks.prompt_tokens is not None and loaded is not None:
        boundary = _boundary_text(blocks.prompt_tokens, loaded, prefill.has_state)
        console.print(f"{boundary}; every group's block ids checked against it", soft_wrap=True)
    for t in transposes:
        order = "[N,H,C] into its heads" if t.to_head_major else "[H,N,C] into [N,H,C]"
        console.print(
            f"group {t.group_index}: decode transposes {t.kernel_block_ids.size} kernel blocks "
            f"after the transfer (prefill's {order})",
            soft_wrap=True,
        )
    return 0


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


#: The order ``kvbridge demo`` picks its default transport in: engines built for the job, then
#: the host-only fallback, then any other installed one by name.
TRANSPORT_PREFERENCE = ("mooncake", "nixl", "cma")
#: More prompt tokens than any shipped model's context: a typo, refused before sizing anything.
MAX_PROMPT_TOKENS = 1 << 21


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


def _boundary_text(prompt_tokens: int, loaded: int, has_state: bool) -> str:
    """What ``remote prefill tokens`` means for this model (``kvbridge.core.boundary``)."""
    if has_state:
        return (
            f"remote prefill tokens: {loaded:,} of the {prompt_tokens:,}-token prompt (N-1: the "
            "model has recurrent state, so decode computes the last prompt token itself)"
        )
    return (
        f"remote prefill tokens: {loaded:,}, the whole {prompt_tokens:,}-token prompt (the "
        "model has no recurrent state)"
    )


def cmd_demo(args: argparse.Namespace, console: Console) -> int:
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
        boundary = _boundary_text(
            args.prompt_tokens, results[0].remote_prefill_tokens, layout.has_state
        )
        console.print(
            f"{boundary}; every byte of the decode cache checked; engine logs in {escape(log_dir)}",
            soft_wrap=True,
        )
    return 0


def cmd_deploy_scripts(args: argparse.Namespace, console: Console) -> int:
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


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, got {text}")
    return value


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line, as every other error of the command."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"kvbridge: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
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
        "--prompt-tokens", type=_positive_int, default=8192, help="prompt length (default 8192)"
    )
    p.add_argument(
        "--num-blocks",
        type=_positive_int,
        default=None,
        help="blocks per cache tensor (default: sized from the shape and prompt, an eighth spare)",
    )
    p.add_argument(
        "--layers",
        type=_positive_int,
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
        "--timeout", type=_positive_seconds, default=60.0, help="seconds for each step (60)"
    )
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
    p.add_argument(
        "--timeout", type=_positive_seconds, default=5.0, help="seconds for each step (5)"
    )
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

    p = sub.add_parser(
        "deploy-scripts",
        help="copy the launch scripts (one-host.sh, prefill.sh, decode.sh, ...) into a folder",
        description="Copy the launch scripts that ship in the package into DIR: one-host.sh "
        "(P, D and a router on one host), prefill.sh, decode.sh, router.sh, proxy.sh and "
        "common.sh. Every variable they read is in the header of each.",
    )
    p.add_argument("dir", type=Path, help="the folder to copy them into (made if missing)")
    p.set_defaults(func=cmd_deploy_scripts)

    add_bench_parser(sub)  # `kvbridge bench`: options and logic live in kvbridge/bench/
    return parser


def main(argv: Sequence[str] | None = None) -> int:
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


if __name__ == "__main__":
    sys.exit(main())
