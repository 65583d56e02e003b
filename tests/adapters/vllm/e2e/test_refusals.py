"""What a real vLLM engine with kvbridge refuses at start, through the launch scripts.

Marked ``e2e`` (run by ``make test`` with ``KVBRIDGE_E2E=1``): a vLLM engine starts, ~30 s.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.adapters.vllm.e2e.marks import E2E
from tests.adapters.vllm.e2e.models import build_llama
from tests.adapters.vllm.e2e.serve_pd import free_ports

pytestmark = E2E
REPO = Path(__file__).resolve().parents[4]


@pytest.mark.timeout(300)
def test_tensor_parallel_decode_stops_at_start_with_one_line(tmp_path: Path) -> None:
    # TP > 1 is not supported yet: the engine must not come up (where every load would fail
    # and be recomputed), and its log must say why and what to do, within a bound.
    model = build_llama(tmp_path / "llama")
    env = {
        **os.environ, "PYTHON": sys.executable, "MODEL": str(model), "HTTP_HOST": "127.0.0.1",
        "HTTP_PORT": str(free_ports(1)[0]), "VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_KVCACHE_SPACE": "1",
    }  # fmt: skip
    done = subprocess.run(
        ["bash", str(REPO / "examples/deploy/decode.sh"), "--tensor-parallel-size", "2",
         "--dtype", "float32", "--max-model-len", "512", "--enforce-eager", "--block-size", "32"],
        env=env, capture_output=True, text=True, timeout=240, cwd=REPO,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode != 0, out[-3000:]
    lines = [line for line in out.splitlines() if "tensor_parallel_size=2 is not supported" in line]
    assert lines, out[-3000:]
    assert "run P and D with tensor_parallel_size 1" in lines[0], lines
