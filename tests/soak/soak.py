"""Soak: many P/D requests through real engine processes, random faults, other load on the CPU.

Run as ``python -m tests.soak.soak --requests 1000`` (``make soak``); ``test_soak.py`` runs a short
version in ``make test``. Per transport, one prefill and one decode engine process
(``tests/control/engine.py``: the real control plane and transport on a hybrid test layout) serve
waves of concurrent requests in random modes (pull, push). Before a wave one fault may be armed:

- ``freeze_p`` / ``freeze_d``: SIGSTOP the engine for 0.3-2x the timeout at a random point of the
  wave, then SIGCONT (delays and stalls transfers, control messages and acknowledgements);
- ``stutter_p`` / ``stutter_d``: SIGSTOP the engine, SIGCONT it for 1-100 ms, SIGSTOP it again
  for 1-2x the timeout, then SIGCONT (a peer that answers in the short window and stalls again:
  a fence resting on the answer would let the rest of a given-up transfer land late);
- ``kill_p``: SIGKILL the prefill engine mid-wave and start a new one (its requests fail at once);
- ``drop_push_done``: P never delivers ``PushDone`` (D must ask P how the push ended);
- ``duplicate``: every message of the wave's first request is sent again, late, by a client of
  its own (release, abort, push request, a forged ``PushDone`` from a foreign engine).

Checks: every request ends with a definite outcome within its bound; every request D reported
loaded has exactly the source's bytes at that moment, and again at the end unless its blocks were
reused; D's blocks are reused the way vLLM reuses them (a failed request's blocks first), so a
late byte of a given-up transfer would show up as a wrong byte; nothing is left leased, held or
registered at the end. The result is a table of requests, faults by kind, outcomes, wrong bytes,
leaks, and time to outcome (p50/p99).
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvbridge.control.channel import PeerClient
from kvbridge.control.messages import Abort, PushDone, PushRequest, Release
from tests.control.engine import (
    BlockAllocator,  # noqa: F401  (same id rules as the tests)
    EngineProcess,
)

FAULTS = ("none", "freeze_p", "freeze_d", "stutter_p", "stutter_d", "kill_p", "drop_push_done",
          "duplicate")  # fmt: skip
TIMEOUT = 2.0  # control and transfer timeout of the soak engines: faults resolve quickly
LEASE = 6.0
KEEP = 12  # loads kept untouched (and checked again later) at most
BLOCKS = 2048  # each engine's pool: a wave of 12 requests of up to 900 tokens fits twice


@dataclass
class Pool:
    """D's block pool, reused as vLLM reuses it: freed blocks go to the front of the queue."""

    layout: Any
    seed: int
    free: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        pool = min(g.num_blocks for g in self.layout.groups.values())
        self.free = [
            int(b) for b in np.random.default_rng(self.seed).permutation(np.arange(1, pool))
        ]

    def take(self, ids: dict[int, list[int]]) -> dict[int, list[int]]:
        """Blocks shaped like P's ids (same count per group), from the front of the queue."""
        out: dict[int, list[int]] = {}
        for index, group in sorted(self.layout.groups.items()):
            p = ids[index]
            real = [b for b in p if b != group.null_block_id]
            nulls = len(p) - len(real)
            out[index] = [group.null_block_id] * nulls + [self.free.pop(0) for _ in real]
        return out

    def give_back(self, ids: dict[int, list[int]], front: bool) -> None:
        real = [
            b
            for index, group in sorted(self.layout.groups.items())
            for b in ids[index]
            if b != group.null_block_id
        ]
        self.free = real + self.free if front else self.free + real


@dataclass
class Tally:
    requests: int = 0
    ok: int = 0
    failed: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    wrong_bytes: int = 0
    late_changes: int = 0
    times: list[float] = field(default_factory=list)
    over_bound: int = 0
    leaks: list[str] = field(default_factory=list)
    reasons: Counter[str] = field(default_factory=Counter)


def _reason_kind(reason: str) -> str:
    for key in (
        "refused",
        "prefill is gone",
        "no write",
        "did not answer",
        "did not finish",
        "not held here",
        "aborted",
        "already taken",
        "could not push",
        "lease",
    ):
        if key in reason:
            return key
    return reason[:60]


