"""A test run's processes write their temp files in its scratch folder, gone when it ends
(``tests/scratch.py``): vLLM engines and ``kvbridge demo`` leave files in the temp folder."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.scratch import SCRATCH_ENV

CHILD = "import tempfile; print(tempfile.gettempdir())"


def test_a_process_the_run_starts_writes_its_temp_files_in_the_runs_scratch_folder() -> None:
    scratch = os.environ[SCRATCH_ENV]
    child = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, check=True
    )
    assert child.stdout.strip() == scratch
    assert Path(scratch).is_dir() and Path(scratch).name.startswith("kvbridge-tests-")


INNER_TEST = """
import subprocess, sys, tempfile
from pathlib import Path

def test_leave_a_file(tmp_path):
    code = "import tempfile, pathlib; p = pathlib.Path(tempfile.mkdtemp()) / 'x.sock'; p.write_text('x'); print(p)"
    left = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    Path(tempfile.gettempdir(), "left.txt").write_text(left.stdout.strip())
"""


def test_a_run_removes_its_scratch_folder_and_what_its_processes_left_there(
    tmp_path: Path,
) -> None:
    root = tmp_path / "inner"
    (root / "tests").mkdir(parents=True)
    for name in ("conftest.py", "scratch.py"):
        shutil.copy(Path(__file__).with_name(name), root / "tests" / name)
    (root / "tests" / "test_inner.py").write_text(INNER_TEST)
    temp = tmp_path / "temp"  # the inner run's "real" temp folder
    temp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != SCRATCH_ENV} | {"TMPDIR": str(temp)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         "--basetemp", str(tmp_path / "base"), "tests"],
        cwd=root, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:]
    left = Path((temp / "left.txt").read_text())  # the child's file: in the scratch folder
    assert left.parent.parent.parent == temp and left.parent.parent.name.startswith(
        "kvbridge-tests-"
    )
    assert not left.exists()
    assert sorted(p.name for p in temp.iterdir()) == ["left.txt"]  # nothing else is left
