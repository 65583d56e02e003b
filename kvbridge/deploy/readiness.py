"""Wait, with a bound, until servers answer ``/health`` 200 (what ``one-host.sh --wait`` runs).

    python -m kvbridge.deploy.readiness --pid PID --timeout 900 http://127.0.0.1:8100/health ...

Exits 0 once every URL answered 200; 1 with one line naming what is not ready when ``--timeout``
seconds pass or process ``PID`` (the deployment) exits first. Uses only the standard library:
the scripts' interpreter needs nothing more than kvbridge.
"""

from __future__ import annotations

import argparse
import os
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbridge.deploy.readiness")
    parser.add_argument("urls", nargs="+", help="health URLs, each must answer 200")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds (900)")
    parser.add_argument("--pid", type=int, default=None, help="stop waiting if it exits")
    args = parser.parse_args(argv)
    if args.timeout <= 0:
        parser.error(f"--timeout {args.timeout:g}: give a positive number of seconds")
    why = wait_healthy(args.urls, args.timeout, args.pid)
    if why is not None:
        print(f"not ready: {why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
