"""Memory a transport registers, and the bookkeeping of it shared by every transport."""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from kvbridge.core.batches import AddrArray
from kvbridge.core.errors import RegistrationError


class MemoryKind(enum.Enum):
    """Where a registered range lives."""

    DRAM = "dram"
    VRAM = "vram"


#: ``(kind, device id)``: engines register, and some move, memory one such group at a time
DeviceKey = tuple[MemoryKind, int]


@dataclass(frozen=True, order=True)
class MemoryRange:
    """A contiguous range of memory to register: ``[addr, addr + size)``."""

    addr: int
    size: int
    kind: MemoryKind = MemoryKind.DRAM
    device_id: int = 0

    @property
    def end(self) -> int:
        return self.addr + self.size

    @property
    def device(self) -> DeviceKey:
        """``(kind, device id)``; host memory is device 0 whatever the range says."""
        return (self.kind, self.device_id if self.kind is MemoryKind.VRAM else 0)


def by_device(ranges: Sequence[MemoryRange]) -> dict[DeviceKey, list[MemoryRange]]:
    """Ranges grouped by ``MemoryRange.device`` in first-seen order (engines register per group)."""
    groups: dict[DeviceKey, list[MemoryRange]] = {}
    for rng in ranges:
        groups.setdefault(rng.device, []).append(rng)
    return groups


class RegisteredRanges:
    """The set of ranges a transport has registered, with a vectorised containment check.

    Registration is idempotent per exact range; ``add`` returns only the ranges that are new, so
    a transport registers each with its engine once.
    """

    def __init__(self) -> None:
        self._ranges: dict[tuple[int, int], MemoryRange] = {}
        self._starts: np.ndarray = np.empty(0, dtype=np.uint64)
        self._ends: np.ndarray = np.empty(0, dtype=np.uint64)

    def __len__(self) -> int:
        return len(self._ranges)

    def __iter__(self) -> Iterator[MemoryRange]:
        return iter(list(self._ranges.values()))

    def __contains__(self, rng: object) -> bool:
        return isinstance(rng, MemoryRange) and (rng.addr, rng.size) in self._ranges

    def add(self, ranges: Sequence[MemoryRange]) -> list[MemoryRange]:
        """Record ranges; return those not registered before (in order, without repeats)."""
        new: list[MemoryRange] = []
        for rng in ranges:
            if rng.size <= 0 or rng.addr < 0:
                raise RegistrationError(f"cannot register {rng}: size must be positive")
            key = (rng.addr, rng.size)
            if key not in self._ranges:
                self._ranges[key] = rng
                new.append(rng)
        if new:
            self._rebuild()
        return new

    def remove(self, ranges: Sequence[MemoryRange]) -> list[MemoryRange]:
        """Forget ranges; return those that were registered."""
        gone = [r for r in ranges if self._ranges.pop((r.addr, r.size), None) is not None]
        if gone:
            self._rebuild()
        return gone

    def clear(self) -> list[MemoryRange]:
        """Forget everything; return what was registered."""
        gone = list(self._ranges.values())
        self._ranges.clear()
        self._rebuild()
        return gone

    def _rebuild(self) -> None:
        items = sorted(self._ranges)
        self._starts = np.array([a for a, _ in items], dtype=np.uint64)
        self._ends = np.array([a + s for a, s in items], dtype=np.uint64)
        # Running maximum of ends lets one searchsorted answer containment with overlapping ranges.
        if len(self._ends):
            self._ends = np.maximum.accumulate(self._ends)

    def find_uncovered(self, addrs: AddrArray, lengths: AddrArray) -> int:
        """Index of the first ``[addr, addr+len)`` not inside one registered range, or -1.

        Uses the running maximum of range ends, so a descriptor spanning two touching ranges
        that overlap nothing else counts as covered only when a single range holds it.
        """
        if addrs.size == 0:
            return -1
        if self._starts.size == 0:
            return 0
        idx = np.searchsorted(self._starts, addrs, side="right").astype(np.int64) - 1
        ok = idx >= 0
        ends = np.where(ok, self._ends[np.clip(idx, 0, None)], 0)
        ok &= addrs + lengths <= ends
        bad = np.flatnonzero(~ok)
        return int(bad[0]) if bad.size else -1

    def require_covered(self, addrs: AddrArray, lengths: AddrArray, what: str) -> None:
        """Raise ``RegistrationError`` naming the first descriptor outside registered memory."""
        i = self.find_uncovered(addrs, lengths)
        if i >= 0:
            raise RegistrationError(
                f"{what} range [{int(addrs[i]):#x}, +{int(lengths[i])}) (descriptor {i}) is not "
                "inside registered memory; register the buffer before transferring from it"
            )
