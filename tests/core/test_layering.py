"""The core stays a pure library: no side channel, engine or serving framework comes with it."""

from __future__ import annotations

import subprocess
import sys


def test_core_imports_no_zmq_engine_or_vllm() -> None:
    code = (
        "import sys, kvbridge.core, kvbridge.core.planning, kvbridge.core.transport\n"
        "bad = [m for m in ('zmq', 'mooncake', 'nixl', 'vllm', 'torch', 'kvbridge.control')"
        " if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"kvbridge.core imported {done.stdout.strip()}"
