"""Ready means able to transfer: a P/D pair that answers ``/health`` but cannot move KV between
its instances (P and D of different block sizes on vLLM's CPU attention, whose blocks do not
split into tokens: D refuses P's layout and recomputes every prompt) is reported not ready by the readiness probe ``one-host.sh --wait`` runs, in one line
naming the cause (D's ``vllm:kvbridge_incompatible_loads_total``).

Marked ``e2e`` (run by ``make test`` with ``KVBRIDGE_E2E=1``): two vLLM servers start.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.adapters.vllm.e2e.marks import E2E
from tests.adapters.vllm.e2e.models import build_llama
from tests.adapters.vllm.e2e.run_pd import stop_all
from tests.adapters.vllm.e2e.serve_pd import (
    CORE_D,
    CORE_P,
    DEPLOY,
    START_DEADLINE_S,
    Server,
    _env,
    free_ports,
    tail,
    wait_healthy,
)

pytestmark = E2E


@pytest.mark.timeout(600)
def test_a_pair_of_different_block_sizes_is_not_ready(tmp_path: Path) -> None:
    model = build_llama(tmp_path / "model")
    http_p, http_d, http_front, side_p, side_d = free_ports(5)
    common = ["--dtype", "float32", "--max-model-len", "512", "--enforce-eager"]
    common += ["--max-num-seqs", "4"]
    servers = [
        Server(
            "prefill",
            ["bash", str(DEPLOY / "prefill.sh"), *common, "--block-size", "32"],
            tmp_path / "prefill.log",
            _env(CORE_P, MODEL=str(model), KVB_TRANSPORT="cma", HTTP_PORT=str(http_p),
                 KVBRIDGE_PORT=str(side_p)),
        ),
        Server(
            "decode",
            ["bash", str(DEPLOY / "decode.sh"), *common, "--block-size", "64"],
            tmp_path / "decode.log",
            _env(CORE_D, MODEL=str(model), KVB_TRANSPORT="cma", HTTP_PORT=str(http_d),
                 KVBRIDGE_PORT=str(side_d)),
        ),
        Server(
            "proxy",
            ["bash", str(DEPLOY / "proxy.sh")],
            tmp_path / "proxy.log",
            _env(None, PREFILL_URLS=f"http://127.0.0.1:{http_p}",
                 DECODE_URLS=f"http://127.0.0.1:{http_d}", PROXY_HOST="127.0.0.1",
                 PROXY_PORT=str(http_front)),
        ),
    ]  # fmt: skip
    try:
        deadline = time.perf_counter() + START_DEADLINE_S
        for port in (http_p, http_d, http_front):  # /health says ready everywhere
            wait_healthy(servers, f"http://127.0.0.1:{port}/health", deadline)
        done = subprocess.run(
            [sys.executable, "-m", "kvbridge.deploy.readiness", "--transfer",
             f"http://127.0.0.1:{http_front}", "--decode", f"http://127.0.0.1:{http_d}"],
            capture_output=True, text=True, timeout=240,
        )  # fmt: skip
    finally:
        stop_all(servers, grace=20.0)
    logs = "\n".join(f"--- {s.name}\n{tail(s.log)}" for s in servers)
    assert done.returncode == 1, f"{done.stderr}\n{logs}"
    assert done.stderr.count("\n") == 1, done.stderr
    # D refused P's layout: counted apart from other failures (its own metric), said so
    assert done.stderr.startswith("not ready: ") and "cannot pair" in done.stderr, (
        f"{done.stderr}\n{logs}"
    )
    # what D's log says of the refusal, where the line sends the operator
    decode = (tmp_path / "decode.log").read_text(errors="replace")
    assert "kernel block size: prefill=32 decode=64" in decode, logs
