"""``kvbridge-proxy``'s command line, checked whole before anything is bound or imported.

Every mistake stops the command with one line on stderr, ``kvbridge-proxy: <what was wrong>;
<what to do>``, and exit status 2, never a traceback: argparse's own errors (a missing
``--prefill``, ``--port abc``), a server that is not an ``http``/``https`` URL with a host and a
port in 1-65535, a port outside 1-65535, a log level that is not one of uvicorn's names, a
timeout that is not a finite number of seconds > 0, and (checked last, by binding it once and
letting go) a ``--host``/``--port`` this machine cannot listen on. Nothing here needs the
``proxy`` extra.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import socket
import sys
from collections.abc import Sequence
from typing import NoReturn
from urllib.parse import urlsplit

PROG = "kvbridge-proxy"
#: uvicorn's log levels (``--log-level``), which ``logging`` takes too (``trace``: uvicorn's 5).
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
TRACE = 5  # uvicorn.logging.TRACE_LOG_LEVEL
#: How requests reach P and D: P first, then D with P's answer (vLLM's convention); or both at
#: once, P streaming each layer to D as it is computed (``kvbridge.router.dispatch``).
DISPATCHES = ("sequential", "concurrent")


class ArgumentError(Exception):
    """One line saying what was wrong with the command line and what to do."""


def fail(message: str) -> NoReturn:
    """Print ``message`` as the command's one line of error and exit 2."""
    print(f"{PROG}: {message}", file=sys.stderr)
    raise SystemExit(2)


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line (no usage block) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        fail(f"{message}; see {PROG} --help")


def server_url(option: str, value: str) -> str:
    """``value`` of ``--prefill``/``--decode`` as the proxy uses it (no trailing ``/``), or
    ``ArgumentError`` naming what is wrong and the URL to write."""
    text = value.strip()
    if not text:
        raise ArgumentError(
            f"{option} is empty; write the server's URL, e.g. http://127.0.0.1:8100"
        )
    if "://" not in text:
        raise ArgumentError(f"{option} {value!r} is not a URL; write http://{text}")
    try:
        parts = urlsplit(text)
    except ValueError as err:  # "Invalid IPv6 URL": an unclosed [
        raise ArgumentError(
            f"{option} {value!r} is not a URL ({err}); write http://HOST:PORT, an IPv6 address "
            "in brackets: http://[::1]:8100"
        ) from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        rest = text.split("://", 1)[1]
        raise ArgumentError(
            f"{option} {value!r} has scheme {parts.scheme!r}; vLLM serves http or https: "
            f"write http://{rest}"
        )
    if not parts.hostname or any(c.isspace() for c in parts.hostname):
        raise ArgumentError(
            f"{option} {value!r} names no host; write {scheme}://HOST:PORT, e.g. "
            f"{scheme}://127.0.0.1:8100"
        )
    try:
        port = parts.port
    except ValueError:  # not a number, or outside 0-65535
        port = -1
    if port is not None and not 1 <= port <= 65535:
        given = parts.netloc.rsplit(":", 1)[-1]
        raise ArgumentError(
            f"{option} {value!r} has port {given!r}; a port is a number 1-65535, e.g. "
            f"{scheme}://{_host(parts.hostname)}:8100"
        )
    if parts.query or parts.fragment:
        root = f"{scheme}://{parts.netloc}{parts.path}"
        raise ArgumentError(f"{option} {value!r} has a query or fragment; write {root}")
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):  # the OpenAI base URL: the proxy adds /v1/... itself
        root = f"{scheme}://{parts.netloc}{path[:-3]}"
        raise ArgumentError(
            f"{option} {value!r} ends in /v1; give the server's root (the proxy adds "
            f"/v1/completions itself): write {root}"
        )
    return f"{scheme}://{parts.netloc}{path}"


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def port_number(option: str, value: str) -> int:
    """A port 1-65535, or ``ArgumentError``."""
    try:
        port = int(value.strip())
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise ArgumentError(f"{option} {value!r} is not a port; give a number 1-65535, e.g. 8000")
    return port


def seconds(option: str, value: str) -> float:
    """A finite number of seconds > 0, or ``ArgumentError``."""
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not (math.isfinite(number) and number > 0):
        raise ArgumentError(f"{option} {value!r} is not a time; give seconds > 0, e.g. 300")
    return number


