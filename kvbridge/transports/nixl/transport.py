"""Transport over NIXL (NVIDIA Inference Xfer Library), UCX backend by default.

Engine facts this module is built around (measured with nixl-cu12 1.5.1 on the CPU, UCX backend):

* The remote side of a transfer must name the memory type and device id the peer registered
  (``DRAM``/``VRAM``, devId); otherwise ``initialize_xfer`` fails with ``NIXL_ERR_NOT_FOUND``.
  NIXL's own metadata does not tell us either, so ``metadata()`` wraps it in a small envelope with
  the ranges this agent had registered (NIXL's metadata, too, covers only those).
* ``add_remote_agent`` of a *different* blob under an agent name already loaded fails with
  ``NIXL_ERR_NOT_ALLOWED``: a restarted peer must be removed (``remove_remote_agent``) first.
* Errors are exceptions of NIXL's bindings (``nixlRemoteDisconnectError``, ``nixlNotFoundError``,
  ...); ``transfer``/``check_xfer_state`` also return ``"ERR"``. A peer that died is reported at
  once; a peer that is frozen (SIGSTOP) keeps a UCX-over-TCP transfer ``"PROC"`` for minutes, so the
  deadline is enforced here. ``release_xfer_handle`` of an in-progress transfer cancels it.
* Between processes on one host UCX uses ``cma`` (the kernel copies straight into the peer's
  memory), which completes even while the peer is stopped.
* Building descriptor lists from an Nx3 ``uint64`` array and ``initialize_xfer`` take about 1 ms for
  20000 descriptors, around 1 % of moving them, so prepared (reusable) descriptor lists do not pay
  off for batches whose addresses change every time.
* A process that loaded the wheel's UCX ``efa`` module segfaults at exit, in a shared-library
  destructor (``rtnl_tc_unregister`` of the bundled libnl-route-3, during ``_dl_fini``, after
  Python has finished): the module links the system ``libefa``, which brings the system libibverbs
  and libnl in next to the wheel's bundled copies. Without that module the exit is clean (also
  with Mooncake's system libibverbs loaded beside NIXL), and no teardown order of ours changes it.
  So UCX's ``efa`` module is left out unless the host has an EFA device or the user configured
  ``UCX_MODULES``; ``exit_cleanly`` covers the remaining cases.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar, NoReturn

import msgspec
import numpy as np

from kvbridge.core.environment import environment_overrides
from kvbridge.core.errors import (
    PeerError,
    RegistrationError,
    TransferError,
    TransportError,
    TransportUnavailableError,
)
from kvbridge.core.memory import RegisteredRanges
from kvbridge.core.transport import (
    DONE,
    PENDING,
    AddrArray,
    Fence,
    MemoryKind,
    MemoryRange,
    TransferHandle,
    TransferOp,
    TransferState,
    TransferStatus,
    Transport,
    TransportLimits,
    prepare_batch,
    unknown_peer_error,
)

#: The exact command that installs the engine without dragging in torch and CUDA (about 6 GB).
INSTALL_COMMAND = "pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1"
_INSTALL_HINT = (
    f"{INSTALL_COMMAND} (nixl-cu13 instead of nixl-cu12 where torch is built for CUDA 13; numpy "
    "is the only other dependency; without --no-deps pip pulls torch and CUDA wheels); where "
    "torch is already installed, pip install 'kvbridge[nixl]' also works"
)
#: UCX modules left out by default (see the module docstring: the EFA module crashes the exit).
DEFAULT_UCX_MODULES = "^efa"
_METADATA_VERSION = 1
_SEG = {MemoryKind.DRAM: "DRAM", MemoryKind.VRAM: "VRAM"}
_OPS = {TransferOp.READ: "READ", TransferOp.WRITE: "WRITE"}

#: Every transport not yet closed, so ``exit_cleanly`` can close them before leaving.
_LIVE: weakref.WeakSet[NixlTransport] = weakref.WeakSet()

_GroupKey = tuple[MemoryKind, int]


class NixlMetadata(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="kvbridge.nixl"):
    """What a peer needs: NIXL's agent metadata and the ranges registered when it was taken."""

    version: int
    agent: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
    #: ``nixl_agent.get_agent_metadata()``
    blob: Annotated[bytes, msgspec.Meta(min_length=1)]
    #: ``(addr, size, kind, device_id)`` of every registered range; the remote side of a transfer
    #: must name the kind and device id of the peer's registration.
    ranges: list[tuple[int, int, MemoryKind, int]]


