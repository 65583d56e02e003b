"""The GDN hybrid (bf16) served P/D behind vllm-router, with the edge cases users hit.

``one-host.sh`` starts P, D and vllm-router as the README shows; every request goes through the
router with the ``openai`` client and asks for log-probs, so that D's answers can be held
against the single instance's as the bf16 cases are everywhere (``Reference.compare``: within
the measured bound at every shared step, parting only at a near tie). What each request moved
and what D served from its own prefix cache come from D's Prometheus ``/metrics``. The cases,
in order (the ``qwen3_next`` case's prompts):

- every prompt once (1 to 700 tokens: shorter than a block, one token, across a block), one of
  them streamed; the one-token prompt loads nothing (N-1 = 0) and is computed by D;
- the 660-token prompt again (a chat's next turn): D serves its attention blocks from its own
  cache and loads only the rest with P's state;
- a prompt D computed itself before (sent to D alone) but P never saw: D's own cache serves it
  in part, and it loads less than a prompt of as many blocks with no hit.

    .venv/bin/python -m tests.adapters.vllm.e2e.serve_hybrid --transport mooncake
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.adapters.vllm.e2e.run_pd import CASES, Reference, build_reference, stop_all
from tests.adapters.vllm.e2e.serve_pd import (
    BYTES,
    FAILURES,
    HANDSHAKES,
    SERVED_NAME,
    START_DEADLINE_S,
    ServeError,
    Server,
    _chunk_tokens,
    _tokens_of,
    client_of,
    scrape,
    start_pair,
    tail,
    wait_ready,
)

#: D's prefix-cache hits (tokens), vLLM's own counter.
HITS = "vllm:prefix_cache_hits_total"
#: The prompts of the ``qwen3_next`` case by role: sent in this order, then ``D_ALONE``.
ROUTED = (0, 2, 3, 4, 5, 6, 7)
#: The prompt streamed (the others are not).
STREAMED = 2
#: The one-token prompt, the no-hit yardstick of as many blocks as ``D_ALONE``, its repeat.
ONE_TOKEN, YARDSTICK, REPEAT = 5, 6, 7
#: The prompt D computes alone first (P never sees it before it is routed).
D_ALONE = 1


def ask(
    client: Any, ids: list[int], max_tokens: int, stream: bool
) -> tuple[list[int], list[float]]:
    """One greedy completion with log-probs (streamed or not): token ids and their log-probs."""
    kw: dict[str, Any] = {
        "model": SERVED_NAME,
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": 1,
        "extra_body": {"ignore_eos": True, "return_token_ids": True},
    }
    if not stream:
        choice = client.completions.create(**kw).choices[0]
        return _tokens_of(choice), [float(x) for x in choice.logprobs.token_logprobs]
    tokens: list[int] = []
    logprobs: list[float] = []
    for chunk in client.completions.create(**kw, stream=True):
        for choice in chunk.choices:
            tokens += _chunk_tokens(choice)
            if choice.logprobs is not None:
                logprobs += [float(x) for x in choice.logprobs.token_logprobs or ()]
    return tokens, logprobs


def run_serve_hybrid(
    ref: Reference,
    *,
    transport: str = "mooncake",
    mode: str = "pull",
    max_tokens: int = 32,
    work_dir: str | Path | None = None,
    log: Any = print,
) -> dict[str, Any]:
    """The cases above on one deployment; a summary (per prompt: the comparison with the single
    instance, D's loaded bytes and prefix-cache hit). Raises ``ServeError`` with the logs'
    tails when a server or a request fails."""
    work = Path(work_dir) if work_dir is not None else Path(tempfile.mkdtemp(prefix="kvb-hyb-"))
    work.mkdir(parents=True, exist_ok=True)
    logs = {name: work / f"{name}.log" for name in ("prefill", "decode", "proxy")}
    servers: list[Server] = []
    rows: dict[int, dict[str, Any]] = {}
    try:
        servers, urls = start_pair(ref, transport, mode, work, None, "vllm-router")
        wait_ready(servers, urls, logs["decode"], time.perf_counter() + START_DEADLINE_S)
        # vLLM compiles its log-prob op at an engine's first log-prob request: once each, in
        # turn (two compiles at once can race in torch's shared cache), before the cases.
        for name in ("prefill", "decode"):
            ask(client_of(urls[name]), [1, 2, 3], 1, stream=False)
        router = client_of(urls["proxy"])

        def routed(i: int) -> dict[str, Any]:
            before = scrape(urls["decode"])
            tokens, logprobs = ask(router, ref.prompts[i], max_tokens, stream=i == STREAMED)
            after = scrape(urls["decode"])
            row = {
                "prompt": i,
                "prompt_len": len(ref.prompts[i]),
                "match": ref.compare(i, tokens, logprobs),
                "lp_dev": ref.deviation(i, tokens, logprobs),
                "loaded_bytes": after.get(BYTES, 0.0) - before.get(BYTES, 0.0),
                "d_hit": after.get(HITS, 0.0) - before.get(HITS, 0.0),
            }
            log(
                f"prompt {i} ({row['prompt_len']} tokens): {row['match']} (deviation "
                f"{row['lp_dev']:.3f}), D loaded {row['loaded_bytes']:.0f} B, D hit "
                f"{row['d_hit']:.0f}"
            )
            return row

        for i in ROUTED:
            rows[i] = routed(i)
        # D computes this prompt itself (no P), then it is routed: D's own cache, not P's.
        ask(client_of(urls["decode"]), ref.prompts[D_ALONE], 1, stream=False)
        rows[D_ALONE] = routed(D_ALONE)
        metrics = scrape(urls["decode"])
    except (Exception, KeyboardInterrupt) as exc:
        tails = "\n".join(f"--- {k} log ({p}) ---\n{tail(p)}" for k, p in logs.items())
        raise ServeError(f"{type(exc).__name__}: {exc}\n{tails}") from exc
    finally:
        stop_all(servers, grace=20.0)
    summary = {
        "model": ref.case.name,
        "transport": transport,
        "mode": mode,
        "rows": [rows[i] for i in sorted(rows)],
        "d_failed_loads": metrics.get(FAILURES, 0.0),
        "d_handshakes": metrics.get(HANDSHAKES, 0.0),
        "work_dir": str(work),
        "logs": {k: str(p) for k, p in logs.items()},
    }
    yardstick = rows[YARDSTICK]["loaded_bytes"]
    summary["ok"] = (
        all(r["match"] != "mismatch" for r in rows.values())
        and rows[ONE_TOKEN]["loaded_bytes"] == 0
        and all(rows[i]["loaded_bytes"] > 0 for i in rows if i != ONE_TOKEN)
        and all(
            rows[i]["d_hit"] > 0 and rows[i]["loaded_bytes"] < yardstick for i in (REPEAT, D_ALONE)
        )
        and summary["d_failed_loads"] == 0
    )
    if summary["ok"] and work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--transport", default="mooncake")
    ap.add_argument("--mode", default="pull", choices=["pull", "push"])
    ap.add_argument("--json", help="write the summary here")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvb-hyb-models-") as tmp:
        ref = build_reference(CASES["qwen3_next"], Path(tmp))
        summary = run_serve_hybrid(ref, transport=a.transport, mode=a.mode)
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=1))
    print("ok" if summary["ok"] else "FAILED")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
