"""End-to-end prefill → decode through ``KVBridgeConnector`` on two real vLLM engines.

Builds a tiny model locally, runs a single-instance greedy reference (no connector), then starts a
prefill engine (``kv_producer``) and a decode engine (``kv_consumer``) in their own spawned
processes and drives vLLM's P/D convention: the prompt goes to P with ``max_tokens=1`` and
``kv_transfer_params={"do_remote_decode": True}``; the ``kv_transfer_params`` P returns go to D
with the same prompt and ``max_tokens`` greedy tokens. D's token ids must equal the reference's.

    .venv/bin/python -m tests.adapters.vllm.e2e.run_pd --transport mooncake --mode pull

Exit status 0 when every prompt matched. ``--json`` writes a summary (per prompt: tokens, D's time
to first token, match).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

CORE_P = "0"
CORE_D = "1"


def _engine_env(cores: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cores
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _make_llm(model: str, kv_transfer: dict[str, Any] | None, dtype: str) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    hybrid = "qwen3_next" in (Path(model) / "config.json").read_text()
    # Hybrid models: vLLM picks the attention block size (a page shared with the GDN state).
    kw: dict[str, Any] = {} if hybrid else {"block_size": 32}
    if hybrid and os.environ.get("KVBRIDGE_E2E_SSM_DTYPE"):
        kw["mamba_ssm_cache_dtype"] = os.environ["KVBRIDGE_E2E_SSM_DTYPE"]
    if kv_transfer is not None:
        kw["kv_transfer_config"] = KVTransferConfig(**kv_transfer)
    return LLM(
        model=model,
        tokenizer=model,
        dtype=dtype,
        max_model_len=1024,
        enforce_eager=True,
        seed=0,
        max_num_seqs=8,
        **kw,
    )


def _generate(llm: Any, ids: list[int], max_tokens: int, params: dict | None) -> dict[str, Any]:
    """One request through the engine's step loop: tokens, returned params, time to 1st token."""
    from vllm import SamplingParams

    extra = {"kv_transfer_params": params} if params is not None else None
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra)
    engine = llm.llm_engine
    rid = f"req-{time.monotonic_ns()}"
    t0 = time.perf_counter()
    engine.add_request(rid, {"prompt_token_ids": list(ids)}, sp)
    first: float | None = None
    final = None
    deadline = t0 + 120
    while engine.has_unfinished_requests():
        if time.perf_counter() > deadline:
            raise TimeoutError(f"request {rid} did not finish in 120 s")
        for out in engine.step():
            if out.request_id != rid:
                continue
            if first is None and out.outputs and out.outputs[0].token_ids:
                first = time.perf_counter()
            if out.finished:
                final = out
    if final is None:
        raise RuntimeError(f"request {rid} returned no final output")
    done = time.perf_counter()
    return {
        "token_ids": list(final.outputs[0].token_ids),
        "kv_transfer_params": final.kv_transfer_params,
        "ttft_s": (first - t0) if first is not None else None,
        "total_s": done - t0,
        "num_cached_tokens": getattr(final, "num_cached_tokens", None),
    }


def engine_main(conn: Any, model: str, kv_transfer: dict | None, cores: str, dtype: str) -> None:
    """A child process holding one engine; serves ``(ids, max_tokens, params)`` over ``conn``."""
    _engine_env(cores)
    port = ((kv_transfer or {}).get("kv_connector_extra_config") or {}).pop(
        "_side_channel_port", None
    )
    if port is not None:
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
    try:
        t0 = time.perf_counter()
        llm = _make_llm(model, kv_transfer, dtype)
        conn.send(("ready", time.perf_counter() - t0))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        msg = conn.recv()
        if msg is None:
            break
        try:
            conn.send(("ok", _generate(llm, *msg)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    conn.send(("bye", None))


class Engine:
    """Handle of an engine child process."""

    def __init__(self, name: str, model: str, kv: dict | None, cores: str, dtype: str) -> None:
        ctx = mp.get_context("spawn")
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=engine_main, args=(child, model, kv, cores, dtype), name=name, daemon=False
        )
        self.proc.start()

    def wait_ready(self, timeout: float = 240) -> float:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.name} did not start in {timeout} s")
        kind, value = self.conn.recv()
        if kind != "ready":
            raise RuntimeError(f"{self.name} failed to start:\n{value}")
        return float(value)

    def generate(self, ids: list[int], max_tokens: int, params: dict | None) -> dict[str, Any]:
        self.conn.send((ids, max_tokens, params))
        if not self.conn.poll(180):
            raise TimeoutError(f"{self.name}: no answer in 180 s")
        kind, value = self.conn.recv()
        if kind != "ok":
            raise RuntimeError(f"{self.name} failed:\n{value}")
        return dict(value)

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.conn.send(None)
                if self.conn.poll(30):
                    self.conn.recv()
        except (OSError, EOFError, BrokenPipeError):
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def kv_config(role: str, transport: str, mode: str, port: int) -> dict[str, Any]:
    if transport == "vllm-nixl":  # vLLM's own NIXL connector, for comparison
        return {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_both",
            "kv_buffer_device": "cpu",
            "kv_connector_extra_config": {"_side_channel_port": port},
        }
    extra: dict[str, Any] = {
        "transport": transport,
        "mode": mode,
        "host": "127.0.0.1",
        "port": port,
        "timeout": 20.0,
        "lease": 60.0,
    }
    if transport == "mooncake":
        extra["transport_options"] = {"protocol": "tcp"}
    return {
        "kv_connector": "KVBridgeConnector",
        "kv_role": role,
        "kv_connector_extra_config": extra,
    }