_encode_metadata = msgspec.msgpack.Encoder().encode
_decode_metadata = msgspec.msgpack.Decoder(NixlMetadata).decode


# -- engine loading -----------------------------------------------------------------------------


def _import_nixl() -> Any:
    """NIXL's ``_api`` module, or ``TransportUnavailableError`` with the install command."""
    try:
        from nixl import _api
    except ImportError as err:
        raise TransportUnavailableError(
            f"the NIXL library cannot be imported ({err}); install it with {_INSTALL_HINT}"
        ) from err
    _quiet_nixl_logging()
    return _api


def _quiet_nixl_logging() -> None:
    # NIXL's logger writes INFO lines to stdout, which belongs to the application (a CLI printing
    # JSON, a peer answering on stdout): send them to stderr and keep only warnings unless the
    # user asked for a level with NIXL_LOG_LEVEL.
    nixl_logger = logging.getLogger("nixl")
    for handler in nixl_logger.handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)
    if not os.environ.get("NIXL_LOG_LEVEL"):
        nixl_logger.setLevel(logging.WARNING)


def _nixl_errors(api: Any) -> tuple[type[BaseException], ...]:
    """The exception classes NIXL's bindings raise (``nixlNotFoundError``, ...)."""
    return tuple(
        cls
        for name, cls in vars(api.nixlBind).items()
        if name.startswith("nixl")
        and name.endswith("Error")
        and isinstance(cls, type)
        and issubclass(cls, BaseException)
    )


def _describe(err: BaseException) -> str:
    """NIXL's exception name and status, e.g. ``nixlNotFoundError NIXL_ERR_NOT_FOUND``."""
    return f"{type(err).__name__} {err}".strip()


def _nvidia_gpu_present() -> bool:
    """True when the host has an NVIDIA GPU (its driver's device node)."""
    return Path("/dev/nvidia0").exists() or Path("/proc/driver/nvidia/gpus").is_dir()


def _tls_hint(env: dict[str, str]) -> str:
    """What to do when NIXL refused a ``UCX_TLS`` that leaves out CUDA on a GPU host.

    NIXL's UCX backend refuses such a setting (its reason goes only to its log), so a
    ``{"TLS": "tcp"}`` that works on a CPU host stops the agent on a GPU host.
    """
    tls = env.get("UCX_TLS", os.environ.get("UCX_TLS", ""))
    if not tls or "cuda" in tls.lower() or not _nvidia_gpu_present():
        return ""
    return (
        f"; UCX_TLS={tls} gives UCX no CUDA transport on a host with NVIDIA GPUs, which NIXL's "
        f'UCX backend refuses: add cuda_copy (ucx: {{"TLS": "{tls},cuda_copy"}})'
    )


def _efa_device_present() -> bool:
    """True when the host has an AWS EFA device, the only case UCX's ``efa`` module serves."""
    root = Path("/sys/class/infiniband")
    with suppress(OSError):
        return any((dev / "device" / "driver").resolve().name == "efa" for dev in root.iterdir())
    return False


def _ucx_environment(ucx: dict[str, Any]) -> dict[str, str]:
    """``UCX_*`` variables for the agent: the user's settings plus the ``efa`` exclusion."""
    env = {}
    for key, value in ucx.items():
        name = str(key).upper()
        env[name if name.startswith("UCX_") else f"UCX_{name}"] = str(value)
    if "UCX_MODULES" not in env and "UCX_MODULES" not in os.environ and not _efa_device_present():
        env["UCX_MODULES"] = DEFAULT_UCX_MODULES
    return env


# -- handles and peers --------------------------------------------------------------------------


@dataclass(eq=False)
class NixlHandle(TransferHandle):
    """A submitted batch: NIXL's transfer handle until it finishes, then its final status."""

    agent: str = ""
    _xfer: Any = field(default=None, repr=False)
    _status: TransferStatus | None = field(default=None, repr=False)
    _fence: Fence = field(default=Fence.PENDING, repr=False)

    # Handles are compared and hashed by identity (usable in sets).
    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def describe(self) -> str:
        direction = "to" if self.op is TransferOp.WRITE else "from"
        return (
            f"{self.op.value} of {self.count} descriptors ({self.nbytes} bytes) {direction} "
            f"peer {self.peer!r} (NIXL agent {self.agent!r})"
        )


