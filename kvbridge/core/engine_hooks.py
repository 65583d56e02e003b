"""The engine hooks a plugin implements, as ``typing.Protocol``s: the kit calls these, nothing else.

``EngineHooks`` are the hooks of every engine; an engine then follows one of two models, chosen by
the plugin's ``blocking_engine`` class attribute and run by a driver (``kvbridge.core.drivers``):

* ``BlockingEngineHooks`` (``blocking_engine = True``): the engine's completion call blocks
  until a chunk ends (Mooncake's ``get_batch_transfer_status``, a ``process_vm_*`` syscall). One
  lane thread per peer (``kvbridge.core.lanes``) makes every call that moves bytes, so ``submit``
  and ``poll`` never block.
* ``PolledEngineHooks`` (``blocking_engine = False``): chunks are checked and released without
  blocking (NIXL). The kit calls these under its lock, from ``poll``/``wait``/``fence``, since
  such engines are rarely thread-safe.

``Transport`` (``kvbridge.core.transport``) has a default for every optional hook; the drivers
and lanes are typed on these protocols, not on ``Transport``, so they never import the kit.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Protocol

from kvbridge.core.batches import AddrArray, Chunk, ChunkResult
from kvbridge.core.contract import TransportLimits
from kvbridge.core.memory import DeviceKey, MemoryRange

__all__ = ["BlockingEngineHooks", "EngineHooks", "PolledEngineHooks"]


class EngineHooks(Protocol):
    """Hooks of every engine. "Lock held": the kit calls it holding its (reentrant) lock."""

    # Read by the drivers: the plugin's class attributes, and the kit's options and limits.
    @property
    def name(self) -> str: ...
    @property
    def log_hint(self) -> str: ...
    @property
    def timeout(self) -> float: ...
    @property
    def retries(self) -> int: ...
    @property
    def limits(self) -> TransportLimits: ...

    @classmethod
    def _import_engine(cls) -> Any:
        """Optional: import and return the engine library; raise ``ImportError`` when it is
        missing (``check_available`` then raises ``TransportUnavailableError``)."""

    @classmethod
    def _unavailable_message(cls, err: ImportError) -> str:
        """Optional: the message for a missing engine (default: names ``install_hint``)."""

    def _register_group(self, device: DeviceKey, ranges: list[MemoryRange]) -> None:
        """Register ranges of one kind and device with the engine; raise ``RegistrationError``."""

    def _deregister_group(self, device: DeviceKey, ranges: list[MemoryRange]) -> None:
        """Deregister ranges of one kind and device; raise ``RegistrationError``."""

    def _check_range(self, rng: MemoryRange) -> None:
        """Optional: refuse a range before anything is registered (``RegistrationError``)."""

    def _memory_hint(self) -> str:
        """Optional: appended to the error for a memory kind the engine cannot move."""

    def _engine_metadata(self) -> bytes:
        """The engine's part of ``metadata()`` (lock held)."""

    def _connect_engine(self, peer: str, payload: bytes, old: Any) -> Any:
        """Load a peer's payload (lock held); return its peer state, or ``old`` when unchanged.

        Raise ``PeerError`` for unusable metadata. ``old`` is the peer's state before, if any;
        the kit forgets it after this returns a new state.
        """

    def _disconnect_engine(self, peer: str, state: Any) -> None:
        """Optional: forget a peer in the engine (lock held); its batches were failed already."""

    def _describe_peer(self, state: Any) -> str:
        """Optional: how messages name a peer's engine side (a session, an agent name)."""

    def _check_remote(self, state: Any, remote: AddrArray, lengths: AddrArray, peer: str) -> None:
        """Refuse remote descriptors outside the peer's memory before any byte moves (lock
        held); engines that do not check this themselves must (``RegistrationError``)."""

    def _start_chunk(self, state: Any, chunk: Chunk) -> Any:
        """Hand a chunk to the engine; return the engine's handle of it, or ``None`` when it
        finished inside the call. Raise ``ChunkRefused`` when nothing was sent (blocking
        engines retry it), or another ``TransportError`` (polled engines: from submit)."""

    def _close_engine(self) -> None:
        """Optional: stop the engine (lock held); peers and registrations are gone already."""


class BlockingEngineHooks(EngineHooks, Protocol):
    """Engines whose completion call blocks; every call below runs on the peer's lane thread."""

    def _lane_key(self, state: Any) -> Hashable:
        """Optional: peers whose key is equal share one lane (default: one lane per state)."""

    def _reach_peer(self, state: Any) -> str | None:
        """Optional: make the peer reachable before its first chunk.

        Return ``None`` when reached, else why not (the chunk that needed it fails).
        """

    def _wait_chunk(self, chunk: Chunk) -> ChunkResult:
        """Wait until the engine gives the chunk back; ``ChunkResult`` says how."""


class PolledEngineHooks(EngineHooks, Protocol):
    """Engines asked without blocking; every call below is made with the kit's lock held."""

    @property
    def cancel_is_fence(self) -> bool:
        """True only when releasing a chunk the engine still moves (``_release_chunk``) stops it
        for good, so once the release returns no byte of it moves (the engine guarantees it).
        False: a released or timed-out batch's chunks stay in the engine, watched by ``fence``,
        until the engine ends them itself."""

    def _check_chunk(self, chunk: Chunk) -> ChunkResult | None:
        """The chunk's result, or ``None`` while it moves."""

    def _release_chunk(self, chunk: Chunk) -> bool:
        """Optional: free the engine's handle of a chunk, cancelling it if it still moves.
        False when the engine refused: the kit retries on ``close``."""
