"""A small prefill/decode proxy for ``vllm serve`` instances that use ``KVBridgeConnector``.

    python -m kvbridge.router --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --host 127.0.0.1 --port 8000

Clients talk to the proxy as to one OpenAI-compatible server. For ``POST /v1/completions`` and
``POST /v1/chat/completions`` it follows vLLM's P/D convention:

1. the request goes to a prefill server (``kv_role: kv_producer``) with ``max_tokens=1`` (and
   ``max_completion_tokens=1`` if given), ``stream=False`` and
   ``kv_transfer_params={"do_remote_decode": True}``;
2. the ``kv_transfer_params`` of P's JSON response (``do_remote_prefill: True``, where P holds
   the KV) go, with the client's original request, to a decode server (``kv_consumer``);
3. D's response goes back to the client, streamed through when the client asked ``stream=True``.

``GET /v1/models`` is forwarded to a decode server; ``GET /health`` answers 200 when every
server's ``/health`` does, 503 otherwise. Repeating ``--prefill``/``--decode`` spreads requests
round-robin. The client's ``Authorization`` and ``X-Request-Id`` headers go to both sides (one
id is made up when absent, so P's and D's logs can be matched).

Errors come back in OpenAI's shape (``{"error": {"message", "type", "code"}}``) and name the side
that failed: 502 when a server is unreachable, times out, answers 5xx or non-JSON, or P answers
without ``kv_transfer_params`` (no KV connector, or a ``kv_role`` that does not publish); a 4xx
from either server (a bad request) keeps its status. One prompt per request: vLLM returns the
params of the first prompt only, so batched prompts are refused (400). When D fails after P
prefilled, P frees the KV when its lease (connector option ``lease``) runs out.

Successful responses carry ``x-kvbridge-prefill-ms`` (P's round trip) and, when P reported them,
``x-kvbridge-remote-engine-id`` and ``x-kvbridge-remote-num-tokens``.

``--dispatch concurrent`` (``create_app(dispatch="concurrent")``) sends each request to P and D
at once, with one transfer id and token made here (``kvbridge.router.dispatch``): D asks
P for the request's KV while P computes it, and each layer moves as soon as it is computed:
P writes it into D's blocks (layer-wise push) or tells D, which reads it (layer-wise pull), in
the mode P's first answer named (P's ``mode`` option). D must know P's side channel: the first
request to each P goes the sequential way and P's answer names it; the rest go concurrently
(``x-kvbridge-dispatch`` says which). A P that fails a concurrent request costs D its
timeout, then D computes the prompt itself. The default, ``sequential``, is vLLM's convention above.

``GET /metrics`` answers Prometheus' text format (OpenMetrics when the scraper asks for it) from
a registry of the app's own (``app.state.metrics.registry``), for the two completions endpoints:
``kvbridge_proxy_requests_total`` by ``endpoint`` and ``outcome`` (one of ``OUTCOMES``),
``kvbridge_proxy_request_duration_seconds`` by ``endpoint`` (arrival to the response's end: a
stream's last chunk), ``kvbridge_proxy_prefill_duration_seconds`` (P's round trip, of the prefills
that returned params), ``kvbridge_proxy_decode_first_byte_seconds`` (for streamed answers, from
sending the request to D to D's first chunk), ``kvbridge_proxy_requests_in_flight``, and
``kvbridge_proxy_backend_errors_total`` by ``role``, ``backend`` (the server's URL) and ``kind``
(one of ``FAILURE_KINDS``); plus the process's own ``process_*`` and ``python_*`` metrics.

``main`` (``kvbridge-proxy``) checks its whole command line before it binds anything
(``kvbridge.router.arguments``): a server that is not an http(s) URL with a host and a
port in 1-65535, a port, timeout, dispatch or log level out of its range, or a host and port
this machine cannot listen on, each stop it with one line saying what to write, exit status 2.
Without the ``proxy`` extra, ``main`` says what to install and exits 2; ``create_app`` raises
``ImportError``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import sys
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, NoReturn

from kvbridge.router import arguments
from kvbridge.router.arguments import DISPATCHES as DISPATCHES
from kvbridge.router.dispatch import concurrent_params, prefill_address

try:
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from prometheus_client import (
        CollectorRegistry,
        Counter,
        Gauge,
        GCCollector,
        Histogram,
        PlatformCollector,
        ProcessCollector,
    )
    from prometheus_client.exposition import choose_encoder
except ImportError as exc:  # without the `proxy` extra: main() says what to install
    _MISSING: ImportError | None = exc
else:
    _MISSING = None

if TYPE_CHECKING:
    from starlette.types import Receive, Scope, Send

log = logging.getLogger("kvbridge.proxy")

#: The install command that brings the proxy's dependencies.
INSTALL_HINT = "pip install 'kvbridge[proxy]'"

#: Request headers passed on to the servers.
FORWARDED_HEADERS = ("authorization", "x-request-id")
#: How long a ``/health`` probe of one server may take (s).
HEALTH_TIMEOUT = 5.0

#: The P/D endpoints (``endpoint`` label of the request metrics).
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
#: How a P/D request ended (``outcome`` label of ``kvbridge_proxy_requests_total``): answered;
#: refused as a bad request (4xx, by the proxy or passed on from P or D); failed by P or by D
#: (502, D also mid-stream); the client left before the end of D's stream; the proxy's own bug
#: (500).
OUTCOMES = ("ok", "client_error", "prefill_error", "decode_error", "cancelled", "internal_error")
#: How a server failed a request (``kind`` label of ``kvbridge_proxy_backend_errors_total``).
FAILURE_KINDS = ("unreachable", "timeout", "http_4xx", "http_5xx", "bad_response", "stream")
#: Histogram buckets (s): whole requests (the default upstream timeout is 300 s), P's round trip,
#: D's first byte.
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300)
PREFILL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
FIRST_BYTE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


def _missing_extra(exc: ImportError) -> NoReturn:
    """Exit 2 with one line naming what cannot be imported and what to install."""
    what = (exc.name or "").split(".")[0] or "a dependency"
    print(
        f"kvbridge-proxy: cannot import {what} ({exc}); it needs the proxy extra: {INSTALL_HINT}",
        file=sys.stderr,
    )
    raise SystemExit(2)


class Metrics:
    """The proxy's Prometheus metrics, in a registry of their own (one per app, none global).

    The labelled series of the hot path are resolved once here; every endpoint/outcome pair and
    every server/kind pair exists (at 0) from the start, so ``rate()`` sees the first one.
    """

    def __init__(self, prefill: Sequence[str], decode: Sequence[str]) -> None:
        self.registry = r = CollectorRegistry()
        for collector in (ProcessCollector, PlatformCollector, GCCollector):
            collector(registry=r)
        requests = Counter(
            "kvbridge_proxy_requests",
            "P/D requests by endpoint and outcome",
            ["endpoint", "outcome"],
            registry=r,
        )
        self._requests = {(e, o): requests.labels(e, o) for e in ENDPOINTS for o in OUTCOMES}
        duration = Histogram(
            "kvbridge_proxy_request_duration_seconds",
            "P/D requests from arrival to the response's end (a stream's last chunk)",
            ["endpoint"],
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self._duration = {e: duration.labels(e) for e in ENDPOINTS}
        self.prefill_duration = Histogram(
            "kvbridge_proxy_prefill_duration_seconds",
            "P's round trip, of the prefills that returned kv_transfer_params",
            buckets=PREFILL_BUCKETS,
            registry=r,
        )
        self.first_byte = Histogram(
            "kvbridge_proxy_decode_first_byte_seconds",
            "Streamed answers: from sending the request to D to D's first chunk",
            buckets=FIRST_BYTE_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "kvbridge_proxy_requests_in_flight", "P/D requests not finished yet", registry=r
        )
        self._errors = Counter(
            "kvbridge_proxy_backend_errors",
            "Failures of P/D requests by server (role, URL) and kind",
            ["role", "backend", "kind"],
            registry=r,
        )
        for role, urls in (("prefill", prefill), ("decode", decode)):
            for url in urls:
                for kind in FAILURE_KINDS:
                    self._errors.labels(role, url.rstrip("/"), kind)

    def finish(self, endpoint: str, outcome: str, t0: float) -> None:
        """Count a request that arrived at ``t0`` (``time.perf_counter``) and ended now."""
        self.in_flight.dec()
        self._requests[endpoint, outcome].inc()
        self._duration[endpoint].observe(time.perf_counter() - t0)

    def backend_error(self, role: str, backend: str, kind: str) -> None:
        """Count a failure of one server."""
        self._errors.labels(role, backend, kind).inc()


class UpstreamError(Exception):
    """A server failed a request: becomes an OpenAI-style error response."""

    def __init__(
        self, status: int, message: str, side: str = "", backend: str = "", kind: str = ""
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.side = side  # "prefill" or "decode"
        self.backend = backend  # the server's URL
        self.kind = kind  # one of FAILURE_KINDS

    @property
    def outcome(self) -> str:
        """The request's outcome (one of ``OUTCOMES``)."""
        return f"{self.side}_error" if self.status >= 500 else "client_error"


