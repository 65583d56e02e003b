"""xPyD as users deploy it: two prefill and two decode servers behind vllm-router (round robin),
many requests in flight, one prefill killed and restarted mid-run, and the P/D edge cases.

Every server is started by its script in ``examples/deploy`` (``prefill.sh`` twice, ``decode.sh``
twice, ``router.sh`` over all four); requests go through the router with the ``openai`` client and
every server's state is read from its Prometheus ``/metrics`` (vLLM's own and kvbridge's through
vLLM's hooks), as an operator would. The phases, in one deployment:

1. **In flight**: the first ``IN_FLIGHT`` prompts (mixed lengths, from one token to several
   hundred; every fourth streamed) sent at once. Once clients hold a few answers (the rest still
   in flight), prefill 1 is killed (SIGKILL to its process group) and started again on the same
   ports. Requests the router could not place meanwhile are sent again once it is back, as a
   client would.
2. **Edge cases**, one request at a time so each one's bytes can be read from D's counters: a
   prompt with no hit (the yardstick), the same length with a prefix already in both D's caches
   (partial hit), a prompt both D's hold whole (full hit), and a repeated prompt.
3. **Client disconnect after P answered**: the request waits on D unscheduled (D's engines
   stopped meanwhile, as a D too busy to take it); the client goes away; P's blocks must come
   back through D's release, long before the lease (the time is measured), with no load on D.

Then nothing may stay held: every server's KV usage back to 0 and no lease expired.

    .venv/bin/python -m tests.adapters.vllm.e2e.serve_xpyd --transport mooncake
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import signal
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from tests.adapters.vllm.e2e.run_pd import CASES, Reference, build_reference, stop_all
from tests.adapters.vllm.e2e.serve_pd import (
    BYTES,
    DEPLOY,
    FAILURES,
    REQUEST_TIMEOUT_S,
    SERVED_NAME,
    START_DEADLINE_S,
    TRANSFERS,
    ServeError,
    Server,
    _env,
    _tokens_of,
    client_of,
    deploy_vars,
    free_ports,
    query_stream,
    scrape,
    tail,
    vllm_args,
    wait_healthy,
)

#: The prompts sent at once in phase 1 (the case's first ones).
IN_FLIGHT = 32
#: D's concurrency: lower than the requests in flight, so requests wait in D's queue with P's
#: parameters (the ones a killed P can no longer serve).
D_MAX_SEQS = 4
#: Prefill 1 is killed once the clients hold this many answers.
KILL_AFTER = 3
#: Seconds P holds a published request for D (the deployment's ``KVB_LEASE``).
LEASE_S = 60.0
#: Per prompt of the ``llama_xpyd`` case after the in-flight ones: its role in phase 2/3.
EDGE = {"no_hit": 32, "partial_hit": 33, "full_hit": 34, "disconnect": 35}
#: Tokens of the partial-hit prompt both D's hold before it is routed (two 32-token blocks).
PARTIAL_PREFIX = 64


def total(urls: list[str], name: str) -> float:
    """``name`` summed over servers."""
    return sum(scrape(u).get(name, 0.0) for u in urls)


LEASE_EXPIRIES = "vllm:kvbridge_lease_expiries_total"
USAGE = "vllm:kv_cache_usage_perc"
SUCCESS = "vllm:request_success_total"


def wait_for(what: str, check: Any, timeout: float, every: float = 0.2) -> float:
    """Seconds until ``check()`` is true; raises ``ServeError`` naming ``what`` after ``timeout``."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if check():
            return time.perf_counter() - t0
        time.sleep(every)
    raise ServeError(f"{what}: not within {timeout:.0f} s")


