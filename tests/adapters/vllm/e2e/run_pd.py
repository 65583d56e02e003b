"""End-to-end prefill → decode through ``KVBridgeConnector`` on two real vLLM engines.

Builds a tiny model locally, runs a single-instance greedy reference (no connector), then starts a
prefill engine (``kv_producer``) and a decode engine (``kv_consumer``) in their own spawned
processes and drives vLLM's P/D convention: the prompt goes to P with ``max_tokens=1`` and
``kv_transfer_params={"do_remote_decode": True}``; the ``kv_transfer_params`` P returns go to D
with the same prompt and ``max_tokens`` greedy tokens. D's token ids must equal the reference's.

One engine pair covers, in order:

- every prompt in each mode (the prefill request names it: ``kvbridge_mode``), both engines'
  prefix caches emptied between modes; the last prompt repeats an earlier one, so D holds its
  full blocks in its prefix cache and loads only the rest (checked: D reports cached tokens);
- a control: D given prompt 0's params with a prompt of other tokens (same last token) must
  answer as for prompt 0, which proves the KV came from P;
- P frozen (SIGSTOP of its process group) after a prefill, longer than the timeout, then
  resumed: D holds the push until P answers, then loads or recomputes; either way exactly;
- P killed (its whole process group) after a prefill: D's load fails, vLLM recomputes
  (``kv_load_failure_policy="recompute"``) and D still answers as the single instance.

    .venv/bin/python -m tests.adapters.vllm.e2e.run_pd --model qwen3_next --transport nixl

Exit status 0 when every check passed. ``--json`` writes the summary; ``--show`` prints each
prompt's P, D and single-instance tokens side by side.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

#: How long the prefill engine is stopped in the "P frozen" check: beyond the 10 s timeout.
FREEZE_S = 12.0
CORE_P = "0"
CORE_D = "1"
#: pull and push: P, then D with P's answer; layerwise and layerwise-pull: the concurrent
#: dispatch (D gets the request while P computes it, and each layer moves as it is computed, P
#: writing it or D reading it: issue 29).
MODES = ("pull", "push", "layerwise", "layerwise-pull")
#: The layer-wise modes, and the transfer mode each asks for.
LAYERWISE = {"layerwise": "push", "layerwise-pull": "pull"}


@dataclass(frozen=True)
class ModelCase:
    """A tiny model, how vLLM runs it, and the prompts that exercise it."""

    name: str
    arch: str
    dtype: str
    #: Prompt lengths; the prompt at ``repeat`` is sent again last (D's prefix-cache hit).
    lengths: tuple[int, ...]
    repeat: int
    #: Attention block size to ask for (None: vLLM chooses, as it must for hybrid models).
    block_size: int | None = 32
    #: How far (log-prob) D's log-probs may lie from the single instance's at each step: bf16
    #: rounding of a differently split computation (0: exact tokens required). Measured on CPUs
    #: with and without AMX; a step whose two best tokens are within twice this may flip.
    bound: float = 0.0
    #: Further ``LLM(...)`` options (e.g. an attention backend).
    llm_options: dict[str, Any] = field(default_factory=dict)
    #: Whether the engine keeps a prefix cache (the repeated prompt then hits it on D).
    prefix_cache: bool = True
    #: Whether D's prefix cache may serve more of the repeated prompt than the single
    #: instance's: hybrids. D counts the attention blocks it cached from its first load and
    #: loads only the rest with P's state (vLLM's divergent hybrid hits, as NixlConnector does),
    #: where a single instance also needs the recurrent state cached at that boundary (none on
    #: CPUs without AMX, where vLLM's attention block and the state's differ).
    d_hit_beyond_single: bool = False
    #: Speculative decoding (``SPEC_TOKENS`` a step), by vLLM's method: ``"draft_model"`` with
    #: the target's own weights as the draft (nearly every proposal is accepted, and only over
    #: the right draft KV of the prompt, which on D must come from P), or ``"eagle"`` with an
    #: EAGLE-1 head of random weights (``models.build_eagle_head``; None: off).
    speculative: str | None = None

    @property
    def tie(self) -> float:
        """The top-two gap under which D may take the runner-up: both sides' errors add."""
        return 2 * self.bound

    def build(self, root: Path) -> Path:
        from tests.adapters.vllm.e2e import models

        path = root / self.arch
        if self.speculative == "eagle" and not (eagle_head(path) / "config.json").exists():
            models.build_eagle_head(eagle_head(path), torch_dtype=self.dtype)
        if (path / "config.json").exists():
            return path
        if self.arch == "llama":
            return models.build_llama(path, torch_dtype=self.dtype)
        if self.arch == "deepseek_mla":
            return models.build_deepseek_mla(path)
        if self.arch == "qwen3_next":
            return models.build_qwen3_next(path)
        raise ValueError(f"unknown model {self.arch!r}")

    def prompts(self) -> list[list[int]]:
        from tests.adapters.vllm.e2e.models import prompts

        ps = prompts(len(self.lengths), lengths=self.lengths)
        return [*ps, list(ps[self.repeat])]


def eagle_head(model: str | Path) -> Path:
    """Where ``ModelCase.build`` writes the EAGLE head of the model at ``model``."""
    return Path(model).parent / f"{Path(model).name}-eagle"


