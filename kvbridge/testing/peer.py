"""A transport peer in its own OS process, driven by the conformance suite.

Run as ``python -m kvbridge.testing.peer --transport NAME --options JSON --size BYTES``. The peer
creates the transport, allocates and registers one buffer, then answers JSON commands, one per
line on stdin, with one JSON line each on its original stdout (fd 1 itself is pointed at stderr,
so nothing an engine prints can corrupt the replies). It exits when stdin closes and, on Linux,
when the process that started it dies, so a crashed test run leaves no orphans.

``PeerProcess`` is the test side: it starts a peer, sends commands with a timeout and always
reaps the process (``close``), continuing a stopped one first. The peer is started with the test
process's interpreter and environment, in its working directory; it needs only kvbridge and the
transport's entry point installed there.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvbridge.testing.reply_stream import take_stdout


def random_bytes(seed: int, size: int) -> np.ndarray:
    """``size`` random bytes from ``seed``, the same in every process."""
    data = np.frombuffer(np.random.default_rng(seed).bytes(size), dtype=np.uint8)
    copy: np.ndarray = data.copy()
    return copy


# -- peer process ---------------------------------------------------------------------------------


class _Buffer:
    """The peer's registered buffer, in host memory or on a CUDA device."""

    def __init__(self, size: int, device: str) -> None:
        self.size = size
        self.device = device
        if device == "cpu":
            self.host = np.zeros(size, dtype=np.uint8)
            self.addr = int(self.host.ctypes.data)
        else:
            import torch

            self.tensor = torch.zeros(size, dtype=torch.uint8, device=device)
            self.addr = int(self.tensor.data_ptr())

    def memory_range(self) -> Any:
        from kvbridge.core.memory import MemoryKind, MemoryRange

        if self.device == "cpu":
            return MemoryRange(self.addr, self.size)
        return MemoryRange(self.addr, self.size, MemoryKind.VRAM, self.tensor.device.index or 0)

    def fill(self, data: np.ndarray) -> None:
        if self.device == "cpu":
            self.host[:] = data
        else:
            import torch

            self.tensor.copy_(torch.from_numpy(data).to(self.device))
            torch.cuda.synchronize()

    def contents(self) -> np.ndarray:
        if self.device == "cpu":
            return self.host
        import torch

        torch.cuda.synchronize()
        return self.tensor.cpu().numpy()


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (also when it is stopped)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def _serve(args: argparse.Namespace) -> int:
    _die_with_parent()
    reply_stream = take_stdout()

    def reply(**payload: Any) -> None:
        reply_stream.write(json.dumps(payload) + "\n")
        reply_stream.flush()

    import kvbridge
    from kvbridge.core.batches import TransferOp

    transport = kvbridge.load_transport(args.transport, **json.loads(args.options))
    buf = _Buffer(args.size, args.device)
    transport.register([buf.memory_range()])
    reply(
        ok=True,
        pid=os.getpid(),
        metadata=base64.b64encode(transport.metadata()).decode(),
        addr=buf.addr,
        size=buf.size,
    )
    for line in sys.stdin:
        cmd = json.loads(line)
        name = cmd.pop("cmd")
        try:
            if name == "fill":
                buf.fill(random_bytes(cmd["seed"], buf.size))
                reply(ok=True)
            elif name == "dump":
                buf.contents().tofile(cmd["path"])
                reply(ok=True)
            elif name == "connect":
                transport.connect(cmd["peer"], base64.b64decode(cmd["metadata"]))
                reply(ok=True)
            elif name == "transfer":
                offsets = np.asarray(cmd["local"], dtype=np.uint64)
                transport.transfer(
                    TransferOp(cmd["op"]),
                    cmd["peer"],
                    offsets + np.uint64(buf.addr),
                    np.asarray(cmd["remote"], dtype=np.uint64),
                    np.asarray(cmd["lengths"], dtype=np.uint64),
                )
                reply(ok=True)
            elif name == "ping":  # answers once the peer runs (after a freeze)
                reply(ok=True)
            elif name == "exit":
                transport.close()
                reply(ok=True)
                return 0
            else:
                reply(ok=False, error=f"unknown command {name!r}")
        except Exception as err:
            traceback.print_exc()
            reply(ok=False, error=f"{type(err).__name__}: {err}", kind=type(err).__name__)
    transport.close()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--transport", required=True)
    parser.add_argument("--options", default="{}", help="transport options as a JSON object")
    parser.add_argument("--size", type=int, required=True, help="buffer size in bytes")
    parser.add_argument("--device", default="cpu", help="cpu, or a torch CUDA device")
    return _serve(parser.parse_args())


