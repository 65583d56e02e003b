"""The scheduler process loads the connector module and what the scheduler side uses: none of it
may import the control plane (zmq sockets, the transport), which only the worker opens."""

from __future__ import annotations

import subprocess
import sys

import pytest

#: Modules only the worker side needs.
WORKER_ONLY = ("kvbridge.control.plane", "kvbridge.control.channel", "kvbridge.control.loads")


@pytest.mark.parametrize(
    "module",
    [
        "kvbridge.adapters.vllm.scheduler",
        "kvbridge.adapters.vllm.stats",
        "kvbridge.adapters.vllm.connector",
    ],
)
def test_scheduler_side_imports_no_control_plane(module: str) -> None:
    code = f"import sys, {module}\nprint(','.join(m for m in {WORKER_ONLY!r} if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    loaded = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    assert not loaded, f"importing {module} loaded worker-only modules: {loaded}"


def test_options_import_no_vllm_and_no_control_plane() -> None:
    code = (
        "import sys, kvbridge.adapters.vllm.options\n"
        f"print(','.join(m for m in ('vllm', *{WORKER_ONLY!r}) if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    loaded = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    assert not loaded, f"importing the options loaded: {loaded}"
