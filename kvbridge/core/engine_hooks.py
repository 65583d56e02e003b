"""The engine hooks a plugin implements: each declared once, here, with its duty and default.

A plugin subclasses ``kvbridge.plugin.Transport`` (which inherits ``EngineHooks``) and writes its
engine's calls as the methods below, every one named ``engine_*``; the kit calls them, callers of
a transport never do. The required ones are checked when the plugin's class is defined (a class
that sets ``name``) and again when a transport is built: ``check_engine_hooks``.

An engine follows one of two models, chosen by the class attribute ``blocking_engine`` and run by
a driver (``kvbridge.core.drivers``):

* blocking (``blocking_engine = True``): the engine's completion call blocks until a chunk ends
  (Mooncake's ``get_batch_transfer_status``, a ``process_vm_*`` syscall). One lane thread per
  peer (``kvbridge.core.lanes``) makes every call that moves bytes, so ``submit`` and ``poll``
  never block. Requires ``engine_wait_chunk``.
* polled (``blocking_engine = False``): chunks are checked and released without blocking (NIXL),
  from ``poll``/``wait``/``fence`` under the kit's lock, since such engines are rarely
  thread-safe. Requires ``engine_check_chunk``.

"Lock held": the kit calls the hook holding its (reentrant) lock. The drivers and lanes are typed
on this class, not on the kit, so they never import it.
"""

from __future__ import annotations

import abc
from collections.abc import Hashable
from typing import Any, ClassVar

from kvbridge.core.batches import AddrArray, Chunk, ChunkResult
from kvbridge.core.contract import TransportLimits
from kvbridge.core.memory import DeviceKey, MemoryRange

__all__ = ["REQUIRED_HOOKS", "EngineHooks", "check_engine_hooks", "missing_engine_hooks"]

#: The hooks every engine writes (abstract below).
REQUIRED_HOOKS = (
    "engine_register",
    "engine_deregister",
    "engine_metadata",
    "engine_connect",
    "engine_check_remote",
    "engine_start_chunk",
)
#: The hook each engine model adds: blocking engines wait for a chunk, the others check it.
_MODEL_HOOK = {True: "engine_wait_chunk", False: "engine_check_chunk"}