#: Draft tokens proposed per step in the speculative cases.
SPEC_TOKENS = 2
_LENGTHS = (45, 80, 130, 33, 64, 5)
#: ``llama_chunked``'s prefill step: three chunks for the 130-token prompt, two for 80 and 64.
CHUNK_TOKENS = 48
#: serve_xpyd.IN_FLIGHT prompts, then its EDGE ones (no hit, partial hit, full hit, disconnect).
_XPYD_LENGTHS = (5, 33, 64, 130, 1, 300, 47, 600) * 4 + (200, 200, 97, 150)
#: bf16 cases: how far D's log-probs may lie from the single instance's (``ModelCase.bound``):
#: four bf16 steps (0.0625 each) of these logits. The deviation is deterministic (the same value
#: in pull, push and served through the router) and depends on the CPU's bf16 kernels, so it is
#: measured per kind of CPU (``test_pd.cpu_bf16_isa``), the largest over the hybrid's prompts:
#: - AMD EPYC without AMX, bf16 instructions not recorded (2026-12-02): 0.124, its 33-token
#:   prompt parting at step 1 where the single instance's two best are 0.25 apart;
#: - AMD EPYC Zen 4 with AVX512-BF16, no AMX (2026-12-03): 0.219, on the 700-token prompt;
#: - Intel with AMX: the hybrid parted at a 0.062 gap;
#: - at D TP 2 the hybrid parts at a 0.3125 gap (test_tp).
BF16_BOUND = 0.25
#: Keyed by ``ModelCase.name``.
CASES = {
    c.name: c
    for c in (
        ModelCase("llama", "llama", "float32", _LENGTHS, repeat=1),
        # Chunked prefill (every engine, the single instance too): at most CHUNK_TOKENS per
        # step, not a multiple of the block, so chunks end inside blocks; layer-wise loads
        # stream each chunk's completed blocks as the chunk is computed.
        ModelCase(
            "llama_chunked", "llama", "float32", _LENGTHS, repeat=1,
            llm_options={"max_num_batched_tokens": CHUNK_TOKENS},
        ),
        # Speculative decoding: a draft model (the target's own weights) whose layers sit in
        # the target's KV cache group, so its KV moves from P with the target's.
        ModelCase("llama_spec", "llama", "float32", _LENGTHS, repeat=1, speculative="draft_model"),
        ModelCase("llama_eagle", "llama", "float32", _LENGTHS, repeat=1, speculative="eagle"),
        # xPyD behind the router (serve_xpyd): 32 prompts in flight, from one token to 600
        # (shorter than a block, across block boundaries), then its edge cases' prompts.
        ModelCase("llama_xpyd", "llama", "float32", _XPYD_LENGTHS, repeat=1),
        # vLLM's reference CPU MLA backend in float32: exact, but it turns prefix caching off.
        ModelCase(
            "deepseek_mla", "deepseek_mla", "float32", _LENGTHS, repeat=1, block_size=16,
            llm_options={"attention_config": {"backend": "CPU_MLA"}}, prefix_cache=False,
        ),
        # Speculative decoding on MLA: the target's own weights as the draft model.
        ModelCase(
            "deepseek_mla_spec", "deepseek_mla", "float32", _LENGTHS, repeat=1, block_size=16,
            llm_options={"attention_config": {"backend": "CPU_MLA"}}, prefix_cache=False,
            speculative="draft_model",
        ),
        # The AMX MLA backend (bf16, prefix caching on): D's last-token forward rounds
        # differently from the single instance's prefill, so near ties may flip.
        ModelCase("deepseek_mla_bf16", "deepseek_mla", "bfloat16", _LENGTHS, repeat=1, bound=BF16_BOUND),
        # Hybrid: vLLM's attention block here is 640 tokens, so the prompts D may find in its
        # prefix cache are longer than that.
        ModelCase(
            "qwen3_next", "qwen3_next", "bfloat16", (45, 700, 130, 33, 5, 1, 660), repeat=6,
            block_size=None, bound=BF16_BOUND, d_hit_beyond_single=True,
        ),
    )
}  # fmt: skip


