"""P → D the way users deploy it: vLLM's OpenAI servers, kvbridge's proxy, an OpenAI client.

Takes a tiny model and its single-instance greedy outputs (``run_pd.build_reference``), then
starts a prefill server (``kv_producer``), a decode server (``kv_consumer``) and the proxy
through the launch scripts in ``examples/deploy`` (``one-host.sh`` on free 127.0.0.1 ports, or
``prefill.sh``, ``decode.sh`` and ``proxy.sh`` on two hosts) and sends every prompt (token ids)
through the proxy with the ``openai`` client. D's token ids must equal the reference's; each
answer must carry the proxy's headers saying P returned ``kv_transfer_params``. One prompt is
also streamed, and a control request goes to P and D directly (P prefills prompt 0, D gets other
tokens with P's params and must answer as for prompt 0), proving D used P's KV.

    .venv/bin/python -m tests.adapters.vllm.e2e.serve_pd --transport mooncake --model llama

Exit status 0 when everything matched. Server and proxy logs go to the work directory (kept on
failure, or with ``--work-dir``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from tests.adapters.vllm.e2e.run_pd import CASES, Reference, build_reference, stop_all
from tests.netns import Host

REPO = Path(__file__).resolve().parents[4]
SERVED_NAME = "tiny"
#: P and D each get one core (the engines' OpenMP threads); the reference gets both.
CORE_P, CORE_D = "0", "1"
START_DEADLINE_S = 240.0
REQUEST_TIMEOUT_S = 180.0


class ServeError(RuntimeError):
    """A server, the proxy or a request failed; the message ends with the logs' tails."""


#: Where listening ports are chosen: below the kernel's ephemeral range (32768-60999 by
#: default), so that no outgoing connection takes one between the choice and the bind, or
#: while a killed server's port waits for its restart.
LISTEN_PORTS = range(20000, 32768)


def free_ports(count: int) -> list[int]:
    """Distinct TCP ports free on 127.0.0.1 right now, from ``LISTEN_PORTS`` (held open
    together while choosing)."""
    import random

    socks: list[socket.socket] = []
    try:
        for port in random.sample(LISTEN_PORTS, len(LISTEN_PORTS)):
            if len(socks) == count:
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def tail(path: Path, lines: int = 40) -> str:
    """The last lines of a log file ('' when absent)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class Server:
    """A subprocess in its own session (its children die with it), logging to a file."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str]) -> None:
        self.name = name
        self.log = log
        self._out = log.open("wb")
        self.proc = subprocess.Popen(
            argv,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
            start_new_session=True,
        )

    def terminate(self) -> None:
        """SIGTERM to the process group (a graceful stop begins; ``stop`` waits for it)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM to the process group, SIGKILL after ``grace`` seconds."""
        self.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(grace)
        # Children (engine core, workers) may outlive the leader: kill what is left of the group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self._out.close()


#: The deployment scripts users start (README "Deploying"): the tests launch through them.
DEPLOY = REPO / "examples" / "deploy"


