"""Soak through the vLLM connector: real vLLM engines, random faults, other load on the CPU.

``python -m tests.soak.vllm_soak --transport mooncake --requests 1000`` (``make soak`` runs it for
each transport after the control-plane soak; ``tests/adapters/vllm/e2e/test_soak.py`` a short
version in ``make test``). A prefill and a decode vLLM engine (``run_pd.Engine``, the tiny float32
llama, ``verify: full``) serve waves of 2-6 concurrent requests, each in a random mode (pull or
push), prompts drawn from the e2e's; every third wave is layer-wise instead (the concurrent
dispatch: P and D get the wave at once, and each layer moves as P computes it, P writing it
(push) or D reading it (pull), the mode drawn per wave, so a fault may hit P mid-forward or D
mid-stream). Before each wave one fault is chosen, every kind once
per cycle:

- ``freeze_p`` / ``freeze_d``: SIGSTOP of the engine's process group before D has the wave or up
  to 0.2 s into its loads, for 0.3-2x the timeout, then SIGCONT;
- ``stutter_p`` / ``stutter_d``: such a freeze, then SIGCONT for 1-100 ms and SIGSTOP again for
  1-2x the timeout (a peer that answers in the short window and stalls again);
- ``kill_p`` / ``kill_d``: SIGKILL at such a point; the engine is started again (a killed D's
  requests end with it: nothing of them is checked but P's blocks coming back); in every
  fifth cycle only (the first included), as a restart costs a minute here;
- ``late_write``: the wave's first transfer is reported failed by the engine while garbage from
  it lands in the destination blocks 0-50 ms later (``faults.arm``): vLLM recomputes, and must
  not see one late byte;
- ``none``.

Checks: every D answer equals the single instance's tokens (float32: exactly); every request
ends within its bound; every armed late write landed; after the last wave and one lease, both
engines hold no KV block (``vllm:kv_cache_usage_perc`` is 0: no leaked lease or block).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.adapters.vllm.e2e import faults as fault_kit
from tests.adapters.vllm.e2e.run_pd import CORE_D, CORE_P, Engine, Reference, kv_config, stop_all

FAULTS = ("none", "freeze_p", "freeze_d", "stutter_p", "stutter_d", "kill_p", "kill_d",
          "late_write")  # fmt: skip
TIMEOUT = 3.0
LEASE = 9.0
MAX_TOKENS = 16
#: The kills come every this many cycles (the first included): a restart costs a minute here.
KILL_EVERY = 5
#: A request's bound: two deadlines, a fence, the settling with a frozen peer (<= 2x timeout),
#: plus the recompute on a loaded CPU.
BOUND = 8 * TIMEOUT + 30


@dataclass
class Tally:
    requests: int = 0
    exact: int = 0
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    lost_with_d: int = 0
    over_bound: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    late_armed: int = 0
    layerwise_waves: int = 0
    times: list[float] = field(default_factory=list)
    restarts: Counter[str] = field(default_factory=Counter)


class VllmSoak:
    """One P/D pair of vLLM engines and the waves sent through it."""

    def __init__(
        self,
        ref: Reference,
        transport: str,
        root: Path,
        seed: int,
        port: int,
        log: Callable[[str], None],
        unfenced: bool = False,
    ) -> None:
        self.ref = ref
        self.transport = transport
        self.root = root
        self.rng = random.Random(seed)
        self.log = log
        self.port = port
        self.unfenced = unfenced
        self.starts = 0  # engines started, for their ports
        self.tally = Tally()
        self.p = self._start("kv_producer")
        self.d = self._start("kv_consumer")
        #: P's side channel for the layer-wise waves, learnt from an answer of P's (again
        #: after P restarts: new ports)
        self.address: dict[str, Any] | None = None
        self.waves = 0

    def _start(self, role: str) -> Engine:
        # A fresh side-channel port per start: a killed engine's ports may linger.
        self.starts += 1
        port = self.port + 2 * self.starts + (role == "kv_consumer")
        kv = kv_config(role, self.transport, port, timeout=TIMEOUT, lease=LEASE, verify="full")
        name = "prefill" if role == "kv_producer" else "decode"
        core = CORE_P if role == "kv_producer" else CORE_D
        eng = Engine(name, self.ref.model, kv, core, self.ref.case, faults=self.root)
        eng.wait_ready()
        return eng

    def wave(self, n: int, fault: str) -> None:
        self.waves += 1
        if self.waves % 3 == 0:  # every third wave
            self.layerwise_wave(n, fault)
            return
        picks = [self.rng.randrange(len(self.ref.prompts)) for _ in range(n)]
        modes = [self.rng.choice(("pull", "push")) for _ in range(n)]
        prefill = [
            (self.ref.prompts[i], 1, {"do_remote_decode": True, "kvbridge_mode": m}, False)
            for i, m in zip(picks, modes, strict=True)
        ]
        pre = self.p.generate_many(prefill)
        self.tally.faults[fault] += 1
        fired_before = self._arm_late(fault, "read" if modes[0] == "pull" else "write")
        timer = self._disturber(fault)
        decode = [
            (self.ref.prompts[i], MAX_TOKENS, dict(r["kv_transfer_params"]), False)
            for i, r in zip(picks, pre, strict=True)
        ]
        t0 = time.perf_counter()
        out = self._decoded(lambda: self.d.generate_many(decode), fault, n)
        if timer is not None:
            timer.join()
        self._count(picks, out, fault)
        self._settle_late(fault, fired_before)
        self._after(fault)
        self.log(f"  wave of {n} ({fault}) in {time.perf_counter() - t0:.1f} s")

    def layerwise_wave(self, n: int, fault: str) -> None:
        """P and D get the wave at once (the concurrent dispatch); the fault starts with it, so
        it may hit P mid-forward (streaming) or D mid-stream."""
        from concurrent.futures import ThreadPoolExecutor

        from kvbridge.router.dispatch import concurrent_params, prefill_address

        if self.address is None:
            learnt = self.p.generate(self.ref.prompts[0], 1, {"do_remote_decode": True})
            self.address = prefill_address(learnt["kv_transfer_params"] or {})
        assert self.address is not None, "P answered without kvbridge's parameters"
        picks = [self.rng.randrange(len(self.ref.prompts)) for _ in range(n)]
        mode = self.rng.choice(("pull", "push"))  # D reads each layer, or P writes it
        params = [concurrent_params(self.address, mode) for _ in picks]
        self.tally.faults[fault] += 1
        self.tally.layerwise_waves += 1
        fired_before = self._arm_late(fault, "read" if mode == "pull" else "write")
        t0 = time.perf_counter()
        timer = self._disturber(fault)
        with ThreadPoolExecutor(1) as pool:
            to_d = [
                (self.ref.prompts[i], MAX_TOKENS, d, False)
                for i, (_, d) in zip(picks, params, strict=True)
            ]
            decoded = pool.submit(self.d.generate_many, to_d)
            try:
                self.p.generate_many(
                    [
                        (self.ref.prompts[i], 1, to_p, False)
                        for i, (to_p, _) in zip(picks, params, strict=True)
                    ]
                )
            except (EOFError, OSError, RuntimeError, TimeoutError):
                if fault != "kill_p":
                    raise
            out = self._decoded(lambda: decoded.result(timeout=600), fault, n)
        if timer is not None:
            timer.join()
        self._settle_late(fault, fired_before)
        self._after(fault)
        self._count(picks, out, fault)
        took = time.perf_counter() - t0
        self.log(f"  layer-wise {mode} wave of {n} ({fault}) in {took:.1f} s")

    def _arm_late(self, fault: str, op: str) -> int:
        """For ``late_write``: arm garbage landing after the wave's first ``op`` transfer fails.
        Returns how many late writes had landed before."""
        fired_before = len(fault_kit.fired(self.root))
        if fault == "late_write":
            fault_kit.arm(self.root, op, self.rng.uniform(0, 50), self.unfenced)
            self.tally.late_armed += 1
        return fired_before

    def _settle_late(self, fault: str, fired_before: int) -> None:
        """An armed late write that never fired (no transfer of that kind happened: D had all
        of it cached) is disarmed and not counted."""
        if fault == "late_write" and len(fault_kit.fired(self.root)) == fired_before:
            fault_kit.disarm(self.root)
            self.tally.late_armed -= 1

    def _decoded(
        self, decode: Callable[[], list[dict[str, Any]]], fault: str, n: int
    ) -> list[dict[str, Any]] | None:
        """D's answers to the wave, or ``None`` when the fault killed D with them in it."""
        try:
            return decode()
        except (EOFError, OSError, RuntimeError, TimeoutError) as err:
            if fault != "kill_d":
                raise
            self.log(f"  D killed with {n} requests in it ({type(err).__name__})")
            self.tally.requests += n
            self.tally.lost_with_d += n
            return None

    def _count(self, picks: list[int], out: list[dict[str, Any]] | None, fault: str) -> None:
        """D's answers against the single instance's, and their times."""
        for i, r in zip(picks, out or (), strict=False):
            self.tally.requests += 1
            self.tally.times.append(r["total_s"])
            self.tally.over_bound += r["total_s"] > BOUND
            if r["token_ids"] == self.ref.tokens[i][:MAX_TOKENS]:  # float32: exactly
                self.tally.exact += 1
            else:
                self.tally.mismatches.append({"prompt": i, "fault": fault, "d": r["token_ids"]})

    def _after(self, fault: str) -> None:
        """Start again the engine the fault killed."""
        if fault in ("kill_p", "kill_d"):
            role = "kv_producer" if fault == "kill_p" else "kv_consumer"
            if role == "kv_producer":
                self.p.kill()
                self.p = self._start(role)
                self.address = None  # new ports: learnt again
            else:
                self.d.kill()
                self.d = self._start(role)
            self.tally.restarts[role] += 1

    def _disturber(self, fault: str) -> threading.Thread | None:
        if fault not in ("freeze_p", "freeze_d", "stutter_p", "stutter_d", "kill_p", "kill_d"):
            return None
        target = self.p if fault.endswith("_p") else self.d
        # A third of the time before D has the wave, else while D loads it.
        delay = max(0.0, self.rng.uniform(-0.1, 0.2))
        length = self.rng.uniform(0.3, 2.0) * TIMEOUT
        window, again = self.rng.uniform(0.001, 0.1), self.rng.uniform(1.0, 2.0) * TIMEOUT

        def hit() -> None:
            time.sleep(delay)
            if fault.startswith("kill"):
                target.kill()
                return
            target.freeze(length)
            if fault.startswith("stutter"):  # runs a few ms, then stops again
                time.sleep(length + window)
                target.freeze(again)

        t = threading.Thread(target=hit, daemon=True)
        t.start()
        return t

    def finish(self) -> dict[str, Any]:
        """Wait out the leases, step each engine once (vLLM frees delayed blocks on a step),
        and read how many KV blocks each still holds."""
        time.sleep(LEASE + 2 * TIMEOUT)
        usage = {}
        for name, eng in (("P", self.p), ("D", self.d)):
            eng.generate(self.ref.prompts[0][:4], 1, None)
            usage[name] = eng.kv_usage()
        return usage

    def close(self) -> None:
        with contextlib.suppress(Exception):
            stop_all([self.d, self.p])


