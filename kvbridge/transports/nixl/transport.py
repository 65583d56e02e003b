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
  deadline is enforced here.
* What proves a transfer's bytes stopped (read in NIXL's UCX backend and UCX 1.23): a transfer
  is its gets or puts followed by an endpoint flush, and ``check_xfer_state`` says ``DONE`` only
  once the flush completed, which is remote completion: a write's bytes are in the peer's memory
  (over tcp the peer acknowledges a put after writing it; over cma the copies are this process's
  own syscalls), a read's are in ours. ``release_xfer_handle`` of a transfer in progress does not
  stop it (``ucp_request_cancel`` is a no-op for RMA; measured: bytes landed 0.8-2.5 s after the
  release over tcp), nor does ``remove_remote_agent`` (the endpoint closes gracefully, flushing
  first). So a given-up transfer is watched until NIXL ends it (``cancel_is_fence`` False): done
  is proven; a peer gone (``nixlRemoteDisconnectError``: UCX fails every request of the endpoint
  at once and drops replies to failed gets) is proven; any other error is not.
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

import importlib
import importlib.util
import logging
import os
import sys
import threading
import uuid
import weakref
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, NoReturn

import msgspec
import numpy as np

from kvbridge.core.batches import CHUNK_OK, AddrArray, Chunk, ChunkResult, TransferOp
from kvbridge.core.contract import MemoryAccess, TransportLimits
from kvbridge.core.descriptors import device_holding
from kvbridge.core.environment import environment_overrides
from kvbridge.core.errors import PeerError, RegistrationError, TransferError, TransportError
from kvbridge.core.memory import MemoryKind, MemoryRange, RegisteredRanges, by_device
from kvbridge.core.transport import Transport
from kvbridge.transports import listeners

#: The exact command that installs the engine without dragging in torch and CUDA (about 6 GB).
INSTALL_COMMAND = "pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1"
_INSTALL_HINT = (
    f"{INSTALL_COMMAND} (nixl-cu13 instead of nixl-cu12 where torch is built for CUDA 13; numpy "
    "is the only other dependency; without --no-deps pip pulls torch and CUDA wheels); where "
    "torch is already installed, pip install 'kvbridge[nixl]' also works"
)
#: UCX modules left out by default (see the module docstring: the EFA module crashes the exit).
DEFAULT_UCX_MODULES = "^efa"
_SEG = {MemoryKind.DRAM: "DRAM", MemoryKind.VRAM: "VRAM"}
_OPS = {TransferOp.READ: "READ", TransferOp.WRITE: "WRITE"}

#: Every transport not yet closed, so ``exit_cleanly`` can close them before leaving.
_LIVE: weakref.WeakSet[NixlTransport] = weakref.WeakSet()
log = logging.getLogger("kvbridge.transports")

_Device = tuple[MemoryKind, int]


