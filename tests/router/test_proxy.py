"""The P/D proxy's request shaping, error paths and metrics (upstream faults injected with httpx's
mock), and its command without the proxy extra.

The real path, two ``vllm serve`` servers behind this proxy, is ``tests/adapters/vllm/e2e/test_serve.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvbridge.router.proxy import create_app

P, D = "http://prefill:1", "http://decode:2"
PARAMS = {"do_remote_prefill": True, "remote_engine_id": "p0", "remote_num_tokens": 7}


def client(handler: Any) -> TestClient:
    app = create_app([P], [D], transport=httpx.MockTransport(handler))
    return TestClient(app)


def test_prefill_then_decode_with_ps_params() -> None:
    seen: dict[str, Any] = {}

    def handler(req: httpx.Request) -> httpx.Response:
        body = json.loads(req.content)
        seen[req.url.host] = body
        if req.url.host == "prefill":
            return httpx.Response(
                200, json={"choices": [{"text": "x"}], "kv_transfer_params": PARAMS}
            )
        return httpx.Response(200, json={"choices": [{"text": "decoded"}]})

    with client(handler) as c:
        r = c.post(
            "/v1/completions",
            json={
                "model": "m",
                "prompt": [5, 6, 7],
                "max_tokens": 32,
                "stream_options": {},
                "kv_transfer_params": {"kvbridge_mode": "push"},
            },
        )
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decoded"
    assert r.headers["x-kvbridge-remote-engine-id"] == "p0"
    p, d = seen["prefill"], seen["decode"]
    assert p["max_tokens"] == 1 and p["stream"] is False and "stream_options" not in p
    assert p["kv_transfer_params"] == {"kvbridge_mode": "push", "do_remote_decode": True}
    assert d["max_tokens"] == 32 and d["kv_transfer_params"] == PARAMS and d["prompt"] == [5, 6, 7]


def test_prefill_without_params_is_a_502_naming_prefill() -> None:
    calls: list[str] = []

    def handler(req: httpx.Request) -> httpx.Response:
        calls.append(req.url.host)
        return httpx.Response(200, json={"choices": [{"text": "x"}]})

    with client(handler) as c:
        r = c.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 4})
    assert r.status_code == 502 and calls == ["prefill"]  # D never asked
    msg = r.json()["error"]["message"]
    assert "prefill server" in msg and "kv_transfer_params" in msg


def test_unreachable_and_refusing_servers() -> None:
    def down(req: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=req)

    with client(down) as c:
        r = c.post("/v1/chat/completions", json={"model": "m", "messages": []})
    assert r.status_code == 502 and "unreachable" in r.json()["error"]["message"]

    def bad_decode(req: httpx.Request) -> httpx.Response:
        if req.url.host == "prefill":
            return httpx.Response(200, json={"kv_transfer_params": PARAMS})
        return httpx.Response(400, json={"error": {"message": "max_tokens too large"}})

    with client(bad_decode) as c:
        r = c.post("/v1/completions", json={"model": "m", "prompt": "hi"})
        batch = c.post("/v1/completions", json={"model": "m", "prompt": ["a", "b"]})
    assert r.status_code == 400 and "decode server" in r.json()["error"]["message"]
    assert batch.status_code == 400


# --- /metrics ---------------------------------------------------------------------------------


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]  # (name, labels) -> value


def scrape(c: TestClient) -> Samples:
    """The proxy's ``/metrics``, parsed: (sample name, labels) -> value."""
    r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[name, frozenset(labels.items())]


def requests(samples: Samples) -> dict[tuple[str, str], float]:
    """``kvbridge_proxy_requests_total`` by (endpoint, outcome), the non-zero ones."""
    out = {}
    for (name, labels), v in samples.items():
        if name == "kvbridge_proxy_requests_total" and v:
            d = dict(labels)
            out[d["endpoint"], d["outcome"]] = v
    return out