def _engine_env(cores: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cores
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # ``collective_rpc`` with a function (``pending_pushes``): test-only introspection.
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


def _make_llm(
    model: str, kv_transfer: dict[str, Any] | None, case: ModelCase, tp: int = 1, pp: int = 1
) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw: dict[str, Any] = {} if case.block_size is None else {"block_size": case.block_size}
    kw.update(case.llm_options)
    if tp > 1:  # vLLM's CPU backend: one core per rank (VLLM_CPU_OMP_THREADS_BIND "0|1")
        kw["tensor_parallel_size"] = tp
    if pp > 1:  # one core per stage; not eager: vLLM's CPU build needs the warm-up's
        # intermediate tensors for the later stages (docs/vllm-connector.md)
        kw["pipeline_parallel_size"] = pp
        kw["distributed_executor_backend"] = "mp"
    if kv_transfer is not None:
        kw["kv_transfer_config"] = KVTransferConfig(**kv_transfer)
    if case.speculative is not None:
        draft = model if case.speculative == "draft_model" else str(eagle_head(model))
        kw["speculative_config"] = {
            "method": case.speculative,
            "model": draft,
            "num_speculative_tokens": SPEC_TOKENS,
        }
    return LLM(
        model=model,
        tokenizer=model,
        dtype=case.dtype,
        max_model_len=1024,
        enforce_eager=pp == 1,
        seed=0,
        max_num_seqs=8,
        disable_log_stats=False,  # the prefix-cache counters (D's local hit)
        **kw,
    )


def _generate(
    llm: Any, ids: list[int], max_tokens: int, params: dict | None, top2: bool = False
) -> dict[str, Any]:
    """One request through the engine's step loop: tokens, returned params, time to 1st token.

    ``top2``: also each step's two best tokens and their log-probability gap.
    """
    return _generate_many(llm, [(ids, max_tokens, params, top2)])[0]


def _generate_many(llm: Any, requests: list[tuple]) -> list[dict[str, Any]]:
    """Requests ``(ids, max_tokens, params, top2)`` in the engine at once; their results in order
    (``total_s`` and ``ttft_s`` counted from when all were added)."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    hits_before, bytes_before = _local_prefix_hits(llm), _loaded_bytes(llm)
    streamed_before = _streamed_bytes(llm)
    landed_before = _landed_after(llm)
    parts_before = _streamed_parts(llm)
    accepted_before = _metric(llm, ACCEPTED)
    t0 = time.perf_counter()
    rids = []
    for k, (ids, max_tokens, params, top2) in enumerate(requests):
        extra = {"kv_transfer_params": params} if params is not None else None
        sp = SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=True,
            extra_args=extra,
            logprobs=2 if top2 else None,
        )
        rids.append(f"req-{time.monotonic_ns()}-{k}")
        engine.add_request(rids[-1], {"prompt_token_ids": list(ids)}, sp)
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    final: dict[str, Any] = {}
    deadline = t0 + 120
    while engine.has_unfinished_requests():
        if time.perf_counter() > deadline:
            raise TimeoutError(f"requests {sorted(set(rids) - set(final))} not finished in 120 s")
        for out in engine.step():
            if out.request_id not in rids:
                continue
            if out.request_id not in first and out.outputs and out.outputs[0].token_ids:
                first[out.request_id] = time.perf_counter()
            if out.finished:
                final[out.request_id] = out
                done[out.request_id] = time.perf_counter()
    missing = [r for r in rids if r not in final]
    if missing:
        raise RuntimeError(f"requests {missing} returned no final output")
    hits = _local_prefix_hits(llm) - hits_before
    # The stats reach the metrics with the step that reports the load done: all have come.
    moved = _loaded_bytes(llm) - bytes_before
    streamed = _streamed_bytes(llm) - streamed_before
    landed = [now - then for now, then in zip(_landed_after(llm), landed_before, strict=True)]
    parts = [now - then for now, then in zip(_streamed_parts(llm), parts_before, strict=True)]
    accepted = _metric(llm, ACCEPTED) - accepted_before
    results = [_result(final[r], first.get(r), done[r], t0, hits, moved) for r in rids]
    for r in results:
        r["streamed_bytes"] = streamed
        # the engine's, over every request of the call: draft tokens the target accepted
        r["accepted"] = accepted
        # mean over the call's loads: from P's answer to the last byte landed
        r["landed_after_s"] = landed[0] / landed[1] if landed[1] else None
        # mean over the call's layer-wise loads: the prefill steps their bytes came in
        r["streamed_parts"] = parts[0] / parts[1] if parts[1] else 0
    return results


def _result(
    final: Any, first: float | None, done: float, t0: float, hits: int, moved: float
) -> dict[str, Any]:
    steps = []
    out = final.outputs[0]
    for token, lp in zip(out.token_ids, out.logprobs or (), strict=False):
        best = sorted(lp.items(), key=lambda kv: -kv[1].logprob)[:2]
        steps.append((best[1][0], best[0][1].logprob - best[1][1].logprob, lp[token].logprob))
    return {
        "runner_up": [t for t, _, _ in steps],
        "gap": [g for _, g, _ in steps],
        # the log-prob of the token taken at each step
        "logprob": [x for _, _, x in steps],
        "token_ids": list(final.outputs[0].token_ids),
        "kv_transfer_params": final.kv_transfer_params,
        "ttft_s": (first - t0) if first is not None else None,
        "total_s": done - t0,
        # With P's transfer parameters vLLM reports P's prefix-cache hit here (P adds
        # remote_prefill_cached_tokens), not this engine's: hence the local hit below.
        "num_cached_tokens": getattr(final, "num_cached_tokens", None),
        # the engine's, over every request of the call
        "local_hit_tokens": hits,
        "loaded_bytes": moved,
    }


def _metric(llm: Any, name: str) -> float:
    """One of the engine's Prometheus metrics, summed over its labels."""
    return float(sum(m.value for m in llm.get_metrics() if m.name == name))  # type: ignore[attr-defined]


#: Draft tokens the target model accepted (speculative decoding), over the engine's life.
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"


def _kv_usage(llm: Any) -> float:
    """The share of KV blocks requests hold (vLLM's gauge; blocks only cached count as free)."""
    return _metric(llm, "vllm:kv_cache_usage_perc")


#: Bytes a D loaded, per connector: kvbridge's histogram and vLLM's NixlConnector's.
LOADED_BYTES = ("vllm:kvbridge_transfer_bytes", "vllm:nixl_bytes_transferred")


def _loaded_bytes(llm: Any) -> float:
    """Bytes this engine's connector moved so far (the sums of the histograms above)."""
    return float(sum(m.sum for m in llm.get_metrics() if m.name in LOADED_BYTES))  # type: ignore[attr-defined]


def _pending_pushes(worker: Any) -> list[str]:
    """On a worker: the requests decode asked this prefill to push before it published them."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    plane = get_kv_transfer_group().plane
    if plane is None:
        return []
    with plane._lock:
        return sorted({key[0] for key in plane._leases._pending_push})


def _streamed_bytes(llm: Any) -> float:
    """Bytes P wrote layer by layer into this engine so far (layer-wise push)."""
    return float(sum(m.sum for m in llm.get_metrics() if m.name == "vllm:kvbridge_streamed_bytes"))  # type: ignore[attr-defined]


def _streamed_parts(llm: Any) -> tuple[float, float]:
    """This engine's histogram of the prefill steps each layer-wise load came in: (sum, count)."""
    found = [m for m in llm.get_metrics() if m.name == "vllm:kvbridge_streamed_parts"]
    return float(sum(m.sum for m in found)), float(sum(m.count for m in found))


def _landed_after(llm: Any) -> tuple[float, float]:
    """This engine's histogram of the time from P's answer to a load's last byte: (sum, count)."""
    name = "vllm:kvbridge_landed_after_prefill_seconds"
    found = [m for m in llm.get_metrics() if m.name == name]
    return float(sum(m.sum for m in found)), float(sum(m.count for m in found))


def _local_prefix_hits(llm: Any) -> int:
    """Tokens this engine served from its own prefix cache so far (vLLM's Prometheus counter)."""
    return int(_metric(llm, "vllm:prefix_cache_hits"))


def _die_with_driver() -> None:
    """Kill this engine's whole process group once the driver that started it is gone.

    The engine leads its own process group (for the kill fault), so a driver killed by hand or by
    a test timeout would otherwise leave the engine and its engine-core process running.
    """
    driver = os.getppid()

    def watch() -> None:
        while os.getppid() == driver:
            time.sleep(0.5)
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="die-with-driver", daemon=True).start()


