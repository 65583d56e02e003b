"""Run the scale benchmark (``kvbridge.bench.scale``) and write its results page and charts.

    .venv/bin/python benchmarks/scale.py                      # run, then write the page
    .venv/bin/python benchmarks/scale.py --from-json benchmarks/results/scale.json  # redraw
    .venv/bin/python benchmarks/scale.py --quick              # small counts, prints only

``make bench-scale`` runs the first form: fan-out (one P rank, 1-256 D ranks) and fan-in (one D
rank, 1-128 P ranks at TP 1 and TP 8) over ``cma``, requests in flight 1-1024 at 64 D ranks,
and a few points over Mooncake TCP and NIXL. The JSON goes to ``benchmarks/results/scale.json``,
the charts to ``docs/bench-scale-*.png``, the page to ``docs/results/scale.md`` (generated
whole; never edit it). Needs matplotlib (the ``bench`` extra) for the charts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
JSON_PATH = ROOT / "benchmarks" / "results" / "scale.json"
PAGE = ROOT / "docs" / "results" / "scale.md"
PEERS_CHART = ROOT / "docs" / "bench-scale-peers.png"
LOAD_CHART = ROOT / "docs" / "bench-scale-load.png"
COMMAND = "make bench-scale"

#: (direction, peers, tp, transport, requests in flight measured)
FULL = [
    *[("fan-out", n, 1, "cma", [64]) for n in (1, 16, 256)],
    ("fan-out", 64, 1, "cma", [1, 16, 64, 256, 1024]),
    *[("fan-in", n, 1, "cma", [64]) for n in (1, 8, 32, 128)],
    *[("fan-in", n, 8, "cma", [64]) for n in (8, 32, 128)],
    ("fan-out", 16, 1, "mooncake", [64]),
    ("fan-out", 16, 1, "nixl", [64]),
]
QUICK = [
    ("fan-out", 8, 1, "cma", [1, 16]),
    ("fan-in", 16, 8, "cma", [16]),
]


def run(points: list[tuple[str, int, int, str, list[int]]]) -> dict[str, Any]:
    from kvbridge.bench.pages import machine
    from kvbridge.bench.scale import ScaleSpec, point_dict, run_point, summarise
    from kvbridge.core.registry import load_transport_class

    doc: dict[str, Any] = {
        "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "points": [],
        "skipped": [],
    }
    for direction, peers, tp, transport, in_flight in points:
        try:
            load_transport_class(transport)
        except Exception as err:  # an engine this machine lacks: say so on the page
            doc["skipped"].append(f"{direction} {peers} over {transport}: {err}")
            continue
        spec = ScaleSpec(transport=transport)
        started = time.monotonic()
        point = run_point(spec, direction, peers, tp=tp, in_flight=in_flight)
        print(summarise([point]), f"({time.monotonic() - started:.0f} s)", file=sys.stderr)
        doc["points"].append({"transport": transport, **point_dict(point)})
    return doc


# -- the page ----------------------------------------------------------------------------------


#: the order of the transports' rows: the one the curves use first
_TRANSPORTS = ("cma", "mooncake", "nixl")


def _order(p: dict[str, Any]) -> tuple[int, int, int]:
    return (_TRANSPORTS.index(p["transport"]), p["tp"], p["peers"])


def _rows(doc: dict[str, Any], direction: str) -> list[dict[str, Any]]:
    return sorted((p for p in doc["points"] if p["direction"] == direction), key=_order)


def _saturation(p: dict[str, Any]) -> dict[str, float]:
    return max(p["load"], key=lambda x: x["in_flight"]) if p["load"] else {}


def peers_table(doc: dict[str, Any], direction: str) -> str:
    hub = "P" if direction == "fan-out" else "D"
    lines = [
        f"| transport | peers (TP) | handshakes, all | {hub}: threads / peer | {hub}: fds / peer "
        f"| {hub}: sockets / peer | {hub}: KiB / peer | {hub}: CPU ms / handshake | requests "
        f"checked, wrong bytes | at rest after half left: threads, fds (start) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for p in _rows(doc, direction):
        per, start, rest = p["hub_per_peer"], p["hub_start"], p["hub_after_leave"]
        lines.append(
            f"| {p['transport']} | {p['peers']} ({p['tp']}) | {p['handshake_s']:.2f} s | "
            f"{per['threads']:.2f} | {per['fds']:.2f} | {per['sockets']:.2f} | "
            f"{per['rss_mib'] * 1024:.0f} | {p['hub_cpu_per_handshake_ms']:.2f} | "
            f"{p['checked']}, {p['wrong_bytes']} | {rest.get('threads', 0):.0f}, "
            f"{rest.get('fds', 0):.0f} ({start['threads']:.0f}, {start['fds']:.0f}) |"
        )
    return "\n".join(lines)


def load_table(doc: dict[str, Any]) -> str:
    lines = [
        "| transport | direction | peers (TP) | in flight | requests / s | hub CPU ms / request "
        "| hub capacity on one core (requests / s) | own p50 ms | own p99 ms | transport p50 ms "
        "| wait for a worker, p99 ms |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for p in sorted(doc["points"], key=lambda p: (p["direction"], *_order(p))):
        for x in p["load"]:
            capacity = 1e3 / x["hub_cpu_ms"] if x["hub_cpu_ms"] else float("inf")
            lines.append(
                f"| {p['transport']} | {p['direction']} | {p['peers']} ({p['tp']}) | "
                f"{x['in_flight']} | {x['per_s']:.0f} | {x['hub_cpu_ms']:.2f} | {capacity:.0f} | "
                f"{x['own_p50_ms']:.2f} | {x['own_p99_ms']:.2f} | "
                f"{x.get('transfer_p50_ms', 0.0):.2f} | {x['queued_p99_ms']:.2f} |"
            )
    return "\n".join(lines)


def charts(doc: dict[str, Any]) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for direction, tp, marker in (("fan-out", 1, "o"), ("fan-in", 1, "s"), ("fan-in", 8, "^")):
        rows = [
            p
            for p in _rows(doc, direction)
            if p["tp"] == tp and p["transport"] == "cma" and p["peers"] > 1
        ]
        if not rows:
            continue
        peers = [p["peers"] for p in rows]
        label = f"{direction}, TP {tp}"
        axes[0].plot(peers, [p["handshake_s"] for p in rows], marker=marker, label=label)
        axes[1].plot(
            peers, [p["hub_per_peer"]["fds"] for p in rows], marker=marker, label=f"{label}: fds"
        )
        axes[1].plot(
            peers,
            [p["hub_per_peer"]["threads"] for p in rows],
            marker=marker,
            linestyle="--",
            label=f"{label}: threads",
        )
    axes[0].set_title("every peer's handshake, all at once")
    axes[0].set_ylabel("seconds")
    axes[1].set_title("what the hub holds per peer, connected")
    axes[1].set_ylabel("per peer")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("peers")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(PEERS_CHART, dpi=100)
    plt.close(fig)

    curve = next(
        (p for p in doc["points"] if p["direction"] == "fan-out" and len(p["load"]) > 1), None
    )
    if curve is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    flight = [x["in_flight"] for x in curve["load"]]
    axes[0].plot(flight, [x["per_s"] for x in curve["load"]], marker="o", label="measured")
    axes[0].plot(
        flight,
        [1e3 / x["hub_cpu_ms"] if x["hub_cpu_ms"] else 0 for x in curve["load"]],
        marker="s",
        label="P's capacity on one core (1 / its CPU per request)",
    )
    axes[0].set_title(f"requests / s through one P rank ({curve['peers']} D ranks)")
    for key, label in (("own_p50_ms", "own p50"), ("own_p99_ms", "own p99")):
        axes[1].plot(flight, [x[key] for x in curve["load"]], marker="o", label=label)
    axes[1].plot(
        flight, [x.get("transfer_p50_ms", 0.0) for x in curve["load"]], marker="s",
        label="transport p50",
    )  # fmt: skip
    axes[1].set_title("D: kvbridge's own time per request (ms)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("requests in flight")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(LOAD_CHART, dpi=100)
    plt.close(fig)


def headlines(doc: dict[str, Any]) -> str:
    """The page's claims, each with its range's weak end, from this run's figures."""
    out_rows = [p for p in _rows(doc, "fan-out") if p["transport"] == "cma"]
    in_rows = [p for p in _rows(doc, "fan-in") if p["transport"] == "cma"]
    if not out_rows or not in_rows:
        return ""
    widest = max(out_rows, key=lambda p: p["peers"])
    p_cpu = [x["hub_cpu_ms"] for p in out_rows for x in p["load"]]
    d1 = [x["hub_cpu_ms"] for p in in_rows if p["tp"] == 1 for x in p["load"]]
    d8 = [x["hub_cpu_ms"] for p in in_rows if p["tp"] == 8 for x in p["load"]]
    low = [x for p in out_rows for x in p["load"] if x["in_flight"] == 1]
    many = [p for p in out_rows + in_rows if p["peers"] >= 8]

    def span(values: list[float], unit: str = "") -> str:
        return f"{min(values):.2f}-{max(values):.2f}{unit}" if values else "n/a"

    lines = [
        f"- **Handshakes:** {widest['peers']} D ranks with one P rank in "
        f"{widest['handshake_s']:.2f} s, all at once; 128 P ranks with one D rank in "
        f"{max(p['handshake_s'] for p in in_rows):.2f} s at worst.",
        f"- **Per connected peer** (8 peers and more): "
        f"{span([p['hub_per_peer']['fds'] for p in many])} descriptors, "
        f"{span([p['hub_per_peer']['sockets'] for p in many])} sockets, "
        f"{span([p['hub_per_peer']['rss_mib'] * 1024 for p in many], ' KiB')}; threads "
        f"{span([p['hub_per_peer']['threads'] for p in out_rows if p['peers'] >= 8])} per D "
        f"rank on P, {span([p['hub_per_peer']['threads'] for p in in_rows if p['peers'] >= 8])} "
        "per P rank on D (its lanes, while it reads; they end after 5 s idle).",
        f"- **P's CPU per small request:** {span(p_cpu, ' ms')} (the rate one core could serve: "
        f"{1e3 / max(p_cpu):.0f}-{1e3 / min(p_cpu):.0f} per second), flat from 1 to "
        f"{widest['peers']} D ranks.",
        f"- **D's CPU per small request:** {span(d1, ' ms')} from one P rank; {span(d8, ' ms')} "
        "from a TP 8 instance (eight reads, asks and releases).",
        f"- **Own time with one request in flight:** p99 {span([x['own_p99_ms'] for x in low])} "
        "ms. With more in flight on this 2-core machine, own time is mostly the wait for a "
        "core (the crowd's D ranks and the hub share two).",
    ]
    return "\n".join(lines)