class Deployment:
    """The four servers and the router, each from its script; ``restart`` brings one back."""

    def __init__(self, ref: Reference, transport: str, mode: str, work: Path) -> None:
        secret = work / "secret"
        secret.write_text(uuid.uuid4().hex + "\n")
        secret.chmod(0o600)
        self.work = work
        deploy = {**deploy_vars(str(ref.model), transport, mode, secret), "KVB_LEASE": str(LEASE_S)}
        base = vllm_args(ref.case.dtype, ref.case.block_size is None)
        *http, side0, side1, side2, side3 = free_ports(9)
        side = [side0, side1, side2, side3]
        self.specs: dict[str, tuple[list[str], dict[str, str]]] = {}
        for n, (role, script, core) in enumerate(
            [
                ("prefill0", "prefill.sh", "0"),
                ("prefill1", "prefill.sh", "0"),
                ("decode0", "decode.sh", "1"),
                ("decode1", "decode.sh", "1"),
            ]
        ):
            # D's API servers log each abort: the disconnect phase waits for it (ABORTED).
            d_args = [
                "--max-num-seqs",
                str(D_MAX_SEQS),
                "--enable-log-requests",
                "--max-log-len",
                "8",
            ]
            args = [*base, *d_args] if role.startswith("d") else base
            # Each D handshakes with both P's at start (prefill_peers).
            peers = {"KVB_PREFILL_PEERS": f"127.0.0.1:{side0},127.0.0.1:{side1}"}
            env = _env(
                core,
                **deploy,
                KVBRIDGE_HOST="127.0.0.1",
                HTTP_HOST="127.0.0.1",
                HTTP_PORT=str(http[n]),
                KVBRIDGE_PORT=str(side[n]),
                **(peers if role.startswith("d") else {}),
            )
            self.specs[role] = (["bash", str(DEPLOY / script), *args], env)
        self.urls = {role: f"http://127.0.0.1:{http[n]}" for n, role in enumerate(self.specs)}
        self.urls["router"] = f"http://127.0.0.1:{http[4]}"
        router_env = _env(
            None,
            PREFILL_URLS=f"{self.urls['prefill0']} {self.urls['prefill1']}",
            DECODE_URLS=f"{self.urls['decode0']} {self.urls['decode1']}",
            ROUTER_HOST="127.0.0.1",
            ROUTER_PORT=str(http[4]),
            VLLM_ROUTER=str(Path(sys.executable).parent / "vllm-router"),
        )
        self.specs["router"] = (["bash", str(DEPLOY / "router.sh")], router_env)
        self.servers: dict[str, Server] = {}
        self.starts: dict[str, int] = {}

    @property
    def prefills(self) -> list[str]:
        return [self.urls["prefill0"], self.urls["prefill1"]]

    @property
    def decodes(self) -> list[str]:
        return [self.urls["decode0"], self.urls["decode1"]]

    def log(self, role: str) -> Path:
        return self.work / f"{role}.{self.starts.get(role, 0)}.log"

    def start(self, role: str) -> None:
        self.starts[role] = self.starts.get(role, 0) + 1
        argv, env = self.specs[role]
        self.servers[role] = Server(role, argv, self.log(role), env)

    def wait_healthy(self, roles: list[str]) -> float:
        t0 = time.perf_counter()
        deadline = t0 + START_DEADLINE_S
        for role in roles:
            wait_healthy(list(self.servers.values()), self.urls[role] + "/health", deadline)
        return time.perf_counter() - t0

    def kill(self, role: str) -> None:
        """SIGKILL to the server's process group: its engine and workers die at once."""
        server = self.servers[role]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.proc.pid, signal.SIGKILL)
        server.stop()

    def stop(self) -> None:
        stop_all(self.servers.values(), grace=20.0)

    def tails(self) -> str:
        logs = sorted(self.work.glob("*.log"))
        return "\n".join(f"--- {p.name} ---\n{tail(p, 25)}" for p in logs)