class Soak:
    def __init__(self, transport: str, root: Path, seed: int, log: Any) -> None:
        self.transport, self.root, self.log = transport, root, log
        self.rng = random.Random(seed)
        self.tally = Tally()
        self.p_count = 0
        self.p = self._start_p()
        self.d = EngineProcess.start(
            root,
            f"{transport}-decode",
            transport=transport,
            seed=seed + 1,
            timeout=TIMEOUT,
            lease=LEASE,
            handshake_timeout=TIMEOUT,
            num_blocks=BLOCKS,
        )
        self.pool = Pool(self.d.layout, seed)
        self.p_alloc = Pool(self.p.layout, seed + 2)
        self.loaded: dict[str, tuple[dict, dict, dict]] = {}  # rid -> (P config, P ids, D ids)

    def _start_p(self) -> EngineProcess:
        self.p_count += 1
        return EngineProcess.start(
            self.root,
            f"{self.transport}-prefill-{self.p_count}",
            transport=self.transport,
            seed=7,
            timeout=TIMEOUT,
            lease=LEASE,
            handshake_timeout=TIMEOUT,
            num_blocks=BLOCKS,
        )

    def wave(self, n: int, fault: str) -> None:
        self.tally.faults[fault] += 1
        rids, params, d_ids, p_ids, started = [], {}, {}, {}, {}
        if fault == "drop_push_done":
            self.p.call(cmd="fault", name="drop_push_done")
        timer = None
        if fault in ("freeze_p", "freeze_d", "stutter_p", "stutter_d"):  # at a random point
            timer = self._disturber(fault)
        for i in range(n):
            rid = f"{self.transport}-{self.tally.requests}"
            self.tally.requests += 1
            mode = self.rng.choice(["pull", "push"])
            tokens = self.rng.randrange(20, 900)
            try:
                ids = self.p_alloc.take(_shape(self.p.layout, tokens))
                pr = self.p.call(
                    cmd="publish",
                    request_id=rid,
                    block_ids=ids,
                    num_tokens=tokens,
                    mode=mode,
                    timeout=3 * TIMEOUT + 10,
                )
            except Exception as err:  # P frozen or dead right now: this request never starts
                self.p_alloc.give_back(ids, front=True)
                self.tally.failed += 1
                self.tally.reasons[f"publish: {type(err).__name__}"] += 1
                continue
            if "error" in pr:
                self.p_alloc.give_back(ids, front=True)
                self.tally.failed += 1
                self.tally.reasons["publish refused"] += 1
                continue
            if fault == "kill_p" and i == n - 1:
                # Every request is published: kill P now. The wave's earlier loads race the
                # kill (a fast transport may finish them first); this last one is asked of a
                # dead P, so at least one load fails for certain.
                timer = self._disturber(fault)
                timer.join()
            dst = self.pool.take(ids)
            try:
                self.d.call(cmd=mode, params=pr, block_ids=dst, timeout=3 * TIMEOUT + 10)
            except Exception as err:
                raise AssertionError(f"D did not take request {rid}: {err}") from err
            rids.append(rid)
            params[rid], d_ids[rid], p_ids[rid], started[rid] = pr, dst, ids, time.monotonic()
            if fault == "duplicate" and i == 0:
                threading.Thread(target=self._duplicate, args=(pr, dst), daemon=True).start()
        if fault == "kill_p" and timer is None:  # the last publish failed: kill P all the same
            timer = self._disturber(fault)
        bound = 3 * TIMEOUT + 4 * TIMEOUT + 10  # deadline, fence and settle, freeze length
        for rid in rids:
            try:
                out = self.d.call(cmd="wait", request_id=rid, timeout=bound + 30)
            except Exception as err:
                raise AssertionError(f"request {rid}: no answer from D ({err})") from err
            if "error" in out:
                raise AssertionError(f"request {rid}: no outcome ({out['error']})")
            elapsed = time.monotonic() - started[rid]
            self.tally.times.append(elapsed)
            self.tally.over_bound += elapsed > bound
            if out["ok"]:
                self.tally.ok += 1
                check = self.d.call(
                    cmd="check", source=self.p.config, p_ids=p_ids[rid], d_ids=d_ids[rid]
                )
                if not check["ok"]:
                    self.tally.wrong_bytes += 1
                    self.log(f"WRONG BYTES in {rid}: {check}")
                self.loaded[rid] = (self.p.config, p_ids[rid], d_ids[rid])
            else:
                self.tally.failed += 1
                self.tally.reasons[_reason_kind(out["reason"])] += 1
        if timer is not None:
            timer.join()
        if fault == "drop_push_done":
            self.p.call(cmd="fault", name="drop_push_done", on=False)
        # Blocks go back to the pools as vLLM returns them: failed loads' first, so the next
        # wave writes into them (a late byte of a given-up transfer would be caught there).
        for rid in rids:
            ok = rid in self.loaded
            if not ok or self.rng.random() < 0.5:
                self.pool.give_back(d_ids[rid], front=not ok)
                self.loaded.pop(rid, None)
            self.p_alloc.give_back(p_ids[rid], front=False)
        while len(self.loaded) > KEEP:  # the oldest kept loads: checked again, then reused
            rid = next(iter(self.loaded))
            self._recheck(rid)
            self.pool.give_back(self.loaded.pop(rid)[2], front=False)

    def _recheck(self, rid: str) -> None:
        """A load kept untouched since it was reported: its bytes must not have changed."""
        config, p_ids, d_ids = self.loaded[rid]
        check = self.d.call(cmd="check", source=config, p_ids=p_ids, d_ids=d_ids)
        if not check["ok"]:
            self.tally.late_changes += 1
            self.log(f"LATE CHANGE in {rid}: {check}")

    def _disturber(self, fault: str) -> threading.Thread:
        delay = self.rng.uniform(0.0, 0.15)
        target = self.d if fault in ("freeze_d", "stutter_d") else self.p
        length = self.rng.uniform(0.3, 2.0) * TIMEOUT
        thread = threading.Thread(target=self._disturb, args=(fault, target, delay, length))
        thread.start()
        return thread

    def _disturb(self, fault: str, target: EngineProcess, delay: float, length: float) -> None:
        time.sleep(delay)
        if fault == "kill_p":
            target.kill()
            target.proc.wait(30)  # gone for good before the next wave publishes anything
            return
        target.kill(signal.SIGSTOP)
        time.sleep(length)
        if fault.startswith("stutter"):  # runs a few ms, then stops again, past the timeout
            target.kill(signal.SIGCONT)
            time.sleep(self.rng.uniform(0.001, 0.1))
            target.kill(signal.SIGSTOP)
            time.sleep(self.rng.uniform(1.0, 2.0) * TIMEOUT)
        target.kill(signal.SIGCONT)

    def _duplicate(self, params: dict, d_ids: dict) -> None:
        """The first request's messages again, late, and a PushDone forged by another engine."""
        time.sleep(self.rng.uniform(0.0, 0.3))
        rid = params["request_id"]
        msgs = [
            (params["endpoint"], Release(rid, True)),
            (params["endpoint"], Abort(rid, "dup")),
            (params["endpoint"], PushRequest(rid, {int(k): v for k, v in d_ids.items()})),
            (self.d.info["endpoint"], PushDone(rid, True)),
        ]
        for endpoint, msg in msgs:
            client = PeerClient(endpoint, "soak-duplicator", timeout=TIMEOUT)
            try:
                client.request(msg)
            except Exception:
                pass  # refused, as it should be, or the peer is frozen
            finally:
                client.close()

    def after_kill(self) -> None:
        if self.p.proc.poll() is not None:
            self.p.stop()
            self.p = self._start_p()
            self.p_alloc = Pool(self.p.layout, self.rng.randrange(1 << 30))

    def abandon(self) -> None:
        """Reap both engines after a failed run (the run's own error is what counts)."""
        for engine in (self.p, self.d):
            try:
                engine.kill(signal.SIGCONT)
                engine.stop()
            except Exception as err:
                self.log(f"stopping an engine after a failed run: {err}")

    def finish(self) -> None:
        for name, engine in (("P", self.p), ("D", self.d)):
            code = engine.proc.poll()
            if code is not None:  # an engine died on its own: a crash is a finding
                role = f"prefill-{self.p_count}" if name == "P" else "decode"
                log = self.root / f"{self.transport}-{role}.log"
                tail = log.read_text()[-3000:] if log.exists() else ""
                raise AssertionError(f"{name} exited with {code} during the soak; log:\n{tail}")
        for rid in list(self.loaded):  # still untouched blocks
            self._recheck(rid)
        deadline = time.monotonic() + LEASE + 3 * TIMEOUT + 5
        while time.monotonic() < deadline and (
            self.p.call(cmd="leased") or self.d.call(cmd="held")
        ):
            time.sleep(0.2)
        if self.p.call(cmd="leased"):
            self.tally.leaks.append(f"P leases {self.p.call(cmd='leased')}")
        if self.d.call(cmd="held"):
            self.tally.leaks.append(f"D held {self.d.call(cmd='held')}")
        for name, engine in (("P", self.p), ("D", self.d)):
            closed = engine.stop() or {}
            if closed.get("leased") or closed.get("registered_after_plane_close"):
                self.tally.leaks.append(f"{name} at close: {closed}")