def backend_errors(samples: Samples) -> dict[tuple[str, str, str], float]:
    """``kvbridge_proxy_backend_errors_total`` by (role, backend, kind), the non-zero ones."""
    out = {}
    for (name, labels), v in samples.items():
        if name == "kvbridge_proxy_backend_errors_total" and v:
            d = dict(labels)
            out[d["role"], d["backend"], d["kind"]] = v
    return out


C, CHAT = "/v1/completions", "/v1/chat/completions"
PREFILL_S = 0.05  # P's answer takes at least this long


def test_metrics_count_outcomes_durations_and_backend_errors() -> None:
    mode = {"p": "ok", "d": "ok"}
    in_flight_seen: list[float | None] = []

    async def handler(req: httpx.Request) -> httpx.Response:
        if req.url.host == "prefill":
            in_flight_seen.append(
                app.state.metrics.registry.get_sample_value("kvbridge_proxy_requests_in_flight")
            )
            await asyncio.sleep(PREFILL_S)
            if mode["p"] == "500":
                return httpx.Response(500, text="engine dead")
            if mode["p"] == "timeout":
                raise httpx.ReadTimeout("slow", request=req)
            return httpx.Response(200, json={"kv_transfer_params": PARAMS})
        if mode["d"] == "down":
            raise httpx.ConnectError("connection refused", request=req)
        if mode["d"] == "400":
            return httpx.Response(400, json={"error": {"message": "max_tokens too large"}})
        return httpx.Response(200, json={"choices": [{"text": "decoded"}]})

    app = create_app([P], [D], transport=httpx.MockTransport(handler))
    other = create_app([P], [D], transport=httpx.MockTransport(handler))  # its own registry
    completion = {"model": "m", "prompt": "hi", "max_tokens": 4}
    with TestClient(app) as c:
        before = scrape(c)
        assert requests(before) == {} and backend_errors(before) == {}
        errors = "kvbridge_proxy_backend_errors_total"  # every server's series, from the start
        assert value(before, errors, role="decode", backend=D, kind="stream") == 0
        assert c.post(C, json=completion).status_code == 200
        assert c.post(CHAT, json={"model": "m", "messages": []}).status_code == 200
        batch = {"model": "m", "prompt": ["a", "b"]}
        assert c.post(C, json=batch).status_code == 400  # P never asked
        assert c.post(C, content=b"{not json").status_code == 400
        mode["p"] = "500"
        assert c.post(C, json=completion).status_code == 502
        mode["p"] = "timeout"
        assert c.post(CHAT, json={"model": "m", "messages": []}).status_code == 502
        mode.update(p="ok", d="down")
        assert c.post(C, json=completion).status_code == 502
        mode["d"] = "400"
        assert c.post(C, json=completion).status_code == 400
        after = scrape(c)
    assert requests(after) == {
        (C, "ok"): 1,
        (CHAT, "ok"): 1,
        (C, "client_error"): 3,
        (C, "prefill_error"): 1,
        (CHAT, "prefill_error"): 1,
        (C, "decode_error"): 1,
    }
    assert backend_errors(after) == {
        ("prefill", P, "http_5xx"): 1,
        ("prefill", P, "timeout"): 1,
        ("decode", D, "unreachable"): 1,
        ("decode", D, "http_4xx"): 1,
    }
    duration = "kvbridge_proxy_request_duration_seconds"
    assert value(after, duration + "_count", endpoint=C) == 6
    assert value(after, duration + "_count", endpoint=CHAT) == 2
    # The two refusals were answered without P, the four others waited for P at least.
    assert value(after, duration + "_bucket", endpoint=C, le="0.025") <= 2
    assert value(after, duration + "_sum", endpoint=C) >= 4 * PREFILL_S
    prefill = "kvbridge_proxy_prefill_duration_seconds"  # P returned params: ok, D down, D 400
    assert value(after, prefill + "_count") == 4
    assert value(after, prefill + "_sum") >= 4 * PREFILL_S
    assert value(after, prefill + "_bucket", le="0.025") == 0
    assert value(after, "kvbridge_proxy_decode_first_byte_seconds_count") == 0  # none streamed
    assert in_flight_seen == [1.0] * 6  # P's six calls, one request at a time
    assert value(after, "kvbridge_proxy_requests_in_flight") == 0
    assert any(name.startswith("process_") for name, _ in after)
    with TestClient(other) as c2:  # two apps in one process count apart
        assert requests(scrape(c2)) == {}


