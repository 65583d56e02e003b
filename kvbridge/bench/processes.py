"""A benchmark's worker processes: each one holds a handler and answers its coordinator's calls.

A benchmark that needs engines in OS processes of their own (a transport's two sides, a crowd of
control planes) starts them with ``WorkerProcess(make, *args)``: a spawned process (a fresh
interpreter, so no engine state is inherited) builds its handler with ``make(*args)`` (a
module-level function: it is pickled), then answers each ``call(name, *args)`` with
``getattr(handler, name)(*args)`` until ``stop``. At ``stop`` it closes the handler (its
``close``, when it has one) and exits at once: some engines crash in their own teardown at
interpreter exit, and everything is released by then.

Every wait is bounded: an answer that does not come in time, or a worker that exits without
answering, raises the benchmark's own error class, as does a call that raised in the worker
(with its traceback; the worker goes on serving).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

#: How long a worker may take to build its handler (engines start, caches are filled).
READY_TIMEOUT_S = 300.0


def _serve(
    conn: Connection, make: Callable[..., Any], args: tuple[Any, ...], log_path: str | None
) -> None:
    """The worker's loop: build the handler, then answer calls until told to stop."""
    if log_path is not None:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 2)  # engines log every batch on stderr
        os.close(fd)
    handler: Any = None
    try:
        handler = make(*args)
        conn.send(("ok", None))
        while True:
            name, call_args = conn.recv()
            if name == "stop":
                break
            try:
                conn.send(("ok", getattr(handler, name)(*call_args)))
            except Exception as err:
                conn.send(("error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
    except BaseException as err:  # report, never leave the coordinator waiting
        with contextlib.suppress(OSError):
            conn.send(("error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
    finally:
        close = getattr(handler, "close", None)
        if close is not None:
            with contextlib.suppress(Exception):
                close()
        conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


class WorkerProcess:
    """One worker process and the coordinator's end of its pipe.

    ``name`` says which worker an error is about; ``error`` is the exception class raised on
    a worker's failure or silence; ``log_path`` takes the worker's stderr. Starting does not
    wait: ``ready`` does (or the first ``call``), so that several workers start at once.
    """

    def __init__(
        self,
        make: Callable[..., Any],
        *args: Any,
        name: str,
        error: type[Exception] = RuntimeError,
        log_path: str | None = None,
    ) -> None:
        self.name, self.error, self.log_path = name, error, log_path
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_serve, args=(child, make, args, log_path), name=name, daemon=True
        )
        self.proc.start()
        child.close()
        self._ready = False

    def ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Wait until the worker has built its handler (its error if it could not)."""
        if not self._ready:
            self._answer(timeout)
            self._ready = True

    def send(self, name: str, *args: Any) -> None:
        """Ask for a call without waiting for its answer (``result`` reads it)."""
        self.ready()
        self.conn.send((name, args))

    def result(self, timeout: float = READY_TIMEOUT_S) -> Any:
        """The answer to the call sent last."""
        return self._answer(timeout)

    def call(self, name: str, *args: Any, timeout: float = READY_TIMEOUT_S) -> Any:
        """``getattr(handler, name)(*args)`` in the worker, within ``timeout`` seconds."""
        self.send(name, *args)
        return self._answer(timeout)

    def _answer(self, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.05):
            if not self.proc.is_alive() and not self.conn.poll(0):
                raise self._exited()
            if time.monotonic() > deadline:
                raise self.error(f"the {self.name} process did not answer within {timeout:g} s")
        try:
            status, value = self.conn.recv()
        except (EOFError, OSError):  # its end closed: it exited
            self.proc.join(5)
            raise self._exited() from None
        if status != "ok":
            raise self.error(f"the {self.name} process failed: {value}")
        return value

    def _exited(self) -> Exception:
        where = f"; its log: {self.log_path}" if self.log_path else ""
        return self.error(
            f"the {self.name} process exited (code {self.proc.exitcode}) without answering{where}"
        )

    def stop(self) -> None:
        """Tell the worker to close its handler and exit; kill it if it does not."""
        with contextlib.suppress(OSError):  # the process may be gone already
            self.conn.send(("stop", ()))
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()


def gather(
    workers: Sequence[WorkerProcess],
    name: str,
    args: Sequence[Sequence[Any]],
    timeout: float = READY_TIMEOUT_S,
) -> list[Any]:
    """Run a call in every worker at once (``args[i]`` for worker i); their answers, in order."""
    for worker, a in zip(workers, args, strict=True):
        worker.send(name, *a)
    return [worker.result(timeout) for worker in workers]