def _shape(layout: Any, tokens: int) -> dict[int, list[int]]:
    """Placeholder ids with the counts a request of ``tokens`` needs (filled by ``Pool.take``)."""
    from kvbridge.core.boundary import blocks_for_tokens, remote_prefill_token_count
    from kvbridge.core.groups import GroupKind

    n = remote_prefill_token_count(tokens, layout.has_state)
    out: dict[int, list[int]] = {}
    for index, group in sorted(layout.groups.items()):
        count = blocks_for_tokens(n, group.block_size)
        if group.kind is GroupKind.STATE:
            out[index] = [group.null_block_id] * max(0, count - 1) + [-1]
        else:
            out[index] = [-1] * count
    return out


def run(transports: list[str], requests: int, hogs: int, seed: int, log: Any = print) -> dict:
    hog_procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
    results = {}
    try:
        for transport in transports:
            with tempfile.TemporaryDirectory(prefix=f"kvbridge-soak-{transport}-") as tmp:
                soak = Soak(transport, Path(tmp), seed, log)
                rng = random.Random(seed)
                cycle: list[str] = []
                try:
                    while soak.tally.requests < requests:
                        if not cycle:  # every fault once per cycle, in a random order
                            cycle = [*FAULTS, "none", "none"]
                            rng.shuffle(cycle)
                        soak.wave(rng.randrange(4, 12), cycle.pop())
                        soak.after_kill()
                except BaseException:
                    soak.abandon()
                    raise
                soak.finish()
                t = soak.tally
                times = np.asarray(t.times)
                results[transport] = {
                    "requests": t.requests,
                    "ok": t.ok,
                    "failed": t.failed,
                    "faults": dict(t.faults),
                    "wrong_bytes": t.wrong_bytes,
                    "late_changes": t.late_changes,
                    "leaks": t.leaks,
                    "over_bound": t.over_bound,
                    "reasons": dict(t.reasons),
                    "p50_s": round(float(np.percentile(times, 50)), 3) if times.size else None,
                    "p99_s": round(float(np.percentile(times, 99)), 3) if times.size else None,
                    "max_s": round(float(times.max()), 3) if times.size else None,
                }
                log(f"{transport}: {json.dumps(results[transport])}")
    finally:
        for h in hog_procs:
            h.kill()
            h.wait()
    return results


def problems(results: dict) -> list[str]:
    out = []
    for transport, r in results.items():
        for key in ("wrong_bytes", "late_changes", "over_bound"):
            if r[key]:
                out.append(f"{transport}: {key}={r[key]}")
        if r["leaks"]:
            out.append(f"{transport}: leaks {r['leaks']}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=1000, help="per transport")
    ap.add_argument("--transports", default="mooncake,nixl")
    ap.add_argument("--hogs", type=int, default=2, help="CPU-burning processes beside the soak")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)
    results = run(a.transports.split(","), a.requests, a.hogs, a.seed)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))
    bad = problems(results)
    for line in bad:
        print("PROBLEM:", line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