def reference(model: str, prompts: list[list[int]], max_tokens: int, dtype: str) -> list[list[int]]:
    eng = Engine("reference", model, None, f"{CORE_P}-{CORE_D}", dtype)
    try:
        eng.wait_ready()
        return [eng.generate(p, max_tokens, None)["token_ids"] for p in prompts]
    finally:
        eng.close()


def run(
    *,
    arch: str = "llama",
    transport: str = "mooncake",
    mode: str = "pull",
    dtype: str = "float32",
    max_tokens: int = 32,
    num_prompts: int = 6,
    port_p: int = 5790,
    port_d: int = 5890,
    model_dir: str | None = None,
    lengths: tuple[int, ...] | None = None,
    log: Any = print,
) -> dict[str, Any]:
    from tests.adapters.vllm.e2e.models import build_llama, build_qwen3_next, prompts

    tmp = None
    if model_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvbridge-e2e-")
        model_dir = tmp.name
    if arch == "qwen3_next":
        dtype = "bfloat16"  # GDN on the CPU needs bf16
        model = str(build_qwen3_next(Path(model_dir) / "qwen3_next"))
    else:
        model = str(build_llama(Path(model_dir) / "llama", torch_dtype=dtype))
    ps = prompts(num_prompts, lengths=lengths) if lengths else prompts(num_prompts)
    if len(ps) > 1:
        # Again: D then holds the prompt's full blocks in its prefix cache and loads only the rest.
        ps.append(list(ps[1]))
    # Control: a prompt as long as the first, other tokens but the same last one. D given it
    # with the first prompt's params must answer as for the first prompt (it decodes over the
    # loaded cache, recomputing only the last token), which proves the KV came from P.
    control = prompts(1, seed=99, lengths=(len(ps[0]),))[0]
    control[-1] = ps[0][-1]
    t0 = time.perf_counter()
    ref = reference(model, [*ps, control], max_tokens, dtype)
    ref_control = ref.pop()
    log(f"reference done in {time.perf_counter() - t0:.1f} s")
    p = Engine("prefill", model, kv_config("kv_producer", transport, mode, port_p), CORE_P, dtype)
    d = Engine("decode", model, kv_config("kv_consumer", transport, mode, port_d), CORE_D, dtype)
    results: list[dict[str, Any]] = []
    control_result: dict[str, Any] = {"loaded": False}
    try:
        log(f"P ready in {p.wait_ready():.1f} s, D ready in {d.wait_ready():.1f} s")
        for i, ids in enumerate(ps):
            pre = p.generate(ids, 1, {"do_remote_decode": True})
            params = pre["kv_transfer_params"]
            if not params:
                raise RuntimeError(f"prompt {i}: P returned no kv_transfer_params")
            params = dict(params, do_remote_prefill=True, do_remote_decode=False)
            dec = d.generate(ids, max_tokens, params)
            match = dec["token_ids"] == ref[i]
            results.append(
                {
                    "prompt": i,
                    "prompt_len": len(ids),
                    "match": match,
                    "p_token": pre["token_ids"],
                    "d_tokens": dec["token_ids"],
                    "ref_tokens": ref[i],
                    "d_ttft_s": dec["ttft_s"],
                    "d_total_s": dec["total_s"],
                    "p_total_s": pre["total_s"],
                    "d_cached": dec["num_cached_tokens"],
                }
            )
            log(
                f"prompt {i} ({len(ids)} tokens): match={match} P {pre['total_s'] * 1e3:.0f} ms, "
                f"D ttft {dec['ttft_s'] * 1e3:.0f} ms total {dec['total_s'] * 1e3:.0f} ms, "
                f"D cached {dec['num_cached_tokens']}"
            )
            if not match:
                log(f"  D:   {dec['token_ids']}\n  ref: {ref[i]}")
        pre = p.generate(ps[0], 1, {"do_remote_decode": True})
        params = dict(pre["kv_transfer_params"], do_remote_prefill=True, do_remote_decode=False)
        dec = d.generate(control, max_tokens, params)
        loaded = dec["token_ids"] == ref[0] and ref_control != ref[0]
        control_result = {
            "loaded": loaded,
            "d_tokens": dec["token_ids"],
            "as_prompt0": dec["token_ids"] == ref[0],
            "as_control": dec["token_ids"] == ref_control,
        }
        log(f"control (prompt 0's KV, other tokens): D used P's KV = {loaded}")
    finally:
        d.close()
        p.close()
        if tmp is not None:
            tmp.cleanup()
    return {
        "model": arch,
        "transport": transport,
        "mode": mode,
        "dtype": dtype,
        "ok": bool(results) and all(r["match"] for r in results) and control_result["loaded"],
        "results": results,
        "control": control_result,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama", choices=["llama", "qwen3_next"])
    ap.add_argument("--transport", default="mooncake")
    ap.add_argument("--mode", default="pull", choices=["pull", "push"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--port-p", type=int, default=5790)
    ap.add_argument("--port-d", type=int, default=5890)
    ap.add_argument("--lengths", help="prompt lengths, comma-separated (default: a varied set)")
    ap.add_argument("--json", help="write the summary here")
    a = ap.parse_args(argv)
    summary = run(
        arch=a.model, transport=a.transport, mode=a.mode, dtype=a.dtype, max_tokens=a.max_tokens,
        num_prompts=a.prompts, port_p=a.port_p, port_d=a.port_d,
        lengths=tuple(int(x) for x in a.lengths.split(",")) if a.lengths else None,
    )  # fmt: skip
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=1))
    print("OK" if summary["ok"] else "MISMATCH", file=sys.stderr)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
