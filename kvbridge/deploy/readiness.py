"""Wait, with a bound, until servers answer ``/health`` 200 (what ``one-host.sh --wait`` runs),
and check, before anything starts, that the ports a deployment will listen on are free.

    python -m kvbridge.deploy.readiness --pid PID --timeout 900 http://127.0.0.1:8100/health ...
    python -m kvbridge.deploy.readiness --free PROXY_PORT=127.0.0.1:8000 ...

Exits 0 once every URL answered 200; 1 with one line naming what is not ready when ``--timeout``
seconds pass or process ``PID`` (the deployment) exits first. With ``--free``: 0 when each
``NAME=HOST:PORT`` can be listened on, else 1 with one line naming the first taken port and the
variable that sets it. Uses only the standard library: the scripts' interpreter needs nothing
more than kvbridge.
"""

from __future__ import annotations

import argparse
import errno
import os
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

#: Seconds between two rounds of health checks.
POLL_S = 1.0


def healthy(url: str, timeout: float = 5.0) -> bool:
    """Whether ``url`` answers 200 now (no proxy: these are the deployment's own servers)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as response:
            return int(response.status) == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_healthy(urls: Sequence[str], timeout: float, pid: int | None = None) -> str | None:
    """Poll until every URL answers 200; None then, else why not (one line)."""
    deadline = time.monotonic() + timeout
    waiting = list(urls)
    while True:
        waiting = [url for url in waiting if not healthy(url)]
        if not waiting:
            return None
        if pid is not None and not alive(pid):
            return f"the deployment exited before {', '.join(waiting)} answered 200"
        if time.monotonic() >= deadline:
            return f"{', '.join(waiting)} did not answer 200 within {timeout:g} s"
        time.sleep(POLL_S)


def port_taken(name: str, host: str, port: int) -> str | None:
    """Why a server could not listen on ``host:port`` now (one line naming ``name``, the
    variable that sets the port), or None when it could."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # As servers bind: a port only in TIME_WAIT is free to them.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            sock.listen(1)
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                why = "is taken (another process listens there)"
            elif err.errno == errno.EACCES:
                why = "needs privileges this user lacks"
            else:
                why = f"cannot be listened on ({err.strerror or err})"
            return f"{name}: port {port} on {host} {why}; free it or set {name} to another port"
    return None


def _free_ports(specs: Sequence[str]) -> str | None:
    """The first of ``NAME=HOST:PORT`` that is not free, said in one line; None if all are."""
    for spec in specs:
        name, _, where = spec.partition("=")
        host, _, port = where.rpartition(":")
        if not name or not host or not port.isdigit() or not 0 < int(port) < 65536:
            return f"--free {spec!r}: expected NAME=HOST:PORT with a port 1-65535"
        why = port_taken(name, host.strip("[]"), int(port))
        if why is not None:
            return why
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbridge.deploy.readiness")
    parser.add_argument("urls", nargs="*", help="health URLs, each must answer 200")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds (900)")
    parser.add_argument("--pid", type=int, default=None, help="stop waiting if it exits")
    parser.add_argument(
        "--free",
        nargs="+",
        metavar="NAME=HOST:PORT",
        help="check these ports can be listened on, instead of waiting",
    )
    args = parser.parse_args(argv)
    if args.free:
        taken = _free_ports(args.free)
        if taken is not None:
            print(taken, file=sys.stderr)
            return 1
        return 0
    if not args.urls:
        parser.error("give the health URLs to wait for (or --free NAME=HOST:PORT ...)")
    if args.timeout <= 0:
        parser.error(f"--timeout {args.timeout:g}: give a positive number of seconds")
    why = wait_healthy(args.urls, args.timeout, args.pid)
    if why is not None:
        print(f"not ready: {why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
