"""Refusals logged once, not once per message: a flood of bad requests must not flood the log.

The side channel logs every refusal it sends (failed authentication, a wrong capability token,
a malformed message) with the peer's engine id and address, at most once per ``interval`` for
the same kind of refusal from the same address; the next line says how many it left out.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable


class RefusalLog:
    """Rate-limited WARNING lines, keyed by (what was refused, who was refused)."""

    def __init__(
        self,
        logger: logging.Logger,
        interval: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        max_keys: int = 4096,
    ) -> None:
        self._logger = logger
        self._interval = interval
        self._clock = clock
        self._max_keys = max_keys
        self._lock = threading.Lock()
        #: key -> (when it was last logged, refusals left out since)
        self._seen: dict[tuple[str, str], tuple[float, int]] = {}

    def warning(self, code: str, peer: str, message: str) -> bool:
        """Log ``message`` unless the same ``code`` from ``peer`` was logged within the
        interval (then count it); True when a line was written."""
        now = self._clock()
        key = (code, peer)
        with self._lock:
            last = self._seen.get(key)
            if last is not None and now - last[0] < self._interval:
                self._seen[key] = (last[0], last[1] + 1)
                return False
            left_out = last[1] if last is not None else 0
            if len(self._seen) >= self._max_keys:  # a flood of new peers: forget the oldest
                self._seen.pop(next(iter(self._seen)))
            self._seen[key] = (now, 0)
        more = f" ({left_out} more like it left out of the log)" if left_out else ""
        self._logger.warning("%s%s", message, more)
        return True
