"""``kvbridge check``: preflight of a deployment against a peer engine."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from rich.console import Console

from kvbridge.cli.arguments import positive_int, positive_seconds
from kvbridge.cli_errors import CliError


def run(args: argparse.Namespace, console: Console) -> int:
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


def add_parser(sub: Any) -> None:
    """Add this command to the ``kvbridge`` parser's subcommands."""
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
        "--timeout", type=positive_seconds, default=5.0, help="seconds for each step (5)"
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
        "--probe-bytes", type=positive_int, default=4096, help="bytes the probe moves each way"
    )
    p.add_argument("--json", action="store_true", help="one JSON object, for scripts")
    p.set_defaults(func=run)
