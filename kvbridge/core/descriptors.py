"""Descriptor arrays: how a ``submit`` call's arguments are checked, the same way for every engine.

A batch is three 1-D ``uint64`` arrays of one length (local addresses, remote addresses, lengths).
These helpers coerce and check them, find which registered device holds one side of a batch, and
word the error for a peer that was never connected. The kit (``kvbridge.core.transport``) uses
them; plugins may too (NIXL needs ``device_holding``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge.core.batches import AddrArray, TransferOp
from kvbridge.core.errors import PeerError, RegistrationError
from kvbridge.core.memory import DeviceKey, RegisteredRanges

__all__ = [
    "Batch",
    "as_addr_array",
    "check_descriptors",
    "device_holding",
    "prepare_batch",
    "unknown_peer_error",
]


def device_holding(
    devices: dict[DeviceKey, RegisteredRanges],
    everything: RegisteredRanges,
    addrs: AddrArray,
    lengths: AddrArray,
    what: str,
) -> DeviceKey:
    """The (kind, device) whose registrations hold every descriptor; engines that take one memory
    kind and device per side of a batch (NIXL) need it."""
    for device, ranges in devices.items():
        if ranges.find_uncovered(addrs, lengths) < 0:
            return device
    everything.require_covered(addrs, lengths, what)  # raises when a descriptor is unregistered
    raise RegistrationError(
        f"the {what} descriptors span memory of several kinds or devices "
        f"({', '.join(f'{k.value}:{d}' for k, d in devices)}); submit them as separate batches"
    )


def as_addr_array(values: Any) -> AddrArray:
    """Coerce a sequence or array to a contiguous 1-D ``uint64`` array."""
    arr = np.ascontiguousarray(values, dtype=np.uint64)
    if arr.ndim != 1:
        raise ValueError(f"descriptor arrays must be 1-D, got shape {arr.shape}")
    return arr


def check_descriptors(local: AddrArray, remote: AddrArray, lengths: AddrArray) -> tuple[int, int]:
    """Validate descriptor arrays; return ``(count, total bytes)``."""
    if not (local.shape == remote.shape == lengths.shape):
        raise ValueError(
            f"descriptor arrays differ in length: local {local.shape}, remote {remote.shape}, "
            f"lengths {lengths.shape}"
        )
    return int(local.shape[0]), int(lengths.sum(dtype=np.uint64))


@dataclass(frozen=True)
class Batch:
    """A ``submit`` call's descriptors, validated: three 1-D ``uint64`` arrays of one length."""

    op: TransferOp
    local: AddrArray
    remote: AddrArray
    lengths: AddrArray
    count: int
    nbytes: int


def prepare_batch(op: TransferOp, local: Any, remote: Any, lengths: Any) -> Batch:
    """Check and coerce what a transport's ``submit`` received, the same way for every engine."""
    if not isinstance(op, TransferOp):
        raise TypeError(f"op must be a TransferOp, got {op!r}")
    local, remote, lengths = as_addr_array(local), as_addr_array(remote), as_addr_array(lengths)
    count, nbytes = check_descriptors(local, remote, lengths)
    return Batch(op, local, remote, lengths, count, nbytes)


def unknown_peer_error(peer: str, connected: Iterable[str]) -> PeerError:
    """The error for a transfer to a peer that was never connected (or was disconnected)."""
    known = ", ".join(repr(p) for p in sorted(connected)) or "none"
    return PeerError(
        f"unknown peer {peer!r} (connected: {known}); call connect(peer, metadata) with the "
        "peer's metadata first"
    )
