"""kvbridge's log lines under vLLM's logging setup (the plugin configures them in every process)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

# A child process as each of vLLM's: the plugins load, then vLLM configures its logging (from
# its environment, as its engine processes do); it logs on kvbridge's loggers and on vLLM's.
SCRIPT = """
import logging
import vllm.logger
from vllm.config.logging import LoggingConfig
from kvbridge.adapters.vllm.plugin import register
register()
register()  # idempotent: one line per record, not two
vllm.logger.configure_logging(LoggingConfig())
logging.getLogger("kvbridge.control.leases").info("kvbridge-info-line")
logging.getLogger("kvbridge.vllm").debug("kvbridge-debug-line")
vllm.logger.init_logger("vllm.test").info("vllm-info-line")
"""


def run(env: dict[str, str]) -> str:
    base = {"PATH": "/usr/bin:/bin", "VLLM_LOGGING_STREAM": "ext://sys.stdout", "NO_COLOR": "1"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout + done.stderr


@pytest.mark.timeout(240)
def test_kvbridge_lines_come_out_in_vllms_format_at_vllms_level() -> None:
    out = run({})
    lines = out.splitlines()
    ours = [line for line in lines if "kvbridge-info-line" in line]
    theirs = [line for line in lines if "vllm-info-line" in line]
    assert len(ours) == 1 and len(theirs) == 1, out[-2000:]
    # vLLM's format ("(process) INFO <date> <time> [file:line] message", on vLLM's stream,
    # stdout here): the same prefix, digits aside.
    prefix = [re.sub(r"\d", "0", line.split("[", 1)[0]) for line in (ours[0], theirs[0])]
    assert prefix[0] == prefix[1] and " INFO " in prefix[0], (ours, theirs)
    assert "kvbridge-debug-line" not in out  # below vLLM's INFO

    quiet = run({"VLLM_LOGGING_LEVEL": "WARNING"})
    assert "kvbridge-info-line" not in quiet and "vllm-info-line" not in quiet, quiet[-2000:]


@pytest.mark.timeout(240)
def test_kvbridge_log_level_shows_debug_lines_with_its_own_handler() -> None:
    out = run({"KVBRIDGE_LOG_LEVEL": "DEBUG"})
    debug = [line for line in out.splitlines() if "kvbridge-debug-line" in line]
    assert len(debug) == 1, out[-2000:]
    assert " kvbridge.vllm DEBUG " in debug[0], debug