def engine_main(
    conn: Any,
    model: str,
    kv_transfer: dict | None,
    cores: str,
    case: ModelCase,
    faults: str | None = None,
    tp: int = 1,
    pp: int = 1,
) -> None:
    """A child process holding one engine; serves requests, ``"reset"``, ``"usage"`` and
    ``("batch", [...])`` over ``conn``. ``faults``: a directory for ``faults.install``."""
    os.setpgrp()  # so that killing "P" kills its engine-core process too
    _die_with_driver()
    _engine_env(cores)
    if faults is not None and kv_transfer is not None:  # the connector with faults.install
        from tests.adapters.vllm.e2e.faults import ENV

        os.environ[ENV] = faults
        kv_transfer = {
            **kv_transfer,
            "kv_connector": "FaultyKVBridgeConnector",
            "kv_connector_module_path": "tests.adapters.vllm.e2e.faulty_connector",
        }
    extra = (kv_transfer or {}).get("kv_connector_extra_config") or {}
    if "_side_channel_port" in extra:  # vLLM's NIXL connector takes its port from the env
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(extra.pop("_side_channel_port"))
    try:
        t0 = time.perf_counter()
        llm = _make_llm(model, kv_transfer, case, tp, pp)
        conn.send(("ready", time.perf_counter() - t0))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        msg = conn.recv()
        if msg is None:
            break
        try:
            if msg == "reset":
                conn.send(("ok", bool(llm.reset_prefix_cache())))
            elif msg == "usage":
                conn.send(("ok", _kv_usage(llm)))
            elif msg == "pending_pushes":
                ids = llm.collective_rpc(_pending_pushes)
                conn.send(("ok", sorted({rid for rank in ids for rid in rank})))
            elif msg[0] == "batch":
                conn.send(("ok", _generate_many(llm, msg[1])))
            else:
                conn.send(("ok", _generate(llm, *msg)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    conn.send(("bye", None))
    # The engine is shut down (its core, workers and connector have exited): what is left is
    # this interpreter's own teardown, about 2 s of one core per engine here for nothing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class Engine:
    """Handle of an engine child process (the leader of its own process group)."""

    def __init__(
        self,
        name: str,
        model: str,
        kv: dict | None,
        cores: str,
        case: ModelCase,
        faults: Path | None = None,
        tp: int = 1,
        pp: int = 1,
    ) -> None:
        ctx = mp.get_context("spawn")
        self.name = name
        self.conn, child = ctx.Pipe()
        args = (child, model, kv, cores, case, None if faults is None else str(faults), tp, pp)
        self.proc = ctx.Process(target=engine_main, args=args, name=name, daemon=False)
        self.proc.start()
        self._shut = False

    def wait_ready(self, timeout: float = 240) -> float:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.name} did not start in {timeout} s")
        kind, value = self.conn.recv()
        if kind != "ready":
            raise RuntimeError(f"{self.name} failed to start:\n{value}")
        return float(value)

    def _call(self, msg: Any, timeout: float = 180) -> Any:
        self.conn.send(msg)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.name}: no answer in {timeout} s")
        kind, value = self.conn.recv()
        if kind != "ok":
            raise RuntimeError(f"{self.name} failed:\n{value}")
        return value

    def generate(
        self, ids: list[int], max_tokens: int, params: dict | None, top2: bool = False
    ) -> dict[str, Any]:
        return dict(self._call((ids, max_tokens, params, top2)))

    def generate_many(self, requests: list[tuple]) -> list[dict[str, Any]]:
        """``(ids, max_tokens, params, top2)`` requests in the engine together."""
        return list(self._call(("batch", requests)))

    def reset_prefix_cache(self) -> bool:
        return bool(self._call("reset"))

    def pending_pushes(self) -> list[str]:
        """P: the requests a decode instance asked it to push before it published them."""
        return list(self._call("pending_pushes"))

    def kv_usage(self) -> float:
        return float(self._call("usage"))

    def freeze(self, seconds: float) -> None:
        """SIGSTOP the engine and its children now; SIGCONT them ``seconds`` later."""
        os.killpg(self.proc.pid, signal.SIGSTOP)

        def thaw() -> None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGCONT)

        timer = threading.Timer(seconds, thaw)
        timer.daemon = True
        timer.start()

    def kill(self) -> None:
        """SIGKILL the engine and its children: a prefill instance dying without notice."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def terminate(self) -> None:
        """Ask the engine to shut down (``stop`` waits for it); once."""
        with contextlib.suppress(OSError, EOFError, BrokenPipeError):
            if self.proc.is_alive() and not self._shut:
                self.conn.send(None)
        self._shut = True

    def stop(self, grace: float = 30.0) -> None:
        """Shut the engine down, killing it if it has not gone within ``grace`` seconds or 10 s
        after it said it had."""
        self.terminate()
        with contextlib.suppress(OSError, EOFError, BrokenPipeError):
            if self.proc.is_alive() and self.conn.poll(grace):
                self.conn.recv()
        self.proc.join(10)
        if self.proc.is_alive():
            self.kill()


class Stoppable(Protocol):
    """An engine or a server: told to stop, then waited for."""

    def terminate(self) -> None: ...

    def stop(self, grace: float) -> None: ...


def stop_all(procs: Iterable[Stoppable], grace: float = 30.0) -> None:
    """Stop engines or servers together: every one is told first, so their shutdowns (about
    5 s each for a vLLM engine here) overlap; each then gets what is left of one ``grace``."""
    procs = list(procs)
    for proc in procs:
        proc.terminate()
    until = time.monotonic() + grace
    for proc in procs:
        proc.stop(max(0.0, until - time.monotonic()))


def kv_config(
    role: str,
    transport: str,
    port: int,
    mode: str = "pull",
    timeout: float = 10.0,
    lease: float = 60.0,
    verify: str = "off",
    peers: list[str] | None = None,
) -> dict[str, Any]:
    """The ``kv_transfer_config`` of one side (what users put on ``vllm serve``).

    ``peers``: D's ``prefill_peers`` (the P side channels it handshakes with at start).

    ``transport="vllm-nixl"`` configures vLLM's own NIXL connector instead, for comparison.
    """
    if transport == "vllm-nixl":
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
        "timeout": timeout,
        "lease": lease,
        "verify": verify,
    }
    if transport == "mooncake":
        extra["transport_options"] = {"protocol": "tcp"}
    if peers:
        extra["prefill_peers"] = peers
    cfg: dict[str, Any] = {
        "kv_connector": "KVBridgeConnector",
        "kv_role": role,
        "kv_connector_extra_config": extra,
    }
    if role == "kv_consumer":
        cfg["kv_load_failure_policy"] = "recompute"
    return cfg


def cores_for(tp: int, core: str) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` of an engine: ``core`` at TP 1, one core per rank above."""
    return core if tp == 1 else "|".join(str(c % (os.cpu_count() or 1)) for c in range(tp))


