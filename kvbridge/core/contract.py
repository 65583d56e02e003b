"""The transport contract: what kvbridge asks of a transport, and what a plugin supplies for it.

A transport knows bytes and peers, nothing else: it never sees cache groups, layers or block ids.
Callers use the methods of ``TransportContract`` below, nothing more. Plugins are found through the
entry-point group ``kvbridge.transports`` (see ``registry``).

Writing a plugin
----------------
Subclass the kit, ``kvbridge.plugin.Transport``, and supply only the ``engine_*`` hooks (each
declared once, with its duty, in ``kvbridge.core.engine_hooks``; the required ones are checked
when the plugin's class is defined):

* memory registration: register and deregister a group of ranges of one kind and device;
* peers: this agent's metadata payload, and loading a peer's payload into the engine;
* batch read/write: start a chunk of descriptors, then either wait for it (an engine whose
  completion call blocks: set ``blocking_engine = True``) or check and release it (an engine
  that can be asked without blocking).

The plugin's ``__init__`` calls ``super().__init__(timeout=..., retries=...)``, starts its
engine, then ``self.open(TransportLimits(...))``.

Memory access
-------------
Every plugin declares, as the class attribute ``memory_access`` (a ``MemoryAccess``), how its
engine reaches the memory registered with it: only by virtual address, or by registering
(pinning) it for DMA/RDMA, or by letting another process of the host map it. An engine that
registers or exports a range needs it backed by one physical allocation; a serving framework
that maps its memory through the driver (vLLM's extensible KV cache) reads the declaration to
allocate accordingly. The default, ``REGISTERS``, is the safe answer for a plugin that says
nothing. Where such driver-mapped memory is used, the classmethod
``prepare_for_driver_mapped_memory`` runs once per process before the first instance is built, so
the engine can pick a registration path that works for it (it does nothing by default).

Options
-------
A transport's options are the keyword parameters of its ``__init__`` (with a ``**options`` that
passes on to the parent class's, the parent's too). Every construction of a transport class
(``load_transport``, or calling the class) checks the given options against them first
(``check_transport_options``): a name the class does not take, or a value not of the parameter's
annotated type (checked for plain data types: ``str``, numbers, ``bool``, ``None``, lists,
tuples, dicts, enums, ``Any``), raises ``TransportOptionError`` naming the transport, the option,
a close match and every option it takes, one line, before the plugin's code runs. The
introspection lives in ``kvbridge.core.transport_options``.

The kit gives every plugin the rest, once: handles and their deadlines, ``poll``/``wait``/
``release``/``fence``, splitting batches by ``limits.max_batch``, the in-flight window, retries
within the deadline, registration bookkeeping with rollback, the metadata envelope and its
version, the closed check, and the engine model (``kvbridge.core.drivers``: one lane thread per
peer for blocking engines, polling under the lock for the others).
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from kvbridge.core.batches import AddrArray, Fence, TransferHandle, TransferOp, TransferStatus
from kvbridge.core.memory import MemoryKind, MemoryRange
from kvbridge.core.transport_options import CheckedOptions

__all__ = ["MemoryAccess", "TransportContract", "TransportLimits"]


@dataclass(frozen=True)
class TransportLimits:
    """What a transport declares about itself.

    ``max_batch`` is the most descriptors the engine takes in one call (``None``: no limit) and
    ``max_in_flight`` the most it holds for one peer at once (blocking engines only); the base
    splits and paces batches by them, callers never need to.
    """

    max_batch: int | None = None
    max_in_flight: int | None = None
    memory_kinds: frozenset[MemoryKind] = field(
        default_factory=lambda: frozenset({MemoryKind.DRAM})
    )


class MemoryAccess(enum.Flag):
    """How a transport's engine reaches the memory registered with it (``memory_access``).

    What matters is whether the engine needs each registered range to be backed by one physical
    allocation: memory a serving framework maps through the driver (CUDA virtual memory, as vLLM
    0.34's extensible KV cache does) may span several, unless the framework is told otherwise.
    Flags combine: ``REGISTERS | EXPORTS_WITHIN_HOST``.
    """

    #: Reached only by virtual address, through the engine's own calls or the kernel's (a
    #: ``process_vm_readv`` on a peer's behalf): nothing registers, pins or exports the range, so
    #: it may span several physical allocations.
    BY_ADDRESS = 0
    #: The engine registers the range for DMA or RDMA (pins it, or imports it through DMA-BUF),
    #: which needs it backed by one physical allocation.
    REGISTERS = enum.auto()
    #: Another process of the host maps the range (UCX ``cuda_ipc`` between GPUs of one host),
    #: which needs one physical allocation the driver can export; for driver-mapped GPU memory,
    #: an export handle (CUDA FABRIC handles need an IMEX channel).
    EXPORTS_WITHIN_HOST = enum.auto()


class TransportContract(abc.ABC, metaclass=CheckedOptions):
    """What callers of a transport use. ``Transport`` (the kit) implements all of it.

    Construction takes keyword options only (from ``load_transport(name, **options)``), each
    checked against the class's ``__init__`` first (``check_transport_options``). ``timeout``
    (seconds) bounds every batch from ``submit``; ``retries`` is how often a failed chunk is
    started again within that deadline.
    """

    name: ClassVar[str]
    #: How the engine reaches registered memory (see ``MemoryAccess``); every plugin declares
    #: it. The default for a plugin that does not, ``REGISTERS``, is the safe answer: it costs a
    #: framework that maps memory through the driver no more than padding each registered
    #: segment to its allocation granule, where ``BY_ADDRESS`` wrongly declared would let an
    #: engine that pins memory register a range spanning several allocations.
    memory_access: ClassVar[MemoryAccess] = MemoryAccess.REGISTERS
    timeout: float
    retries: int

    @classmethod
    @abc.abstractmethod
    def check_available(cls) -> None:
        """Raise ``TransportUnavailableError`` when the engine library cannot be loaded."""

    @classmethod
    def prepare_for_driver_mapped_memory(cls) -> None:
        """Get the engine ready to register memory the driver maps (CUDA virtual memory).

        Called once per process, before the first instance is built, when the device memory
        the transport will register is mapped through the driver (vLLM 0.34's extensible KV
        cache), so the engine can pick a registration path that works for such memory (Mooncake:
        DMA-BUF instead of nvidia-peermem). Calling it again does no harm. Does nothing by
        default; raises ``TransportError``, one line saying what is wrong and what to do, when
        the engine cannot register such memory as configured.
        """

    @property
    @abc.abstractmethod
    def limits(self) -> TransportLimits:
        """What the engine takes (batch size, in-flight window, memory kinds)."""

    @property
    @abc.abstractmethod
    def registered(self) -> list[MemoryRange]:
        """Ranges registered now (empty after ``close``)."""

    # -- memory -------------------------------------------------------------------------------

    @abc.abstractmethod
    def register(self, ranges: Sequence[MemoryRange]) -> None:
        """Register memory; registering a range already registered is a no-op.

        All or nothing: when the engine refuses a group, the groups registered before are
        deregistered again.
        """

    @abc.abstractmethod
    def deregister(self, ranges: Sequence[MemoryRange]) -> None:
        """Release ranges registered before; unknown ranges are ignored."""

    # -- peers --------------------------------------------------------------------------------

    @abc.abstractmethod
    def metadata(self) -> bytes:
        """What a peer needs to reach this agent (passed to the peer's ``connect``)."""

    @abc.abstractmethod
    def connect(self, peer: str, metadata: bytes) -> None:
        """Make ``peer`` reachable under the given name; reconnecting replaces the old entry."""

    @abc.abstractmethod
    def disconnect(self, peer: str) -> None:
        """Forget ``peer``; unknown peers are ignored."""

    @abc.abstractmethod
    def disconnect_idle(self, peer: str) -> bool:
        """Forget ``peer`` unless a batch to it is unfinished or holds engine work (until every
        one is drained, something of it may still move); False when the peer stays known for
        that reason, True otherwise (an unknown peer included). The control plane releases
        peers that went quiet with it; ``connect`` makes the peer known again."""

    # -- transfers ----------------------------------------------------------------------------

    @abc.abstractmethod
    def submit(
        self,
        op: TransferOp,
        peer: str,
        local: AddrArray,
        remote: AddrArray,
        lengths: AddrArray,
    ) -> TransferHandle:
        """Start moving ``lengths[i]`` bytes between ``local[i]`` and ``remote[i]``.

        Never blocks for long: completion is observed with ``poll`` or ``wait``.
        """

    @abc.abstractmethod
    def poll(self, handle: TransferHandle) -> TransferStatus:
        """State of a batch; a batch past its deadline is released and reported ``FAILED``."""

    @abc.abstractmethod
    def wait(self, handle: TransferHandle, timeout: float | None = None) -> None:
        """Block until the batch finishes; raise ``TransferError`` on failure or timeout.

        The wait is bounded by the handle's deadline and by ``timeout`` when given.
        """

    @abc.abstractmethod
    def transfer(
        self,
        op: TransferOp,
        peer: str,
        local: AddrArray,
        remote: AddrArray,
        lengths: AddrArray,
    ) -> None:
        """Submit and wait: the synchronous convenience over ``submit``/``wait``."""

    @abc.abstractmethod
    def release(self, handle: TransferHandle) -> None:
        """Abandon a batch: it ends ``FAILED`` unless it finished; no further part of it starts.

        Parts the engine already holds may still move afterwards: ``fence`` tells when they no
        longer can.
        """

    @abc.abstractmethod
    def fence(self, handle: TransferHandle, timeout: float) -> Fence:
        """Release the batch if unfinished, then wait up to ``timeout`` s for its ``Fence``.

        After a failed, timed-out or abandoned transfer the memory it touched may be reused only
        once this returns ``DRAINED``: every part of the batch came back from the engine at its
        real end (see ``Fence``). ``PENDING``: the engine still holds a part (a frozen peer keeps
        it there), ask again. ``UNPROVEN``: nothing proves the bytes stopped; keep the memory out
        of use for good.
        """

    @abc.abstractmethod
    def fence_state(self, handle: TransferHandle) -> Fence:
        """``Fence`` of a batch now, without waiting (``PENDING`` while it is unfinished)."""

    # -- life cycle ---------------------------------------------------------------------------

    @abc.abstractmethod
    def close(self) -> None:
        """Fail pending batches, stop the engine's work, deregister every range. Safe twice.

        Transfers end before the memory they point into is deregistered, and the engine goes
        last. Waits at most ``timeout`` s for chunks a blocking engine holds, so registered
        buffers may be freed once it returns (unless a peer was frozen).
        """

    def __enter__(self) -> TransportContract:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