@dataclass
class _Peer:
    """A loaded remote agent: its name in NIXL and its registered memory by (kind, device)."""

    agent: str
    blob: bytes
    groups: dict[_GroupKey, RegisteredRanges]
    everything: RegisteredRanges

    @classmethod
    def from_metadata(cls, meta: NixlMetadata) -> _Peer:
        ranges = [MemoryRange(a, s, k, d) for a, s, k, d in meta.ranges]
        everything = RegisteredRanges()
        everything.add(ranges)
        return cls(meta.agent, meta.blob, _group(ranges), everything)


def _group(ranges: Sequence[MemoryRange]) -> dict[_GroupKey, RegisteredRanges]:
    groups: dict[_GroupKey, RegisteredRanges] = {}
    for rng in ranges:
        groups.setdefault(_key(rng), RegisteredRanges()).add([rng])
    return groups


def _key(rng: MemoryRange) -> _GroupKey:
    # NIXL's device id of host memory is 0 whatever the range says.
    return (rng.kind, rng.device_id if rng.kind is MemoryKind.VRAM else 0)


def _side(
    groups: dict[_GroupKey, RegisteredRanges],
    everything: RegisteredRanges,
    addrs: AddrArray,
    lengths: AddrArray,
    what: str,
) -> _GroupKey:
    """The (kind, device) whose registrations hold every descriptor of one side of a batch.

    NIXL takes one memory type per descriptor list, and the device id must match the
    registration, so a batch must stay within one kind and device on each side.
    """
    for key, ranges in groups.items():
        if ranges.find_uncovered(addrs, lengths) < 0:
            return key
    everything.require_covered(addrs, lengths, what)  # raises when a descriptor is unregistered
    raise RegistrationError(
        f"the {what} descriptors span memory of several kinds or devices "
        f"({', '.join(f'{k.value}:{d}' for k, d in groups)}); NIXL moves one kind and device "
        "per side of a batch, so submit them as separate batches"
    )


# -- the transport ------------------------------------------------------------------------------


