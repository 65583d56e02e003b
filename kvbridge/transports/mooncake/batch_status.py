"""The Mooncake engine's own batch status calls, which the Python binding does not expose.

``TransferEngine.get_batch_transfer_status`` (the binding) returns at the first failed task of a
batch and frees the batch only if every task had finished, without saying which it did, so after a
failure nobody can learn when the batch's other tasks stop writing. The engine's C++ API can:
``TransferEngine::getBatchTransferStatus`` and ``getTransferStatus`` report a batch and a task
without freeing anything, a task is terminal only once its session is done with the memory (the
TCP session marks it from its last handler), and ``freeBatchID`` frees the batch once every task
is terminal. ``engine.so`` exports these symbols (Itanium ABI: a returned ``Status``, which has a
destructor, goes through a hidden first pointer), and ``get_engine_ptr()`` gives the
``TransferEngine*``. Where the symbols are missing (another build), ``load`` returns None and the
transport falls back to the binding, whose failures then prove nothing.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from typing import Any

#: ``Transport::TransferStatusEnum`` (transport.h)
WAITING, PENDING, INVALID, CANCELED, COMPLETED, TIMEOUT, FAILED = range(7)
_TERMINAL = (COMPLETED, FAILED, CANCELED)

_BATCH = "_ZN8mooncake14TransferEngine22getBatchTransferStatusEmRNS_9Transport14TransferStatusE"
_TASK = "_ZN8mooncake14TransferEngine17getTransferStatusEmmRNS_9Transport14TransferStatusE"
_FREE = "_ZN8mooncake14TransferEngine11freeBatchIDEm"


class _Status(ctypes.Structure):
    """``mooncake::Status``: a 16-bit code and an owned message (set only on errors)."""

    _fields_ = [("code", ctypes.c_uint16), ("message", ctypes.c_char_p)]


class _TransferStatus(ctypes.Structure):
    """``Transport::TransferStatus``."""

    _fields_ = [("s", ctypes.c_int), ("transferred_bytes", ctypes.c_size_t)]


@dataclass(frozen=True)
class BatchStatus:
    """The three engine calls, bound to ``engine.so``."""

    _batch: Any
    _task: Any
    _free: Any

    def wait(self, engine: Any, batch_id: int, tasks: int) -> tuple[bool, str]:
        """Block until every task of the batch is terminal, free it; (completed, reason).

        Unbounded on purpose: a task that still waits is a session that may still write, and
        the caller (a lane thread) keeps the chunk "in the engine" meanwhile. Polls with a short
        sleep (the GIL is released in the calls), so a peer that stays frozen costs no CPU.
        """
        ptr = ctypes.c_void_p(engine.get_engine_ptr())
        status, state = _Status(), _TransferStatus()
        delay = 1e-5
        while True:
            self._batch(ctypes.byref(status), ptr, batch_id, ctypes.byref(state))
            self._check(status, "getBatchTransferStatus")
            if state.s == COMPLETED:
                self._release(ptr, batch_id)
                return True, ""
            if state.s in (FAILED, TIMEOUT):
                break
            time.sleep(delay)
            delay = min(delay * 2, 1e-4)
        # A task failed: wait for every other one to end too (each may still be moving bytes).
        failed, pending = 0, list(range(tasks))
        delay = 1e-4
        while pending:
            left = []
            for task in pending:
                self._task(ctypes.byref(status), ptr, batch_id, task, ctypes.byref(state))
                self._check(status, "getTransferStatus")
                if state.s in _TERMINAL:
                    failed += state.s != COMPLETED
                else:
                    left.append(task)
            pending = left
            if pending:
                time.sleep(delay)
                delay = min(delay * 2, 0.01)
        self._release(ptr, batch_id)
        return False, f"{failed} of {tasks} task(s) failed (every task has ended)"

    def _release(self, ptr: ctypes.c_void_p, batch_id: int) -> None:
        status = _Status()
        self._free(ctypes.byref(status), ptr, batch_id)
        self._check(status, "freeBatchID")

    @staticmethod
    def _check(status: _Status, call: str) -> None:
        if status.code:  # the message (a few bytes) is left to the engine's allocator
            why = (status.message or b"").decode(errors="replace")
            raise RuntimeError(f"Mooncake {call} returned status {status.code}: {why}")


def load(engine_module: Any) -> BatchStatus | None:
    """The engine's status calls from the loaded ``mooncake.engine`` module, or None."""
    try:
        lib = ctypes.CDLL(engine_module.__file__)
        batch, task, free = getattr(lib, _BATCH), getattr(lib, _TASK), getattr(lib, _FREE)
    except (OSError, AttributeError, TypeError):
        return None
    ref, ptr, u64 = ctypes.POINTER, ctypes.c_void_p, ctypes.c_uint64
    batch.argtypes = [ref(_Status), ptr, u64, ref(_TransferStatus)]
    task.argtypes = [ref(_Status), ptr, u64, ctypes.c_size_t, ref(_TransferStatus)]
    free.argtypes = [ref(_Status), ptr, u64]
    for call in (batch, task, free):
        call.restype = None
    return BatchStatus(batch, task, free)
