"""vllm-router's ``--kv-connector mooncake`` mode, served by kvbridge's concurrent dispatch.

In that mode vllm-router (the mode vLLM's MooncakeConnector uses) asks each prefill's bootstrap
server ``GET http://<P host>:<bootstrap port>/query`` once at start for P's engine id per
data-parallel rank, then gives every request one transfer id of its own (``xfer-<uuid4>``) and
sends it to P and then to D (vllm-router 0.1.17 sends D the request once P answered; D's
parameters do not depend on P's answer, so a router may as well send both at once):

- to P: ``{"do_remote_decode": true, "do_remote_prefill": false, "transfer_id": X}``;
- to D: ``{"do_remote_prefill": true, "transfer_id": X, "remote_bootstrap_addr":
  "http://<P host>:<port>", "remote_engine_id": E}``.

kvbridge serves it as its own concurrent dispatch (``kvbridge.router.dispatch``):

- P answers ``/query`` (``BootstrapServer``, started when the connector option
  ``bootstrap_port`` is set) with ``{"0": {"engine_id": E, "kvbridge": <P's address>}}``: its
  side channel, TP ranks, transport and configured mode, as P's answers name them
  (``prefill_address``);
- P publishes the request under the router's transfer id and streams its layers;
- D looks P's address up at the bootstrap address the router names (``BootstrapLookups``: once
  per address, off the scheduler's thread; the request waits meanwhile) and asks P for the
  layer-wise transfer in P's mode, as if kvbridge's proxy had dispatched it. D's request reaches
  P while P computes the prompt only when the router sends both at once; after P's answer, P
  answers it with the published request and D reads it whole, as a whole-request pull.

The router makes no capability token, so the transfer id is the token: it is a random UUID only
the router, P and D see (the side channel's secret still authenticates P and D to each other).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger("kvbridge.vllm")

#: What P's ``/query`` answer keeps kvbridge's address under, beside the router's ``engine_id``.
ADDRESS_KEY = "kvbridge"
#: Seconds D waits for a bootstrap answer; a failed lookup is tried again after ``RETRY_S``.
LOOKUP_TIMEOUT_S = 5.0
RETRY_S = 10.0


def query_answer(engine_id: str, address: Mapping[str, Any]) -> dict[str, Any]:
    """P's ``/query`` answer: one data-parallel rank, ``0``."""
    return {"0": {"engine_id": engine_id, ADDRESS_KEY: dict(address)}}


class BootstrapServer:
    """P's bootstrap ``/query`` over HTTP, in a daemon thread, until ``close``."""

    def __init__(self, host: str, port: int, answer: Mapping[str, Any]) -> None:
        body = json.dumps(answer).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if urlsplit(self.path).path != "/query":
                    self.send_error(404, "kvbridge's bootstrap answers GET /query only")
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("kvbridge bootstrap: " + format, *args)

        try:
            self._server = ThreadingHTTPServer((host, port), Handler)
        except OSError as err:
            raise ValueError(
                f"kvbridge option bootstrap_port={port}: cannot listen on {host}:{port} "
                f"({err.strerror or err}); choose a free port"
            ) from None
        self._server.daemon_threads = True
        self.address = f"http://{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="kvbridge-bootstrap", daemon=True
        )
        self._thread.start()
        log.info("kvbridge: bootstrap /query for vllm-router's mooncake mode at %s", self.address)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class BootstrapError(Exception):
    """A bootstrap address that gave no kvbridge address (said in one line)."""


class BootstrapLookups:
    """D: P's address behind each bootstrap address the router names, looked up once per
    address in a thread of its own, so that the scheduler never waits on the network."""

    def __init__(self, timeout: float = LOOKUP_TIMEOUT_S, retry: float = RETRY_S) -> None:
        self._timeout, self._retry = timeout, retry
        self._lock = threading.Lock()
        self._found: dict[str, dict[str, Any]] = {}
        self._failed: dict[str, tuple[float, str]] = {}
        self._running: set[str] = set()

    def get(self, addr: str, engine_id: str | None = None) -> dict[str, Any] | None:
        """P's address (``prefill_address``'s form) behind ``addr``, or None while the lookup
        runs. Raises ``BootstrapError`` when the last lookup failed (tried again after
        ``retry`` seconds) or ``addr`` is no ``http://host:port``."""
        try:
            parts = urlsplit(addr)
            port = parts.port  # raises for a port out of range or not a number
        except ValueError:
            port = None
        if port is None or parts.scheme != "http" or not parts.hostname:
            raise BootstrapError(f"remote_bootstrap_addr {addr!r} is not http://host:port")
        with self._lock:
            found = self._found.get(addr)
            if found is not None:
                return found
            failed = self._failed.get(addr)
            if failed is not None and time.monotonic() < failed[0] + self._retry:
                raise BootstrapError(failed[1])
            if addr not in self._running:
                self._running.add(addr)
                threading.Thread(target=self._look_up, args=(addr, engine_id), daemon=True).start()
        return None

    def _look_up(self, addr: str, engine_id: str | None) -> None:
        try:
            found, failure = self._fetch(addr, engine_id), ""
        except BootstrapError as err:
            found, failure = None, str(err)
        except Exception as err:  # whatever the answer held: the lookup ends, never hangs
            found, failure = None, f"bootstrap {addr}: {type(err).__name__}: {err}"
        with self._lock:
            self._running.discard(addr)
            if found is not None:
                self._found[addr] = found
                self._failed.pop(addr, None)
            else:
                self._failed[addr] = (time.monotonic(), failure)
        if failure:
            log.error("kvbridge: %s", failure)

    def _fetch(self, addr: str, engine_id: str | None) -> dict[str, Any]:
        url = addr.rstrip("/") + "/query"
        try:
            with urllib.request.urlopen(url, timeout=self._timeout) as reply:
                data = json.loads(reply.read(1 << 20))
        except (OSError, ValueError, urllib.error.URLError) as err:
            raise BootstrapError(f"bootstrap {url}: {err}; decode computes such prompts") from None
        ranks = data if isinstance(data, Mapping) else {}
        for entry in ranks.values():
            address = entry.get(ADDRESS_KEY) if isinstance(entry, Mapping) else None
            if not isinstance(address, Mapping):
                continue
            if engine_id is None or entry.get("engine_id") == engine_id:
                return dict(address)
        raise BootstrapError(
            f"bootstrap {url} names no kvbridge prefill"
            + (f" with engine id {engine_id!r}" if engine_id else "")
            + " (is P's connector kvbridge, with option bootstrap_port?); decode computes "
            "such prompts itself"
        )
