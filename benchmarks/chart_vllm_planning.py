"""Draw ``docs/bench-vllm-planning.png`` from a ``benchmarks/vllm_planning.py --output`` JSON.

    .venv/bin/python benchmarks/chart_vllm_planning.py benchmarks/results/vllm-planning.json

One panel per model shape and KV layout: planning time per request against prompt length, for
kvbridge and vLLM's own Mooncake connector code, one line per block-id pattern (log scales;
full-model estimates where a cell timed fewer layers). Needs matplotlib (the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PATTERN_STYLE = {"contiguous": "-", "runs": "--", "random": ":"}


def chart(rows: list[dict[str, Any]], path: Path) -> None:
    from kvbridge.bench.charts import panel_grid, save

    panels: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        if not row.get("refused"):
            panels[(row["shape"], row["layout"])].append(row)
    keys = sorted(panels)
    fig, axes = panel_grid(len(keys))
    for ax, key in zip(axes, keys, strict=True):
        for pattern, style in PATTERN_STYLE.items():
            cells = sorted(
                (r for r in panels[key] if r["pattern"] == pattern), key=lambda r: r["tokens"]
            )
            if not cells:
                continue
            tokens = [r["tokens"] for r in cells]
            ax.plot(
                tokens,
                [r["kvbridge_ms_model"] for r in cells],
                style,
                color="tab:blue",
                marker="o",
                label=f"kvbridge {pattern}",
            )
            ax.plot(
                tokens,
                [r["vllm_ms_model"] for r in cells],
                style,
                color="tab:red",
                marker="s",
                label=f"vLLM {pattern}",
            )
        ax.set(xscale="log", yscale="log", title=f"{key[0]} {key[1]}", xlabel="prompt tokens")
        ax.grid(True, which="both", alpha=0.3)
        ax.set_ylabel("planning ms per request")
    axes[0].legend()
    save(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", type=Path)
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "bench-vllm-planning.png")
    args = parser.parse_args()
    doc = json.loads(args.json.read_text())
    chart(doc["vllm_planning"]["results"], args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
