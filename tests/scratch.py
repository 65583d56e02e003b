"""A scratch temp folder for the processes a test run starts, removed when the run ends.

vLLM engines leave their ZMQ IPC sockets and torch.distributed file stores in the temp folder
when they stop (about eight entries per engine), and ``kvbridge demo`` keeps its engine logs
there. Every process started while it is in place gets ``TMPDIR`` pointing at the scratch
folder; the process that made it keeps the real temp folder (pytest's ``tmp_path`` folders
live there, and outlive the run for a look at a failure).
"""

from __future__ import annotations

import os
import shutil
import tempfile

#: The scratch folder's path, for the processes of the run (pytest-xdist's workers among them:
#: they use their controller's folder, and only the controller removes it).
SCRATCH_ENV = "KVBRIDGE_TEST_SCRATCH"


def make_scratch() -> tuple[str, str | None] | None:
    """Point ``TMPDIR`` of the processes started from now on at a new scratch folder: the folder
    and the ``TMPDIR`` before, for ``remove_scratch``; None in a process of a run that made
    one already."""
    if os.environ.get(SCRATCH_ENV):
        return None
    tempfile.gettempdir()  # this process keeps the real one (tempfile caches it)
    scratch = tempfile.mkdtemp(prefix="kvbridge-tests-")
    before = os.environ.get("TMPDIR")
    os.environ[SCRATCH_ENV] = os.environ["TMPDIR"] = scratch
    return scratch, before


def remove_scratch(made: tuple[str, str | None] | None) -> None:
    """Put ``TMPDIR`` back and remove the scratch folder ``make_scratch`` made."""
    if made is None:
        return
    scratch, before = made
    os.environ.pop(SCRATCH_ENV, None)
    if before is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before
    shutil.rmtree(scratch, ignore_errors=True)  # an engine still stopping may hold a file