def write_page(doc: dict[str, Any]) -> None:
    from kvbridge.bench.pages import generated_by

    skipped = "".join(f"- skipped: {s}\n" for s in doc["skipped"])
    body = f"""# Scale: one rank among many

{generated_by(COMMAND, doc["measured"], doc["machine"])}. Raw data:
`benchmarks/results/scale.json`.

Real control planes, side channels and transports between OS processes
(`kvbridge/bench/scale.py`): a *hub* process holds the one plane measured; *crowd* processes
hold its peers, 32 planes each (a plane is what one vLLM worker runs). Requests are small
(2 blocks of 2 layers of a Llama-3-70B attention cache, 32-256 KiB), so the control plane is
what is measured, not the copy. D checks every byte of one request per peer. A TP 8 P instance
is 8 ranks holding their share of the KV heads as vLLM shards them: a TP 1 D reads each request
from all 8.

*Own time* is D's time for a request less the transport's transfer and the wait for a free
worker: handshake (none once connected), the ask to P, planning, the release. *Hub CPU per
request* is the hub process's CPU time over the requests it served; its inverse is what one
core could serve. On this 2-core machine the hub, the crowd and the coordinator share the
cores: the measured rate is the machine's, the capacity the hub's.

{headlines(doc)}

## Fan-out: one P rank, many D ranks

![handshakes and per-peer cost](../bench-scale-peers.png)

[full size](../bench-scale-peers.png)

{peers_table(doc, "fan-out")}

## Fan-in: one D rank loading from many P ranks

{peers_table(doc, "fan-in")}

## Requests at a number in flight

![rate and own time against requests in flight](../bench-scale-load.png)

[full size](../bench-scale-load.png)

{load_table(doc)}

{skipped}
"""
    PAGE.write_text(body.rstrip() + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from-json", type=Path, help="redraw from this JSON instead of running")
    parser.add_argument("--quick", action="store_true", help="small counts; print, write nothing")
    args = parser.parse_args()
    if args.from_json:
        doc = json.loads(args.from_json.read_text())
    else:
        doc = run(QUICK if args.quick else FULL)
        if args.quick:
            return
        JSON_PATH.parent.mkdir(parents=True, exist_ok=True)
        JSON_PATH.write_text(json.dumps(doc, indent=1) + "\n")
    charts(doc)
    write_page(doc)


if __name__ == "__main__":
    main()