def run(
    ref: Reference,
    transport: str,
    requests: int,
    hogs: int,
    seed: int,
    port: int = 6100,
    log: Callable[[str], None] = print,
    kinds: tuple[str, ...] = FAULTS,
    unfenced: bool = False,
    minutes: float | None = None,
) -> dict[str, Any]:
    """The soak on one transport; returns its row (see ``problems`` for what must hold).

    ``kinds``: the faults to cycle through; ``unfenced``: late writes skip the fence (the check
    must then find wrong answers); ``minutes``: start no wave after that long (the row then says
    how many requests ran: ``stopped_early``).
    """
    stop_at = None if minutes is None else time.monotonic() + 60 * minutes
    hog_procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvbridge-vllm-soak-") as tmp:
        root = Path(tmp)
        soak = VllmSoak(ref, transport, root, seed, port, log, unfenced)
        try:
            cycle: list[str] = []
            cycles = 0
            while soak.tally.requests < requests:
                if stop_at is not None and time.monotonic() > stop_at:
                    break
                if not cycle:  # every fault once per cycle, the kills every KILL_EVERY cycles
                    kill = cycles % KILL_EVERY == 0
                    cycle = [f for f in kinds if kill or not f.startswith("kill")]
                    soak.rng.shuffle(cycle)
                    cycles += 1
                soak.wave(soak.rng.randint(2, 6), cycle.pop())
            usage = soak.finish()
        finally:
            soak.close()
            for h in hog_procs:
                h.kill()
                h.wait()
        t = soak.tally
        seen = fault_kit.outcomes(root)
        d_out = [o for o in seen if o["role"] == "kv_consumer"]
        fired = fault_kit.fired(root)
    times = sorted(t.times) or [0.0]
    return {
        "transport": transport,
        "requests": t.requests,
        "exact": t.exact,
        "mismatches": t.mismatches,
        "lost_with_d": t.lost_with_d,
        "faults": dict(t.faults),
        "restarts": dict(t.restarts),
        "d_loaded": sum(o["ok"] for o in d_out),
        "d_failed": sum(not o["ok"] for o in d_out),
        "verify_failed": sum(o["verify_failed"] for o in d_out),
        "late_armed": t.late_armed,
        "layerwise_waves": t.layerwise_waves,
        "late_landed": len(fired),
        "max_fence_s": max((o["fence_s"] for o in seen), default=0.0),
        "over_bound": t.over_bound,
        "kv_usage_end": usage,
        "p50_s": times[len(times) // 2],
        "p99_s": times[min(len(times) - 1, int(len(times) * 0.99))],
        "max_s": times[-1],
        "wall_s": time.perf_counter() - start,
        "stopped_early": t.requests < requests,
        "max_transfer_s": max((o["transfer_s"] for o in d_out), default=0.0),
        "max_handshake_s": max((o["handshake_s"] for o in d_out), default=0.0),
        # Loads whose transfer or handshake took over a second: stalls, or a frozen peer.
        "slow": [o for o in seen if max(o["transfer_s"], o["handshake_s"]) > 1.0],
    }


def problems(row: dict[str, Any]) -> list[str]:
    """What went wrong in a soak's row (empty: nothing)."""
    out = []
    if row["mismatches"]:
        out.append(
            f"{len(row['mismatches'])} answers differ from the single instance: "
            f"{row['mismatches'][:3]}"
        )
    if row["over_bound"]:
        out.append(f"{row['over_bound']} requests ended after their {BOUND:g} s bound")
    if row["late_landed"] != row["late_armed"]:
        out.append(f"{row['late_armed']} late writes armed, {row['late_landed']} landed")
    if any(u > 0 for u in row["kv_usage_end"].values()):
        out.append(f"KV blocks still held at the end: {row['kv_usage_end']}")
    if row["stopped_early"]:
        out.append(f"stopped after {row['requests']} requests (time budget)")
    if row["exact"] + row["lost_with_d"] != row["requests"]:
        out.append("requests unaccounted for")
    return out


def main(argv: list[str] | None = None) -> int:
    from tests.adapters.vllm.e2e.run_pd import CASES, build_reference

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--transport", default="mooncake")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--hogs", type=int, default=2, help="CPU-burning processes beside the soak")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--faults", default=",".join(FAULTS), help="the kinds to cycle through")
    ap.add_argument(
        "--unfenced", action="store_true", help="late writes skip the fence (must go wrong)"
    )
    ap.add_argument("--minutes", type=float, help="start no wave after this long")
    ap.add_argument("--json", help="write the row here")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvbridge-vllm-soak-model-") as tmp:
        ref = build_reference(CASES["llama"], Path(tmp))
        row = run(
            ref,
            a.transport,
            a.requests,
            a.hogs,
            a.seed,
            kinds=tuple(a.faults.split(",")),
            unfenced=a.unfenced,
            minutes=a.minutes,
        )
    print(json.dumps(row, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(row, indent=1))
    bad = problems(row)
    for line in bad:
        print("PROBLEM:", line, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
