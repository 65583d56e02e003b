"""What a served P/D pair must survive, sent to P and D directly as any client that reaches their
HTTP ports could (issue 45), each returning what it saw for the tests to check:

- ``fuzz_params``: generated ``kv_transfer_params`` (``tests.adapters.vllm.kv_params_strategies``)
  through vLLM's own API server: both engines stay up, every answer is the single instance's or
  a 4xx, and afterwards neither engine holds a KV block.
- ``queue_past_claim``: a request P prefilled waits in D (its engine stopped: too busy to
  schedule it) until P's hold of it lapsed unclaimed: D answers as the single instance (it
  computes the prompt, told at once by P), never from released blocks.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tests.adapters.vllm.e2e.run_pd import Reference
from tests.adapters.vllm.e2e.serve_pd import (
    FAILURES,
    REQUEST_TIMEOUT_S,
    SERVED_NAME,
    UNCLAIMED,
    ServeError,
    scrape,
)
from tests.adapters.vllm.e2e.serve_xpyd import USAGE, descendants, wait_for


def _complete(url: str, prompt: list[int], max_tokens: int, params: Any) -> tuple[int, Any]:
    """One completion (greedy, token ids back): the HTTP status and the JSON answer."""
    import httpx

    body = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "kv_transfer_params": params,
    }
    # Python's JSON, as a client may write it: NaN and Infinity included (not strict JSON)
    content = json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    with httpx.Client(timeout=REQUEST_TIMEOUT_S, trust_env=False) as http:
        reply = http.post(url + "/v1/completions", content=content, headers=headers)
    try:
        return reply.status_code, reply.json()
    except ValueError:
        return reply.status_code, reply.text


def _prefill(p_url: str, prompt: list[int]) -> dict[str, Any]:
    """P prefills ``prompt`` for a remote decode (as the router's first leg): P's parameters."""
    status, answer = _complete(p_url, prompt, 1, {"do_remote_decode": True})
    if status != 200 or not isinstance(answer, dict) or not answer.get("kv_transfer_params"):
        raise ServeError(f"P did not prefill for decode: {status} {str(answer)[:300]}")
    return dict(answer["kv_transfer_params"])


def _verdict(status: int, answer: Any, want: list[int]) -> str:
    """``same`` (the single instance's tokens), ``refused`` (a 4xx) or what else came back."""
    if 400 <= status < 500:
        return "refused"
    if status == 200 and isinstance(answer, dict):
        got = list(answer["choices"][0].get("token_ids") or [])
        return "same" if got == want else f"different tokens {got} != {want}"
    return f"HTTP {status}: {str(answer)[:200]}"


def fuzz_params(
    urls: dict[str, str], ref: Reference, examples: int, settle_s: float, max_tokens: int = 4
) -> dict[str, Any]:
    """``examples`` generated ``kv_transfer_params`` sent to D with prompt 0 (around P's real
    parameters for it), and a third as many to P; what came back.

    Hypothesis draws them (``kv_params_strategies.transfer_params`` with ids that are never a
    real block, group or token count: a plan well formed enough to load other blocks of the
    same request is its own client's business). ``bad`` lists every answer that was neither the
    single instance's tokens nor a 4xx (hypothesis stops at the first and shrinks it); then
    both servers must answer ``/health`` and a plain request as before, and every KV block of
    both must be free again within ``settle_s`` (P's unclaimed holds end at its claim timeout).
    """
    import httpx
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from kvbridge.adapters.vllm.scheduler import PARAMS_KEY
    from tests.adapters.vllm.kv_params_strategies import INVALID_INT, transfer_params

    p_url, d_url = urls["prefill"], urls["decode"]
    prompt, want = ref.prompts[0], ref.tokens[0][:max_tokens]
    verdicts: dict[str, dict[str, int]] = {"decode": {}, "prefill": {}}
    bad: list[dict[str, Any]] = []
    shape = _prefill(p_url, prompt)  # a real answer of P's: the keys and the token's length
    good = shape[PARAMS_KEY]
    mark_d = st.fixed_dictionaries({"do_remote_prefill": st.just(True)})
    mark_p = st.fixed_dictionaries({"do_remote_decode": st.just(True)})

    def check(role: str, url: str, params: dict[str, Any]) -> None:
        status, answer = _complete(url, prompt, max_tokens, params)
        verdict = _verdict(status, answer, want)
        key = verdict if verdict in ("same", "refused") else "bad"
        verdicts[role][key] = verdicts[role].get(key, 0) + 1
        if key == "bad":
            bad.append({"role": role, "params": params, "verdict": verdict})
        assert key != "bad", (role, params, verdict)

    fuzz = settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )

    @fuzz
    @given(mark=mark_d, drawn=transfer_params(good, INVALID_INT))
    def to_decode(mark: dict[str, Any], drawn: dict[str, Any]) -> None:
        # Around P's parameters for a request it held: whole, the first loads it (and P's
        # hold ends), every later one is told at once that it ended; broken, D computes.
        check("decode", d_url, {**mark, **drawn})

    @settings(fuzz, max_examples=max(1, examples // 3))
    @given(mark=mark_p, drawn=transfer_params(good, INVALID_INT))
    def to_prefill(mark: dict[str, Any], drawn: dict[str, Any]) -> None:
        check("prefill", p_url, {**mark, **drawn})

    failure: str | None = None
    try:
        to_decode()
        to_prefill()
    except AssertionError as err:
        failure = str(err)[:2000]
    with httpx.Client(timeout=10, trust_env=False) as http:
        health = {role: http.get(urls[role] + "/health").status_code for role in verdicts}
    after = _complete(d_url, prompt, max_tokens, None)
    usage: dict[str, float] = {}

    def free() -> bool:
        usage.update({role: scrape(urls[role]).get(USAGE, -1.0) for role in verdicts})
        return all(u == 0.0 for u in usage.values())

    try:
        settled: float | None = wait_for("every KV block free after the fuzz", free, settle_s)
    except ServeError:
        settled = None
    return {
        "verdicts": verdicts,
        "bad": bad,
        "failure": failure,
        "health": health,
        "after": _verdict(*after, want),
        "usage": usage,
        "settled_s": settled,
    }


def _api_server(port: int) -> int:
    """The pid of the vLLM API server listening on ``port`` (its command line names it)."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            args = cmdline.read_bytes().split(b"\0")
            if b"vllm.entrypoints.openai.api_server" in args and str(port).encode() in args:
                return int(cmdline.parent.name)
    raise ServeError(f"no vLLM API server on port {port}")


def queue_past_claim(
    urls: dict[str, str], ref: Reference, max_tokens: int, claim_s: float
) -> dict[str, Any]:
    """A request that waits in D past P's claim timeout: P prefills prompt 0, D's API server
    takes it with P's parameters while D's engine core and workers are stopped (SIGSTOP: the
    state of a D too busy to schedule it, made certain, as ``serve_xpyd.disconnect`` does), and
    D resumes 3 s after P's hold lapsed. D's scheduler then sees the request for the first time.

    Returns D's answer (``verdict``: ``same`` when it is the single instance's), how the
    counters moved (D's failed loads; P's unclaimed holds, which may lag: P reports them when
    its engine steps) and how long D took from resuming to its answer.
    """
    from urllib.parse import urlparse

    p_url, d_url = urls["prefill"], urls["decode"]
    prompt, want = ref.prompts[0], ref.tokens[0][:max_tokens]
    p0, d0 = scrape(p_url), scrape(d_url)
    port = urlparse(d_url).port
    assert port is not None
    engine = descendants(_api_server(port))
    if not engine:
        raise ServeError("D's engine processes not found")
    with ThreadPoolExecutor(1) as pool:
        params = _prefill(p_url, prompt)
        published = time.perf_counter()
        for pid in engine:
            os.kill(pid, signal.SIGSTOP)
        try:
            answer = pool.submit(_complete, d_url, prompt, max_tokens, params)
            time.sleep(max(0.0, claim_s + 3 - (time.perf_counter() - published)))
            early = answer.done()
        finally:
            for pid in engine:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        resumed = time.perf_counter()
        if early:
            raise ServeError(f"D answered while its engine was stopped: {answer.result()}")
        status, body = answer.result(timeout=REQUEST_TIMEOUT_S)
        answered_s = time.perf_counter() - resumed
    p1, d1 = scrape(p_url), scrape(d_url)
    return {
        "verdict": _verdict(status, body, want),
        "unclaimed": p1.get(UNCLAIMED, 0) - p0.get(UNCLAIMED, 0),
        "d_failed_loads": d1.get(FAILURES, 0) - d0.get(FAILURES, 0),
        "answered_after_resume_s": answered_s,
    }
