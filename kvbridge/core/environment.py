"""Scoped environment variables, for engines that read their settings from the environment."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager


@contextmanager
def environment_overrides(values: Mapping[str, str]) -> Iterator[None]:
    """Set ``values`` in ``os.environ`` for the block, then restore what was there.

    Engines read such settings once, when they start; restoring them keeps one transport's
    settings from leaking into another one created later in the same process.
    """
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old