class NixlMetadata(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a peer needs: NIXL's agent metadata and the ranges registered when it was taken."""

    agent: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
    #: ``nixl_agent.get_agent_metadata()``
    blob: Annotated[bytes, msgspec.Meta(min_length=1)]
    #: ``(addr, size, kind, device_id)`` of every registered range; the remote side of a transfer
    #: must name the kind and device id of the peer's registration.
    ranges: list[tuple[int, int, MemoryKind, int]]


# -- engine loading -----------------------------------------------------------------------------


def _import_nixl() -> Any:
    """NIXL's ``_api`` module (``ImportError`` when the package is missing).

    ``import nixl`` picks its build (``nixl_cu12``, ...) by CUDA version, and where no CUDA
    stack is loaded and torch's files name none (a CPU build, no torch) it imports torch to ask,
    seconds before anything moves (``kvbridge transports`` took 3-6 s). Then it would take the
    first build installed, so that one is imported here directly, without torch.
    """
    backend = _nixl_build_without_torch()
    if backend is None:
        from nixl import _api
    else:
        _api = importlib.import_module(f"{backend}._api")
    _quiet_nixl_logging()
    return _api


def _nixl_build_without_torch() -> str | None:
    """The build ``import nixl`` takes when choosing it would import torch; ``None`` when
    ``import nixl`` chooses without torch (or is not the 1.5 meta package)."""
    if "nixl" in sys.modules or any(m in sys.modules for m in ("torch", "cuda.bindings", "cupy")):
        return None
    try:
        import nixl_meta_utils
    except ImportError:
        return None
    from_disk = getattr(nixl_meta_utils, "_torch_cuda_version_from_disk", None)
    if from_disk is None or from_disk() is not None:
        return None
    for name in ("nixl_cu13", "nixl_cu12", "nixl_rocm"):  # the meta package's order
        if importlib.util.find_spec(name) is not None:
            return name
    return None


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


_START_LOCK = threading.Lock()


def _start_agent(api: Any, name: str, config: Any, progress_delay_us: int) -> Any:
    """``nixl_agent(name, config)`` with the progress thread's idle wait set.

    ``nixl_agent`` builds NIXL's own ``nixlAgentConfig`` with ``pthrDelay = 0`` and offers no
    option for it, so the constructor it calls is wrapped for the moment the agent is made.
    """
    if progress_delay_us < 0:
        raise ValueError(f"progress_delay_us must not be negative, got {progress_delay_us}")
    build = api.nixlBind.nixlAgent

    def with_delay(agent_name: str, agent_config: Any) -> Any:
        agent_config.pthrDelay = progress_delay_us
        return build(agent_name, agent_config)

    with _START_LOCK:
        api.nixlBind.nixlAgent = with_delay
        try:
            return api.nixl_agent(name, config)
        finally:
            api.nixlBind.nixlAgent = build


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


def _rdma_devices() -> list[str]:
    """UCX names (``mlx5_0:1``) of the host's RDMA device ports, kept in ``UCX_NET_DEVICES``."""
    root = Path("/sys/class/infiniband")
    with suppress(OSError):
        return sorted(
            f"{dev.name}:{port.name}"
            for dev in root.iterdir()
            for port in (dev / "ports").iterdir()
        )
    return []


def _listen_environment(
    host: str | None, port_range: tuple[int, int] | None, user: dict[str, str]
) -> dict[str, str]:
    """``UCX_NET_DEVICES`` and ``UCX_TCP_PORT_RANGE`` from the ``host`` and ``port_range`` options.

    UCX's TCP transport listens on every network device it uses, each on that device's address:
    naming only the interface that holds ``host`` (plus RDMA ports, which open no TCP listener)
    binds it there. The user's own ``UCX_*`` settings win, with a log line.
    """
    ours: dict[str, str] = {}
    if host is not None and not listeners.is_wildcard(host):
        address = listeners.resolve_host(host)
        interface = listeners.interface_of(address) if address is not None else None
        if interface is None:
            log.warning(
                "kvbridge nixl: no network interface holds host %s (%s); UCX keeps listening "
                "on every interface",
                host,
                address or "unresolved",
            )
        else:
            ours["UCX_NET_DEVICES"] = ",".join([interface, *_rdma_devices()])
    if port_range is not None:
        ours["UCX_TCP_PORT_RANGE"] = f"{port_range[0]}-{port_range[1]}"
    return listeners.settings_not_set(ours, user, log, "nixl")


# -- peers ----------------------------------------------------------------------------------------


@dataclass
class _Peer:
    """A loaded remote agent: its name in NIXL and its registered memory by (kind, device)."""

    agent: str
    blob: bytes
    devices: dict[_Device, RegisteredRanges]
    everything: RegisteredRanges

    @classmethod
    def from_metadata(cls, meta: NixlMetadata) -> _Peer:
        ranges = [MemoryRange(a, s, k, d) for a, s, k, d in meta.ranges]
        everything = RegisteredRanges()
        everything.add(ranges)
        devices: dict[_Device, RegisteredRanges] = {}
        for device, group in by_device(ranges).items():
            devices.setdefault(device, RegisteredRanges()).add(group)
        return cls(meta.agent, meta.blob, devices, everything)


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
        progress_delay_us: how long NIXL's progress thread waits for UCX events before it looks
            again when idle (1000). NIXL's Python API sets 0, which makes that thread spin a
            whole core even with nothing to do (measured: 0.97 CPU-seconds per second idle, 0.02
            with 1000): on a busy host it takes a core from the engine and from kvbridge. Events
            wake it at once, so transfers do not wait for the delay.
        timeout: seconds a batch may take from ``submit``; NIXL itself never gives up on a
            stalled peer, so ``poll`` fails a batch past this deadline (what NIXL already
            moves is watched until it ends: ``fence``).
        ucx: UCX settings, set as ``UCX_<KEY>`` environment variables while the agent is created,
            e.g. ``{"TLS": "tcp", "NET_DEVICES": "lo"}`` (on a GPU host NIXL wants a CUDA
            transport in ``TLS`` too: ``"tcp,cuda_copy"``). ``MODULES`` defaults to ``^efa`` (see
            the module docstring) unless ``UCX_MODULES`` is set or the host has an EFA device.
            Settings UCX reads once per process (``MODULES``, logging) take effect only for the
            first agent of the process.
        device_id: the CUDA device of this agent's GPU memory; when given, registering GPU memory
            of another device is refused (each range names its device in ``MemoryRange``).
        host: the address this agent's UCX listeners bind to (the vLLM connector sets it from
            its side-channel ``host``): UCX's TCP transport then uses only the interface holding
            it (``UCX_NET_DEVICES=<interface>`` plus the host's RDMA ports), so it listens on
            that interface's address alone. ``None``, ``0.0.0.0`` or ``::``: every interface
            (UCX's default). A ``NET_DEVICES`` in ``ucx`` or ``UCX_NET_DEVICES`` in the
            environment wins (logged). A listener left on another address is named by a
            WARNING and in ``wide_listeners``.
        port_range: ``(lo, hi)``: UCX's TCP listeners take ports from this range
            (``UCX_TCP_PORT_RANGE``; a user's setting wins).
    """

    name: ClassVar[str] = "nixl"
    install_hint: ClassVar[str] = _INSTALL_HINT
    metadata_version: ClassVar[int] = 2
    host_option: ClassVar[str | None] = "host"
    # UCX registers every range (RDMA memory regions, GPU memory through DMA-BUF or peermem),
    # and between processes of one host maps a peer's GPU memory through cuda_ipc.
    memory_access: ClassVar[MemoryAccess] = (
        MemoryAccess.REGISTERS | MemoryAccess.EXPORTS_WITHIN_HOST
    )

    def __init__(
        self,
        *,
        backends: str | Sequence[str] = ("UCX",),
        agent_name: str | None = None,
        progress_thread: bool = True,
        progress_delay_us: int = 1000,
        timeout: float = 30.0,
        ucx: dict[str, Any] | None = None,
        device_id: int | None = None,
        host: str | None = None,
        port_range: tuple[int, int] | None = None,
    ) -> None:
        super().__init__(timeout=timeout)
        if isinstance(backends, str):
            backends = (backends,)
        if not backends:
            raise ValueError("backends must name at least one NIXL backend, e.g. ('UCX',)")
        api = self.load_engine()
        self._errors: tuple[type[BaseException], ...] = _nixl_errors(api)
        self.agent_name = agent_name or f"kvbridge-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.backends = tuple(backends)
        self.device_id = device_id
        self.host = host
        self.port_range = listeners.check_port_range(port_range)
        ucx_env = _ucx_environment(dict(ucx or {}))
        self.ucx_environment = {**ucx_env, **_listen_environment(host, self.port_range, ucx_env)}
        config = api.nixl_agent_config(
            enable_prog_thread=bool(progress_thread), backends=list(self.backends)
        )
        # NIXL raises RuntimeError when no plugin at all could be loaded.
        startup_errors: tuple[type[BaseException], ...] = (*self._errors, RuntimeError)
        before = {lst.inode for lst in listeners.listening_sockets()}
        try:
            with environment_overrides(self.ucx_environment):
                agent = _start_agent(api, self.agent_name, config, int(progress_delay_us))
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
        #: the agent's listening sockets (UCX's TCP interfaces), as the kernel reports them
        self.listeners = [lst for lst in listeners.listening_sockets() if lst.inode not in before]
        if host is not None:
            self.wide_listeners = listeners.report_wide(
                "nixl", host, self.listeners, log, why="UCX uses more than the host's interface"
            )
        self.open(TransportLimits(memory_kinds=frozenset(kinds)))
        _LIVE.add(self)

    @classmethod
    def engine_import(cls) -> Any:
        return _import_nixl()

    # -- memory -------------------------------------------------------------------------------

    def engine_memory_hint(self) -> str:
        return f" with backends {list(self.backends)}"

    def engine_check_range(self, rng: MemoryRange) -> None:
        if rng.kind is MemoryKind.VRAM and self.device_id not in (None, rng.device_id):
            raise RegistrationError(
                f"cannot register {rng}: this transport was created for GPU memory of "
                f"device {self.device_id}"
            )

    def engine_register(self, device: _Device, ranges: list[MemoryRange]) -> None:
        try:
            self._agent.register_memory(_reg_array(ranges, device), _SEG[device[0]])
        except self._errors as err:
            raise RegistrationError(
                f"NIXL could not register {len(ranges)} range(s), first {ranges[0]}: "
                f"{_describe(err)}"
            ) from None

    def engine_deregister(self, device: _Device, ranges: list[MemoryRange]) -> None:
        try:
            descs = self._agent.get_reg_descs(_reg_array(ranges, device), _SEG[device[0]])
            self._agent.deregister_memory(descs)
        except self._errors as err:
            raise RegistrationError(
                f"NIXL could not deregister {len(ranges)} range(s) from {ranges[0]}: "
                f"{_describe(err)}"
            ) from None

    # -- peers --------------------------------------------------------------------------------

    def engine_metadata(self) -> bytes:
        """This agent's NIXL metadata and registered ranges; take it after ``register``."""
        blob = bytes(self._agent.get_agent_metadata())
        ranges = [(r.addr, r.size, *r.device) for r in self._ranges]
        return msgspec.msgpack.encode(NixlMetadata(self.agent_name, blob, ranges))

    def engine_connect(self, peer: str, payload: bytes, old: Any) -> _Peer:
        meta = self.decode_payload(peer, payload, NixlMetadata)
        try:
            entry = _Peer.from_metadata(meta)
        except RegistrationError as err:
            raise PeerError(f"peer {peer!r} sent metadata with an unusable range: {err}") from None
        if meta.agent == self.agent_name:
            raise PeerError(
                f"peer {peer!r} is this agent itself ({self.agent_name!r}); NIXL agent names "
                "must differ between the agents that talk to each other"
            )
        if old is not None and old.agent == meta.agent and old.blob == meta.blob:
            return old  # type: ignore[no-any-return]  # the same agent again
        if old is not None:  # before loading: NIXL refuses a second blob under one agent name
            self._forget(peer, f"peer {peer!r} reconnected")
        # A NIXL agent name is loaded once; another peer name may hold it with older metadata
        # (that agent restarted under a fixed name): it is replaced for all names.
        aliases = [name for name, p in self._peers.items() if p.agent == meta.agent]
        if aliases and self._peers[aliases[0]].blob != meta.blob:
            for name in aliases:
                self._forget(name, f"NIXL agent {meta.agent!r} restarted")
        else:
            aliases = []
        try:
            loaded = self._agent.add_remote_agent(meta.blob)
        except self._errors as err:
            hint = ""
            if type(err).__name__ == "nixlBackendError":
                hint = (
                    "; UCX may have no transport that reaches the peer: an agent whose host "
                    "option is a loopback or other local-only address is bound to that "
                    "interface and unreachable from other hosts"
                )
            raise PeerError(
                f"NIXL could not load the metadata of peer {peer!r} (agent {meta.agent!r}): "
                f"{_describe(err)}{hint}"
            ) from None
        entry.agent = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        for alias in aliases:
            self._peers[alias] = entry
        # Start the UCX connection now (it does not block, even on a frozen peer), so the
        # first transfer does not pay for it.
        with suppress(*self._errors):
            self._agent.make_connection(entry.agent)
        return entry

    def engine_disconnect(self, peer: str, state: Any) -> None:
        if self._agent is not None and all(p.agent != state.agent for p in self._peers.values()):
            with suppress(*self._errors):
                self._agent.remove_remote_agent(state.agent)

    def engine_describe_peer(self, state: Any) -> str:
        return f"NIXL agent {state.agent!r}"

    # -- transfers ----------------------------------------------------------------------------

    def engine_check_remote(
        self, state: Any, remote: AddrArray, lengths: AddrArray, peer: str
    ) -> None:
        pass  # each chunk's remote side is found in the peer's registrations when it starts

    def engine_start_chunk(self, state: Any, chunk: Chunk) -> Any:
        local = self.device_of(chunk.local, chunk.lengths, "local")
        remote = device_holding(
            state.devices,
            state.everything,
            chunk.remote,
            chunk.lengths,
            f"remote (peer {chunk.handle.peer!r})",
        )
        try:
            xfer = self._agent.initialize_xfer(
                _OPS[chunk.op],
                self._agent.get_xfer_descs(
                    _xfer_array(chunk.local, chunk.lengths, local[1]), _SEG[local[0]]
                ),
                self._agent.get_xfer_descs(
                    _xfer_array(chunk.remote, chunk.lengths, remote[1]), _SEG[remote[0]]
                ),
                state.agent,
            )
        except self._errors as err:
            raise self._start_error(chunk, "initialize_xfer", err) from None
        try:
            started = self._agent.transfer(xfer)
        except self._errors as err:
            self._release_xfer(xfer)
            raise self._start_error(chunk, "transfer", err) from None
        if started == "ERR":
            self._release_xfer(xfer)
            raise TransferError(f"{chunk.handle.describe()} failed to start: transfer returned ERR")
        if started == "DONE":  # small transfers may finish inside the call
            self._release_xfer(xfer)
            return None
        return xfer

    def _start_error(self, chunk: Chunk, call: str, err: BaseException) -> TransportError:
        what = f"{chunk.handle.describe()} could not start: {call} raised {_describe(err)}"
        if type(err).__name__ == "nixlRemoteDisconnectError":
            # A batch failure like a disconnect noticed by poll: callers handle both one way.
            return TransferError(f"{what}; the peer is gone (reconnect it with new metadata)")
        if type(err).__name__ == "nixlNotFoundError":
            return RegistrationError(
                f"{what}; a descriptor lies outside the memory NIXL knows as registered"
            )
        return TransferError(what)

    def engine_check_chunk(self, chunk: Chunk) -> ChunkResult | None:
        try:
            state = self._agent.check_xfer_state(chunk.token)
        except self._errors as err:
            # A peer that is gone ends every request of the endpoint; after any other error
            # nothing says the transfer's other requests ended (see the module docstring).
            gone = type(err).__name__ == "nixlRemoteDisconnectError"
            return ChunkResult(False, _describe(err), unproven=not gone)
        if state == "DONE":
            return CHUNK_OK
        if state == "ERR":
            return ChunkResult(False, "NIXL reported ERR", unproven=True)
        return None

    def engine_release_chunk(self, chunk: Chunk) -> bool:
        return self._agent is None or self._release_xfer(chunk.token)

    def _release_xfer(self, xfer: Any) -> bool:
        # Called once NIXL ended the transfer (or on close); if it refuses, the base keeps the
        # chunk in the engine and releases it again on close (before deregistering memory).
        try:
            self._agent.release_xfer_handle(xfer)
        except self._errors:
            return False
        return True

    # -- life cycle ---------------------------------------------------------------------------

    def engine_close(self) -> None:
        self._agent = None  # the last reference: NIXL destroys the agent and its backends
        _LIVE.discard(self)

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.peer_count} peers"
        return f"<NixlTransport {self.agent_name} {'+'.join(self.backends)} {state}>"


def _reg_array(ranges: Sequence[MemoryRange], device: _Device) -> np.ndarray:
    """NIXL's Nx3 registration array ``(addr, size, device id)``."""
    return np.array([(r.addr, r.size, device[1]) for r in ranges], dtype=np.uint64).reshape(-1, 3)


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
