"""The deploy scripts as shipped in the package, and the readiness wait of ``one-host.sh``."""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbridge.deploy import SCRIPTS, copy_scripts, scripts_dir
from kvbridge.deploy.readiness import wait_healthy
from tests.ports import free_port


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 503)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_every_script_ships_in_the_package_and_copies_out_executable(tmp_path: Path) -> None:
    assert sorted(p.name for p in scripts_dir().glob("*.sh")) == sorted(SCRIPTS)
    copies = copy_scripts(tmp_path / "deploy")
    assert sorted(p.name for p in copies) == sorted(SCRIPTS)
    assert all(os.access(p, os.X_OK) for p in copies)
    with pytest.raises(FileExistsError, match=r"already has one-host\.sh"):
        copy_scripts(tmp_path / "deploy")


def test_readiness_returns_once_every_url_answers_200(server: str) -> None:
    assert wait_healthy([f"{server}/health"] * 2, timeout=10) is None


def test_readiness_names_what_never_answered(server: str) -> None:
    why = wait_healthy([f"{server}/health", f"{server}/other"], timeout=1.5)
    assert why == f"{server}/other did not answer 200 within 1.5 s"


def test_readiness_stops_when_the_deployment_exits(server: str) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    why = wait_healthy([f"{server}/other"], timeout=60, pid=dead.pid)
    assert why == f"the deployment exited before {server}/other answered 200"


def test_one_host_wait_fails_in_one_line_and_stops_what_it_started(tmp_path: Path) -> None:
    """No MODEL: P and D exit at once; --wait says so and leaves nothing running."""
    env = {k: v for k, v in os.environ.items() if k not in ("MODEL", "KVBRIDGE_SECRET_FILE")}
    env.update(
        LOG_DIR=str(tmp_path),
        PYTHON=sys.executable,
        READY_TIMEOUT="60",
        ROUTER="kvbridge-proxy",
        PREFILL_PORT="1",
        DECODE_PORT="2",
        PROXY_PORT="3",
        PREFILL_SIDE_PORT=str(free_port()),
        DECODE_SIDE_PORT=str(free_port()),
    )
    done = subprocess.run(
        ["bash", str(scripts_dir() / "one-host.sh"), "--wait"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert "not ready: the deployment exited before" in done.stderr, done.stderr
    assert "set MODEL to the model to serve" in done.stderr, done.stderr
    assert not (tmp_path / "one-host.pid").exists()
    # no secret: said on the terminal that started it, not only in the engines' logs
    assert "note: no KVBRIDGE_SECRET_FILE" in done.stderr, done.stderr


def test_the_cli_copies_the_scripts_and_refuses_to_overwrite(tmp_path: Path) -> None:
    kvbridge = [sys.executable, "-m", "kvbridge.cli", "deploy-scripts", str(tmp_path / "d")]
    first = subprocess.run(kvbridge, capture_output=True, text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    assert (tmp_path / "d" / "one-host.sh").is_file()
    again = subprocess.run(kvbridge, capture_output=True, text=True, timeout=60)
    assert again.returncode == 2
    assert again.stderr.count("\n") == 1 and "give an empty or new folder" in again.stderr


def test_one_host_names_a_taken_port_before_starting_anything(tmp_path: Path) -> None:
    """A taken router port was found after 402 s, as "Address already in use" without the
    port: now one line names it and the variable that sets it, and nothing starts."""
    env = {k: v for k, v in os.environ.items() if k not in ("MODEL", "KVBRIDGE_SECRET_FILE")}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        env.update(
            LOG_DIR=str(tmp_path),
            PYTHON=sys.executable,
            PROXY_PORT=str(port),
            PREFILL_PORT=str(free_port()),
            DECODE_PORT=str(free_port()),
            PREFILL_SIDE_PORT=str(free_port()),
            DECODE_SIDE_PORT=str(free_port()),
        )
        for args in ([], ["--wait"]):
            done = subprocess.run(
                ["bash", str(scripts_dir() / "one-host.sh"), *args],
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert done.returncode == 1, done.stderr
            line = [ln for ln in done.stderr.splitlines() if ln.startswith("one-host.sh:")]
            assert line == [
                f"one-host.sh: PROXY_PORT: port {port} on 127.0.0.1 is taken (another process "
                f"listens there); free it or set PROXY_PORT to another port; nothing started"
            ], done.stderr
            assert not (tmp_path / "prefill.log").exists()
            assert not (tmp_path / "one-host.pid").exists()


@pytest.mark.parametrize(
    ("variables", "words"),
    [
        ({"KVB_TRANSPORT": "mooncak"}, "no transport named 'mooncak'"),
        ({"KVB_TRANSPORT_OPTIONS": '{"protocl": "tcp"}'}, "did you mean 'protocol'?"),
        ({"KVB_MODE": "pul"}, "mode"),
    ],
)
def test_a_wrong_setting_stops_the_scripts_before_vllm_starts(variables, words) -> None:
    """A transport name typo stopped D after 146 s, 275 log lines and 5 tracebacks: the
    scripts now say it in one line before vLLM starts."""
    env = {k: v for k, v in os.environ.items() if k != "KVBRIDGE_SECRET_FILE"}
    env.update(MODEL="unused", PYTHON=sys.executable, HTTP_PORT=str(free_port()), **variables)
    done = subprocess.run(
        ["bash", str(scripts_dir() / "prefill.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("kvbridge kv_producer:")]
    assert len(lines) == 1 and words in lines[0], done.stderr
    assert lines[0].endswith("; vLLM not started")
    assert "Traceback" not in done.stderr and "api_server" not in done.stderr


def test_decodes_load_counters_are_read_from_prometheus_text() -> None:
    from kvbridge.deploy.readiness import FAILED_LOADS, LOADS, counter

    text = (
        "# HELP vllm:kvbridge_transfers_total Successful kvbridge KV cache transfers.\n"
        f'{LOADS}{{engine="0",model_name="m"}} 3.0\n'
        f'{LOADS}{{engine="1",model_name="m"}} 2.0\n'
        f"{LOADS}_created 1.7e9\n"
        f"{FAILED_LOADS} 1.0\n"
    )
    assert counter(text, LOADS) == 5.0 and counter(text, FAILED_LOADS) == 1.0
    assert counter(text, "vllm:absent") == 0.0


def test_the_transfer_probe_fails_in_one_line_when_nothing_answers() -> None:
    from kvbridge.deploy.readiness import main

    front, decode = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvbridge.deploy.readiness",
            "--transfer",
            front,
            "--decode",
            decode,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"not ready: a completion through {front} failed")
    with pytest.raises(SystemExit):
        main(["--transfer", front])  # --decode missing: a usage error