def reference(
    model: str, case: ModelCase, prompts: list[list[int]], max_tokens: int, tp: int = 1
) -> list[dict[str, Any]]:
    """Greedy outputs of one instance without any connector (both cores), with top-2 gaps;
    ``tp``: at that TP size (TP ranks round differently from one rank: D's reference)."""
    eng = Engine("reference", model, None, cores_for(tp, f"{CORE_P}-{CORE_D}"), case, tp=tp)
    try:
        eng.wait_ready()
        return [eng.generate(p, max_tokens, None, top2=True) for p in prompts]
    finally:
        # Its shutdown (about 5 s of one core) overlaps the start of the engines that follow.
        eng.terminate()
        threading.Thread(target=eng.stop, name="stop-reference", daemon=True).start()


def control_prompt(prompts: list[list[int]]) -> list[int]:
    """As long as prompt 0, other tokens, the same last token (D recomputes only that one)."""
    from tests.adapters.vllm.e2e.models import prompts as make

    control = make(1, seed=99, lengths=(len(prompts[0]),))[0]
    control[-1] = prompts[0][-1]
    return control


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token sequences differ (within the shorter), or None."""
    return next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


@dataclass
class Reference:
    """A model built once and its single-instance outputs (shared by every transport's run)."""

    case: ModelCase
    model: str
    prompts: list[list[int]]
    control: list[int]
    tokens: list[list[int]]
    control_tokens: list[int]
    #: Per prompt and step: the single instance's runner-up token and its log-prob gap.
    runner_up: list[list[int]]
    gap: list[list[float]]
    #: Per prompt and step: the log-prob of the single instance's token.
    logprob: list[list[float]]
    #: Tokens the single instance served from its own prefix cache for the repeated prompt.
    repeat_hit: int = 0
    #: Per prompt: draft tokens the single instance accepted (speculative decoding).
    accepted: list[float] = field(default_factory=list)

    def deviation(self, i: int, tokens: list[int], logprobs: list[float]) -> float:
        """The largest gap between D's log-probs and the single instance's for the same token,
        over the steps where the two saw the same tokens (up to and with the first differing
        one, where D's token is compared with the single instance's runner-up); inf where D
        took a token the single instance did not rank first or second."""
        ref = self.tokens[i]
        step = first_difference(tokens, ref)
        same = len(ref) if step is None else step
        devs = [abs(logprobs[k] - self.logprob[i][k]) for k in range(min(same, len(logprobs)))]
        if step is not None and step < len(logprobs):
            if tokens[step] != self.runner_up[i][step]:
                return float("inf")
            devs.append(abs(logprobs[step] - (self.logprob[i][step] - self.gap[i][step])))
        return max(devs, default=0.0)

    def compare(self, i: int, tokens: list[int], logprobs: list[float] | None = None) -> str:
        """``"exact"``, ``"near-tie"`` or ``"mismatch"`` of D's tokens against prompt ``i``'s.

        ``near-tie``: the first differing step is one where the single instance's two best
        tokens were within ``case.tie`` (log-prob) and D took the runner-up; a bf16 rounding
        difference there flips greedy decoding, and the sequences part from that step on.
        With D's ``logprobs`` and a case ``bound``, every step up to that one must also lie
        within the bound of the single instance's (a wrong state or block shows far beyond
        rounding even where the greedy tokens agree).
        """
        ref = self.tokens[i]
        bounded = self.case.bound > 0 and logprobs is not None
        if bounded and self.deviation(i, tokens, logprobs or []) > self.case.bound:
            return "mismatch"
        if tokens == ref:
            return "exact"
        step = first_difference(tokens, ref)
        if (
            step is not None
            and len(tokens) == len(ref)
            and self.gap[i][step] <= self.case.tie
            and tokens[step] == self.runner_up[i][step]
        ):
            return "near-tie"
        return "mismatch"


def build_reference(case: ModelCase, root: Path, max_tokens: int = 32, tp: int = 1) -> Reference:
    model = str(case.build(root))
    ps = case.prompts()
    control = control_prompt(ps)
    outs = reference(model, case, [*ps, control], max_tokens, tp)
    ref, ctl = outs[:-1], outs[-1]
    return Reference(
        case,
        model,
        ps,
        control,
        [o["token_ids"] for o in ref],
        ctl["token_ids"],
        [o["runner_up"] for o in ref],
        [o["gap"] for o in ref],
        [o["logprob"] for o in ref],
        ref[-1]["local_hit_tokens"],
        [o["accepted"] for o in ref],
    )


def _decode(
    p: Engine, d: Engine, ids: list[int], mode: str, max_tokens: int, prefill: dict | None = None
) -> tuple[dict, dict]:
    if mode in LAYERWISE:
        if prefill is None:
            raise RuntimeError("the layer-wise dispatch needs P's address from an earlier answer")
        return _decode_layerwise(p, d, ids, max_tokens, prefill, LAYERWISE[mode])
    pre = p.generate(ids, 1, {"do_remote_decode": True, "kvbridge_mode": mode})
    params = pre["kv_transfer_params"]
    if not params:
        raise RuntimeError("P returned no kv_transfer_params")
    return pre, d.generate(ids, max_tokens, dict(params), top2=True)


def _decode_layerwise(
    p: Engine, d: Engine, ids: list[int], max_tokens: int, prefill: dict[str, Any], mode: str
) -> tuple[dict, dict]:
    """D first, then P once D's push (or layer-wise pull) request reached it (so that every
    layer streams: a race left alone would stream only when P is slower than D's request, as a
    real router's is)."""
    from concurrent.futures import ThreadPoolExecutor

    from kvbridge.router.dispatch import concurrent_params

    to_p, to_d = concurrent_params(prefill, mode)
    tid = to_p["kvbridge_layerwise"]["id"]
    with ThreadPoolExecutor(1) as pool:
        dec = pool.submit(d.generate, ids, max_tokens, to_d, True)
        deadline = time.monotonic() + 60
        # (D asks nothing when it loads nothing: a one-token prompt with a recurrent state.)
        while not dec.done() and tid not in p.pending_pushes():
            if time.monotonic() > deadline:
                raise RuntimeError(f"D's push request for {tid} never reached P")
            time.sleep(0.02)
        pre = p.generate(ids, 1, to_p)
        return pre, dec.result(300)


def _after_fault(
    p: Engine,
    d: Engine,
    ref: Reference,
    i: int,
    mode: str | None,
    fault: Callable[[], None],
    max_tokens: int,
) -> dict[str, Any]:
    """P prefills prompt ``i`` (in ``mode``, or P's configured one), ``fault`` hits P, then D
    decodes with P's parameters: D's tokens against the single instance's, and D's time."""
    params: dict[str, Any] = {"do_remote_decode": True}
    if mode is not None:
        params["kvbridge_mode"] = mode
    pre = p.generate(ref.prompts[i], 1, params)
    fault()
    t0 = time.perf_counter()
    dec = d.generate(ref.prompts[i], max_tokens, dict(pre["kv_transfer_params"]), top2=True)
    return {
        "match": ref.compare(i, dec["token_ids"], dec["logprob"]),
        "lp_dev": ref.deviation(i, dec["token_ids"], dec["logprob"]),
        "d_total_s": time.perf_counter() - t0,
        "d_tokens": dec["token_ids"],
    }


#: A prompt D computes alone before the measured ones (``run_pair``); the prefix caches are
#: reset before each mode.
WARMUP_PROMPT = [1, 2, 3]


def run_pair(
    ref: Reference,
    transport: str,
    *,
    modes: tuple[str, ...] = MODES,
    max_tokens: int = 32,
    port_p: int = 5790,
    port_d: int = 5890,
    kill_check: bool = True,
    freeze_check: bool = True,
    tp_p: int = 1,
    tp_d: int = 1,
    pp_p: int = 1,
    pp_d: int = 1,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Every check above on one P/D pair; returns a summary with ``ok`` and per-check results.

    ``tp_p``/``tp_d``: the TP sizes of P and D (``ref`` must be a single instance at ``tp_d``);
    ``pp_p``/``pp_d``: their pipeline stages (one core per worker).
    """
    case = ref.case
    p = Engine(
        "prefill",
        ref.model,
        kv_config("kv_producer", transport, port_p),
        cores_for(tp_p * pp_p, CORE_P),
        case,
        tp=tp_p,
        pp=pp_p,
    )
    # P's workers' side channels (port + worker, stage-major)
    peers = [f"127.0.0.1:{port_p + r}" for r in range(tp_p * pp_p)]
    d = Engine(
        "decode",
        ref.model,
        kv_config("kv_consumer", transport, port_d, peers=peers),
        cores_for(tp_d * pp_d, CORE_D),
        case,
        tp=tp_d,
        pp=pp_d,
    )
    summary: dict[str, Any] = {
        "model": case.name,
        "transport": transport,
        "dtype": case.dtype,
        "tp_p": tp_p,
        "tp_d": tp_d,
        "pp_p": pp_p,
        "pp_d": pp_d,
    }
    results: list[dict[str, Any]] = []
    try:
        t_p, t_d = p.wait_ready(), d.wait_ready()
        log(f"{case.name}/{transport}: P ready in {t_p:.1f} s, D ready in {t_d:.1f} s")
        # In the results file: a slow start shows there (the readiness bound is 240 s).
        summary["ready_s"] = {"P": round(t_p, 1), "D": round(t_d, 1)}
        # vLLM compiles its log-prob sampler op (torch.compile) at the first request that asks
        # for log-probs: 1.5-3.5 s on these CPUs, in any engine, kvbridge or not. D's first
        # time to first token would measure that compile, so D asks once before the prompts.
        d.generate(WARMUP_PROMPT, 1, None, top2=True)
        prefill: dict[str, Any] | None = None
        if any(m in LAYERWISE for m in modes):
            # P's side channel, as a router learns it: from an answer of P's (a hold nobody
            # claims, freed at P's claim timeout).
            from kvbridge.router.dispatch import prefill_address

            learnt = p.generate(WARMUP_PROMPT, 1, {"do_remote_decode": True})
            prefill = prefill_address(learnt["kv_transfer_params"] or {})
            # D loads it, so P holds nothing and can reset its prefix cache before each mode
            d.generate(WARMUP_PROMPT, 1, dict(learnt["kv_transfer_params"]), top2=True)
        for mode in modes:
            # P's may fail while it still holds a request D has not released: P then serves
            # the mode's prompts partly from its cache (``p_cached``)
            p.reset_prefix_cache()
            d.reset_prefix_cache()
            for i, ids in enumerate(ref.prompts):
                pre, dec = _decode(p, d, ids, mode, max_tokens, prefill)
                repeat = i == len(ref.prompts) - 1
                r = {
                    "mode": mode,
                    "prompt": i,
                    "prompt_len": len(ids),
                    "repeat": repeat,
                    "match": ref.compare(i, dec["token_ids"], dec["logprob"]),
                    "lp_dev": ref.deviation(i, dec["token_ids"], dec["logprob"]),
                    "p_tokens": pre["token_ids"],
                    "d_tokens": dec["token_ids"],
                    "ref_tokens": ref.tokens[i],
                    "d_ttft_s": dec["ttft_s"],
                    "d_total_s": dec["total_s"],
                    "p_total_s": pre["total_s"],
                    "d_cached": dec["local_hit_tokens"],
                    # P's hit: D's params carry it (vLLM reports it as D's cached tokens),
                    # except layer-wise, where D's params left before P computed anything
                    "p_cached": pre["num_cached_tokens"]
                    if mode in LAYERWISE
                    else dec["num_cached_tokens"],
                    "d_loaded_bytes": dec["loaded_bytes"],
                    "d_streamed_bytes": dec["streamed_bytes"],
                    "d_streamed_parts": dec["streamed_parts"],
                    "d_landed_after_s": dec["landed_after_s"],
                    # speculative decoding: D's drafter proposes as the single instance's
                    # only over the same draft KV of the prompt (P's)
                    "d_accepted": dec["accepted"],
                    "ref_accepted": ref.accepted[i],
                }
                results.append(r)
                log(
                    f"  {mode} prompt {i} ({len(ids)} tokens{', again' if repeat else ''}): "
                    f"match={r['match']} P {pre['total_s'] * 1e3:.0f} ms, D ttft "
                    f"{dec['ttft_s'] * 1e3:.0f} ms, D cached {dec['local_hit_tokens']} (P "
                    f"{r['p_cached']}), D loaded {dec['loaded_bytes']:.0f} B"
                    f" ({dec['streamed_bytes']:.0f} B layer by layer, in"
                    f" {dec['streamed_parts']:g} parts)"
                    + (
                        f", drafts accepted {dec['accepted']:g} (single instance "
                        f"{ref.accepted[i]:g})"
                        if case.speculative
                        else ""
                    )
                )
                if r["match"] != "exact":
                    log(f"    D:   {dec['token_ids']}\n    ref: {ref.tokens[i]}")
        summary["results"] = results
        # The control: prompt 0's KV under other tokens.
        pre = p.generate(ref.prompts[0], 1, {"do_remote_decode": True})
        dec = d.generate(ref.control, max_tokens, dict(pre["kv_transfer_params"]), top2=True)
        # D answers as for prompt 0 (exactly, or in bf16 as compare allows), not as for the
        # control's own tokens: it decoded over P's KV.
        as_prompt0 = ref.compare(0, dec["token_ids"], dec["logprob"]) != "mismatch"
        summary["control"] = {
            "loaded": as_prompt0
            and dec["token_ids"] != ref.control_tokens
            and ref.control_tokens != ref.tokens[0],
            "d_tokens": dec["token_ids"],
        }
        log(f"  control: D used P's KV = {summary['control']['loaded']}")
        if freeze_check:
            # P stopped (SIGSTOP) right after its prefill for longer than the timeout, then
            # resumed: D's push request and its questions go unanswered meanwhile; D holds the
            # request until P answers, then loads it or recomputes it: either way exactly.
            p.reset_prefix_cache()
            d.reset_prefix_cache()
            summary["p_frozen"] = _after_fault(
                p, d, ref, 1, "push", lambda: p.freeze(FREEZE_S), max_tokens
            )
            log(
                f"  P frozen {FREEZE_S:g} s: match={summary['p_frozen']['match']} "
                f"in {summary['p_frozen']['d_total_s']:.1f} s"
            )
        if kill_check:
            # A prompt D has not cached, so nothing but P's KV or a recompute can serve it.
            summary["p_killed"] = _after_fault(p, d, ref, 2, None, p.kill, max_tokens)
            log(
                f"  P killed: D recomputed, match={summary['p_killed']['match']} "
                f"in {summary['p_killed']['d_total_s']:.1f} s"
            )
    finally:
        stop_all([d, p])
    summary["results"] = results
    repeats = [r for r in results if r["repeat"]]
    if not case.prefix_cache or (ref.repeat_hit == 0 and not case.d_hit_beyond_single):
        # The single instance itself serves nothing of the repeated prompt from its cache
        # (prefix caching off, as vLLM's reference CPU MLA backend has it; on CPUs without AMX
        # the bf16 MLA case too): neither P nor D may then report a hit.
        summary["prefix_hit"] = all(not r["p_cached"] and not r["d_cached"] for r in repeats)
    else:
        # D serves the repeat partly from its own cache (what it loaded the first time) and
        # loads less than the first time: only what its cache lacks.
        first = {r["mode"]: r for r in results if r["prompt"] == case.repeat}
        summary["prefix_hit"] = all(
            (r["d_cached"] or 0) > 0 and r["d_loaded_bytes"] < first[r["mode"]]["d_loaded_bytes"]
            for r in repeats
        )
    summary["ok"] = (
        bool(results)
        and all(r["match"] != "mismatch" for r in results)
        and summary.get("control", {}).get("loaded", False)
        and summary["prefix_hit"]
        and (not kill_check or summary.get("p_killed", {}).get("match") in ("exact", "near-tie"))
        and (not freeze_check or summary.get("p_frozen", {}).get("match") in ("exact", "near-tie"))
    )
    return summary


def show(ref: Reference, summary: dict[str, Any]) -> None:
    """Each prompt's P token, D's tokens and the single instance's, side by side."""
    from rich.console import Console
    from rich.table import Table

    verdict = {"exact": "yes", "near-tie": "near tie"}
    table = Table(
        title=f"{summary['model']} over {summary['transport']}: P -> D against one instance",
        caption=(
            "P prefills the prompt (N-1 tokens when the model has recurrent state) and returns "
            "1 token; D loads P's KV and generates 32. 'near tie': D and the single instance "
            "part where the latter's two best tokens were within "
            f"{ref.case.tie} log-prob (bf16 rounding)."
        ),
    )
    for col in ("mode", "prompt", "P", "D (first 6 of 32)", "single instance", "same"):
        table.add_column(col)
    for r in summary["results"]:
        again = " again" if r["repeat"] else ""
        table.add_row(
            r["mode"],
            f"{r['prompt']} ({r['prompt_len']} t{again})",
            str(r["p_tokens"]),
            str(r["d_tokens"][:6]),
            str(r["ref_tokens"][:6]),
            verdict.get(r["match"], "[red]NO[/red]") + _parting(r),
        )
    console = Console(width=120)
    console.print(table)
    ctl, killed = summary.get("control", {}), summary.get("p_killed", {})
    frozen = summary.get("p_frozen", {})
    console.print(
        f"control (prompt 0's KV under other tokens) answered as prompt 0: {ctl.get('loaded')}; "
        f"P frozen {FREEZE_S:g} s before D loaded: {frozen.get('match')} in "
        f"{frozen.get('d_total_s', 0):.1f} s; P killed before D loaded: D recomputed, "
        f"{killed.get('match')}"
    )


def _parting(r: dict[str, Any]) -> str:
    step = first_difference(r["d_tokens"], r["ref_tokens"])
    return "" if step is None else f" (from token {step})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama", choices=sorted(CASES))
    ap.add_argument("--transport", default="mooncake")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--port-p", type=int, default=5790)
    ap.add_argument("--port-d", type=int, default=5890)
    ap.add_argument("--no-kill", action="store_true", help="skip the P-killed check")
    ap.add_argument("--no-freeze", action="store_true", help="skip the P-frozen check")
    ap.add_argument("--show", action="store_true", help="print the tokens side by side")
    ap.add_argument("--json", help="write the summary here")
    a = ap.parse_args(argv)
    case = CASES[a.model]
    with tempfile.TemporaryDirectory(prefix="kvbridge-e2e-") as tmp:
        t0 = time.perf_counter()
        ref = build_reference(case, Path(tmp), a.max_tokens)
        print(f"single-instance reference in {time.perf_counter() - t0:.1f} s")
        summary = run_pair(
            ref,
            a.transport,
            modes=tuple(a.modes.split(",")),
            max_tokens=a.max_tokens,
            port_p=a.port_p,
            port_d=a.port_d,
            kill_check=not a.no_kill,
            freeze_check=not a.no_freeze,
        )
    if a.show:
        show(ref, summary)
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=1))
    print("OK" if summary["ok"] else "MISMATCH", file=sys.stderr)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
