"""The getting-started one-host quick start, run verbatim as a reader runs it.

The block marked ``<!-- check: serve -->`` (``tests/doc_blocks.py``) copies the deploy scripts
out of the installed package, starts P, D and vllm-router with ``one-host.sh --wait``, sends one
completion with curl and stops them. Here it runs on a tiny local Llama (``MODEL`` from the
environment, as the block allows) on the block's own ports; the answer must be a completion, and
D's log must count a transfer loaded from P.

Marked ``e2e`` (run by ``make test`` with ``KVBRIDGE_E2E=1``): two vLLM servers start.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.adapters.vllm.e2e.marks import E2E
from tests.adapters.vllm.e2e.models import build_llama
from tests.doc_blocks import of_kind, run_block

pytestmark = E2E

#: The ports the quick start uses (one-host.sh's defaults): HTTP of the router, P, D; side
#: channels of P and D.
PORTS = (8000, 8100, 8200, 5790, 5800)


def _taken(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.timeout(1200)
def test_the_one_host_quick_start_runs_as_written(tmp_path: Path) -> None:
    (block,) = of_kind("serve")
    taken = [port for port in PORTS if _taken(port)]
    assert not taken, f"the quick start's ports {taken} are in use on 127.0.0.1: free them"
    model = build_llama(tmp_path / "model")
    work = tmp_path / "work"
    work.mkdir()
    env = dict(os.environ)
    env.update(
        MODEL=str(model),
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        # each load D finishes is logged ("kvbridge: load of ... done")
        KVBRIDGE_LOG_LEVEL="DEBUG",
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
    )
    for name in ("KVBRIDGE_SECRET", "KVBRIDGE_SECRET_FILE", "VIRTUAL_ENV", "PYTHON"):
        env.pop(name, None)
    try:
        done = run_block(block, work, env, timeout=1080)
    finally:
        pidfile = next(work.rglob("one-host.pid"), None)
        if pidfile is not None:  # the block failed before its --stop: stop what it started
            stop = next(work.rglob("one-host.sh"))
            subprocess.run(
                ["bash", str(stop), "--stop"],
                cwd=pidfile.parent,
                env={**env, "LOG_DIR": str(pidfile.parent)},
                timeout=120,
            )
    logs = {p.name: p.read_text(errors="replace") for p in work.rglob("*.log")}
    shown = "\n".join(f"--- {name}\n{text[-3000:]}" for name, text in logs.items())
    assert done.returncode == 0, f"{block.where}:\n{done.stderr[-3000:]}\n{shown}"
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["choices"][0]["text"], answer
    assert answer["usage"]["completion_tokens"] > 0, answer
    decode = logs.get("decode.log", "")
    # two loads at least: --wait's readiness probe's, then the curl's
    loads = re.findall(r"kvbridge: load of \S+ done", decode)
    assert len(loads) >= 2, f"D loaded {len(loads)} requests from P:\n{shown}"
    assert "ready: http://127.0.0.1:8000" in done.stderr, done.stderr
    assert "note: no KVBRIDGE_SECRET_FILE" in done.stderr, done.stderr
    assert not any(_taken(port) for port in PORTS), "the quick start left a server running"
