"""P's bound on what it holds for decode instances: requests and KV blocks.

A prefill engine keeps a finished request's blocks until a decode instance took them (or the
hold ended). Without a bound, anyone who can send P requests marked for remote decode can make
it hold memory for requests nobody reads, until normal traffic finds no free blocks. The
``HoldBudget`` admits a hold only while P holds fewer than ``max_requests`` requests and the new
request's blocks fit under ``max_blocks``; a request past the bound is still answered, but P
holds nothing for it and tells decode to compute the prompt itself.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class HoldLimits:
    """The most P holds for decode at once."""

    max_requests: int
    max_blocks: int

    def __post_init__(self) -> None:
        for name in ("max_requests", "max_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"hold limit {name} must be an integer >= 0, got {value!r}")

    @classmethod
    def of_pool(cls, num_blocks: int, fraction: float, max_requests: int) -> HoldLimits:
        """Limits for a pool of ``num_blocks``: at most ``fraction`` of it held."""
        if not 0 <= fraction <= 1:
            raise ValueError(f"the held fraction of the KV pool must be in [0, 1], got {fraction}")
        return cls(max_requests, int(num_blocks * fraction))


class HoldBudget:
    """What P holds for decode now, within ``limits`` (thread-safe)."""

    def __init__(self, limits: HoldLimits) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}
        self._blocks = 0
        #: holds refused since start, and the most blocks held at one time
        self.declined = 0
        self.peak_blocks = 0

    def admit(self, request_id: str, blocks: int) -> str | None:
        """Hold ``blocks`` for ``request_id``: None when admitted, else why not (counted)."""
        with self._lock:
            limits = self.limits
            if request_id in self._held:
                return None
            if len(self._held) >= limits.max_requests:
                why = f"it holds {len(self._held)} requests for decode (max_held_requests)"
            elif self._blocks + blocks > limits.max_blocks:
                why = (
                    f"{blocks} more blocks would exceed its bound of {limits.max_blocks} held "
                    f"for decode ({self._blocks} held; max_held_fraction)"
                )
            else:
                self._held[request_id] = blocks
                self._blocks += blocks
                self.peak_blocks = max(self.peak_blocks, self._blocks)
                return None
            self.declined += 1
            return why

    def release(self, request_ids: Iterable[str]) -> None:
        """These holds ended (the blocks went back to the engine)."""
        with self._lock:
            for rid in request_ids:
                self._blocks -= self._held.pop(rid, 0)

    @property
    def held_requests(self) -> int:
        return len(self._held)

    @property
    def held_blocks(self) -> int:
        return self._blocks