class DStream(httpx.AsyncByteStream):
    """D's streamed body: SSE chunks after a delay, then a failure if asked; records its close."""

    def __init__(self, fail: bool = False, delay: float = 0.05) -> None:
        self.fail, self.delay, self.closed = fail, delay, False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        await asyncio.sleep(self.delay)
        yield b'data: {"choices": [{"text": "a"}]}\n\n'
        if self.fail:
            raise httpx.ReadError("connection reset")
        yield b"data: [DONE]\n\n"

    async def aclose(self) -> None:
        self.closed = True


def stream_handler(streams: list[DStream], fail: bool = False) -> Any:
    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.host == "prefill":
            return httpx.Response(200, json={"kv_transfer_params": PARAMS})
        streams.append(DStream(fail=fail))
        return httpx.Response(
            200, stream=streams[-1], headers={"content-type": "text/event-stream"}
        )

    return handler


def test_metrics_of_streamed_answers_count_first_byte_and_mid_stream_failures() -> None:
    streams: list[DStream] = []
    body = {"model": "m", "prompt": "hi", "stream": True}
    with client(stream_handler(streams)) as c:
        r = c.post(C, json=body)
        ok = scrape(c)
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n") and streams[0].closed
    assert requests(ok) == {(C, "ok"): 1}
    assert value(ok, "kvbridge_proxy_decode_first_byte_seconds_count") == 1
    assert value(ok, "kvbridge_proxy_decode_first_byte_seconds_sum") >= 0.05
    assert value(ok, "kvbridge_proxy_decode_first_byte_seconds_bucket", le="0.025") == 0
    assert value(ok, "kvbridge_proxy_request_duration_seconds_sum", endpoint=C) >= 0.05
    assert value(ok, "kvbridge_proxy_requests_in_flight") == 0

    with client(stream_handler(streams, fail=True)) as c:
        r = c.post(C, json=body)
        failed = scrape(c)
    assert r.status_code == 200 and "failed mid-stream" in r.text and streams[1].closed
    assert requests(failed) == {(C, "decode_error"): 1}
    assert backend_errors(failed) == {("decode", D, "stream"): 1}
    assert value(failed, "kvbridge_proxy_decode_first_byte_seconds_count") == 1
    assert value(failed, "kvbridge_proxy_request_duration_seconds_count", endpoint=C) == 1
    assert value(failed, "kvbridge_proxy_requests_in_flight") == 0


def test_a_client_leaving_before_the_stream_is_counted_and_ds_answer_closed() -> None:
    """The client is gone when the response starts: Starlette cancels it before the body runs."""
    streams: list[DStream] = []
    app = create_app([P], [D], transport=httpx.MockTransport(stream_handler(streams)))
    body = json.dumps({"model": "m", "prompt": "hi", "stream": True}).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": C,
        "raw_path": C.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("c", 1),
        "server": ("s", 80),
    }
    sent: list[dict[str, Any]] = []

    async def run() -> None:
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            await asyncio.sleep(0)  # as a server's or middleware's send can: the disconnect wins
            sent.append(message)

        async with app.router.lifespan_context(app):
            await app(scope, receive, send)

    asyncio.run(run())
    assert not any(m.get("body") for m in sent)  # no chunk of D's reached the client
    assert len(streams) == 1 and streams[0].closed
    samples = scrape(TestClient(app))
    assert requests(samples) == {(C, "cancelled"): 1}
    assert value(samples, "kvbridge_proxy_requests_in_flight") == 0
    assert value(samples, "kvbridge_proxy_request_duration_seconds_count", endpoint=C) == 1


# --- without the proxy extra ------------------------------------------------------------------