class NixlTransport(Transport):
    """Moves bytes with NIXL agents (UCX backend by default).

    Options (keyword only):
        backends: NIXL backend plugins to create, ``("UCX",)`` by default.
        agent_name: this agent's name, unique among the agents it talks to; by default
            ``kvbridge-<pid>-<8 hex>``.
        progress_thread: let NIXL progress transfers in its own thread (NIXL's default). Without
            it this agent advances only while ``poll`` runs, so an agent that only serves its
            peers' reads and writes (never polls) must keep it: a peer's first transfer to it
            then never connects and times out.
        timeout: seconds a batch may take from ``submit``; NIXL itself never gives up on a
            stalled peer, so ``poll`` fails and cancels a batch past this deadline.
        ucx: UCX settings, set as ``UCX_<KEY>`` environment variables while the agent is created,
            e.g. ``{"TLS": "tcp", "NET_DEVICES": "lo"}`` (on a GPU host NIXL wants a CUDA
            transport in ``TLS`` too: ``"tcp,cuda_copy"``). ``MODULES`` defaults to ``^efa`` (see
            the module docstring) unless ``UCX_MODULES`` is set or the host has an EFA device.
            Settings UCX reads once per process (``MODULES``, logging) take effect only for the
            first agent of the process.
        device_id: the CUDA device of this agent's GPU memory; when given, registering GPU memory
            of another device is refused (each range names its device in ``MemoryRange``).
    """

    name: ClassVar[str] = "nixl"
    install_hint: ClassVar[str] = _INSTALL_HINT

    def __init__(
        self,
        *,
        backends: Sequence[str] = ("UCX",),
        agent_name: str | None = None,
        progress_thread: bool = True,
        timeout: float = 30.0,
        ucx: dict[str, Any] | None = None,
        device_id: int | None = None,
    ) -> None:
        super().__init__(timeout=timeout)
        self._closed = True  # until the agent runs: nothing to close, and repr() works
        if isinstance(backends, str):
            backends = (backends,)
        if not backends:
            raise ValueError("backends must name at least one NIXL backend, e.g. ('UCX',)")
        api = _import_nixl()
        self._errors: tuple[type[BaseException], ...] = _nixl_errors(api)
        self.agent_name = agent_name or f"kvbridge-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.backends = tuple(backends)
        self.device_id = device_id
        self.ucx_environment = _ucx_environment(dict(ucx or {}))
        config = api.nixl_agent_config(
            enable_prog_thread=bool(progress_thread), backends=list(self.backends)
        )
        # NIXL raises RuntimeError when no plugin at all could be loaded.
        startup_errors: tuple[type[BaseException], ...] = (*self._errors, RuntimeError)
        try:
            with environment_overrides(self.ucx_environment):
                agent = api.nixl_agent(self.agent_name, config)
        except startup_errors as err:
            raise TransportError(
                f"the NIXL agent {self.agent_name!r} did not start with backends "
                f"{list(self.backends)}: {_describe(err)}{_tls_hint(self.ucx_environment)}"
            ) from err
        missing = [b for b in self.backends if b not in agent.backends]
        if missing:  # NIXL only logs a warning for a backend whose plugin is missing
            raise TransportError(
                f"NIXL has no plugin for backend(s) {missing}; available plugins: "
                f"{sorted(agent.get_plugin_list())}"
            )
        kinds = {MemoryKind.DRAM}
        if all("VRAM_SEG" in agent.get_backend_mem_types(b) for b in self.backends):
            kinds.add(MemoryKind.VRAM)
        self._agent: Any = agent
        self._limits = TransportLimits(max_batch=None, memory_kinds=frozenset(kinds))
        self._ranges = RegisteredRanges()
        self._groups: dict[_GroupKey, RegisteredRanges] = {}
        self._peers: dict[str, _Peer] = {}  # our peer name -> loaded remote agent
        self._live: set[NixlHandle] = set()  # handles whose NIXL transfer is not released
        self._stuck: list[Any] = []  # NIXL handles that refused release; retried on close
        # NIXL agents are not thread-safe in the default sync mode; every call holds this lock.
        self._lock = threading.Lock()
        self._closed = False
        _LIVE.add(self)

    @classmethod
    def check_available(cls) -> None:
        _import_nixl()

    @property
    def limits(self) -> TransportLimits:
        return self._limits

    @property
    def registered(self) -> list[MemoryRange]:
        """Ranges registered now (empty after ``close``)."""
        return list(self._ranges)

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"the nixl transport (agent {self.agent_name!r}) is closed")

    # -- memory -------------------------------------------------------------------------------

    def register(self, ranges: Sequence[MemoryRange]) -> None:
        self._check_open()
        for rng in ranges:
            if rng.kind not in self._limits.memory_kinds:
                raise RegistrationError(
                    f"cannot register {rng}: NIXL backends {list(self.backends)} move only "
                    f"{sorted(k.value for k in self._limits.memory_kinds)} memory"
                )
            if (
                rng.kind is MemoryKind.VRAM
                and self.device_id is not None
                and rng.device_id != self.device_id
            ):
                raise RegistrationError(
                    f"cannot register {rng}: this transport was created for GPU memory of "
                    f"device {self.device_id}"
                )
        with self._lock:
            self._check_open()
            new = self._ranges.add(ranges)
            done: list[MemoryRange] = []
            try:
                for key, group in _by_key(new).items():
                    self._agent.register_memory(_reg_array(group, key), _SEG[key[0]])
                    done.extend(group)
            except self._errors as err:
                with suppress(*self._errors):
                    for key, group in _by_key(done).items():
                        self._deregister_engine(key, group)
                self._ranges.remove(new)
                raise RegistrationError(
                    f"NIXL could not register {len(new)} range(s), first {new[0]}: {_describe(err)}"
                ) from None
            for key, group in _by_key(new).items():
                self._groups.setdefault(key, RegisteredRanges()).add(group)

    def deregister(self, ranges: Sequence[MemoryRange]) -> None:
        if self._closed:
            return
        failures: list[str] = []
        with self._lock:
            gone = self._ranges.remove(ranges)
            for key, group in _by_key(gone).items():
                self._groups[key].remove(group)
                if not len(self._groups[key]):
                    del self._groups[key]
                try:
                    self._deregister_engine(key, group)
                except self._errors as err:  # keep going: the other groups still go
                    failures.append(f"{len(group)} range(s) from {group[0]}: {_describe(err)}")
        if failures:
            raise RegistrationError(f"NIXL could not deregister {'; '.join(failures)}")

    def _deregister_engine(self, key: _GroupKey, group: Sequence[MemoryRange]) -> None:
        descs = self._agent.get_reg_descs(_reg_array(group, key), _SEG[key[0]])
        self._agent.deregister_memory(descs)

    # -- peers --------------------------------------------------------------------------------

    def metadata(self) -> bytes:
        """This agent's NIXL metadata and registered ranges; take it after ``register``."""
        self._check_open()
        with self._lock:
            blob = bytes(self._agent.get_agent_metadata())
            ranges = [(r.addr, r.size, *_key(r)) for r in self._ranges]
        return _encode_metadata(
            NixlMetadata(version=_METADATA_VERSION, agent=self.agent_name, blob=blob, ranges=ranges)
        )

    def connect(self, peer: str, metadata: bytes) -> None:
        self._check_open()
        try:
            meta = _decode_metadata(metadata)
        except (msgspec.DecodeError, TypeError, ValueError) as err:
            raise PeerError(
                f"metadata for peer {peer!r} is not NIXL transport metadata ({err}); pass the "
                "bytes that peer's nixl transport metadata() returned"
            ) from None
        if meta.version != _METADATA_VERSION:
            raise PeerError(
                f"peer {peer!r} sent NIXL metadata version {meta.version}, this agent "
                f"understands version {_METADATA_VERSION}; run the same kvbridge on both sides"
            )
        try:
            entry = _Peer.from_metadata(meta)
        except RegistrationError as err:
            raise PeerError(f"peer {peer!r} sent metadata with an unusable range: {err}") from None
        if meta.agent == self.agent_name:
            raise PeerError(
                f"peer {peer!r} is this agent itself ({self.agent_name!r}); NIXL agent names "
                "must differ between the agents that talk to each other"
            )
        with self._lock:
            self._check_open()
            old = self._peers.get(peer)
            if old is not None and old.agent == meta.agent and old.blob == meta.blob:
                return  # the same agent again
            if old is not None:
                self._forget(peer, f"peer {peer!r} reconnected")
            # A NIXL agent name is loaded once; another peer name may hold it with older
            # metadata (that agent restarted under a fixed name): it is replaced for all names.
            aliases = [name for name, p in self._peers.items() if p.agent == meta.agent]
            if aliases and self._peers[aliases[0]].blob != meta.blob:
                for name in aliases:
                    self._forget(name, f"NIXL agent {meta.agent!r} restarted")
            else:
                aliases = []
            try:
                loaded = self._agent.add_remote_agent(meta.blob)
            except self._errors as err:
                raise PeerError(
                    f"NIXL could not load the metadata of peer {peer!r} (agent {meta.agent!r}): "
                    f"{_describe(err)}"
                ) from None
            name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            entry.agent = name
            for alias in [*aliases, peer]:
                self._peers[alias] = entry
            # Start the UCX connection now (it does not block, even on a frozen peer), so the
            # first transfer does not pay for it.
            with suppress(*self._errors):
                self._agent.make_connection(name)

    def disconnect(self, peer: str) -> None:
        with self._lock:
            if not self._closed and peer in self._peers:
                self._forget(peer, f"peer {peer!r} was disconnected")

    def _forget(self, peer: str, reason: str) -> None:
        """Drop a peer name (lock held): fail its batches, unload its agent when unused."""
        entry = self._peers.pop(peer)
        for handle in [h for h in self._live if h.peer == peer]:
            self._finish(
                handle, _failed(f"nixl {handle.describe()} failed: {reason}"), cancelled=True
            )
        if all(p.agent != entry.agent for p in self._peers.values()):
            with suppress(*self._errors):
                self._agent.remove_remote_agent(entry.agent)

    # -- transfers ----------------------------------------------------------------------------

    def submit(
        self,
        op: TransferOp,
        peer: str,
        local: AddrArray,
        remote: AddrArray,
        lengths: AddrArray,
    ) -> NixlHandle:
        self._check_open()
        batch = prepare_batch(op, local, remote, lengths)
        local, remote, lengths = batch.local, batch.remote, batch.lengths
        count, nbytes = batch.count, batch.nbytes
        entry = self._peers.get(peer)
        if entry is None:
            raise unknown_peer_error(peer, self._peers)
        handle = NixlHandle(
            op, peer, count, nbytes, time.monotonic() + self.timeout, agent=entry.agent
        )
        keep = lengths > 0
        if not keep.all():  # zero-length descriptors move nothing
            local, remote, lengths = local[keep], remote[keep], lengths[keep]
        if not len(lengths):
            handle._status, handle._fence = DONE, Fence.DRAINED
            return handle
        with self._lock:
            self._check_open()
            if self._peers.get(peer) is not entry:
                raise PeerError(f"peer {peer!r} was disconnected while the batch was submitted")
            local_key = _side(self._groups, self._ranges, local, lengths, "local")
            remote_key = _side(
                entry.groups, entry.everything, remote, lengths, f"remote (peer {peer!r})"
            )
            try:
                xfer = self._agent.initialize_xfer(
                    _OPS[op],
                    self._agent.get_xfer_descs(
                        _xfer_array(local, lengths, local_key[1]), _SEG[local_key[0]]
                    ),
                    self._agent.get_xfer_descs(
                        _xfer_array(remote, lengths, remote_key[1]), _SEG[remote_key[0]]
                    ),
                    entry.agent,
                )
            except self._errors as err:
                raise self._submit_error(handle, "initialize_xfer", err) from None
            try:
                state = self._agent.transfer(xfer)
            except self._errors as err:
                self._release_engine(xfer)
                raise self._submit_error(handle, "transfer", err) from None
            if state == "ERR":
                self._release_engine(xfer)
                raise TransferError(
                    f"nixl {handle.describe()} failed to start: transfer returned ERR"
                )
            if state == "DONE":  # small transfers may finish inside the call
                self._release_engine(xfer)
                handle._status, handle._fence = DONE, Fence.DRAINED
            else:
                handle._xfer = xfer
                self._live.add(handle)
        return handle

    def _submit_error(self, handle: NixlHandle, call: str, err: BaseException) -> TransportError:
        what = f"nixl {handle.describe()} could not start: {call} raised {_describe(err)}"
        if type(err).__name__ == "nixlRemoteDisconnectError":
            # A batch failure like a disconnect noticed by poll: callers handle both one way.
            return TransferError(f"{what}; the peer is gone (reconnect it with new metadata)")
        if type(err).__name__ == "nixlNotFoundError":
            return RegistrationError(
                f"{what}; a descriptor lies outside the memory NIXL knows as registered"
            )
        return TransferError(what)

    def poll(self, handle: TransferHandle) -> TransferStatus:
        h = self._own(handle)
        if h._status is not None:
            return h._status
        with self._lock:
            if h._status is not None:
                return h._status
            if self._closed:  # close() finishes every handle; this one was never ours
                return self._finish(h, _failed(f"nixl {h.describe()}: the transport is closed"))
            try:
                state = self._agent.check_xfer_state(h._xfer)
            except self._errors as err:
                gone = type(err).__name__ == "nixlRemoteDisconnectError"
                return self._finish(
                    h, _failed(f"nixl {h.describe()} failed: {_describe(err)}"), cancelled=not gone
                )
            if state == "DONE":
                return self._finish(h, DONE)
            if state == "ERR":
                return self._finish(h, _failed(f"nixl {h.describe()} failed: NIXL reported ERR"))
            if time.monotonic() >= h.deadline:
                h.timed_out = True
                return self._finish(
                    h,
                    _failed(
                        f"nixl {h.describe()} did not finish within {self.timeout:g} s (peer "
                        "frozen, overloaded or unreachable); the batch was cancelled"
                    ),
                    cancelled=True,
                )
        return PENDING

    def release(self, handle: TransferHandle) -> None:
        """Cancel a pending batch (its NIXL handle is freed); a finished one holds nothing."""
        h = self._own(handle)
        with self._lock:
            if h._status is None:
                self._finish(
                    h, _failed(f"nixl {h.describe()} was released before it finished"),
                    cancelled=True,
                )  # fmt: skip

    def fence_state(self, handle: TransferHandle) -> Fence:
        """``DRAINED`` once NIXL finished the batch (done, or failed by the peer's end);
        ``UNCONFIRMED`` when it was cancelled in progress (bytes the peer's UCX worker already
        received may still be applied); ``PENDING`` while NIXL holds it (release refused)."""
        h = self._own(handle)
        with self._lock:
            return h._fence if h._status is not None else Fence.PENDING

    def _finish(
        self, h: NixlHandle, status: TransferStatus, *, cancelled: bool = False
    ) -> TransferStatus:
        """Record a final status and free NIXL's handle (lock held)."""
        h._status = status
        self._live.discard(h)
        xfer, h._xfer = h._xfer, None
        released = True
        if xfer is not None and self._agent is not None:
            released = self._release_engine(xfer)
        if not released:
            h._fence = Fence.PENDING
        else:
            h._fence = Fence.UNCONFIRMED if cancelled and xfer is not None else Fence.DRAINED
        return status

    def _release_engine(self, xfer: Any) -> bool:
        # NIXL cancels an in-progress transfer on release; if it refuses, the handle is kept and
        # released again on close (before the memory it points into is deregistered).
        try:
            self._agent.release_xfer_handle(xfer)
        except self._errors:
            self._stuck.append(xfer)
            return False
        return True

    def _own(self, handle: TransferHandle) -> NixlHandle:
        if not isinstance(handle, NixlHandle):
            raise TypeError(f"not a handle of the nixl transport: {handle!r}")
        return handle

    # -- life cycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """Cancel pending batches, deregister memory, unload peers, destroy the agent.

        Safe to call twice. The order matters: transfers are released before the memory they
        point into is deregistered, and the agent (its UCX worker, hence every connection) goes
        last, so a peer can no longer reach this agent's memory through it.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for handle in list(self._live):
                self._finish(handle, _failed(f"nixl {handle.describe()}: the transport was closed"))
            stuck, self._stuck = self._stuck, []
            for xfer in stuck:
                with suppress(*self._errors):
                    self._agent.release_xfer_handle(xfer)
            for key, group in _by_key(self._ranges.clear()).items():
                with suppress(*self._errors):
                    self._deregister_engine(key, group)
            self._groups.clear()
            for agent in {p.agent for p in self._peers.values()}:
                with suppress(*self._errors):
                    self._agent.remove_remote_agent(agent)
            self._peers.clear()
            self._agent = None  # the last reference: NIXL destroys the agent and its backends
        _LIVE.discard(self)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._peers)} peers"
        return f"<NixlTransport {self.agent_name} {'+'.join(self.backends)} {state}>"


