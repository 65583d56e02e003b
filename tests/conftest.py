"""The whole suite's setup: one scratch temp folder for the processes a test run starts.

vLLM engines leave their ZMQ IPC sockets and torch.distributed file stores in the temp folder
when they stop (about eight entries per engine), and ``kvbridge demo`` keeps its engine logs
there: one CI run left about 500 entries in /tmp. Every process a run starts gets ``TMPDIR``
pointing at a folder of the run's own, removed when the run ends, so a run leaves nothing
behind. This process keeps the real temp folder (pytest's ``tmp_path`` folders live there, and
outlive the run for a look at a failure).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

#: The scratch folder's path, for the processes of the run (pytest-xdist's workers among them:
#: they use their controller's folder, and only the controller removes it).
SCRATCH_ENV = "KVBRIDGE_TEST_SCRATCH"
_OWNED = pytest.StashKey[tuple[str, str | None]]()


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get(SCRATCH_ENV):
        return  # a worker of a run that made its folder already
    tempfile.gettempdir()  # this process keeps the real one (tempfile caches it)
    scratch = tempfile.mkdtemp(prefix="kvbridge-tests-")
    config.stash[_OWNED] = (scratch, os.environ.get("TMPDIR"))
    os.environ[SCRATCH_ENV] = os.environ["TMPDIR"] = scratch


def pytest_unconfigure(config: pytest.Config) -> None:
    owned = config.stash.get(_OWNED, None)
    if owned is None:
        return
    scratch, before = owned
    os.environ.pop(SCRATCH_ENV, None)
    if before is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before
    shutil.rmtree(scratch, ignore_errors=True)  # an engine still stopping may hold a file