BLOCK = 'import sys; sys.modules["{}"] = None  # "not installed": importing it raises ImportError\n'
ROOT = Path(__file__).resolve().parents[2]


def blocking(tmp_path: Path, module: str) -> dict[str, str]:
    """An environment whose Pythons cannot import ``module`` (a ``sitecustomize`` sees to it)."""
    (tmp_path / "sitecustomize.py").write_text(BLOCK.format(module))
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}


@pytest.mark.parametrize("missing", ["httpx", "prometheus_client", "uvicorn"])
def test_the_command_without_the_extra_says_what_to_install(tmp_path: Path, missing: str) -> None:
    env = blocking(tmp_path, missing)
    commands = [[sys.executable, "-m", "kvbridge.router"]]
    script = Path(sys.executable).parent / "kvbridge-proxy"
    if missing == "httpx" and script.is_file():
        commands.append([str(script)])  # the console script, through the real entry point
    for cmd in commands:
        r = subprocess.run(
            [*cmd, "--prefill", P, "--decode", D],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert r.returncode == 2, (cmd, r.stderr)
        assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert f"cannot import {missing}" in r.stderr, r.stderr
        assert "pip install 'kvbridge[proxy]'" in r.stderr, r.stderr


def test_create_app_without_the_extra_raises_import_error_naming_it(tmp_path: Path) -> None:
    env = blocking(tmp_path, "fastapi")
    code = (
        "from kvbridge.router.proxy import create_app\n"
        "try:\n    create_app(['http://p'], ['http://d'])\n"
        "except ImportError as e:\n    print(e, '|', e.__cause__.name)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert r.returncode == 0, r.stderr
    hint = "the P/D proxy needs the proxy extra: pip install 'kvbridge[proxy]'"
    assert r.stdout.strip() == f"{hint} | fastapi"


def test_a_clients_forged_transfer_params_never_reach_p_or_d() -> None:
    """Issue 28: a client naming another request's parameters (or asking P to load from an
    engine of its choosing) gets them dropped; P sees only the mode, D only what P returned."""
    seen: dict[str, Any] = {}

    def handler(req: httpx.Request) -> httpx.Response:
        seen[req.url.host] = json.loads(req.content)
        if req.url.host == "prefill":
            return httpx.Response(200, json={"choices": [{}], "kv_transfer_params": PARAMS})
        return httpx.Response(200, json={"choices": [{"text": "decoded"}]})

    forged = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "kvbridge": {"request_id": "someone-else", "endpoint": "tcp://evil:1", "token": "x"},
        "kvbridge_mode": "push",
    }
    with client(handler) as c:
        r = c.post(
            "/v1/completions", json={"model": "m", "prompt": [1], "kv_transfer_params": forged}
        )
        assert r.status_code == 200
        assert seen["prefill"]["kv_transfer_params"] == {
            "kvbridge_mode": "push",
            "do_remote_decode": True,
        }
        assert seen["decode"]["kv_transfer_params"] == PARAMS
        # not an object: dropped, the request still served
        r = c.post("/v1/completions", json={"model": "m", "prompt": [1], "kv_transfer_params": 7})
        assert r.status_code == 200
        assert seen["prefill"]["kv_transfer_params"] == {"do_remote_decode": True}


@pytest.mark.parametrize(
    ("payload", "status"),
    [
        (b"{not json", 400),
        (b"[1, 2]", 400),
        (b'"text"', 400),
        (json.dumps({"model": "m", "prompt": [[1], [2]]}).encode(), 400),
        (json.dumps({"model": "m", "prompt": ["a", "b"]}).encode(), 400),
        (b"\xff\xfe\x00", 400),
    ],
)
def test_malformed_client_bodies_are_refused_before_any_backend_is_called(
    payload: bytes, status: int
) -> None:
    calls: list[str] = []

    def handler(req: httpx.Request) -> httpx.Response:
        calls.append(req.url.host)
        return httpx.Response(500)

    with client(handler) as c:
        r = c.post("/v1/completions", content=payload, headers={"content-type": "application/json"})
    assert r.status_code == status and "message" in r.json()["error"]
    assert calls == []  # nothing reached P or D


def _published(engine: str = "p0") -> dict[str, Any]:
    """What a kvbridge P answers: its own params under ``kvbridge`` (it names P)."""
    from kvbridge.control.requests import Mode, TransferParams

    transfer = TransferParams(
        "r", engine, "tcp://10.0.0.1:5790", {0: [1]}, 7, "mooncake", Mode.PULL, token="t" * 32
    )
    return {**PARAMS, "kvbridge": transfer.to_dict()}


def test_concurrent_dispatch_learns_p_then_sends_both_at_once() -> None:
    from kvbridge.control.requests import TransferParams

    seen: list[tuple[str, dict[str, Any]]] = []

    def handler(req: httpx.Request) -> httpx.Response:
        body = json.loads(req.content)
        seen.append((req.url.host, body))
        if req.url.host == "prefill":
            return httpx.Response(200, json={"choices": [{}], "kv_transfer_params": _published()})
        return httpx.Response(200, json={"choices": [{"text": "decoded"}]})

    app = create_app([P], [D], transport=httpx.MockTransport(handler), dispatch="concurrent")
    forged = {"kvbridge_layerwise": {"id": "mine", "token": "x" * 32}, "kvbridge_mode": "pull"}
    with TestClient(app) as c:
        first = c.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 4})
        second = c.post(
            "/v1/completions",
            json={"model": "m", "prompt": "hi", "max_tokens": 4, "kv_transfer_params": forged},
        )
    assert first.headers["x-kvbridge-dispatch"] == "sequential"  # P's address not known yet
    assert second.status_code == 200 and second.json()["choices"][0]["text"] == "decoded"
    assert second.headers["x-kvbridge-dispatch"] == "concurrent"
    (to_p,) = [b for host, b in seen[2:] if host == "prefill"]
    (to_d,) = [b for host, b in seen[2:] if host == "decode"]
    router = to_p["kv_transfer_params"]["kvbridge_layerwise"]
    assert router["id"] != "mine" and len(router["token"]) >= 32  # made here, not the client's
    assert to_p["max_tokens"] == 1 and to_p["kv_transfer_params"]["do_remote_decode"] is True
    params = TransferParams.from_dict(to_d["kv_transfer_params"]["kvbridge"])
    # the mode P's answer named (a layer-wise pull here), not the client's
    assert params.layerwise and params.block_ids == {} and params.mode.value == "pull"
    assert router["mode"] == "pull"
    assert (params.request_id, params.token) == (router["id"], router["token"])
    assert (params.engine_id, params.endpoint) == ("p0", "tcp://10.0.0.1:5790")
    assert to_d["max_tokens"] == 4 and to_d["kv_transfer_params"]["do_remote_prefill"] is True


def test_concurrent_dispatch_answers_with_d_when_p_fails() -> None:
    calls = {"prefill": 0}

    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.host == "prefill":
            calls["prefill"] += 1
            if calls["prefill"] > 1:  # after P's address is known, P fails
                return httpx.Response(500, json={"error": "engine died"})
            return httpx.Response(200, json={"choices": [{}], "kv_transfer_params": _published()})
        return httpx.Response(200, json={"choices": [{"text": "recomputed"}]})

    app = create_app([P], [D], transport=httpx.MockTransport(handler), dispatch="concurrent")
    with TestClient(app) as c:
        c.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 4})
        r = c.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 4})
        text = c.get("/metrics").text
    # D computed the prompt itself (its load fails at its timeout): the answer is still D's
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "recomputed"
    assert 'kvbridge_proxy_backend_errors_total{backend="http://prefill:1",kind="http_5xx"' in text


def test_an_unknown_dispatch_is_refused() -> None:
    with pytest.raises(ValueError, match="sequential, concurrent"):
        create_app([P], [D], dispatch="parallel")