def _failed(reason: str) -> TransferStatus:
    return TransferStatus(TransferState.FAILED, reason)


def _by_key(ranges: Sequence[MemoryRange]) -> dict[_GroupKey, list[MemoryRange]]:
    groups: dict[_GroupKey, list[MemoryRange]] = {}
    for rng in ranges:
        groups.setdefault(_key(rng), []).append(rng)
    return groups


def _reg_array(ranges: Sequence[MemoryRange], key: _GroupKey) -> np.ndarray:
    """NIXL's Nx3 registration array ``(addr, size, device id)``."""
    return np.array([(r.addr, r.size, key[1]) for r in ranges], dtype=np.uint64).reshape(-1, 3)


def _xfer_array(addrs: AddrArray, lengths: AddrArray, device: int) -> np.ndarray:
    """NIXL's Nx3 descriptor array ``(addr, length, device id)``, built without a Python loop."""
    out = np.empty((len(addrs), 3), dtype=np.uint64)
    out[:, 0] = addrs
    out[:, 1] = lengths
    out[:, 2] = device
    return out


def exit_cleanly(code: int = 0) -> NoReturn:
    """Close every NIXL transport, flush output and end the process with ``os._exit(code)``.

    For a process that owns a NIXL agent and may still crash at interpreter exit (an EFA host, or
    ``UCX_MODULES`` set so that UCX's ``efa`` module loads): the crash happens in a shared-library
    destructor after Python has finished, so the only way around it is not to run those
    destructors. ``os._exit`` also skips ``atexit`` handlers and ``finally`` blocks further up;
    call it last, from the process's main entry point, never from library code or a test run.
    """
    for transport in list(_LIVE):
        with suppress(Exception):
            transport.close()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with suppress(Exception):
            stream.flush()
    os._exit(code)
