"""The GPU check: what kvbridge does on a GPU, measured in one short run.

``python -m benchmarks.gpu.check --out DIR`` on a machine with CUDA, torch and the carried wheels
(``benchmarks.gpu.carry``) installed:

1. ``env``: Python, torch, the GPU, NIXL and kvbridge (``env.json``);
2. ``conformance``: the CUDA variants of the transport conformance suite for NIXL (VRAM on both
   sides, two processes on one GPU), through pytest (``conformance.json``, ``conformance.xml``);
3. ``throughput``: one request VRAM to VRAM between two processes, dense, MLA and hybrid shapes at
   1k-128k tokens, four ways in one run (``benchmarks.gpu.throughput``: kvbridge, its transport
   alone, the raw NIXL calls, a device copy of as many bytes), the bytes checked at the smallest
   size of each shape (``throughput.json``, ``throughput.md``);
4. ``streaming``: P runs an 8B model's layer per cache layer on the GPU while each finished
   layer's KV is pushed to D, against the forward pass alone and the forward pass then the whole
   transfer (``streaming.json``: times to D's last byte).

Each phase prints progress lines and the whole run stops adding work at ``--budget-s`` (default
420 s: a device call lasts at most 600). ``--dry-run`` rehearses every phase on the CPU (host
memory, small requests; the CUDA tests skip with their reason), as ``make test`` does.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DRY_SHAPES = (("llama3-70b-dense", 2), ("deepseek-mla", 2), ("qwen3.5-hybrid", 2))
DRY_TOKENS = (256, 1024)
DRY_STREAM_TOKENS = (64, 128)
DRY_HIDDEN = 256
#: The streaming phase runs its first size even when the throughput phase used the budget up.
STREAM_GRACE_S = 60.0


def _log(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True)


def environment(device: str) -> dict[str, Any]:
    """What ran the check."""
    out: dict[str, Any] = {"python": platform.python_version(), "device": device}
    try:
        import torch

        out["torch"] = torch.__version__
        out["cuda"] = torch.version.cuda
        if device.startswith("cuda"):
            props = torch.cuda.get_device_properties(torch.device(device))
            out["gpu"] = props.name
            out["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
    except Exception as err:  # the check says what is missing; it does not stop here
        out["torch_error"] = f"{type(err).__name__}: {err}"
    for module in ("nixl", "msgspec", "zmq", "stevedore", "kvbridge"):
        try:
            found = __import__(module)
            out[module] = getattr(found, "__version__", "present")
        except Exception as err:
            out[module] = f"missing: {type(err).__name__}: {err}"
    return out


def conformance(out: Path, timeout: float) -> dict[str, Any]:
    """The NIXL conformance suite's GPU-memory cases (they skip, saying why, without a GPU)."""
    xml = out / "conformance.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}"]
    cmd += ["tests/transports/test_nixl.py", "-k", "gpu_memory"]
    try:
        done = subprocess.run(
            cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False
        )
        tail = (done.stdout + done.stderr).strip().splitlines()[-5:]
        rc: int | None = done.returncode
    except subprocess.TimeoutExpired:
        tail, rc = [f"timed out after {timeout:g} s"], None
    cases: list[dict[str, str]] = []
    if xml.exists():
        for case in ET.parse(xml).getroot().iter("testcase"):
            outcome, reason = "passed", ""
            for child in case:
                if child.tag in ("failure", "error", "skipped"):
                    outcome, reason = child.tag, (child.get("message") or "")[:300]
            name = f"{case.get('classname')}.{case.get('name')}"
            cases.append({"test": name, "outcome": outcome, "reason": reason})
    return {"returncode": rc, "cases": cases, "tail": tail}


def table(rows: list[dict[str, Any]]) -> str:
    """The throughput rows as a markdown table."""
    names = ["shape", "layers", "tokens", "MiB", "descriptors", "kvbridge GB/s"]
    names += ["transport GB/s", "raw GB/s", "copy GB/s", "kvbridge cost µs"]
    lines = ["| " + " | ".join(names) + " |", "|" + " --- |" * len(names)]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['layers']} | {r['tokens']} | {r['bytes'] / 2**20:.1f} | "
            f"{r['descriptors']} | {r['kvbridge_gbps']:.2f} | {r['transport_gbps']:.2f} | "
            f"{r['raw_gbps']:.2f} | {r['copy_gbps']:.2f} | {r['kvbridge_us']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the tables (created)")
    ap.add_argument("--dry-run", action="store_true", help="rehearse on the CPU, small requests")
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    start = time.monotonic()
    deadline = start + args.budget_s
    args.out.mkdir(parents=True, exist_ok=True)
    device = "cpu"
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            _log("no CUDA device: run with --dry-run to rehearse on the CPU")
            return 2
        device = "cuda:0"
    env = environment(device)
    (args.out / "env.json").write_text(json.dumps(env, indent=1))
    _log(f"env: {env}")
    failed = False

    _log("conformance: NIXL's GPU-memory cases")
    conf = conformance(args.out, min(180.0, max(30.0, deadline - time.monotonic())))
    (args.out / "conformance.json").write_text(json.dumps(conf, indent=1))
    for case in conf["cases"]:
        _log(f"conformance: {case['test']}: {case['outcome']} {case['reason']}".rstrip())
    failed |= conf["returncode"] not in (0, 5) or any(
        c["outcome"] in ("failure", "error") for c in conf["cases"]
    )

    from benchmarks.gpu import throughput

    _log(f"throughput: {'dry run on the CPU' if args.dry_run else device}")
    rows: list[dict[str, Any]] = []
    try:
        rows = throughput.run(
            device,
            DRY_SHAPES if args.dry_run else throughput.SHAPES,
            DRY_TOKENS if args.dry_run else throughput.TOKENS,
            reps=1 if args.dry_run else args.reps,
            deadline=deadline,
            log=_log,
        )
    except throughput.ThroughputError as err:
        _log(f"throughput failed: {err}")
        failed = True
    (args.out / "throughput.json").write_text(json.dumps(rows, indent=1))
    (args.out / "throughput.md").write_text(table(rows))

    _log("streaming: P's forward pass with each layer pushed as it is computed")
    streams: list[dict[str, Any]] = []
    try:
        streams = throughput.run_streaming(
            device,
            DRY_SHAPES[0] if args.dry_run else throughput.SHAPES[0],
            DRY_STREAM_TOKENS if args.dry_run else throughput.STREAM_TOKENS,
            DRY_HIDDEN if args.dry_run else throughput.HIDDEN,
            deadline=deadline + STREAM_GRACE_S,
            log=_log,
        )
    except throughput.ThroughputError as err:
        _log(f"streaming failed: {err}")
        failed = True
    (args.out / "streaming.json").write_text(json.dumps(streams, indent=1))
    _log(f"done in {time.monotonic() - start:.0f} s; tables in {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