def error_response(status: int, message: str) -> JSONResponse:
    """An error in the OpenAI/vLLM shape, which OpenAI clients raise with its message."""
    kind = "BadGateway" if status == 502 else "BadRequestError" if status < 500 else "ServerError"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status)


def prompt_count(body: dict[str, Any]) -> int:
    """Number of prompts in a completions body (a token-id list is one prompt)."""
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or not prompt or isinstance(prompt[0], int):
        return 1
    return len(prompt)


#: The keys of a client's ``kv_transfer_params`` the proxy passes on to P (the others are
#: dropped; D gets only what P returned).
CLIENT_PARAMS = frozenset({"kvbridge_mode"})


def checked_dispatch(dispatch: str) -> str:
    """``dispatch`` if it is one of ``DISPATCHES``, else ``ValueError`` naming them."""
    if dispatch not in DISPATCHES:
        raise ValueError(f"dispatch must be one of {', '.join(DISPATCHES)}, not {dispatch!r}")
    return dispatch


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request P gets: one token, no streaming, asking P to publish its KV for D."""
    out = dict(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out["n"] = 1
    for key in ("stream_options", "min_tokens"):  # invalid without streaming / above 1 token
        out.pop(key, None)
    # Of the client's own params only the per-request mode rides along: anything else (a forged
    # ``do_remote_prefill`` with another request's parameters) would make P load KV from where
    # the client says, into blocks other requests may reuse. P must publish for D.
    given = body.get("kv_transfer_params")
    given = given if isinstance(given, dict) else {}
    kept = {k: v for k, v in given.items() if k in CLIENT_PARAMS}
    out["kv_transfer_params"] = {**kept, "do_remote_decode": True}
    return out


def _excerpt(resp: httpx.Response, limit: int = 500) -> str:
    try:
        err = resp.json().get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:limit]
        if isinstance(err, str):
            return err[:limit]
    except (ValueError, AttributeError):
        pass
    return resp.text[:limit] or "(empty body)"


def _http_failure(side: str, base: str, url: str, exc: httpx.HTTPError) -> UpstreamError:
    timeout = isinstance(exc, httpx.TimeoutException)
    what = "timed out" if timeout else "unreachable"
    msg = f"{side} server {url} {what}: {type(exc).__name__}: {exc}"
    return UpstreamError(502, msg, side, base, "timeout" if timeout else "unreachable")


def _status_failure(side: str, base: str, url: str, resp: httpx.Response) -> UpstreamError:
    code = resp.status_code
    status = code if 400 <= code < 500 else 502
    kind = "http_4xx" if status < 500 else "http_5xx" if code >= 500 else "bad_response"
    msg = f"{side} server {url} answered HTTP {code}: {_excerpt(resp)}"
    return UpstreamError(status, msg, side, base, kind)


class Proxy:
    """Round-robin over prefill and decode servers; one shared HTTP client with timeouts."""

    def __init__(
        self,
        prefill: Sequence[str],
        decode: Sequence[str],
        client: httpx.AsyncClient,
        metrics: Metrics | None = None,
        dispatch: str = "sequential",
    ) -> None:
        if not prefill or not decode:
            raise ValueError("need at least one prefill and one decode server")
        self.dispatch = checked_dispatch(dispatch)
        #: each P's side channel, from its first answer (the concurrent dispatch needs it)
        self.addresses: dict[str, dict[str, Any]] = {}
        self.prefill = [u.rstrip("/") for u in prefill]
        self.decode = [u.rstrip("/") for u in decode]
        self._next_p = itertools.cycle(self.prefill)
        self._next_d = itertools.cycle(self.decode)
        self.client = client
        self.metrics = metrics if metrics is not None else Metrics(self.prefill, self.decode)

    def next_prefill(self) -> str:
        """The prefill server for the next request."""
        return next(self._next_p)

    def next_decode(self) -> str:
        """The decode server for the next request."""
        return next(self._next_d)

    async def run_prefill(
        self,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        base: str | None = None,
        params: dict[str, Any] | None = None,
    ) -> tuple[dict[str, Any], float]:
        """P's ``kv_transfer_params`` for ``body`` and P's round trip (s); ``base``: this P
        (else the next), ``params``: these ``kv_transfer_params`` (the concurrent dispatch's)."""
        base = base or self.next_prefill()
        url = base + path
        sent = prefill_body(body)
        if params is not None:
            sent["kv_transfer_params"] = params
        t0 = time.perf_counter()
        try:
            resp = await self.client.post(url, json=sent, headers=headers)
        except httpx.HTTPError as exc:
            raise _http_failure("prefill", base, url, exc) from exc
        if resp.status_code != 200:
            raise _status_failure("prefill", base, url, resp)
        try:
            answer = resp.json().get("kv_transfer_params")
        except (ValueError, AttributeError):
            msg = f"prefill server {url} answered non-JSON: {resp.text[:200]!r}"
            raise UpstreamError(502, msg, "prefill", base, "bad_response") from None
        if not isinstance(answer, dict) or not answer:
            msg = (
                f"prefill server {url} returned no kv_transfer_params (is it serving with "
                "kv_connector KVBridgeConnector and kv_role kv_producer?)"
            )
            raise UpstreamError(502, msg, "prefill", base, "bad_response")
        if base not in self.addresses and (address := prefill_address(answer)) is not None:
            self.addresses[base] = address
        return answer, time.perf_counter() - t0

    async def forward(self, request: Request, path: str) -> Response:
        """The P/D round for one completions or chat request, counted in the metrics."""
        t0 = time.perf_counter()
        self.metrics.in_flight.inc()
        outcome: str | None = "internal_error"  # an exception of its own: FastAPI answers 500
        try:
            response, outcome = await self._round(request, path, t0)
        finally:
            if outcome is not None:  # None: a stream, counted when it ends
                self.metrics.finish(path, outcome, t0)
        return response

    async def _round(self, request: Request, path: str, t0: float) -> tuple[Response, str | None]:
        """``forward``'s response and outcome (None for a stream, which counts its own)."""
        try:
            body = await request.json()
        except ValueError:
            return error_response(400, "request body is not JSON"), "client_error"
        if not isinstance(body, dict):
            return error_response(400, "request body must be a JSON object"), "client_error"
        if prompt_count(body) != 1:
            return error_response(400, "this proxy takes one prompt per request"), "client_error"
        headers = {k: v for k in FORWARDED_HEADERS if (v := request.headers.get(k)) is not None}
        headers.setdefault("x-request-id", uuid.uuid4().hex)
        p_base = self.next_prefill()
        address = self.addresses.get(p_base) if self.dispatch == "concurrent" else None
        try:
            if address is not None:
                params, prefill_s, sent, resp, base = await self._concurrent(
                    path, body, headers, p_base, address
                )
            else:
                params, prefill_s = await self.run_prefill(path, body, headers, p_base)
                self.metrics.prefill_duration.observe(prefill_s)
                sent = time.perf_counter()
                resp, base = await self.run_decode(
                    path, dict(body, kv_transfer_params=params), headers
                )
        except UpstreamError as exc:
            log.warning("%s", exc.message)
            self.metrics.backend_error(exc.side, exc.backend, exc.kind)
            return error_response(exc.status, exc.message), exc.outcome
        extra = {
            "x-kvbridge-prefill-ms": f"{prefill_s * 1e3:.1f}",
            "x-kvbridge-dispatch": "concurrent" if address is not None else "sequential",
        }
        for key in ("remote_engine_id", "remote_num_tokens"):
            if params.get(key) is not None:
                extra[f"x-kvbridge-{key.replace('_', '-')}"] = str(params[key])
        media = resp.headers.get("content-type", "application/json")
        if not body.get("stream"):
            return Response(resp.content, media_type=media, headers=extra), "ok"
        stream = DecodeStream(resp, base, self.metrics, path, t0, sent)
        return _StreamResponse(stream, media_type=media, headers=extra), None

    async def _concurrent(
        self,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        p_base: str,
        address: dict[str, Any],
    ) -> tuple[dict[str, Any], float, float, httpx.Response, str]:
        """P and D get the request at once (layer-wise); D's answer, as ``_round`` wants.

        P's answer is awaited before D's is returned, so that a P failure is counted; it does
        not fail the request: D then computes the prompt itself after its timeout.
        """
        to_p, to_d = concurrent_params(address)
        prefill = asyncio.ensure_future(self.run_prefill(path, body, headers, p_base, to_p))
        sent = time.perf_counter()
        try:
            resp, base = await self.run_decode(path, dict(body, kv_transfer_params=to_d), headers)
        except BaseException:
            prefill.cancel()
            raise
        try:
            params, prefill_s = await prefill
            self.metrics.prefill_duration.observe(prefill_s)
        except UpstreamError as exc:  # D recomputes: the answer is still right, only later
            log.warning("%s (decode computes the prompt itself)", exc.message)
            self.metrics.backend_error(exc.side, exc.backend, exc.kind)
            params, prefill_s = {}, time.perf_counter() - sent
        return params, prefill_s, sent, resp, base

    async def run_decode(
        self, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> tuple[httpx.Response, str]:
        """D's answer to ``body`` (still open when streamed) and the server (URL) that gave it."""
        base = self.next_decode()
        url = base + path
        req = self.client.build_request("POST", url, json=body, headers=headers)
        try:
            resp = await self.client.send(req, stream=bool(body.get("stream")))
        except httpx.HTTPError as exc:
            raise _http_failure("decode", base, url, exc) from exc
        if resp.status_code != 200:
            await resp.aread()
            await resp.aclose()
            raise _status_failure("decode", base, url, resp)
        return resp, base

    async def get(self, side: str, url: str) -> Response:
        """A plain GET passed through (status and body), 502 when the server is unreachable."""
        try:
            resp = await self.client.get(url, timeout=HEALTH_TIMEOUT)
        except httpx.HTTPError as exc:
            return error_response(502, _http_failure(side, url, url, exc).message)
        media = resp.headers.get("content-type", "application/json")
        return Response(resp.content, status_code=resp.status_code, media_type=media)

    async def health(self) -> JSONResponse:
        """200 when every server answers ``/health`` with 200, else 503 and who did not."""

        async def probe(url: str) -> str:
            try:
                resp = await self.client.get(url + "/health", timeout=HEALTH_TIMEOUT)
            except httpx.HTTPError as exc:
                return f"{type(exc).__name__}: {exc}"
            return "ok" if resp.status_code == 200 else f"HTTP {resp.status_code}"

        urls = [*self.prefill, *self.decode]
        states = await asyncio.gather(*(probe(u) for u in urls))
        report = {
            "prefill": dict(zip(self.prefill, states[: len(self.prefill)], strict=True)),
            "decode": dict(zip(self.decode, states[len(self.prefill) :], strict=True)),
        }
        ok = all(s == "ok" for s in states)
        return JSONResponse({"status": "ok" if ok else "unhealthy", **report}, 200 if ok else 503)


class DecodeStream:
    """D's streamed answer relayed chunk by chunk; counted and closed once, however it ends."""

    def __init__(
        self,
        resp: httpx.Response,
        backend: str,
        metrics: Metrics,
        endpoint: str,
        t0: float,
        sent: float,
    ) -> None:
        self.resp = resp
        self.backend = backend
        self.metrics = metrics
        self.endpoint = endpoint
        self.t0 = t0  # the request's arrival
        self.sent = sent  # the request to D left
        self.outcome = "cancelled"  # until D's stream ends or fails: the client left
        self._closed = False

    async def chunks(self) -> AsyncIterator[bytes]:
        """D's chunks; a failure mid-stream ends them with an SSE error event."""
        first = True
        try:
            async for chunk in self.resp.aiter_raw():
                if first:
                    first = False
                    self.metrics.first_byte.observe(time.perf_counter() - self.sent)
                yield chunk
        except httpx.HTTPError as exc:
            self.outcome = "decode_error"
            self.metrics.backend_error("decode", self.backend, "stream")
            url = self.resp.request.url
            msg = f"decode server {url} failed mid-stream: {type(exc).__name__}: {exc}"
            log.warning("%s", msg)
            yield f"data: {json.dumps({'error': {'message': msg, 'code': 502}})}\n\n".encode()
        else:
            self.outcome = "ok"

    async def close(self) -> None:
        """Count the request (its outcome so far) and close D's response; once."""
        if self._closed:
            return
        self._closed = True
        self.metrics.finish(self.endpoint, self.outcome, self.t0)
        await self.resp.aclose()


if _MISSING is None:

    class _StreamResponse(StreamingResponse):
        """Relays a ``DecodeStream`` and closes it when the response ends, however it ends.

        Also when the client left before the body started (Starlette cancels the response on
        the disconnect, or fails it when sending the headers fails): a body never started runs
        no ``finally``, and a cancelled one could not finish awaiting D's close in it.
        """

        def __init__(self, stream: DecodeStream, media_type: str, headers: dict[str, str]) -> None:
            super().__init__(stream.chunks(), media_type=media_type, headers=headers)
            self.stream = stream

        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            try:
                await super().__call__(scope, receive, send)
            finally:
                await self.stream.close()


def create_app(
    prefill: Sequence[str],
    decode: Sequence[str],
    *,
    timeout: float = 300.0,
    connect_timeout: float = 10.0,
    transport: httpx.AsyncBaseTransport | None = None,
    dispatch: str = "sequential",
) -> FastAPI:
    """The proxy as an ASGI app; ``timeout`` bounds each upstream read/write (s); ``dispatch``
    one of ``DISPATCHES``.

    ``transport``: httpx's, for the upstream calls (default: the network). The metrics
    (``app.state.metrics``) live as long as the app, across restarts of its lifespan.
    """
    if _MISSING is not None:
        raise ImportError(f"the P/D proxy needs the proxy extra: {INSTALL_HINT}") from _MISSING
    checked_dispatch(dispatch)  # before the app starts, not at its first request
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    http_timeout = httpx.Timeout(timeout, connect=connect_timeout)
    metrics = Metrics(prefill, decode)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with httpx.AsyncClient(
            timeout=http_timeout, limits=limits, transport=transport
        ) as client:
            app.state.proxy = Proxy(prefill, decode, client, metrics, dispatch)
            yield

    app = FastAPI(title="kvbridge P/D proxy", lifespan=lifespan)
    app.state.metrics = metrics

    def proxy_of(request: Request) -> Proxy:
        proxy: Proxy = request.app.state.proxy
        return proxy

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy_of(request).forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy_of(request).forward(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        proxy = proxy_of(request)
        return await proxy.get("decode", proxy.next_decode() + "/v1/models")

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        return await proxy_of(request).health()

    @app.get("/metrics", include_in_schema=False)
    async def metrics_text(request: Request) -> Response:
        encode, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encode(metrics.registry), media_type=content_type)

    return app


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: check every argument (``arguments``: one line and exit 2 for a mistake),
    then serve the proxy with uvicorn."""
    a = arguments.parse(argv, __doc__.splitlines()[0] if __doc__ else None)
    if _MISSING is not None:
        _missing_extra(_MISSING)
    try:
        import uvicorn
    except ImportError as exc:
        _missing_extra(exc)
    arguments.check_listen(a.host, a.port)
    level = arguments.TRACE if a.log_level == "trace" else a.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(message)s")
    app = create_app(
        a.prefill,
        a.decode,
        timeout=a.timeout,
        connect_timeout=a.connect_timeout,
        dispatch=a.dispatch,
    )
    uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level)


if __name__ == "__main__":
    main()