class EngineHooks(abc.ABC):
    """The engine's side of a transport: what a plugin declares and the hooks it implements."""

    name: ClassVar[str]
    #: how to install the engine, shown when it cannot be imported
    install_hint: ClassVar[str] = ""
    #: where the engine's own reason for a failure goes, appended to failure messages
    log_hint: ClassVar[str] = ""
    #: True when the engine's completion call blocks (``engine_wait_chunk``, run on one lane
    #: thread per peer); False when chunks are checked without blocking (``engine_check_chunk``).
    #: Read once, at construction, to pick the driver.
    blocking_engine: ClassVar[bool] = False
    #: Polled engines: True only when releasing a chunk the engine still moves
    #: (``engine_release_chunk``) stops it for good, so once the release returns no byte of it
    #: moves (the engine's code guarantees it). False: a released or timed-out batch's chunks
    #: stay in the engine, watched by ``fence``, until the engine ends them itself.
    cancel_is_fence: ClassVar[bool] = False
    # Set by the kit (its options), read by the drivers.
    timeout: float
    retries: int

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:  # a plugin: its hooks are checked now, not at first chunk
            check_engine_hooks(cls)

    @property
    @abc.abstractmethod
    def limits(self) -> TransportLimits:
        """What the engine takes (batch size, in-flight window, memory kinds)."""

    # -- availability -------------------------------------------------------------------------

    @classmethod
    def engine_import(cls) -> Any:
        """Optional: import and return the engine library; raise ``ImportError`` when it is
        missing (``check_available`` then raises ``TransportUnavailableError``)."""
        return None  # no engine library to import

    @classmethod
    def engine_unavailable_message(cls, err: ImportError) -> str:
        """Optional: the message for a missing engine (default: names ``install_hint``)."""
        return (
            f"the {cls.name} engine cannot be imported ({err}); install it with {cls.install_hint}"
        )

    # -- memory -------------------------------------------------------------------------------

    @abc.abstractmethod
    def engine_register(self, device: DeviceKey, ranges: list[MemoryRange]) -> None:
        """Register ranges of one kind and device with the engine; raise ``RegistrationError``."""

    @abc.abstractmethod
    def engine_deregister(self, device: DeviceKey, ranges: list[MemoryRange]) -> None:
        """Deregister ranges of one kind and device; raise ``RegistrationError``."""

    def engine_check_range(self, rng: MemoryRange) -> None:
        """Optional: refuse a range before anything is registered (``RegistrationError``)."""

    def engine_memory_hint(self) -> str:
        """Optional: appended to the error for a memory kind the engine cannot move."""
        return ""

    # -- peers --------------------------------------------------------------------------------

    @abc.abstractmethod
    def engine_metadata(self) -> bytes:
        """The engine's part of ``metadata()`` (lock held)."""

    @abc.abstractmethod
    def engine_connect(self, peer: str, payload: bytes, old: Any) -> Any:
        """Load a peer's payload (lock held); return its peer state, or ``old`` when unchanged.

        Raise ``PeerError`` for unusable metadata. ``old`` is the peer's state before, if any;
        the kit forgets it after this returns a new state.
        """

    def engine_disconnect(self, peer: str, state: Any) -> None:
        """Optional: forget a peer in the engine (lock held); its batches were failed already."""

    def engine_describe_peer(self, state: Any) -> str:
        """Optional: how messages name a peer's engine side (a session, an agent name)."""
        return ""

    @abc.abstractmethod
    def engine_check_remote(
        self, state: Any, remote: AddrArray, lengths: AddrArray, peer: str
    ) -> None:
        """Refuse remote descriptors outside the peer's memory before any byte moves (lock
        held; ``RegistrationError``). Required, so that no engine skips it by omission: an
        engine that checks remote ranges itself implements it as ``pass``, saying so."""

    # -- chunks -------------------------------------------------------------------------------

    @abc.abstractmethod
    def engine_start_chunk(self, state: Any, chunk: Chunk) -> Any:
        """Hand a chunk to the engine; return the engine's handle of it, or ``None`` when it
        finished inside the call. Raise ``ChunkRefused`` when nothing was sent (blocking
        engines retry it), or another ``TransportError`` (polled engines: from submit)."""

    def engine_wait_chunk(self, chunk: Chunk) -> ChunkResult:
        """Blocking engines (required there): wait until the engine gives the chunk back;
        ``ChunkResult`` says how. Runs on the peer's lane thread."""
        raise NotImplementedError(_missing_message(type(self), ["engine_wait_chunk"]))

    def engine_check_chunk(self, chunk: Chunk) -> ChunkResult | None:
        """Polled engines (required there): the chunk's result, or ``None`` while it moves
        (lock held)."""
        raise NotImplementedError(_missing_message(type(self), ["engine_check_chunk"]))

    def engine_release_chunk(self, chunk: Chunk) -> bool:
        """Optional, polled engines: free the engine's handle of a chunk, cancelling it if it
        still moves (lock held). False when the engine refused: the kit retries on ``close``."""
        return True  # nothing to free

    def engine_lane_key(self, state: Any) -> Hashable:
        """Optional, blocking engines: peers whose key is equal share one lane (default: one
        lane per peer state)."""
        return id(state)

    def engine_reach_peer(self, state: Any) -> str | None:
        """Optional, blocking engines: make the peer reachable before its first chunk (on the
        peer's lane). Return ``None`` when reached, else why not (the chunk that needed it
        fails)."""
        return None  # reachable without asking

    # -- life cycle ---------------------------------------------------------------------------

    def engine_close(self) -> None:
        """Optional: stop the engine (lock held); peers and registrations are gone already."""


def missing_engine_hooks(cls: type[EngineHooks]) -> list[str]:
    """The required hooks ``cls`` does not implement, its engine model's included."""
    missing = [h for h in REQUIRED_HOOKS if getattr(getattr(cls, h), "__isabstractmethod__", False)]
    model_hook = _MODEL_HOOK[bool(cls.blocking_engine)]
    if getattr(cls, model_hook) is getattr(EngineHooks, model_hook):
        missing.append(model_hook)
    return missing


def check_engine_hooks(cls: type[EngineHooks]) -> None:
    """Raise ``TypeError`` (one line) when ``cls`` misses a required hook."""
    missing = missing_engine_hooks(cls)
    if missing:
        raise TypeError(_missing_message(cls, missing))


def _missing_message(cls: type, missing: list[str]) -> str:
    model = "blocking" if getattr(cls, "blocking_engine", False) else "polled"
    return (
        f"transport class {cls.__qualname__} ({model} engine) does not implement the engine "
        f"hook{'s' if len(missing) > 1 else ''} {', '.join(missing)}; every transport writes "
        f"{', '.join(REQUIRED_HOOKS)} and {_MODEL_HOOK[model == 'blocking']} "
        f"(see kvbridge.core.engine_hooks)"
    )
