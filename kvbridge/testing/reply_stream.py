"""The reply channel of a test child process that answers its parent with JSON lines."""

from __future__ import annotations

import os
import sys
from typing import TextIO


def take_stdout() -> TextIO:
    """A private stream on the original stdout; fd 1 (and ``sys.stdout``) then go to stderr.

    Engine libraries write to fd 1 too (UCX prints "connect ... failed" when a peer dies), which
    would corrupt a reply line; after this, only what is written to the returned stream reaches
    the parent's pipe.
    """
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return replies
