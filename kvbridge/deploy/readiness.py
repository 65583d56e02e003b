"""Wait, with a bound, until servers answer ``/health`` 200 (what ``one-host.sh --wait`` runs),
and check, before anything starts, that the ports a deployment will listen on are free.

    python -m kvbridge.deploy.readiness --pid PID --timeout 900 http://127.0.0.1:8100/health ...
    python -m kvbridge.deploy.readiness --free PROXY_PORT=127.0.0.1:8000 ...

    python -m kvbridge.deploy.readiness --transfer http://127.0.0.1:8000 \
        --decode http://127.0.0.1:8200

Exits 0 once every URL answered 200; 1 with one line naming what is not ready when ``--timeout``
seconds pass or process ``PID`` (the deployment) exits first. With ``--free``: 0 when each
``NAME=HOST:PORT`` can be listened on, else 1 with one line naming the first taken port and the
variable that sets it. With ``--transfer``: one completion through the front (the router), then
0 when decode's ``/metrics`` counted a KV cache load from prefill for it, else 1 with one line
(a pair that answers ``/health`` may still recompute every request: P and D of different
models or block sizes). Uses only the standard library: the scripts' interpreter needs nothing
more than kvbridge.
"""

from __future__ import annotations

import argparse
import errno
import json
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


#: Decode's counters of kvbridge loads, as vLLM's Prometheus hook exports them.
LOADS = "vllm:kvbridge_transfers_total"
FAILED_LOADS = "vllm:kvbridge_transfer_failures_total"
#: of those, the loads refused because prefill and decode cannot pair
INCOMPATIBLE_LOADS = "vllm:kvbridge_incompatible_loads_total"
#: The probe's prompt: some tokens to move, whatever the tokenizer (a one-token prompt of a model
#: with recurrent state has none to load).
PROBE_PROMPT = "kvbridge readiness probe: " + "one request from prefill to decode. " * 8


def _open(url: str, body: dict[str, object] | None = None, timeout: float = 30.0) -> bytes:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"content-type": "application/json"})
    with opener.open(request, timeout=timeout) as response:
        return bytes(response.read(1 << 20))


def counter(metrics_text: str, name: str) -> float:
    """A Prometheus sample's value summed over its labels (0 when absent)."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _loads(decode: str) -> tuple[float, float, float]:
    text = _open(decode.rstrip("/") + "/metrics").decode()
    return counter(text, LOADS), counter(text, FAILED_LOADS), counter(text, INCOMPATIBLE_LOADS)


def transfer_works(front: str, decode: str, wait: float = 30.0) -> str | None:
    """One completion through ``front``; None once decode counted a load from prefill for it,
    else why not (one line). Decode's counters reach its ``/metrics`` once per engine step,
    hence the bounded wait."""
    front = front.rstrip("/")
    try:
        loads, failed, refused = _loads(decode)
        # the served model's name as decode's own vLLM says it (a router may not forward this)
        models = json.loads(_open(decode.rstrip("/") + "/v1/models"))
        model = models["data"][0]["id"]
        _open(
            front + "/v1/completions",
            {"model": model, "prompt": PROBE_PROMPT, "max_tokens": 1, "temperature": 0},
            timeout=max(wait, 30.0),
        )
    except (OSError, ValueError, KeyError, IndexError, TypeError) as err:
        return f"a completion through {front} failed: {err}"
    deadline = time.monotonic() + wait
    while True:
        now_loads, now_failed, now_refused = _loads(decode)
        if now_loads > loads:
            return None
        if now_refused > refused:
            return (
                f"a completion through {front} was answered, but prefill and decode cannot "
                "pair (different models, block sizes, KV layouts, transports or TP ranks: "
                f"{INCOMPATIBLE_LOADS}), so decode recomputes every prompt; decode's log names "
                "what differs"
            )
        if now_failed > failed:
            return (
                f"a completion through {front} was answered, but decode's load of its KV cache "
                "from prefill failed, so decode recomputes every prompt (decode's log says why: "
                "P and D of different models, block sizes or cache settings are refused)"
            )
        if time.monotonic() >= deadline:
            return (
                f"a completion through {front} was answered, but decode loaded nothing from "
                f"prefill within {wait:g} s (is the front a P/D router sending both P and D the "
                "request? decode's log may say why)"
            )
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
        "--transfer", metavar="FRONT_URL", help="send one completion through the front, then"
    )
    parser.add_argument(
        "--decode", metavar="DECODE_URL", help="... wait for decode's /metrics to count its load"
    )
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
    if args.transfer or args.decode:
        if not (args.transfer and args.decode):
            parser.error("--transfer FRONT_URL goes with --decode DECODE_URL")
        failed = transfer_works(args.transfer, args.decode)
        if failed is not None:
            print(f"not ready: {failed}", file=sys.stderr)
            return 1
        return 0
    if not args.urls:
        parser.error("give the health URLs to wait for (or --free, or --transfer)")
    if args.timeout <= 0:
        parser.error(f"--timeout {args.timeout:g}: give a positive number of seconds")
    why = wait_healthy(args.urls, args.timeout, args.pid)
    if why is not None:
        print(f"not ready: {why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