def log_level(value: str) -> str:
    """One of ``LOG_LEVELS`` (any case), lower-cased as uvicorn takes it, or ``ArgumentError``."""
    level = value.strip().lower()
    if level not in LOG_LEVELS:
        raise ArgumentError(
            f"--log-level {value!r} is not a log level; give one of {', '.join(LOG_LEVELS)}"
        )
    return level


def dispatch(value: str) -> str:
    """One of ``DISPATCHES``, or ``ArgumentError``."""
    if value not in DISPATCHES:
        raise ArgumentError(
            f"--dispatch {value!r} is not a dispatch; give one of {', '.join(DISPATCHES)}"
        )
    return value


def host(value: str) -> str:
    """A host name or address to listen on (resolved later, when checked by binding)."""
    text = value.strip()
    if not text or any(c.isspace() for c in text) or "/" in text:
        raise ArgumentError(
            f"--host {value!r} is not a host; give an address of this machine, e.g. 127.0.0.1 "
            "or 0.0.0.0 (every interface)"
        )
    return text[1:-1] if text.startswith("[") and text.endswith("]") else text


def parser(description: str | None = None) -> argparse.ArgumentParser:
    """The command's parser; values stay text, ``checked`` checks them."""
    ap = _Parser(prog=PROG, description=description)
    ap.add_argument(
        "--prefill",
        action="append",
        required=True,
        metavar="URL",
        help="prefill server (kv_producer), e.g. http://127.0.0.1:8100; repeat for several",
    )
    ap.add_argument(
        "--decode",
        action="append",
        required=True,
        metavar="URL",
        help="decode server (kv_consumer), e.g. http://127.0.0.1:8200; repeat for several",
    )
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    ap.add_argument("--port", default="8000", help="port to listen on, 1-65535 (default 8000)")
    ap.add_argument(
        "--timeout", default="300", help="seconds each upstream read may take (default 300)"
    )
    ap.add_argument(
        "--connect-timeout", default="10", help="seconds to connect to a server (default 10)"
    )
    ap.add_argument(
        "--dispatch",
        default="sequential",
        help="sequential: P, then D with P's answer (default); concurrent: P and D at once, "
        "each layer moving to D as P computes it (layer-wise push or pull: P's mode option)",
    )
    ap.add_argument(
        "--log-level", default="info", help=f"one of {', '.join(LOG_LEVELS)} (default info)"
    )
    return ap


def checked(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with each value checked and converted; ``ArgumentError`` at the first bad one."""
    return argparse.Namespace(
        prefill=[server_url("--prefill", u) for u in args.prefill],
        decode=[server_url("--decode", u) for u in args.decode],
        host=host(args.host),
        port=port_number("--port", args.port),
        timeout=seconds("--timeout", args.timeout),
        connect_timeout=seconds("--connect-timeout", args.connect_timeout),
        dispatch=dispatch(args.dispatch),
        log_level=log_level(args.log_level),
    )


def parse(argv: Sequence[str] | None, description: str | None = None) -> argparse.Namespace:
    """The checked command line; a mistake exits 2 with one line (``fail``)."""
    try:
        return checked(parser(description).parse_args(argv))
    except ArgumentError as err:
        fail(str(err))


def check_listen(host_name: str, port: int) -> None:
    """Exit 2 with one line when this machine cannot listen on ``host_name``:``port`` (the name
    does not resolve, the address is not this machine's, the port is taken or privileged).

    Binds once and lets go (``SO_REUSEADDR``, as uvicorn binds), so uvicorn binds it next.
    """
    try:
        infos = socket.getaddrinfo(
            host_name, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as err:
        fail(
            f"--host {host_name!r} does not resolve ({err.strerror}); give an address of this "
            "machine, e.g. 127.0.0.1 or 0.0.0.0"
        )
    family, kind, proto, _, address = infos[0]
    try:
        with contextlib.closing(socket.socket(family, kind, proto)) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
    except OSError as err:
        fail(
            f"cannot listen on {_host(host_name)}:{port} ({err.strerror or err}); stop what "
            "listens there or choose another --port (or a --host of this machine)"
        )