# -- test side ------------------------------------------------------------------------------------


class PeerProcessError(RuntimeError):
    """The peer process failed to answer (not a transport error: a harness problem)."""


class PeerProcess:
    """A running peer. Always ``close()`` it (the suite's fixtures do)."""

    def __init__(
        self,
        transport: str,
        options: dict[str, Any],
        size: int,
        log_path: Path,
        device: str = "cpu",
        start_timeout: float = 60.0,
        prefix: Sequence[str] = (),
    ) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in close()
        self._pending = b""
        self.proc = subprocess.Popen(
            [
                *prefix,  # e.g. ``ip netns exec NAME``, which runs the peer in place
                sys.executable,
                "-m",
                "kvbridge.testing.peer",
                "--transport",
                transport,
                "--options",
                json.dumps(options),
                "--size",
                str(size),
                "--device",
                device,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
        )
        try:
            hello = self._read(start_timeout)
        except BaseException:
            self.close()
            raise
        self.pid: int = hello["pid"]
        self.metadata: bytes = base64.b64decode(hello["metadata"])
        self.addr: int = hello["addr"]
        self.size: int = hello["size"]

    def __repr__(self) -> str:
        return f"<PeerProcess pid={self.proc.pid} addr={self.addr:#x}>"

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def request(self, timeout: float = 60.0, **cmd: Any) -> dict[str, Any]:
        """Send one command; the reply (``ok`` False carries the peer's ``error``)."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise PeerProcessError(f"peer {self.proc.pid} is gone; {self.log_tail()}") from None
        return self._read(timeout)

    def call(self, timeout: float = 60.0, **cmd: Any) -> dict[str, Any]:
        """Like ``request`` but a failed command raises."""
        answer = self.request(timeout, **cmd)
        if not answer.get("ok"):
            raise PeerProcessError(f"peer command {cmd.get('cmd')!r} failed: {answer.get('error')}")
        return answer

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        end = time.monotonic() + timeout
        while b"\n" not in self._pending:
            left = end - time.monotonic()
            if left <= 0:
                raise PeerProcessError(
                    f"peer {self.proc.pid} did not answer in {timeout} s; {self.log_tail()}"
                )
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    code = self.proc.wait(5)
                    raise PeerProcessError(
                        f"peer {self.proc.pid} exited ({code}) without answering; {self.log_tail()}"
                    )
                self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        answer: dict[str, Any] = json.loads(line)
        return answer

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return "(no log)"
        return f"last lines of {self.log_path}:\n" + "\n".join(text)

    def exit(self, timeout: float = 30.0) -> int:
        """Close the peer's transport and let the process exit normally."""
        self.call(timeout, cmd="exit")
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL the peer and reap it."""
        if self.alive:
            self.proc.kill()
        self.proc.wait(30)

    @property
    def stopped(self) -> bool | None:
        """Whether the process is stopped (``freeze``) now; None where ``/proc`` cannot tell."""
        try:
            stat = Path(f"/proc/{self.proc.pid}/stat").read_text()
        except OSError:
            return None
        return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")

    def freeze(self, timeout: float = 5.0) -> None:
        """SIGSTOP the peer and return once every one of its threads has stopped.

        The signal is delivered asynchronously: an engine thread busy on another core may still
        move bytes for a moment after ``kill`` returns, and a test that submits right after
        would race it. Bounded: after ``timeout`` (or where ``/proc`` cannot tell) it returns.
        """
        os.kill(self.proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self._all_threads_stopped():
            time.sleep(0.001)

    def _all_threads_stopped(self) -> bool:
        try:
            tasks = list(Path(f"/proc/{self.proc.pid}/task").iterdir())
            states = [(t / "stat").read_text().rsplit(")", 1)[1].split()[0] for t in tasks]
        except OSError:  # gone, or no /proc: nothing to wait for
            return True
        return all(state in ("T", "t", "Z", "X") for state in states)  # exited ones: Z, X

    def thaw(self) -> None:
        if self.alive:
            os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        """Reap the process whatever its state: continue it, kill it, wait for it."""
        try:
            if self.alive:
                self.thaw()
                self.proc.kill()
            self.proc.wait(30)
        finally:
            for stream in (self.proc.stdin, self.proc.stdout):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
            self._log.close()


if __name__ == "__main__":
    sys.exit(main())
