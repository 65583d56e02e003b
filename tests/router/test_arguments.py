"""``kvbridge-proxy``'s command line, through the installed console script in a subprocess: every
mistake is one line on stderr and exit status 2, before anything is bound; good arguments serve.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.ports import free_port

_SCRIPT = Path(sys.executable).parent / "kvbridge-proxy"
#: The installed console script; where this interpreter's environment has none (the vLLM 0.33
#: environment, which sees the main one's packages), the same ``main`` through ``-m``.
COMMAND = [str(_SCRIPT)] if _SCRIPT.is_file() else [sys.executable, "-m", "kvbridge.router"]
P, D = "http://127.0.0.1:9", "http://127.0.0.1:10"  # nothing answers there (discard, unassigned)


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*COMMAND, *args], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
    )


def one_line_error(*args: str) -> str:
    """The command's one line of error for ``args`` (exit status 2, no traceback)."""
    r = run(*args)
    assert r.returncode == 2, (args, r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and r.stdout == "", r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("kvbridge-proxy: "), lines[0]
    return lines[0]


def servers(*extra: str) -> tuple[str, ...]:
    return ("--prefill", P, "--decode", D, *extra)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            servers("--port", "99999"),
            "kvbridge-proxy: --port '99999' is not a port; give a number 1-65535, e.g. 8000",
        ),
        (servers("--port", "0"), "--port '0' is not a port"),
        (servers("--port", "http"), "--port 'http' is not a port"),
        (
            servers("--log-level", "LOUD"),
            "kvbridge-proxy: --log-level 'LOUD' is not a log level; give one of critical, "
            "error, warning, info, debug, trace",
        ),
        (
            ("--prefill", "127.0.0.1:8100", "--decode", D),
            "kvbridge-proxy: --prefill '127.0.0.1:8100' is not a URL; write http://127.0.0.1:8100",
        ),
        (
            ("--prefill", P, "--decode", "localhost:8200"),
            "--decode 'localhost:8200' is not a URL; write http://localhost:8200",
        ),
        (
            ("--prefill", P, "--prefill", "ftp://h:8100", "--decode", D),
            "--prefill 'ftp://h:8100' has scheme 'ftp'; vLLM serves http or https: write "
            "http://h:8100",
        ),
        (("--prefill", "http://:8100", "--decode", D), "--prefill 'http://:8100' names no host"),
        (
            ("--prefill", "http://h:99999", "--decode", D),
            "--prefill 'http://h:99999' has port '99999'; a port is a number 1-65535",
        ),
        (("--prefill", "http://h:0", "--decode", D), "has port '0'"),
        (("--prefill", "http://h:80a", "--decode", D), "has port '80a'"),
        (("--prefill", "http://[::1:8100", "--decode", D), "is not a URL (Invalid IPv6 URL)"),
        (
            ("--prefill", "http://h:8100/v1", "--decode", D),
            "ends in /v1; give the server's root (the proxy adds /v1/completions itself): write "
            "http://h:8100",
        ),
        (("--prefill", "http://h:8100/?x=1", "--decode", D), "has a query or fragment"),
        (("--prefill", "", "--decode", D), "--prefill is empty"),
        (
            ("--decode", D),
            "kvbridge-proxy: the following arguments are required: --prefill; see "
            "kvbridge-proxy --help",
        ),
        (servers("--bogus"), "unrecognized arguments: --bogus; see kvbridge-proxy --help"),
        (servers("--timeout", "-1"), "--timeout '-1' is not a time; give seconds > 0"),
        (servers("--timeout", "inf"), "--timeout 'inf' is not a time"),
        (servers("--connect-timeout", "soon"), "--connect-timeout 'soon' is not a time"),
        (
            servers("--dispatch", "parallel"),
            "--dispatch 'parallel' is not a dispatch; give one of sequential, concurrent",
        ),
        (servers("--host", "two words"), "--host 'two words' is not a host"),
        (servers("--host", "nowhere.invalid"), "--host 'nowhere.invalid' does not resolve"),
    ],
)
def test_a_bad_argument_is_one_line_and_exit_status_2(args: tuple[str, ...], message: str) -> None:
    assert message in one_line_error(*args)


def test_a_port_in_use_is_one_line_before_serving() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = one_line_error(*servers("--port", str(port)))
    assert line == (
        f"kvbridge-proxy: cannot listen on 127.0.0.1:{port} (Address already in use); stop "
        "what listens there or choose another --port (or a --host of this machine)"
    )


def test_good_arguments_serve_with_any_case_of_log_level() -> None:
    """Checked arguments reach uvicorn as before: the proxy listens and answers ``/health``
    (503: nothing serves at P's and D's URLs), trailing slashes and the level's case aside."""
    port = free_port()
    proc = subprocess.Popen(
        [
            *(*COMMAND, "--prefill", P + "/", "--decode", D, "--port", str(port)),
            *("--log-level", "WARNING", "--timeout", "5", "--connect-timeout", "1"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10)
            except urllib.error.HTTPError as err:
                status, body = err.code, json.loads(err.read())
                break
            except OSError:
                assert time.monotonic() < deadline, "the proxy did not start listening"
                time.sleep(0.2)
        assert status == 503 and set(body["prefill"]) == {P} and set(body["decode"]) == {D}
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=30)
    assert "Traceback" not in stderr, stderr
