"""The benchmarks' worker processes (``kvbridge.bench.processes``): answers, and every way a
worker can fail reaching the coordinator as the benchmark's own error, within a bound."""

from __future__ import annotations

import os
import time

import pytest

from kvbridge.bench.processes import WorkerProcess, gather


class Failed(RuntimeError):
    pass


class Handler:
    def __init__(self, base: int) -> None:
        self.base = base

    def add(self, n: int) -> int:
        return self.base + n

    def pid(self) -> int:
        return os.getpid()

    def fail(self) -> None:
        raise ValueError("the handler said no")

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def die(self) -> None:
        os._exit(3)


def refuse(base: int) -> Handler:
    raise OSError(f"no engine for {base}")


@pytest.mark.timeout(60)
def test_workers_answer_in_their_own_processes_and_a_failed_call_leaves_them_serving() -> None:
    workers = [WorkerProcess(Handler, b, name=f"w{b}", error=Failed) for b in (10, 20)]
    try:
        assert gather(workers, "add", [(1,), (2,)]) == [11, 22]
        assert len({w.call("pid") for w in workers} | {os.getpid()}) == 3
        with pytest.raises(
            Failed, match=r"the w10 process failed: ValueError: the handler said no"
        ):
            workers[0].call("fail")
        assert workers[0].call("add", 5) == 15  # still serving
    finally:
        for w in workers:
            w.stop()
    assert all(not w.proc.is_alive() for w in workers)


@pytest.mark.timeout(60)
def test_a_worker_that_cannot_start_dies_or_stalls_is_an_error_within_the_bound() -> None:
    refused = WorkerProcess(refuse, 7, name="refused", error=Failed)
    try:
        with pytest.raises(Failed, match=r"the refused process failed: OSError: no engine for 7"):
            refused.ready(30)
    finally:
        refused.stop()
    worker = WorkerProcess(Handler, 0, name="stalled", error=Failed)
    try:
        with pytest.raises(Failed, match=r"the stalled process did not answer within 0.5 s"):
            worker.call("sleep", 5, timeout=0.5)
    finally:
        worker.stop()
    dying = WorkerProcess(Handler, 0, name="dying", error=Failed)
    try:
        with pytest.raises(Failed, match=r"the dying process exited \(code 3\) without answering"):
            dying.call("die", timeout=30)
    finally:
        dying.stop()
