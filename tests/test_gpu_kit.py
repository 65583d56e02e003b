"""The GPU kit rehearsed on the CPU (``benchmarks/gpu``), so that it does not rot before a GPU
machine is at hand: the check's every phase in its dry run, and the carried wheels' stripping."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from benchmarks.gpu.carry import CarryError, record_is_consistent, sizes, strip_wheel

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_the_gpu_check_rehearses_every_phase_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu.check", "--dry-run", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=280, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert json.loads((out / "env.json").read_text())["device"] == "cpu"
    # Each case's planes close D first, so D's last release reaches a P that still holds it:
    # a GPU run's log shows the figures, not a refusal per case.
    assert "refused" not in done.stdout + done.stderr, done.stderr[-3000:]
    conformance = json.loads((out / "conformance.json").read_text())
    # the GPU-memory cases ran and, without a GPU, skipped saying why
    assert conformance["cases"] and all(
        c["outcome"] == "skipped" and "CUDA GPU" in c["reason"] for c in conformance["cases"]
    ), conformance
    rows = json.loads((out / "throughput.json").read_text())
    assert {r["shape"] for r in rows} == {"llama3-70b-dense", "deepseek-mla", "qwen3.5-hybrid"}
    assert all(r["bytes"] > 0 and r[f"{w}_s"] > 0 for r in rows for w in ("kvbridge", "raw"))
    assert sum(r["checked"] for r in rows) == 3  # every shape's bytes checked once
    assert (out / "throughput.md").read_text().count("\n") == len(rows) + 2
    streams = json.loads((out / "streaming.json").read_text())
    # each size ran all three ways, and the layer-wise push moved layers before publish
    assert [r["tokens"] for r in streams] == [64, 128]
    assert all(r["forward_s"] > 0 and r["then_whole_s"] > 0 for r in streams)
    assert all(r["streamed_bytes"] > 0 for r in streams), streams


def _wheel(path: Path) -> Path:
    """A small wheel whose RECORD lists its members with their hashes, as pip writes them."""
    import base64
    import hashlib

    members = {"pkg/__init__.py": b"x = 1\n", "pkg_ep/big.so": b"\0" * 4096}
    record = (
        "".join(
            f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}\n"
            for name, data in members.items()
        )
        + "pkg-1.0.dist-info/RECORD,,\n"
    )
    with zipfile.ZipFile(path, "w") as whl:
        for name, data in members.items():
            whl.writestr(name, data)
        whl.writestr("pkg-1.0.dist-info/RECORD", record)
    return path


def test_a_stripped_wheel_keeps_a_record_of_what_it_holds(tmp_path: Path) -> None:
    whl = _wheel(tmp_path / "pkg-1.0-py3-none-any.whl")
    assert record_is_consistent(whl)
    assert strip_wheel(whl, ("pkg_ep/",)) > 0
    with zipfile.ZipFile(whl) as z:
        assert sorted(z.namelist()) == ["pkg-1.0.dist-info/RECORD", "pkg/__init__.py"]
    assert record_is_consistent(whl)


def test_a_missing_wheel_is_named_with_the_command_that_fetches_it(tmp_path: Path) -> None:
    with pytest.raises(CarryError, match=r"nixl==1.5.1 is not in .*carry fetch"):
        sizes(tmp_path)