def wait_healthy(servers: list[Server], url: str, deadline: float) -> float:
    """Seconds until ``url`` answered 200; raises if any server exits or time runs out."""
    import httpx

    t0 = time.perf_counter()
    while time.perf_counter() < deadline:
        for server in servers:
            if server.proc.poll() is not None:
                raise ServeError(f"{server.name} exited with {server.proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=5, trust_env=False).status_code == 200:
                return time.perf_counter() - t0
        time.sleep(1.0)
    raise ServeError(f"{url} not healthy in {time.perf_counter() - t0:.0f} s")


def _env(cores: str | None = None, **deploy: str) -> dict[str, str]:
    """The environment of a script: this one's, the test's engine settings, ``deploy``'s values."""
    env = dict(os.environ)
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    env["VLLM_LOG_STATS_INTERVAL"] = "1"  # the connector's stats line comes within a second
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    env["PYTHON"] = sys.executable
    for name in ("KVBRIDGE_HOST", "KVBRIDGE_PORT", "KVBRIDGE_SECRET", "KVBRIDGE_SECRET_FILE"):
        env.pop(name, None)  # only what this deployment sets
    if cores is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cores
    env.update(deploy)
    return env


def vllm_args(dtype: str, hybrid: bool) -> list[str]:
    """The vLLM options both instances get, after the scripts' own (model, ports, connector)."""
    args = [
        "--served-model-name",
        SERVED_NAME,
        "--dtype",
        dtype,
        "--max-model-len",
        "1024",
        "--enforce-eager",
        "--seed",
        "0",
        "--max-num-seqs",
        "8",
        "--enable-prompt-tokens-details",
    ]
    if not hybrid:  # hybrid models: vLLM picks the attention block size
        args += ["--block-size", "32"]
    return args


def deploy_vars(model: str, transport: str, mode: str, secret_file: Path) -> dict[str, str]:
    """What a launch script is given for one pair (the README's variables)."""
    out = {
        "MODEL": model,
        "KVB_TRANSPORT": transport,
        "KVB_MODE": mode,
        "KVB_LEASE": "60",
        "KVBRIDGE_SECRET_FILE": str(secret_file),
    }
    return out


def _chunk_tokens(choice: Any) -> list[int]:
    """The token ids a completion choice (or a streamed chunk's) carries; none if it has none."""
    ids = getattr(choice, "token_ids", None)
    if ids is None:
        ids = (choice.model_extra or {}).get("token_ids")
    return [int(t) for t in ids or ()]


def _tokens_of(choice: Any) -> list[int]:
    ids = getattr(choice, "token_ids", None)
    if ids is None:
        ids = (choice.model_extra or {}).get("token_ids")
    if ids is None:
        raise ServeError("the completion carries no token_ids (return_token_ids ignored?)")
    return [int(t) for t in ids]


def _cached(usage: Any) -> int | None:
    details = getattr(usage, "prompt_tokens_details", None) if usage is not None else None
    return getattr(details, "cached_tokens", None) if details is not None else None


def client_of(url: str, timeout: float = REQUEST_TIMEOUT_S) -> Any:
    """An OpenAI client of the server at ``url``: no retries of its own, no proxy from the
    environment."""
    import openai

    return openai.OpenAI(
        base_url=url + "/v1",
        api_key="x",
        max_retries=0,
        timeout=timeout,
        http_client=openai.DefaultHttpxClient(trust_env=False),
    )


def query(client: Any, ids: list[int], max_tokens: int) -> dict[str, Any]:
    """One completion through the proxy: token ids, the proxy's headers, the cached tokens D's
    usage reports (P's prefix-cache hit: vLLM reports it because P's parameters carry
    ``do_remote_prefill``)."""
    t0 = time.perf_counter()
    raw = client.completions.with_raw_response.create(
        model=SERVED_NAME,
        prompt=ids,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    total = time.perf_counter() - t0
    resp = raw.parse()
    hdr = raw.headers
    prefill_ms = hdr.get("x-kvbridge-prefill-ms")
    return {
        "token_ids": _tokens_of(resp.choices[0]),
        "text": resp.choices[0].text,
        "prefill_ms": float(prefill_ms) if prefill_ms is not None else None,
        "remote_engine_id": hdr.get("x-kvbridge-remote-engine-id"),
        "remote_num_tokens": hdr.get("x-kvbridge-remote-num-tokens"),
        "dispatch": hdr.get("x-kvbridge-dispatch"),
        "p_cached": _cached(resp.usage),
        "total_s": total,
    }


def query_stream(client: Any, ids: list[int], max_tokens: int) -> list[int]:
    """One streamed completion through the proxy: the token ids of all chunks."""
    out: list[int] = []
    stream = client.completions.create(
        model=SERVED_NAME,
        prompt=ids,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    for chunk in stream:
        for choice in chunk.choices:
            out += _chunk_tokens(choice)
    return out


#: Chat requests through the front (text, streamed), each a prompt of its own so that D's prefix
#: cache holds none of it and loads it from P.
CHATS = tuple(
    (" ".join(f"w{(7 * n + 3 * i) % 97 + 10}" for i in range(40 + 25 * n)), n == 1)
    for n in range(2)
)


def query_chat(client: Any, text: str, max_tokens: int, *, stream: bool) -> str:
    """One greedy chat completion: its content (all chunks' deltas when streamed)."""
    kwargs: dict[str, Any] = {
        "model": SERVED_NAME,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    if not stream:
        return str(client.chat.completions.create(**kwargs).choices[0].message.content)
    parts = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
    return "".join(parts)


def control(
    p_url: str, d_url: str, ids: list[int], other: list[int], max_tokens: int
) -> dict[str, Any]:
    """P prefills ``ids``; D gets ``other`` with P's params (direct HTTP, no proxy)."""
    import httpx

    with httpx.Client(timeout=REQUEST_TIMEOUT_S, trust_env=False) as http:
        body = {
            "model": SERVED_NAME,
            "prompt": ids,
            "max_tokens": 1,
            "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True},
        }
        pre = http.post(p_url + "/v1/completions", json=body)
        pre.raise_for_status()
        params = pre.json().get("kv_transfer_params")
        if not params:
            raise ServeError(f"control: P returned no kv_transfer_params: {pre.text[:300]}")
        body = {
            "model": SERVED_NAME,
            "prompt": other,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "kv_transfer_params": params,
        }
        dec = http.post(d_url + "/v1/completions", json=body)
        dec.raise_for_status()
        return {"p_params": params, "d_tokens": list(dec.json()["choices"][0]["token_ids"])}


def scrape(url: str) -> dict[str, float]:
    """A server's Prometheus metrics, each sample summed over its labels."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
    return out


#: kvbridge's counters, as vLLM's Prometheus hook exports them.
HANDSHAKES = "vllm:kvbridge_handshake_time_seconds_count"
TRANSFERS = "vllm:kvbridge_transfers_total"
BYTES = "vllm:kvbridge_transfer_bytes_sum"
DESCRIPTORS = "vllm:kvbridge_transfer_descriptors_sum"
FAILURES = "vllm:kvbridge_transfer_failures_total"
STREAMED = "vllm:kvbridge_streamed_bytes_sum"


def transfer_stats(url: str, want: int, wait: float = 15.0) -> dict[str, float]:
    """The connector's stats as D's Prometheus ``/metrics`` shows them, as an operator reads them.

    Not vLLM's ``KV Transfer metrics`` log lines: vLLM logs an interval in which D produced no
    token at debug level, so a load that ends alone in its interval never shows there. Waits
    (bounded) until ``want`` transfers were counted: stats reach the API server once per step.
    """
    deadline = time.monotonic() + wait
    while True:
        m = scrape(url)
        total = {
            "transfers": m.get(TRANSFERS, 0.0),
            "failed": m.get(FAILURES, 0.0),
            "MiB": m.get(BYTES, 0.0) / 2**20,
            "descriptors": m.get(DESCRIPTORS, 0.0),
            "handshakes": m.get(HANDSHAKES, 0.0),
            "streamed_MiB": m.get(STREAMED, 0.0) / 2**20,
        }
        if total["transfers"] >= want or time.monotonic() > deadline:
            return total
        time.sleep(0.5)


#: P's hold settings in a flood run (``run_serve(flood=...)``): few holds, short unclaimed ones.
FLOOD_HOLDS = {"KVB_MAX_HELD_REQUESTS": "4", "KVB_CLAIM_TIMEOUT": "15"}
DECLINED = "vllm:kvbridge_holds_declined_total"
UNCLAIMED = "vllm:kvbridge_unclaimed_holds_total"
HELD_PEAK = "vllm:kvbridge_held_blocks_peak"
HOLD_LIMIT = "vllm:kvbridge_hold_limit_blocks"


def flood_prefill(
    urls: dict[str, str], ref: Reference, count: int, max_tokens: int
) -> dict[str, Any]:
    """``count`` concurrent prefills marked for remote decode that nobody claims, sent to P
    directly (as any client that reaches P's port could), and one normal request to P meanwhile.

    What P answered each (held: kvbridge's params; declined: ``kvbridge_declined``), whether the
    normal request was answered as the single instance, and P's hold metrics once every hold
    has ended (bounded wait: the claim timeout and a margin).
    """
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    p_url = urls["prefill"]

    def marked(i: int) -> dict[str, Any]:
        prompt = [10 + (7 * i + j) % 900 for j in range(160)]
        body = {
            "model": SERVED_NAME,
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True},
        }
        with httpx.Client(timeout=REQUEST_TIMEOUT_S, trust_env=False) as http:
            reply = http.post(p_url + "/v1/completions", json=body)
            reply.raise_for_status()
            return dict(reply.json().get("kv_transfer_params") or {})

    with ThreadPoolExecutor(count) as pool:
        answers = list(pool.map(marked, range(count)))
        normal = query(client_of(p_url), ref.prompts[0], max_tokens)
    held = sum(1 for a in answers if "kvbridge" in a)
    declined = sum(1 for a in answers if "kvbridge_declined" in a)
    wait = float(FLOOD_HOLDS["KVB_CLAIM_TIMEOUT"]) + 20.0
    deadline = time.monotonic() + wait
    while True:
        m = scrape(p_url)
        if m.get(UNCLAIMED, 0.0) >= held or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    return {
        "sent": count,
        "held": held,
        "declined": declined,
        "normal_match": normal["token_ids"] == ref.tokens[0],
        "metrics": {name: m.get(name) for name in (DECLINED, UNCLAIMED, HELD_PEAK, HOLD_LIMIT)},
    }


def start_pair(
    ref: Reference,
    transport: str,
    mode: str,
    work: Path,
    hosts: tuple[Host, Host] | None,
    router: str = "kvbridge-proxy",
    extra: dict[str, str] | None = None,
) -> tuple[list[Server], dict[str, str]]:
    """P, D and the proxy through ``examples/deploy``: the servers and the URLs to reach them.

    One host: ``one-host.sh`` starts all three. Two hosts: P is ``prefill.sh`` in P's network
    namespace, D ``decode.sh`` and the proxy ``proxy.sh`` in D's, each told its own address as
    the README says; the caller runs in D's namespace (``tests.netns.run_in``) as a client there.
    """
    secret = work / "secret"
    secret.write_text(uuid.uuid4().hex + "\n")
    secret.chmod(0o600)
    # layerwise / layerwise-pull: the proxy dispatches at once, in P's configured mode (push:
    # P writes each layer; pull: D reads each layer P says is computed)
    layerwise = mode in ("layerwise", "layerwise-pull")
    deploy_mode = {"layerwise": "push", "layerwise-pull": "pull"}.get(mode, mode)
    deploy = {**deploy_vars(str(ref.model), transport, deploy_mode, secret), **(extra or {})}
    if transport == "nixl" and hosts is not None:
        # Two namespaces are one node to UCX, which would read through CMA: TCP, as across hosts.
        deploy["KVB_TRANSPORT_OPTIONS"] = json.dumps({"ucx": {"TLS": "tcp"}})
    args = vllm_args(ref.case.dtype, ref.case.block_size is None)
    http_p, http_d, http_proxy, side_p, side_d, boot = free_ports(6)
    if layerwise and router == "vllm-router":
        # vllm-router's mooncake mode: it asks P's bootstrap /query at start, then gives P and
        # D a transfer id of its own (router.sh, common.sh)
        deploy.update(
            KVB_BOOTSTRAP_PORT=str(boot),
            ROUTER_KV_CONNECTOR="mooncake",
            PREFILL_BOOTSTRAP_PORTS=str(boot),
        )
    if hosts is None:
        env = _env(
            None,
            **deploy,
            LOG_DIR=str(work),
            PREFILL_CPUS=CORE_P,
            DECODE_CPUS=CORE_D,
            PREFILL_PORT=str(http_p),
            DECODE_PORT=str(http_d),
            PROXY_PORT=str(http_proxy),
            PREFILL_SIDE_PORT=str(side_p),
            DECODE_SIDE_PORT=str(side_d),
            ROUTER=router,
            VLLM_ROUTER=str(Path(sys.executable).parent / "vllm-router"),
        )
        argv = ["bash", str(DEPLOY / "one-host.sh"), *args]
        servers = [Server("one-host", argv, work / "proxy.log", env)]
        p_addr = d_addr = "127.0.0.1"
    else:
        p_host, d_host = hosts
        p_addr, d_addr = p_host.address, d_host.address
        p_env = _env(
            CORE_P,
            **deploy,
            KVBRIDGE_HOST=p_addr,
            HTTP_HOST=p_addr,
            HTTP_PORT=str(http_p),
            KVBRIDGE_PORT=str(side_p),
        )
        d_env = _env(
            CORE_D,
            **deploy,
            KVBRIDGE_HOST=d_addr,
            HTTP_HOST=d_addr,
            HTTP_PORT=str(http_d),
            KVBRIDGE_PORT=str(side_d),
            KVB_PREFILL_PEERS=f"{p_addr}:{side_p}",
        )
        proxy_env = _env(
            None,
            PREFILL_URLS=f"http://{p_addr}:{http_p}",
            DECODE_URLS=f"http://{d_addr}:{http_d}",
            PROXY_HOST=d_addr,
            PROXY_PORT=str(http_proxy),
        )
        # `ip netns exec` as on each host: it also mounts the namespace's own /sys, where UCX
        # lists the network devices (through the parent's /sys, D's would see only loopback).
        in_p, in_d = (["ip", "netns", "exec", h.netns, "bash"] for h in hosts)
        servers = [
            Server(
                "prefill", [*in_p, str(DEPLOY / "prefill.sh"), *args], work / "prefill.log", p_env
            ),
            Server("decode", [*in_d, str(DEPLOY / "decode.sh"), *args], work / "decode.log", d_env),
            Server(
                "proxy",
                [
                    *in_d,
                    str(DEPLOY / "proxy.sh"),
                    "--timeout",
                    str(REQUEST_TIMEOUT_S),
                    *(["--dispatch", "concurrent"] if layerwise else []),
                ],
                work / "proxy.log",
                proxy_env,
            ),
        ]
    # (one-host.sh gives D P's side channel itself; the two-host D is told it, as the README says)
    urls = {
        "prefill": f"http://{p_addr}:{http_p}",
        "decode": f"http://{d_addr}:{http_d}",
        "proxy": f"http://{d_addr}:{http_proxy}",
        "prefill_side": f"tcp://{p_addr}:{side_p}",
    }
    return servers, urls


def wait_ready(
    servers: list[Server], urls: dict[str, str], decode_log: Path, deadline: float
) -> tuple[float, float]:
    """Seconds until P, D and the front answer ``/health``, then until D says it handshook
    with P at start (``prefill_peers``: no request then pays for a handshake)."""
    t0 = time.perf_counter()
    # The proxy's /health answers 200 once P's and D's do; vllm-router's as soon as it runs.
    for name in ("prefill", "decode", "proxy"):
        wait_healthy(servers, urls[name] + "/health", deadline)
    early = f"early handshake with {urls['prefill_side']}: engine"
    return time.perf_counter() - t0, wait_logged(servers, decode_log, early, deadline)


def wait_logged(servers: list[Server], log: Path, text: str, deadline: float) -> float:
    """Seconds until ``text`` appears in ``log``; raises if a server exits or time runs out."""
    t0 = time.perf_counter()
    while time.perf_counter() < deadline:
        if log.exists() and text in log.read_text(errors="replace"):
            return time.perf_counter() - t0
        for server in servers:
            if server.proc.poll() is not None:
                raise ServeError(f"{server.name} exited with {server.proc.returncode}")
        time.sleep(0.2)
    raise ServeError(f"{log.name} never said {text!r}")


def run_serve(
    ref: Reference,
    *,
    transport: str = "mooncake",
    mode: str = "pull",
    max_tokens: int = 32,
    work_dir: str | Path | None = None,
    hosts: tuple[Host, Host] | None = None,
    router: str = "kvbridge-proxy",
    log: Any = print,
    flood: int = 0,
    fuzz: int = 0,
    queue_past_claim: bool = False,
) -> dict[str, Any]:
    """P, D and the proxy as deployed by ``examples/deploy``, ``ref``'s prompts via the OpenAI
    client: a summary.

    ``ref`` (``run_pd.build_reference``) holds the model and its single-instance outputs.
    ``hosts``: P and D in these two network namespaces (call this inside D's, ``run_in``).
    Raises ``ServeError`` (with the logs' tails) when a server, the proxy or a request fails; a
    token mismatch is reported in the summary (``ok`` False, per-prompt ``match``). ``flood``:
    then, with P's holds bounded (``FLOOD_HOLDS``), that many unclaimed prefills sent to P
    directly (``flood_prefill``; the summary's ``flood``). ``fuzz``: that many generated
    ``kv_transfer_params`` sent to D (a third as many to P), ``serve_stress.fuzz_params``;
    ``queue_past_claim``: a request that waits in D (engine stopped) past P's claim timeout,
    ``serve_stress.queue_past_claim`` (the summary's ``fuzz`` and ``queue``).
    """

    work = Path(work_dir) if work_dir is not None else Path(tempfile.mkdtemp(prefix="kvb-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    ps, other = ref.prompts, ref.control
    logs = {name: work / f"{name}.log" for name in ("prefill", "decode", "proxy")}
    servers: list[Server] = []
    results: list[dict[str, Any]] = []
    timings: dict[str, float] = {}

    try:
        t0 = time.perf_counter()
        extra = FLOOD_HOLDS if flood or queue_past_claim else None
        servers, urls = start_pair(ref, transport, mode, work, hosts, router, extra)
        deadline = time.perf_counter() + START_DEADLINE_S
        # D's handshake counter then stays at 0 (checked by the tests).
        _, early = wait_ready(servers, urls, logs["decode"], deadline)
        timings["servers_ready_s"] = time.perf_counter() - t0 - early
        timings["early_handshake_wait_s"] = early
        log(f"P, D and the {router} ready in {timings['servers_ready_s']:.1f} s at {urls['proxy']}")

        client = client_of(urls["proxy"])
        model_ids = [m.id for m in client.models.list()]
        if SERVED_NAME not in model_ids:
            raise ServeError(f"/v1/models through the proxy lists {model_ids}")
        for i, ids in enumerate(ps):
            out = query(client, ids, max_tokens)
            match = out["token_ids"] == ref.tokens[i]
            results.append(
                {
                    "prompt": i,
                    "prompt_len": len(ids),
                    "match": match,
                    "ref_tokens": ref.tokens[i],
                    **out,
                }
            )
            log(
                f"prompt {i} ({len(ids)} tokens): match={match} P {out['prefill_ms']} ms, "
                f"total {out['total_s'] * 1e3:.0f} ms, P cached {out['p_cached']}, "
                f"P num_tokens {out['remote_num_tokens']}"
            )
            if not match:
                log(f"  D:   {out['token_ids']}\n  ref: {ref.tokens[i]}")
        streamed = query_stream(client, ps[0], max_tokens)
        log(f"streamed prompt 0: match={streamed == ref.tokens[0]}")
        chats = []
        for n, (text, stream) in enumerate(CHATS):
            # The reference: the same chat on P alone (no kv_transfer_params: a single instance).
            alone = query_chat(client_of(urls["prefill"]), text, max_tokens, stream=False)
            routed = query_chat(client, text, max_tokens, stream=stream)
            chats.append(
                {
                    "chat": n,
                    "stream": stream,
                    "match": bool(alone) and routed == alone,
                    "routed": routed,
                    "alone": alone,
                }
            )
            log(f"chat {n} (stream={stream}): match={routed == alone}")
        ctl = control(urls["prefill"], urls["decode"], ps[0], other, max_tokens)
        loaded = ctl["d_tokens"] == ref.tokens[0] and ref.control_tokens != ref.tokens[0]
        log(f"control (prompt 0's KV, other tokens): D used P's KV = {loaded}")
        stats = transfer_stats(urls["decode"], len(ps) + 2 + len(CHATS))
        log(f"D's connector stats, from its Prometheus /metrics: {stats}")
        flooded = flood_prefill(urls, ref, flood, max_tokens) if flood else None
        if flooded is not None:
            log(f"flood of {flood} unclaimed prefills on P: {flooded}")
        fuzzed = queued = None
        if fuzz:
            from tests.adapters.vllm.e2e.serve_stress import fuzz_params

            t1 = time.perf_counter()
            claim_s = float(FLOOD_HOLDS["KVB_CLAIM_TIMEOUT"]) if extra else 30.0
            fuzzed = fuzz_params(urls, ref, fuzz, settle_s=claim_s + 20.0)
            log(f"fuzzed kv_transfer_params ({time.perf_counter() - t1:.1f} s): {fuzzed}")
        if queue_past_claim:
            from tests.adapters.vllm.e2e.serve_stress import queue_past_claim as queue

            claim_s = float(FLOOD_HOLDS["KVB_CLAIM_TIMEOUT"])
            queued = queue(urls, ref, max_tokens, claim_s)
            log(f"a request queued in D past P's claim timeout: {queued}")
    except (Exception, KeyboardInterrupt) as exc:
        tails = "\n".join(f"--- {k} log ({p}) ---\n{tail(p)}" for k, p in logs.items())
        raise ServeError(f"{type(exc).__name__}: {exc}\n{tails}") from exc
    finally:
        stop_all(servers, grace=20.0)
    as_prompt0 = ctl["d_tokens"] == ref.tokens[0]
    summary = {
        "model": ref.case.name,
        "transport": transport,
        "mode": mode,
        "dtype": ref.case.dtype,
        "results": results,
        "stream_match": streamed == ref.tokens[0],
        "router": router,
        "chats": chats,
        "control": {"loaded": loaded, "d_tokens": ctl["d_tokens"], "as_prompt0": as_prompt0},
        # kvbridge's proxy says in headers that P returned kv_transfer_params (vllm-router says
        # nothing: D's stats show the loads)
        "p_params_seen": router != "kvbridge-proxy" or all(r["remote_engine_id"] for r in results),
        "stats": stats,
        "flood": flooded,
        "fuzz": fuzzed,
        "queue": queued,
        "timings": timings,
        "work_dir": str(work),
        "logs": {k: str(p) for k, p in logs.items()},
    }
    summary["ok"] = (
        bool(results)
        and all(r["match"] for r in results)
        and summary["stream_match"]
        and all(c["match"] for c in chats)
        and loaded
        and summary["p_params_seen"]
        and stats["transfers"] >= len(ps)
        and stats["failed"] == 0
    )
    if summary["ok"] and work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", default="llama", choices=sorted(CASES))
    ap.add_argument("--transport", default="mooncake")
    ap.add_argument(
        "--mode", default="pull", choices=["pull", "push", "layerwise", "layerwise-pull"]
    )
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--work-dir", help="model and logs here (kept); default: a temp dir")
    ap.add_argument("--json", help="write the summary here")
    ap.add_argument("--router", default="kvbridge-proxy", choices=["kvbridge-proxy", "vllm-router"])
    ap.add_argument("--fuzz", type=int, default=0, help="generated kv_transfer_params to send D")
    ap.add_argument("--queue-past-claim", action="store_true", help="queue one past P's claim")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvb-models-") as models:
        ref = build_reference(CASES[a.model], Path(models), a.max_tokens)
        summary = run_serve(
            ref,
            transport=a.transport,
            mode=a.mode,
            max_tokens=a.max_tokens,
            work_dir=a.work_dir,
            router=a.router,
            fuzz=a.fuzz,
            queue_past_claim=a.queue_past_claim,
        )
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=1))
    if not summary["ok"]:
        print(f"logs kept in {summary['work_dir']}", file=sys.stderr)
    print("OK" if summary["ok"] else "MISMATCH", file=sys.stderr)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
