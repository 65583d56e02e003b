"""Transport over the Mooncake Transfer Engine (``mooncake.engine.TransferEngine``).

Engine facts this module is built around (measured with mooncake-transfer-engine 0.3.13, TCP):

* Engine calls never raise: they return a negative number (``batch_transfer_async_*`` also 0) and
  the reason goes only to the engine's log on stderr.
* ``transfer_check_status(batch_id)`` looks at the *first task only* and frees the batch id once it
  reports a result, so it cannot tell when a multi-descriptor batch is done. The only whole-batch
  status call, ``get_batch_transfer_status``, blocks (it spins, GIL released) until the batch
  finishes or ``MC_TRANSFER_TIMEOUT`` (at least 5 s) passes.
* The first transfer to a peer performs a handshake under an engine-wide lock; a peer that is
  frozen at that moment blocks it for about 60 s, stalling every other peer. ``send_probe`` blocks
  as long but without that lock, so a peer is probed before its first transfer.
* A session that makes no progress (no status frame, ``MC_TCP_STATUS_TIMEOUT_SEC``; no payload,
  ``MC_TCP_PROGRESS_TIMEOUT_SEC``, a sliding window) is dropped by the engine after 30 s by default:
  its connection closed, its task failed. Both are read from the environment each time a session
  arms them. Until then the task is not terminal, so a batch that stalled holds its fence that
  long after kvbridge's own deadline; ``bound_stalls`` lowers both to ``stall_bound(timeout)``.
* One peer accepts about 2048 descriptors in flight (TCP lane queue plus pending admissions);
  more is refused ("TCP lane queue-full") and the lane keeps refusing until it drains.
* The TCP transport does not check that local addresses are registered, and it does not support
  overlapping registrations (error -7). A remote range outside the peer's registrations is refused
  by the peer.
* What proves a chunk's bytes stopped (read in the engine's TCP transport): each descriptor is a
  task with its own connection and session, whose handlers run on the engine's io thread and read
  the socket straight into the destination (the initiator's memory for a read, the target's for a
  write). A session stops touching memory once its last handler ran, and a task is finished only
  then; a write's task completes only after the target acknowledged that its memory holds the
  payload (the v2 status frame). No engine timer cancels a session: the binding's
  ``get_batch_transfer_status`` gives up at ``MC_TRANSFER_TIMEOUT`` without cancelling anything,
  and the payload has no deadline. It reports ``COMPLETED`` only when every task completed, but
  returns on the *first* failed task (other tasks may still be moving), freeing the batch only if
  all had finished, and Python cannot learn which it did nor ask again. The engine's C++ status
  calls can (``batch_status``): they report every task without freeing the batch.

Hence ``blocking_engine``: the base runs every engine call that moves bytes on a per-peer lane
thread (``kvbridge.core.lanes``), keeps at most ``max_in_flight`` descriptors in the engine per
peer and waits for chunks in order; ``poll`` reads Python state only, so it never blocks, and a
batch past its deadline is reported ``FAILED`` whatever the engine is doing. The lane waits for a
chunk with the engine's own status calls until every task of it is terminal, with no timer: a
chunk comes back completed (every byte landed) or failed with every task ended, and either way no
session touches its memory any more, which is what its fence rests on. Without those calls (a
build that does not export them) the binding's wait is used, set far beyond any transfer
(``ENGINE_WAIT_S``), and a failed chunk of several tasks is ``unproven`` (see ``Fence``). This
module is the engine calls.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import math
import os
import threading
from typing import Annotated, Any, ClassVar

import msgspec

from kvbridge.core.batches import CHUNK_OK, AddrArray, Chunk, ChunkResult, TransferOp
from kvbridge.core.contract import MemoryAccess, TransportLimits
from kvbridge.core.environment import environment_overrides
from kvbridge.core.errors import ChunkRefused, PeerError, RegistrationError, TransportError
from kvbridge.core.memory import MemoryKind, MemoryRange
from kvbridge.core.transport import Transport
from kvbridge.transports import listeners
from kvbridge.transports.mooncake import batch_status

log = logging.getLogger("kvbridge.transports")

#: ``metadata_server`` value that makes engines exchange metadata peer to peer (no server).
P2P_HANDSHAKE = "P2PHANDSHAKE"
#: Descriptors one peer accepts in flight with the engine's default TCP queue settings.
DEFAULT_MAX_IN_FLIGHT = 2048
#: The binding's own wait for a batch (``MC_TRANSFER_TIMEOUT``), in seconds: a year, so it never
#: gives a chunk up while its sessions may still move bytes (the batch's deadline is kept by the
#: base, in Python).
ENGINE_WAIT_S = 365 * 24 * 3600

_INSTALL_HINT = (
    "pip install 'kvbridge[mooncake]' (package mooncake-transfer-engine-non-cuda; "
    "on a CUDA machine pip install 'kvbridge[mooncake-cuda]' instead)"
)
#: Why Mooncake's listeners cannot be bound (read in its source, seen in 0.3.13.post1): the P2P
#: handshake (RPC) socket binds ``INADDR_ANY`` (``findAvailableTcpPort``, ``startDaemon``) and the
#: TCP data port a dual-stack ``[::]`` acceptor (``TcpContext``); no setting names an address
#: (``MC_TCP_BIND_ADDRESS`` only names the address announced with a metadata server).
UNBINDABLE = "Mooncake binds its RPC and data ports to every interface and has no setting for it"
#: the variables that bound both ports' range (Mooncake reads them into its global config once,
#: when ``mooncake.engine`` is imported; ``_pin_ports`` has it read them again)
PORT_RANGE_ENV = ("MC_MIN_RPC_PORT", "MC_MAX_RPC_PORT")
#: ``mooncake::globalConfig()`` and ``mooncake::loadGlobalConfig(GlobalConfig&)`` in engine.so
_GLOBAL_CONFIG = "_ZN8mooncake12globalConfigEv"
_LOAD_GLOBAL_CONFIG = "_ZN8mooncake16loadGlobalConfigERNS_12GlobalConfigE"
_CONFIG_LOCK = threading.Lock()
_ENGINE_ERRORS = {-7: "the range overlaps one already registered (Mooncake forbids overlaps)"}
#: Seconds without progress after which the engine drops a TCP session (default 30 each), read
#: from the environment whenever a session arms them (checked in 0.3.13.post1: a value set after
#: the engine started applied to its next transfer), hence process-wide
STALL_ENV = ("MC_TCP_STATUS_TIMEOUT_SEC", "MC_TCP_PROGRESS_TIMEOUT_SEC")
_ENGINE_STALL_S = 30
#: the lowest bound kvbridge sets: a peer stalled that briefly (a burst of CPU contention, a test
#: freezing it) should not cost a session, in this process or in another transport of it
_MIN_STALL_S = 5
_STALL_LOCK = threading.Lock()
_stall_set: int | None = None  # the value kvbridge last put in STALL_ENV in this process
_users_stall: dict[str, str] = {}  # STALL_ENV as the user set it, read by the first transport


def stall_bound(timeout: float) -> int:
    """Seconds of no progress after which a session is dropped, for a transport ``timeout``.

    Half the timeout, 5 s to 30 s (the engine's default): a session stalled from the start is
    dropped in time for the failed chunk's retry to run within the batch's deadline (10 s: at
    5 s), and a batch past its deadline holds its fence about this long more per round of
    sessions the engine still holds (was: 30 s a round whatever kvbridge's timeout; issue 45).
    """
    return max(_MIN_STALL_S, min(_ENGINE_STALL_S, math.ceil(timeout / 2)))


def bound_stalls(timeout: float) -> None:
    """Set ``STALL_ENV`` to ``stall_bound(timeout)`` (the smallest any transport of this process
    asked for); a value the user set before the first transport wins, with a log line. The
    engine reads them per session, so they stay set: changed only when a transport starts,
    before it moves anything."""
    global _stall_set, _users_stall
    with _STALL_LOCK:
        if _stall_set is None:
            _users_stall = {name: os.environ[name] for name in STALL_ENV if name in os.environ}
            want = stall_bound(timeout)
            for name, theirs in _users_stall.items():
                log.info(
                    "kvbridge mooncake: %s=%s set by the user wins over the %d s kvbridge "
                    "derived from its timeout",
                    name,
                    theirs,
                    want,
                )
        else:
            want = min(stall_bound(timeout), _stall_set)
        for name in STALL_ENV:
            if name not in _users_stall:
                os.environ[name] = str(want)
        _stall_set = want


#: Read by the engine at ``initialize``: "1" registers GPU memory through nvidia-peermem, "0"
#: through DMA-BUF (the only way for memory the driver maps, which nvidia-peermem cannot pin)
PEERMEM_ENV = "WITH_NVIDIA_PEERMEM"


class MooncakeMetadata(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a peer needs to reach this agent: the engine's session (segment) name."""

    #: ``"host:rpc_port"`` with the peer-to-peer handshake, else the name given to the server.
    session: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
    protocol: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]


def engine_import() -> Any:
    """The engine class (``ImportError`` when the package is missing)."""
    from mooncake.engine import TransferEngine

    return TransferEngine


def _engine_supports_vram() -> bool:
    """False for the non-CUDA wheel, which can only move host memory."""
    from importlib import metadata

    try:
        metadata.distribution("mooncake-transfer-engine-non-cuda")
    except metadata.PackageNotFoundError:
        return True
    return False


def _pin_ports(engine_module: Any, env: dict[str, str]) -> bool:
    """Have Mooncake read its port range (``env``, set for the call) again; False: cannot.

    The engine reads ``MC_MIN_RPC_PORT``/``MC_MAX_RPC_PORT`` (with every other ``MC_*`` setting)
    into a process-wide config once, at import, and picks both listening ports from that range
    in ``initialize``. ``loadGlobalConfig`` on that config reads the environment again: settings
    not set keep their value, the others get the value of the environment at this moment.
    """
    try:
        lib = ctypes.CDLL(engine_module.__file__)
        get, load = getattr(lib, _GLOBAL_CONFIG), getattr(lib, _LOAD_GLOBAL_CONFIG)
    except (OSError, AttributeError, TypeError):
        return False
    get.argtypes, get.restype = [], ctypes.c_void_p
    load.argtypes, load.restype = [ctypes.c_void_p], None
    with _CONFIG_LOCK, environment_overrides(env):
        load(get())
    return True


def _location(device: tuple[MemoryKind, int]) -> str:
    """Mooncake location string: any NUMA node for host memory, the GPU for VRAM."""
    return f"cuda:{device[1]}" if device[0] is MemoryKind.VRAM else "*"


class MooncakeTransport(Transport):
    """Moves bytes with the Mooncake Transfer Engine.

    Options (keyword only):
        protocol: engine protocol, ``"tcp"`` (default), ``"rdma"``, ... passed through.
        device_name: engine device filter, e.g. RDMA NIC names separated by commas.
        hostname: address this agent announces to peers (``host`` or ``host:port``). Mooncake
            cannot bind its listeners to it: the RPC (handshake) and TCP data ports accept on
            every interface, which ``wide_listeners`` lists and a WARNING names at
            construction (unless ``hostname`` is ``0.0.0.0``); firewall them.
        port_range: ``(lo, hi)``: the RPC and data ports are picked from this range (Mooncake's
            ``MC_MIN_RPC_PORT``/``MC_MAX_RPC_PORT``, default 15000-17000; a value the user set
            in the environment wins, with a log line). Mooncake keeps the range in a
            process-wide config, which kvbridge has it re-read before ``initialize``; ports
            outside the range after all raise ``TransportError``.
        metadata_server: ``"P2PHANDSHAKE"`` (peers exchange metadata directly) or the address
            of a metadata server (``etcd://...``, ``http://...``).
        max_batch: most descriptors handed to the engine in one call; bigger batches are split.
        max_in_flight: most descriptors in the engine for one peer at once (the engine refuses
            more than about 2048 with its default queue settings); extra chunks wait their turn.
        retries: times a failed chunk is submitted again before its batch fails (only while
            the batch's deadline has not passed; reads and writes are idempotent).
        timeout: seconds a batch may take from ``submit``; past it the batch fails, and the
            engine keeps what it already moves until it ends (``fence`` tells when). Also sets
            the engine's no-progress limits (``STALL_ENV``, process-wide) to ``stall_bound``.
    """

    name: ClassVar[str] = "mooncake"
    install_hint: ClassVar[str] = _INSTALL_HINT
    log_hint: ClassVar[str] = "the Mooncake engine log (stderr) has the reason"
    metadata_version: ClassVar[int] = 2
    blocking_engine: ClassVar[bool] = True
    host_option: ClassVar[str | None] = "hostname"
    # The engine registers every range with its transports (ibverbs memory regions for RDMA,
    # GPU memory through nvidia-peermem or DMA-BUF): each must be one physical allocation.
    memory_access: ClassVar[MemoryAccess] = MemoryAccess.REGISTERS

    @classmethod
    def prepare_for_driver_mapped_memory(cls) -> None:
        """Have the engine register GPU memory through DMA-BUF (``WITH_NVIDIA_PEERMEM=0``):
        nvidia-peermem cannot pin memory the driver maps. Set unless the environment already
        says so; ``TransportError`` when it asks for nvidia-peermem (``1``)."""
        value = os.environ.setdefault(PEERMEM_ENV, "0")  # read at the engine's ``initialize``
        if value != "0":
            raise TransportError(
                f"{PEERMEM_ENV}={value!r} makes Mooncake register GPU memory through "
                "nvidia-peermem, which cannot pin driver-mapped (CUDA virtual) memory such as "
                f"vLLM's extensible KV cache; unset {PEERMEM_ENV} (Mooncake then registers "
                "through DMA-BUF) or turn that memory off (vLLM: --no-enable-extensible-kv-cache)"
            )

    def __init__(
        self,
        *,
        protocol: str = "tcp",
        device_name: str = "",
        hostname: str = "127.0.0.1",
        metadata_server: str = P2P_HANDSHAKE,
        max_batch: int = 1024,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        retries: int = 1,
        timeout: float = 30.0,
        port_range: tuple[int, int] | None = None,
    ) -> None:
        super().__init__(timeout=timeout, retries=retries)
        self.port_range = listeners.check_port_range(port_range)
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        if max_in_flight < max_batch:
            raise ValueError(
                f"max_in_flight ({max_in_flight}) must be at least max_batch ({max_batch})"
            )
        engine_cls = self.load_engine()
        bound_stalls(self.timeout)
        self.protocol = protocol
        self._session = hostname
        module = importlib.import_module(engine_cls.__module__)
        self._status = batch_status.load(module)
        env = {"MC_TRANSFER_TIMEOUT": str(ENGINE_WAIT_S)}
        pinned = self._pin_port_range(module)
        before = {lst.inode for lst in listeners.listening_sockets()}
        with environment_overrides(env):
            engine = engine_cls()
            rc = engine.initialize(hostname, metadata_server, protocol, device_name)
        opened = [lst for lst in listeners.listening_sockets() if lst.inode not in before]
        if rc != 0:
            raise TransportError(
                f"the Mooncake engine did not start: initialize({hostname!r}, "
                f"{metadata_server!r}, {protocol!r}, {device_name!r}) returned {rc}; "
                f"{self.log_hint}"
            )
        self._engine: Any = engine
        rpc_port = int(engine.get_rpc_port())
        host = listeners.host_part(hostname)
        if metadata_server == P2P_HANDSHAKE:
            self._session = f"{host}:{rpc_port}"
        #: the engine's listening sockets, as the kernel reports them after ``initialize``
        self.listeners: list[listeners.Listener] = opened
        if len(pinned) == len(PORT_RANGE_ENV):
            self._check_pinned_ports(opened)
        labels = {rpc_port: "RPC"} | {
            lst.port: "data" for lst in opened if lst.port != rpc_port and lst.protocol == "tcp"
        }
        self.wide_listeners = listeners.report_wide(
            "mooncake", host, opened, log, labels, UNBINDABLE
        )
        kinds = {MemoryKind.DRAM, *([MemoryKind.VRAM] if _engine_supports_vram() else [])}
        self.open(TransportLimits(int(max_batch), int(max_in_flight), frozenset(kinds)))

    def _pin_port_range(self, module: Any) -> dict[str, str]:
        """Pin the engine's ports to ``port_range`` where the environment does not already;
        the settings pinned."""
        if self.port_range is None:
            return {}
        ours = dict(zip(PORT_RANGE_ENV, map(str, self.port_range), strict=True))
        pinned = listeners.settings_not_set(ours, {}, log, "mooncake")
        if pinned and not _pin_ports(module, pinned):
            raise TransportError(
                "this Mooncake build does not export loadGlobalConfig, so port_range cannot "
                "be applied; set MC_MIN_RPC_PORT and MC_MAX_RPC_PORT in the environment of "
                "the process before it starts instead"
            )
        return pinned

    def _check_pinned_ports(self, opened: list[listeners.Listener]) -> None:
        """Refuse an engine listening outside the ``port_range`` it was pinned to."""
        if self.port_range is None:  # nothing was pinned
            return
        lo, hi = self.port_range
        outside = [str(lst) for lst in opened if not lo <= lst.port <= hi]
        if outside:
            self._engine = None
            raise TransportError(
                f"the Mooncake engine listens on {', '.join(outside)}, outside port_range "
                f"{lo}-{hi} (another thread may have changed Mooncake's port range); "
                f"{self.log_hint}"
            )

    @classmethod
    def engine_import(cls) -> Any:
        return engine_import()

    @classmethod
    def engine_unavailable_message(cls, err: ImportError) -> str:
        msg = super().engine_unavailable_message(err)
        if "libibverbs" in str(err):
            msg += "; its engine.so also needs libibverbs: apt-get install -y libibverbs1"
        return msg

    @property
    def session(self) -> str:
        """This agent's session name, as peers address it."""
        return self._session

    # -- memory -------------------------------------------------------------------------------

    def engine_memory_hint(self) -> str:
        return "; for GPU memory install mooncake-transfer-engine (the CUDA build)"

    def engine_register(self, device: tuple[MemoryKind, int], ranges: list[MemoryRange]) -> None:
        location = _location(device)
        rc = self._engine.batch_register_memory(
            [r.addr for r in ranges], [r.size for r in ranges], location
        )
        if rc != 0:
            raise RegistrationError(
                f"Mooncake could not register {len(ranges)} range(s) at {location!r}, first "
                f"[{ranges[0].addr:#x}, +{ranges[0].size}): batch_register_memory returned {rc}; "
                f"{_ENGINE_ERRORS.get(rc, self.log_hint)}"
            )

    def engine_deregister(self, device: tuple[MemoryKind, int], ranges: list[MemoryRange]) -> None:
        rc = self._engine.batch_unregister_memory([r.addr for r in ranges])
        if rc != 0:
            raise RegistrationError(
                f"Mooncake could not deregister {len(ranges)} range(s) (batch_unregister_memory "
                f"returned {rc}); {self.log_hint}"
            )

    # -- peers --------------------------------------------------------------------------------

    def engine_metadata(self) -> bytes:
        return msgspec.msgpack.encode(MooncakeMetadata(self._session, self.protocol))

    def engine_connect(self, peer: str, payload: bytes, old: Any) -> str:
        meta = self.decode_payload(peer, payload, MooncakeMetadata)
        if meta.protocol != self.protocol:
            raise PeerError(
                f"peer {peer!r} uses Mooncake protocol {meta.protocol!r}, this agent "
                f"{self.protocol!r}; configure both with the same protocol"
            )
        return old if old == meta.session else meta.session  # the state is the session

    def engine_describe_peer(self, state: Any) -> str:
        return str(state)

    def engine_lane_key(self, state: Any) -> str:
        return str(state)  # peer names announcing one session share its lane

    def engine_reach_peer(self, state: Any) -> str | None:
        # Blocks (up to ~60 s) on a frozen peer but, unlike the handshake inside the first
        # transfer, holds no engine-wide lock: other peers keep moving meanwhile.
        engine = self._engine
        if engine is None:
            return "the transport is closed"
        rc = int(engine.send_probe(state))
        return None if rc == 0 else f"the peer did not answer a probe (send_probe returned {rc})"

    # -- transfers ----------------------------------------------------------------------------

    def engine_check_remote(
        self, state: Any, remote: AddrArray, lengths: AddrArray, peer: str
    ) -> None:
        pass  # the peer's engine refuses a range outside its registrations (module docstring)

    def engine_start_chunk(self, state: Any, chunk: Chunk) -> tuple[Any, int]:
        engine = self._engine  # the token keeps it: close() may drop ours while chunks run out
        if chunk.op is TransferOp.WRITE:
            submit, name = engine.batch_transfer_async_write, "batch_transfer_async_write"
        else:
            submit, name = engine.batch_transfer_async_read, "batch_transfer_async_read"
        batch_id = int(
            submit(state, chunk.local.tolist(), chunk.remote.tolist(), chunk.lengths.tolist())
        )
        if batch_id <= 0:  # -1: peer unreachable; 0: submission refused: nothing was sent
            raise ChunkRefused(f"{name} returned {batch_id}")
        return engine, batch_id

    def engine_wait_chunk(self, chunk: Chunk) -> ChunkResult:
        engine, batch_id = chunk.token
        if self._status is not None:
            completed, why = self._status.wait(engine, batch_id, len(chunk.lengths))
            return CHUNK_OK if completed else ChunkResult(False, why)
        rc = engine.get_batch_transfer_status([batch_id])
        if rc == 0:
            return CHUNK_OK
        # The first failed task ends the call: with more than one task, others may still move.
        return ChunkResult(
            False, f"get_batch_transfer_status returned {rc}", unproven=len(chunk.lengths) > 1
        )

    def engine_close(self) -> None:
        self._engine = None  # chunks still in it hold it through their tokens

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.peer_count} peers"
        return f"<MooncakeTransport {self.protocol} {self._session} {state}>"
