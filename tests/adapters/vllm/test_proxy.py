"""The P/D proxy's request shaping and error paths (upstream faults injected with httpx's mock).

The real path, two ``vllm serve`` servers behind this proxy, is ``e2e/test_serve.py``.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from fastapi.testclient import TestClient

from kvbridge.adapters.vllm.proxy import create_app

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
        r = c.post("/v1/completions", json={
            "model": "m", "prompt": [5, 6, 7], "max_tokens": 32, "stream_options": {},
            "kv_transfer_params": {"kvbridge_mode": "push"},
        })  # fmt: skip
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