def complete(client: Any, ids: list[int], max_tokens: int, *, stream: bool = False) -> list[int]:
    """One greedy completion (streamed or not): its token ids."""
    if stream:
        return query_stream(client, ids, max_tokens)
    resp = client.completions.create(
        model=SERVED_NAME,
        prompt=ids,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    return _tokens_of(resp.choices[0])


def in_flight(dep: Deployment, ref: Reference, max_tokens: int, log: Any) -> dict[str, Any]:
    """Phase 1: ``IN_FLIGHT`` requests at once; prefill 1 killed after ``KILL_AFTER`` answers
    and restarted; the requests that failed meanwhile sent again once it is back."""
    client = client_of(dep.urls["router"])
    answers: dict[int, list[int]] = {}
    errors: dict[int, list[str]] = {}
    lock = threading.Lock()

    def send(i: int) -> None:
        try:
            tokens = complete(client, ref.prompts[i], max_tokens, stream=i % 4 == 3)
        except Exception as err:  # the router's answer while a prefill is down
            with lock:
                errors.setdefault(i, []).append(f"{type(err).__name__}: {str(err)[:120]}")
            return
        with lock:
            answers[i] = tokens

    p1 = dep.urls["prefill1"]
    before = scrape(p1).get(SUCCESS, 0.0)
    failures_before = total(dep.decodes, FAILURES)
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(IN_FLIGHT) as pool:
        futures = [pool.submit(send, i) for i in range(IN_FLIGHT)]
        # Killed once clients hold a few answers: the rest are still in flight then (queued on
        # D behind D_MAX_SEQS, some with prefill 1's parameters), which is what the kill tests.
        # (Prefill 1's own success counter read over HTTP lagged until every request was done.)
        wait_for(f"{KILL_AFTER} answers", lambda: len(answers) >= KILL_AFTER, 120, every=0.02)
        killed_at = time.perf_counter() - t0
        with lock:
            answered_before_kill = len(answers)
        p1_prefills = scrape(p1).get(SUCCESS, 0.0) - before
        dep.kill("prefill1")
        log(f"prefill 1 killed {killed_at:.1f} s in ({answered_before_kill} answered by then)")
        dep.start("prefill1")
        concurrent.futures.wait(futures, timeout=REQUEST_TIMEOUT_S * 2)
    first_pass_errors = dict(errors)
    restart_s = dep.wait_healthy(["prefill1"])
    log(
        f"prefill 1 healthy again after {restart_s:.1f} s; {len(first_pass_errors)} requests "
        f"failed while it was down: {sorted(first_pass_errors)}"
    )
    for _ in range(3):  # as a client: send the failed ones again, a bounded number of times
        missing = [i for i in range(IN_FLIGHT) if i not in answers]
        if not missing:
            break
        for i in missing:
            send(i)
    mismatches = [i for i in range(IN_FLIGHT) if answers.get(i) != ref.tokens[i]]
    return {
        "answered": len(answers),
        "mismatches": mismatches,
        "errors": {str(k): v for k, v in errors.items()},
        "failed_while_down": sorted(first_pass_errors),
        "killed_at_s": killed_at,
        "answered_before_kill": answered_before_kill,
        "p1_prefills_before_kill": p1_prefills,
        "restart_s": restart_s,
        "d_failed_loads": total(dep.decodes, FAILURES) - failures_before,
        "wall_s": time.perf_counter() - t0,
    }


def one_request(dep: Deployment, ref: Reference, i: int, max_tokens: int) -> dict[str, Any]:
    """Prompt ``i`` through the router alone: whether it matched, and the bytes and loads D's
    counters gained (read once the stats interval has passed)."""
    b0, t0 = total(dep.decodes, BYTES), total(dep.decodes, TRANSFERS)
    f0 = total(dep.decodes, FAILURES)
    tokens = complete(client_of(dep.urls["router"]), ref.prompts[i], max_tokens)
    with contextlib.suppress(ServeError):  # a request that loads nothing never moves the count
        wait_for("D's transfer counter", lambda: total(dep.decodes, TRANSFERS) > t0, 5)
    return {
        "prompt": i,
        "prompt_len": len(ref.prompts[i]),
        "match": tokens == ref.tokens[i],
        "bytes": total(dep.decodes, BYTES) - b0,
        "loads": total(dep.decodes, TRANSFERS) - t0,
        "failed": total(dep.decodes, FAILURES) - f0,
    }


def warm_decodes(dep: Deployment, ids: list[int]) -> None:
    """Both D's compute ``ids`` themselves (no P): their prefix caches then hold it."""
    for url in dep.decodes:
        complete(client_of(url), ids, 1)


def edge_cases(dep: Deployment, ref: Reference, max_tokens: int, log: Any) -> dict[str, Any]:
    """Phase 2: no hit, a partial and a full hit on D (not on P), a repeated prompt."""
    out: dict[str, Any] = {"no_hit": one_request(dep, ref, EDGE["no_hit"], max_tokens)}
    warm_decodes(dep, ref.prompts[EDGE["partial_hit"]][:PARTIAL_PREFIX])
    out["partial_hit"] = one_request(dep, ref, EDGE["partial_hit"], max_tokens)
    warm_decodes(dep, ref.prompts[EDGE["full_hit"]])
    out["full_hit"] = one_request(dep, ref, EDGE["full_hit"], max_tokens)
    # Prompt 0 again, twice: round robin takes it to each D once more.
    out["repeated"] = [one_request(dep, ref, 1, max_tokens) for _ in range(2)]
    for key, value in out.items():
        log(f"{key}: {value}")
    return out


def descendants(root: int) -> list[int]:
    """Every process below ``root`` (a vLLM API server's engine core and its workers)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    found, frontier = [], [root]
    while frontier:
        below = [pid for pid, parent in parents.items() if parent in frontier]
        found += below
        frontier = below
    return found


def engine_processes(server: Server) -> list[int]:
    """The server's processes but its API server: the engine core and its workers."""
    return descendants(server.proc.pid)


#: What vLLM's API server logs (with ``--enable-log-requests``) once it aborted a request.
ABORTED = "Aborted request"


def aborts_logged(dep: Deployment) -> int:
    """How many aborts the D API servers have logged so far."""
    count = 0
    for role in ("decode0", "decode1"):
        with contextlib.suppress(OSError):
            count += dep.log(role).read_text(errors="replace").count(ABORTED)
    return count


def disconnect(dep: Deployment, ref: Reference, log: Any) -> dict[str, Any]:
    """Phase 3: the client leaves after P answered, while its request waits on D unscheduled.

    D's engines (not their API servers) are stopped (SIGSTOP) meanwhile: the state of a D too
    busy to schedule the request yet, made certain. The API server takes the request, sees the
    client go and aborts it; the engine, resumed, ends a request it never scheduled.
    """
    import httpx

    frozen = [pid for role in ("decode0", "decode1") for pid in engine_processes(dep.servers[role])]
    if not frozen:
        raise ServeError("no engine process found under the decode servers")
    loads0 = total(dep.decodes, TRANSFERS)
    success0 = total(dep.prefills, SUCCESS)
    aborts0 = aborts_logged(dep)
    body = {
        "model": SERVED_NAME,
        "prompt": ref.prompts[EDGE["disconnect"]],
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    try:
        with (
            httpx.Client(timeout=60, trust_env=False) as http,
            http.stream("POST", dep.urls["router"] + "/v1/completions", json=body) as resp,
        ):
            # P answered (its prefill counted) and holds the blocks for D.
            wait_for("prefill answering", lambda: total(dep.prefills, SUCCESS) > success0, 60)
            held = max(scrape(u).get(USAGE, 0.0) for u in dep.prefills)
            time.sleep(0.5)  # the router passes the request on to D
            left_at = time.perf_counter()
            resp.close()  # the client goes away
        # D's API server sees the client gone and aborts the request; the engines resume only
        # then (a fixed wait let a slow machine resume them first, and D loaded the request).
        wait_for("D's API server aborting the request", lambda: aborts_logged(dep) > aborts0, 60)
    finally:
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    resumed_at = time.perf_counter()
    wait_for(
        "prefill's blocks freed after the client left",
        lambda: max(scrape(u).get(USAGE, 0.0) for u in dep.prefills) == 0.0,
        LEASE_S,
    )
    freed_at = time.perf_counter()
    result = {
        "p_usage_held": held,
        "freed_after_s": freed_at - left_at,
        "freed_after_resume_s": freed_at - resumed_at,
        "d_loads_meanwhile": total(dep.decodes, TRANSFERS) - loads0,
    }
    log(f"client disconnect: {result}")
    return result


def run_xpyd(
    ref: Reference,
    *,
    transport: str = "mooncake",
    mode: str = "pull",
    max_tokens: int = 32,
    work_dir: str | Path | None = None,
    log: Any = print,
) -> dict[str, Any]:
    """Every phase above on one deployment; a summary (raises ``ServeError`` with the logs'
    tails when a server, the router or a request fails outright)."""
    work = Path(work_dir) if work_dir is not None else Path(tempfile.mkdtemp(prefix="kvb-xpyd-"))
    work.mkdir(parents=True, exist_ok=True)
    dep = Deployment(ref, transport, mode, work)
    summary: dict[str, Any] = {"transport": transport, "mode": mode, "work_dir": str(work)}
    try:
        for role in dep.specs:
            dep.start(role)
        ready = dep.wait_healthy(["prefill0", "prefill1", "decode0", "decode1"])
        # The router's own /health answers before it has checked its workers: one request.
        wait_for("the router placing a request", lambda: _answers(dep), 60, every=1.0)
        log(f"2P2D and vllm-router ready in {ready:.1f} s at {dep.urls['router']}")
        summary["in_flight"] = in_flight(dep, ref, max_tokens, log)
        log(f"in flight: {summary['in_flight']}")
        summary["edge"] = edge_cases(dep, ref, max_tokens, log)
        summary["disconnect"] = disconnect(dep, ref, log)
        every = [*dep.prefills, *dep.decodes]
        summary["settled_s"] = wait_for(
            "every server's KV usage back to 0", lambda: total(every, USAGE) == 0.0, LEASE_S
        )
        summary["lease_expiries"] = total(dep.prefills, LEASE_EXPIRIES)
        summary["prefill_loads_failed"] = total(dep.prefills, FAILURES)
    except (Exception, KeyboardInterrupt) as exc:
        raise ServeError(f"{type(exc).__name__}: {exc}\n{dep.tails()}") from exc
    finally:
        dep.stop()
    summary["tails"] = dep.tails()
    return summary


def _answers(dep: Deployment) -> bool:
    try:
        complete(client_of(dep.urls["router"], timeout=30), [5, 6, 7], 1)
        return True
    except Exception:
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--transport", default="mooncake")
    ap.add_argument("--mode", default="pull", choices=["pull", "push"])
    ap.add_argument("--work-dir", help="logs here (kept); default: a temp dir")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvb-models-") as models:
        ref = build_reference(CASES["llama_xpyd"], Path(models))
        summary = run_xpyd(ref, transport=a.transport, mode=a.mode, work_dir=a.work_dir)
    summary.pop("tails", None)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
