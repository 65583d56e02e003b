"""A small prefill/decode proxy for ``vllm serve`` instances that use ``KVBridgeConnector``.

    python -m kvbridge.adapters.vllm.proxy --prefill http://127.0.0.1:8100 \\
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
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

log = logging.getLogger("kvbridge.proxy")

#: Request headers passed on to the servers.
FORWARDED_HEADERS = ("authorization", "x-request-id")
#: How long a ``/health`` probe of one server may take (s).
HEALTH_TIMEOUT = 5.0


class UpstreamError(Exception):
    """A server failed a request: becomes an OpenAI-style error response."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


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
    # The client's own params (e.g. ``kvbridge_mode``) ride along; P must publish for D.
    out["kv_transfer_params"] = {**(body.get("kv_transfer_params") or {}), "do_remote_decode": True}
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


def _http_failure(side: str, url: str, exc: httpx.HTTPError) -> UpstreamError:
    kind = "timed out" if isinstance(exc, httpx.TimeoutException) else "unreachable"
    return UpstreamError(502, f"{side} server {url} {kind}: {type(exc).__name__}: {exc}")


def _status_failure(side: str, url: str, resp: httpx.Response) -> UpstreamError:
    status = resp.status_code if 400 <= resp.status_code < 500 else 502
    return UpstreamError(
        status, f"{side} server {url} answered HTTP {resp.status_code}: {_excerpt(resp)}"
    )


class Proxy:
    """Round-robin over prefill and decode servers; one shared HTTP client with timeouts."""

    def __init__(
        self, prefill: Sequence[str], decode: Sequence[str], client: httpx.AsyncClient
    ) -> None:
        if not prefill or not decode:
            raise ValueError("need at least one prefill and one decode server")
        self.prefill = [u.rstrip("/") for u in prefill]
        self.decode = [u.rstrip("/") for u in decode]
        self._next_p = itertools.cycle(self.prefill)
        self._next_d = itertools.cycle(self.decode)
        self.client = client

    def next_prefill(self) -> str:
        """The prefill server for the next request."""
        return next(self._next_p)

    def next_decode(self) -> str:
        """The decode server for the next request."""
        return next(self._next_d)

    async def run_prefill(
        self, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> tuple[dict[str, Any], float]:
        """P's ``kv_transfer_params`` for ``body`` and P's round trip (s)."""
        url = self.next_prefill() + path
        t0 = time.perf_counter()
        try:
            resp = await self.client.post(url, json=prefill_body(body), headers=headers)
        except httpx.HTTPError as exc:
            raise _http_failure("prefill", url, exc) from exc
        if resp.status_code != 200:
            raise _status_failure("prefill", url, resp)
        try:
            params = resp.json().get("kv_transfer_params")
        except (ValueError, AttributeError):
            msg = f"prefill server {url} answered non-JSON: {resp.text[:200]!r}"
            raise UpstreamError(502, msg) from None
        if not isinstance(params, dict) or not params:
            raise UpstreamError(
                502,
                f"prefill server {url} returned no kv_transfer_params (is it serving with "
                "kv_connector KVBridgeConnector and kv_role kv_producer?)",
            )
        return params, time.perf_counter() - t0

    async def forward(self, request: Request, path: str) -> Response:
        """The P/D round for one completions or chat request."""
        try:
            body = await request.json()
        except ValueError:
            return error_response(400, "request body is not JSON")
        if not isinstance(body, dict):
            return error_response(400, "request body must be a JSON object")
        if prompt_count(body) != 1:
            return error_response(400, "this proxy takes one prompt per request")
        headers = {k: v for k in FORWARDED_HEADERS if (v := request.headers.get(k)) is not None}
        headers.setdefault("x-request-id", uuid.uuid4().hex)
        try:
            params, prefill_s = await self.run_prefill(path, body, headers)
            resp, url = await self.run_decode(path, dict(body, kv_transfer_params=params), headers)
        except UpstreamError as exc:
            log.warning("%s", exc.message)
            return error_response(exc.status, exc.message)
        extra = {"x-kvbridge-prefill-ms": f"{prefill_s * 1e3:.1f}"}
        for key in ("remote_engine_id", "remote_num_tokens"):
            if params.get(key) is not None:
                extra[f"x-kvbridge-{key.replace('_', '-')}"] = str(params[key])
        media = resp.headers.get("content-type", "application/json")
        if not body.get("stream"):
            return Response(resp.content, media_type=media, headers=extra)
        return StreamingResponse(_relay(resp, url), media_type=media, headers=extra)

    async def run_decode(
        self, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> tuple[httpx.Response, str]:
        """D's answer to ``body`` (still open when streamed) and the URL that gave it."""
        url = self.next_decode() + path
        req = self.client.build_request("POST", url, json=body, headers=headers)
        try:
            resp = await self.client.send(req, stream=bool(body.get("stream")))
        except httpx.HTTPError as exc:
            raise _http_failure("decode", url, exc) from exc
        if resp.status_code != 200:
            await resp.aread()
            await resp.aclose()
            raise _status_failure("decode", url, resp)
        return resp, url

    async def get(self, side: str, url: str) -> Response:
        """A plain GET passed through (status and body), 502 when the server is unreachable."""
        try:
            resp = await self.client.get(url, timeout=HEALTH_TIMEOUT)
        except httpx.HTTPError as exc:
            return error_response(502, _http_failure(side, url, exc).message)
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


async def _relay(resp: httpx.Response, url: str) -> AsyncIterator[bytes]:
    """D's stream, chunk by chunk; a failure mid-stream ends it with an SSE error event."""
    try:
        async for chunk in resp.aiter_raw():
            yield chunk
    except httpx.HTTPError as exc:
        msg = f"decode server {url} failed mid-stream: {type(exc).__name__}: {exc}"
        log.warning("%s", msg)
        yield f"data: {json.dumps({'error': {'message': msg, 'code': 502}})}\n\n".encode()
    finally:
        await resp.aclose()


def create_app(
    prefill: Sequence[str], decode: Sequence[str], *, timeout: float = 300.0,
    connect_timeout: float = 10.0, transport: httpx.AsyncBaseTransport | None = None,
) -> FastAPI:  # fmt: skip
    """The proxy as an ASGI app; ``timeout`` bounds each upstream read/write (s).

    ``transport``: httpx's, for the upstream calls (default: the network).
    """
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    http_timeout = httpx.Timeout(timeout, connect=connect_timeout)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with httpx.AsyncClient(
            timeout=http_timeout, limits=limits, transport=transport
        ) as client:
            app.state.proxy = Proxy(prefill, decode, client)
            yield

    app = FastAPI(title="kvbridge P/D proxy", lifespan=lifespan)

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

    return app


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: parse the servers and serve the proxy with uvicorn."""
    import uvicorn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--prefill", action="append", required=True, metavar="URL",
                    help="prefill server (kv_producer); repeat for several")  # fmt: skip
    ap.add_argument("--decode", action="append", required=True, metavar="URL",
                    help="decode server (kv_consumer); repeat for several")  # fmt: skip
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="seconds each upstream read may take (default 300)")  # fmt: skip
    ap.add_argument("--connect-timeout", type=float, default=10.0)
    ap.add_argument("--log-level", default="info")
    a = ap.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    app = create_app(a.prefill, a.decode, timeout=a.timeout, connect_timeout=a.connect_timeout)
    uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level)


if __name__ == "__main__":
    main()
