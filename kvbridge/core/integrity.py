"""Integrity check of moved bytes: both sides digest the same descriptor ranges of one plan.

The source digests the bytes it sent, the destination the bytes it received, each walking the
plan's descriptors in the same order (both sides compute the same plan from the same layouts and
block ids), so equal digests mean equal bytes. ``sample`` digests a fixed, request-seeded subset
of the descriptors (about one in ``SAMPLE_EVERY``); ``full`` all of them. Host memory only: a
digest reads the bytes from this process.
"""

from __future__ import annotations

import ctypes
import enum
import zlib
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
import xxhash

from kvbridge.core.batches import AddrArray
from kvbridge.core.memory import MemoryKind

if TYPE_CHECKING:
    from kvbridge.core.layout import Layout

#: ``sample`` digests about one descriptor in this many (at least one).
SAMPLE_EVERY = 16


class Verify(str, enum.Enum):
    """How much of a transfer is checked after it: nothing, a sample of descriptors, or all."""

    OFF = "off"
    SAMPLE = "sample"
    FULL = "full"


def chosen(count: int, mode: Verify, request_id: str) -> npt.NDArray[np.intp]:
    """Indices of the descriptors a check covers; the same on both sides for one request."""
    if mode is Verify.OFF or count == 0:
        return np.empty(0, dtype=np.intp)
    if mode is Verify.FULL:
        return np.arange(count, dtype=np.intp)
    rng = np.random.default_rng(zlib.crc32(request_id.encode()))
    size = max(1, count // SAMPLE_EVERY)
    return np.sort(rng.choice(count, size=size, replace=False)).astype(np.intp)


def digest(addrs: AddrArray, lengths: AddrArray, indices: npt.NDArray[np.intp]) -> int:
    """xxh3-64 of the bytes of the chosen descriptors, in order, read from this process."""
    h = xxhash.xxh3_64()
    for addr, length in zip(addrs[indices].tolist(), lengths[indices].tolist(), strict=True):
        h.update((ctypes.c_char * length).from_address(addr))
    return int(h.intdigest())


def unreadable_here(layout: Layout) -> str:
    """Why this process cannot digest ``layout``'s bytes ('' when it can): the digest reads
    them from the CPU, which GPU memory is not."""
    vram = sorted({r.device_id for r in layout.registration if r.kind is MemoryKind.VRAM})
    if not vram:
        return ""
    return (
        f"the KV caches lie in GPU memory (device {', '.join(map(str, vram))}), which the "
        "integrity check (verify) cannot read yet: set verify off"
    )
