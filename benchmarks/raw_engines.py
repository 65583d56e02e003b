"""The comparison baseline: each engine driven through its own Python API, with no kvbridge code.

``kvbridge bench`` moves a request through kvbridge and, beside it, through one of these with the
same descriptor arrays. Each class does only what a user of the bare engine would write: create
the engine, register the buffers, exchange the metadata, submit the batch and wait for it.

``ENGINES`` maps a kvbridge transport name to the class that drives the same engine. A transport
without an entry here has no raw baseline in the benchmark.
"""

from __future__ import annotations

import os
import uuid
from collections import deque
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

import numpy as np
import numpy.typing as npt

Addrs = npt.NDArray[np.uint64]


class RawEngineError(RuntimeError):
    """The engine refused a call (its log on stderr has the reason)."""


class RawEngine(Protocol):
    """What the benchmark needs from a bare engine."""

    name: ClassVar[str]

    def register(self, ranges: Sequence[tuple[int, int]]) -> None: ...
    def deregister(self, ranges: Sequence[tuple[int, int]]) -> None: ...
    def metadata(self) -> bytes: ...
    def connect(self, metadata: bytes) -> None: ...
    def read(self, local: Addrs, remote: Addrs, lengths: Addrs) -> None: ...
    def close(self) -> None: ...


class RawMooncake:
    """Mooncake Transfer Engine over TCP with the peer-to-peer handshake (no metadata server).

    ``read`` submits chunks of ``max_batch`` descriptors with ``batch_transfer_async_read`` and
    keeps at most ``max_in_flight`` descriptors in the engine, waiting for the oldest chunk with
    ``get_batch_transfer_status``: the engine refuses more than about 2048 in flight per peer
    (queue 1024 plus 1024 pending admissions, see PLATFORM.md).
    """

    name: ClassVar[str] = "mooncake"

    def __init__(
        self, hostname: str = "127.0.0.1", max_batch: int = 1024, max_in_flight: int = 2048
    ) -> None:
        from mooncake.engine import TransferEngine

        self.engine: Any = TransferEngine()
        rc = self.engine.initialize(hostname, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise RawEngineError(f"TransferEngine.initialize returned {rc}")
        self.session = f"{hostname}:{int(self.engine.get_rpc_port())}"
        self.max_batch = max_batch
        self.max_in_flight = max_in_flight
        self.peer = ""

    def register(self, ranges: Sequence[tuple[int, int]]) -> None:
        rc = self.engine.batch_register_memory([a for a, _ in ranges], [n for _, n in ranges], "*")
        if rc != 0:
            raise RawEngineError(f"batch_register_memory returned {rc}")

    def deregister(self, ranges: Sequence[tuple[int, int]]) -> None:
        self.engine.batch_unregister_memory([a for a, _ in ranges])

    def metadata(self) -> bytes:
        return self.session.encode()

    def connect(self, metadata: bytes) -> None:
        self.peer = metadata.decode()

    def read(self, local: Addrs, remote: Addrs, lengths: Addrs) -> None:
        inflight: deque[tuple[int, int]] = deque()  # (batch id, descriptors)
        count = 0
        for start in range(0, len(local), self.max_batch):
            stop = start + self.max_batch
            size = min(stop, len(local)) - start
            while inflight and count + size > self.max_in_flight:
                count -= self._wait(*inflight.popleft())
            batch = self.engine.batch_transfer_async_read(
                self.peer,
                local[start:stop].tolist(),
                remote[start:stop].tolist(),
                lengths[start:stop].tolist(),
            )
            if batch <= 0:
                raise RawEngineError(f"batch_transfer_async_read returned {batch}")
            inflight.append((batch, size))
            count += size
        while inflight:
            self._wait(*inflight.popleft())

    def _wait(self, batch: int, size: int) -> int:
        rc = self.engine.get_batch_transfer_status([batch])
        if rc != 0:
            raise RawEngineError(f"get_batch_transfer_status returned {rc}")
        return size

    def close(self) -> None:
        self.engine = None


class RawNixl:
    """A NIXL agent with the UCX backend; ``read`` polls ``check_xfer_state`` until done.

    UCX's ``efa`` module is left out, as kvbridge's NIXL transport does, because loading it
    crashes the process at exit on hosts without EFA (PLATFORM.md). Its progress thread waits
    ``PROGRESS_DELAY_US`` for UCX events when idle, as kvbridge's agent does: NIXL's Python API
    sets no wait (a busy loop), and an idle agent spinning in each benchmark process would take
    a core from whichever way is being timed.
    """

    name: ClassVar[str] = "nixl"
    PROGRESS_DELAY_US: ClassVar[int] = 1000

    def __init__(self, mem_type: str = "DRAM", device_id: int = 0) -> None:
        """``mem_type``: NIXL's name of the memory registered and moved (``DRAM``, or ``VRAM``
        of GPU ``device_id``)."""
        self.mem_type, self.device_id = mem_type, device_id
        os.environ.setdefault("UCX_MODULES", "^efa")
        from nixl import _api

        self.agent_name = f"raw-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        make = _api.nixlBind.nixlAgent

        def quiet(name: str, config: Any) -> Any:  # the only way to set NIXL's pthrDelay
            config.pthrDelay = self.PROGRESS_DELAY_US
            return make(name, config)

        _api.nixlBind.nixlAgent = quiet
        try:
            self.agent: Any = _api.nixl_agent(self.agent_name, _api.nixl_agent_config())
        finally:
            _api.nixlBind.nixlAgent = make
        self.peer = ""

    def _triples(self, ranges: Sequence[tuple[int, int]]) -> npt.NDArray[np.uint64]:
        dev = self.device_id
        return np.array([(a, n, dev) for a, n in ranges], dtype=np.uint64).reshape(-1, 3)

    def register(self, ranges: Sequence[tuple[int, int]]) -> None:
        self.agent.register_memory(self._triples(ranges), self.mem_type)

    def deregister(self, ranges: Sequence[tuple[int, int]]) -> None:
        self.agent.deregister_memory(self.agent.get_reg_descs(self._triples(ranges), self.mem_type))

    def metadata(self) -> bytes:
        return bytes(self.agent.get_agent_metadata())

    def connect(self, metadata: bytes) -> None:
        if self.peer:  # NIXL keeps a peer's first metadata: forget it to load the new one
            self.agent.remove_remote_agent(self.peer)
        name = self.agent.add_remote_agent(metadata)
        self.peer = name.decode() if isinstance(name, bytes) else str(name)

    def read(self, local: Addrs, remote: Addrs, lengths: Addrs) -> None:
        def descs(addrs: Addrs) -> Any:
            table = np.zeros((len(addrs), 3), dtype=np.uint64)
            table[:, 0], table[:, 1], table[:, 2] = addrs, lengths, self.device_id
            return self.agent.get_xfer_descs(table, self.mem_type)

        handle = self.agent.initialize_xfer("READ", descs(local), descs(remote), self.peer)
        try:
            state = self.agent.transfer(handle)
            while state == "PROC":
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise RawEngineError(f"NIXL transfer ended in state {state!r}")
        finally:
            self.agent.release_xfer_handle(handle)

    def close(self) -> None:
        self.agent = None


ENGINES: dict[str, type[RawMooncake] | type[RawNixl]] = {"mooncake": RawMooncake, "nixl": RawNixl}
