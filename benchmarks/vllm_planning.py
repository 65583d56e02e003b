"""kvbridge's planner beside vLLM's own Mooncake planning code, on the same caches and block ids.

    .venv/bin/python benchmarks/vllm_planning.py [--shapes ...] [--layouts LBHNC BLHNC]
        [--tokens 1024 8192 32768 131072] [--patterns contiguous runs random] [--vllm-runs 5]
        [--memory-gib 6] [--layers N] [--no-estimate] [--json] [--output FILE] [--markdown]

(or ``python -m benchmarks.vllm_planning ...`` from the repository root). Needs vLLM (the CPU
build will do). A script of the source tree, not part of the ``kvbridge`` package: it builds
vLLM's Mooncake worker from its private attributes, which any vLLM release may change, so it
lives beside the tests that pin the vLLM versions it runs with (``tests/test_vllm_planning.py``,
also run against vLLM 0.33 by ``make test-vllm033``). It prints a table (rich or Markdown) or
the JSON ``benchmarks/chart_vllm_planning.py`` draws; ``kvbridge bench`` measures planning and
transfers through kvbridge's own API.

For each model shape, vLLM KV cache layout, request size and block-id pattern, vLLM's own code
configures and allocates the caches of two workers (P and D) on the CPU
(``get_kv_cache_groups``, ``get_kv_cache_config_from_groups`` with ``cache_config.kv_cache_layout``
set, ``allocate_kv_cache``). The same views then go to both planners:

* **kvbridge**: ``Layout(build_layout_spec(...))`` once per worker (timed apart, as
  ``layout_build_ms``), then ``plan_transfers(p_layout, d_layout, p_ids, d_ids)`` per request.
* **vLLM**: the Mooncake connector's ``MooncakeConnectorWorker``, imported from the installed vLLM
  and created with ``object.__new__`` so that its ``__init__`` starts no Mooncake engine, zmq socket
  or thread. The attributes its ``__init__`` would set and planning reads are set by hand
  (``_layer_specs``, the kernel ratio, TP/PP identity, a real ``TransferTopology``); the engine is a
  stub whose ``batch_register_memory`` returns 0, the zmq context one whose ``term`` does nothing,
  and both role flags are set so that ``register_kv_caches`` returns before starting the sender
  listener and ``shutdown`` has no thread to stop (planning reads neither flag). Everything else is
  vLLM's: ``register_kv_caches`` records the regions of each worker's views, D's registration goes
  to P as the ``MooncakeXferMetadata`` D sends (msgpack round trip included), and per request the
  timed part is what ``send_kv_to_decode`` runs between the peer's message and the engine call:
  ``_prepare_transfer_regions`` (its per-peer cache hit), the
  ``_validate_asymmetric_region_lengths`` check and ``_build_transfer_params`` (null-id filter,
  ``_logical_to_kernel_block_ids``, ``group_concurrent_contiguous``, per-region descriptors and
  coalescing of consecutive blocks). The latter is a coroutine that awaits nothing; it is driven to
  completion directly, without an event loop. The uncached ``_prepare_transfer_regions`` (alignment
  and ``_coalesce_contiguous_transfer_regions``, once per peer) and ``register_kv_caches`` are timed
  apart.

Both planners keep what they derive per peer (vLLM: the prepared regions; kvbridge: the
templates ``plan_transfers`` keeps with the layouts' group regions), so the per-request medians
are warm; the first request to a new peer is timed apart on both sides (``vllm_prepare_ms``,
``kvbridge_first_ms``). Calls of both planners are interleaved in the same rounds, with the
garbage collector off while timing (as ``timeit``).

Both sides' descriptors are compared: total bytes, and the byte ranges after merging ranges that
continue one another on both sides (so different descriptor counts can still move identical
bytes). vLLM moves a Mamba/GDN layer's whole padded page, kvbridge only its states: there the
ranges differ and ``vllm_covers_kvbridge`` says whether vLLM's ranges contain kvbridge's.

Caches are real allocations (``allocate_kv_cache`` zeroes them), so a cell keeps at most
``memory_bytes`` per worker by measuring fewer layers than the model has. Such a cell is also
measured at one layer unit, in the same interleaved rounds, and the full model's time estimated
from the two (an affine fit, fixed cost plus cost per layer, the slope at least 0):
``*_ms_model``. Planning is not linear in layers everywhere: on block-outermost layouts (BLHNC)
both planners fuse every layer of a block into one region, so the cost hardly depends on it.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import shlex
import statistics
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

import kvbridge
from kvbridge.bench import cases, machine_info, progress
from kvbridge.bench.report import Grid
from kvbridge.core.block_mapping import GroupBlockIds
from kvbridge.core.boundary import blocks_for_tokens, remote_prefill_token_count
from kvbridge.core.layout import Layout
from kvbridge.core.planning import TransferPlan, merge_descriptors, plan_transfers
from kvbridge.workloads.shapes import (
    DEEPSEEK_MLA,
    LLAMA3_DENSE,
    QWEN35_HYBRID,
    ModelShape,
    hybrid_block_size,
)

#: Model shapes, named as in ``kvbridge bench planning``.
VLLM_SHAPES: dict[str, ModelShape] = {
    "llama3-70b-dense": LLAMA3_DENSE,
    "deepseek-mla": DEEPSEEK_MLA,
    "qwen3.5-hybrid": QWEN35_HYBRID,
}
#: vLLM physical KV cache layouts compared (``vllm.v1.kv_cache_layout.KVCacheLayout`` names).
VLLM_LAYOUTS = ("LBHNC", "BLHNC")
#: Every physical layout vLLM has (``KVCacheLayout``), spelled out so the parser needs no vLLM.
ALL_VLLM_LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
#: Request sizes measured by default.
DEFAULT_TOKENS = (1024, 8192, 32768, 131072)
#: How a request's block ids lie in the pool.
VLLM_PATTERNS = ("contiguous", "runs", "random")
VLLM_PATTERN_HELP = (
    "contiguous: consecutive ids; runs: runs of 8 consecutive ids in random order; random: ids "
    "in random order (blocks merge only where two happen to be adjacent on both sides)"
)
RUN_LENGTH = 8
#: Kernel block size of attention layers (vLLM splits a hybrid's 544-token block into 34).
KERNEL_BLOCK = 16

Ranges = tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]


class VllmRefused(Exception):
    """vLLM's (or kvbridge's) code refuses this cell; the message says why."""


@dataclass
class VllmPlanningRow:
    """One cell: a shape, layout, block-id pattern and request size, planned by both sides."""

    shape: str
    layout: str
    pattern: str
    tokens: int
    model_layers: int  # the model's layer count
    layers: int = 0  # layers measured (fewer where the memory budget needs it)
    blocks: int = 0  # logical blocks the request moves, every group (state slots included)
    kvbridge_ms: float | None = None  # median plan_transfers, checks on (the default)
    kvbridge_nocheck_ms: float | None = None  # median plan_transfers(check=False)
    vllm_ms: float | None = None  # median of vLLM's per-request planning
    kvbridge_descriptors: int = 0
    kvbridge_descriptors_before: int = 0  # before merging
    vllm_transfers: int = 0  # (src, dst, length) entries vLLM hands the engine
    kvbridge_bytes: int = 0
    vllm_bytes: int = 0
    same_ranges: bool | None = None  # identical byte ranges after merging
    vllm_covers_kvbridge: bool | None = None  # every kvbridge byte within vLLM's, same mapping
    layout_build_ms: float | None = None  # Layout(build_layout_spec(...)) for one worker
    vllm_register_ms: float | None = None  # register_kv_caches for one worker (engine stubbed)
    vllm_prepare_ms: float | None = None  # _prepare_transfer_regions, uncached (once per peer)
    kvbridge_first_ms: float | None = None  # plan_transfers for a new peer (templates built)
    fit_layers: int | None = None  # the second layer count the full-model estimate uses
    kvbridge_ms_model: float | None = None  # estimated (or measured) at model_layers
    vllm_ms_model: float | None = None
    runs: int = 0
    kvbridge_fastest_ms: float | None = None  # fastest of the runs (the machine is shared)
    vllm_fastest_ms: float | None = None
    refused: str | None = None  # why vLLM's (or kvbridge's) code refuses the cell

    @property
    def speedup(self) -> float | None:
        """vLLM's planning time over kvbridge's (above 1: kvbridge is faster)."""
        if self.vllm_ms is None or not self.kvbridge_ms:
            return None
        return self.vllm_ms / self.kvbridge_ms

    @property
    def speedup_model(self) -> float | None:
        if self.vllm_ms_model is None or not self.kvbridge_ms_model:
            return None
        return self.vllm_ms_model / self.kvbridge_ms_model

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "speedup": self.speedup, "speedup_model": self.speedup_model}


# --- vLLM's caches -------------------------------------------------------------------------------


def block_sizes(shape: ModelShape) -> tuple[int, int]:
    """Logical and kernel block size of the attention (or MLA) layers."""
    if shape.mla_latent_dim:
        return 64, 64
    if shape.is_hybrid:
        return hybrid_block_size(shape, KERNEL_BLOCK), KERNEL_BLOCK
    return KERNEL_BLOCK, KERNEL_BLOCK


def layer_unit(shape: ModelShape) -> int:
    """Fewest layers that keep the model's structure (a hybrid: one attention layer's period)."""
    return shape.full_attention_interval if shape.is_hybrid else 1


def layer_specs(shape: ModelShape, num_layers: int) -> dict[str, Any]:
    """vLLM cache spec per layer, in model order, as a model runner's ``get_kv_cache_spec``.

    Layer names carry one integer, the layer index, as vLLM's ``extract_layer_index`` needs. A
    hybrid's GDN pages are padded to the attention page, as vLLM's platform hook does.
    """
    import torch
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec

    block, _ = block_sizes(shape)
    dtype = torch.bfloat16
    if shape.mla_latent_dim:
        mla = MLAAttentionSpec(
            block_size=block, num_kv_heads=1, head_size=shape.mla_latent_dim, dtype=dtype
        )
        return {f"model.layers.{i}.self_attn.attn": mla for i in range(num_layers)}
    attn = FullAttentionSpec(
        block_size=block, num_kv_heads=shape.num_kv_heads, head_size=shape.head_dim, dtype=dtype
    )
    if not shape.is_hybrid:
        return {f"model.layers.{i}.self_attn.attn": attn for i in range(num_layers)}
    conv_dim = 2 * shape.linear_num_key_heads * shape.linear_key_head_dim + (
        shape.linear_num_value_heads * shape.linear_value_head_dim
    )
    gdn = MambaSpec(
        block_size=block,
        shapes=(
            (shape.linear_conv_kernel_dim - 1, conv_dim),
            (shape.linear_num_value_heads, shape.linear_value_head_dim, shape.linear_key_head_dim),
        ),
        dtypes=(dtype, dtype),
        page_size_padded=attn.page_size_bytes,
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        mamba_cache_mode="align",
    )
    interval = shape.full_attention_interval
    return {
        (
            f"model.layers.{i}.self_attn.attn"
            if (i + 1) % interval == 0
            else f"model.layers.{i}.linear_attn"
        ): (attn if (i + 1) % interval == 0 else gdn)
        for i in range(num_layers)
    }


@dataclass
class VllmCaches:
    """One worker's caches as vLLM configured and allocated them."""

    config: Any  # vllm.v1.kv_cache_interface.KVCacheConfig
    views: dict[str, Any]  # layer name -> torch view, what register_kv_caches receives
    kernel_sizes: list[int]
    ratio: int  # kernel blocks per logical attention block

    @property
    def nbytes(self) -> int:
        return int(self.config.kv_cache_tensors[0].size)


def _refusal(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}".strip()


def kv_cache_config(shape: ModelShape, layout: str, num_layers: int, num_blocks: int) -> Any:
    """vLLM's grouping and placement of the layers (``VllmRefused`` with vLLM's message)."""
    from vllm.config import VllmConfig

    from kvbridge.adapters.vllm.versions import (
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
    )

    config = VllmConfig()
    config.cache_config.kv_cache_layout = layout
    config.cache_config.num_gpu_blocks_override = num_blocks  # the pool size, whatever memory
    try:
        groups = get_kv_cache_groups(config, layer_specs(shape, num_layers))
        kv_config = get_kv_cache_config_from_groups(config, groups, 1 << 62)
    except (ValueError, AssertionError, NotImplementedError) as err:
        raise VllmRefused(f"vLLM: {_refusal(err)}") from err
    if kv_config.num_blocks != num_blocks:
        raise VllmRefused(f"vLLM made {kv_config.num_blocks} blocks, not {num_blocks}")
    return kv_config


def kernel_block_sizes(kv_config: Any) -> list[int]:
    """Kernel block size per group: attention at ``KERNEL_BLOCK`` (MLA whole), Mamba whole."""
    from vllm.v1.kv_cache_interface import MambaSpec, MLAAttentionSpec

    sizes = []
    for group in kv_config.kv_cache_groups:
        spec = group.kv_cache_spec
        whole = isinstance(spec, (MambaSpec, MLAAttentionSpec))
        sizes.append(int(spec.block_size) if whole else KERNEL_BLOCK)
    return sizes


def allocate(kv_config: Any, layout: str) -> VllmCaches:
    """``allocate_kv_cache`` on the CPU, as a model runner does before registering the caches."""
    import torch
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    sizes = kernel_block_sizes(kv_config)
    try:
        views = allocate_kv_cache(kv_config, torch.device("cpu"), KVCacheLayout[layout], sizes)
    except (ValueError, AssertionError, NotImplementedError) as err:
        raise VllmRefused(f"vLLM: {_refusal(err)}") from err
    ratio = max(
        int(g.kv_cache_spec.block_size) // k
        for g, k in zip(kv_config.kv_cache_groups, sizes, strict=True)
    )
    return VllmCaches(kv_config, views, sizes, ratio)


# --- vLLM's Mooncake worker, without its engine ----------------------------------------------


class _NoEngine:
    """Stands in for mooncake's ``TransferEngine``: registration succeeds, nothing moves."""

    def batch_register_memory(self, ptrs: list[int], lengths: list[int]) -> int:
        return 0

    def batch_transfer_sync_write(self, *args: object) -> int:
        raise AssertionError("the benchmark plans; it never transfers")


class _NoZmqContext:
    """Stands in for the zmq context ``shutdown`` (run by ``__del__``) terminates."""

    def term(self) -> None:
        return None


def mooncake_worker(shape: ModelShape, caches: VllmCaches, engine_id: str) -> Any:
    """vLLM's ``MooncakeConnectorWorker`` with ``caches`` registered, built without ``__init__``.

    ``__init__`` would start a Mooncake engine, zmq context, threads and (on P) a bootstrap
    server. Only the attributes that ``register_kv_caches`` and the planning methods read are
    set here, to the values ``__init__`` gives them for TP 1, PP 1 (the kernel ratio, which
    ``__init__`` learns from the attention backends, is the one the caches were allocated with).
    Then vLLM's own ``register_kv_caches`` runs (``is_kv_consumer`` makes it return before
    starting P's sender listener, which only serves D's messages).
    """
    from vllm.distributed.kv_transfer.kv_connector.utils import TransferTopology
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
        MooncakeConnectorWorker,
    )

    config = caches.config
    worker: Any = object.__new__(MooncakeConnectorWorker)
    worker.engine = _NoEngine()
    worker.engine_id = engine_id
    worker.hostname, worker.rpc_port = "127.0.0.1", 0
    # Both roles: registration returns before starting a sender listener, and shutdown (run by
    # __del__) has no thread or loop to stop. Planning reads neither flag.
    worker.is_kv_producer, worker.is_kv_consumer = True, True
    worker.async_zmq_ctx = _NoZmqContext()
    worker.tp_rank, worker.tp_size, worker.pp_size, worker.pp_rank = 0, 1, 1, 0
    worker.use_mla = bool(shape.mla_latent_dim)
    worker.kv_cache_config = config
    worker._physical_blocks_per_logical_kv_block = caches.ratio
    worker.block_size = block_sizes(shape)[0] // caches.ratio
    worker._prepared_transfer_regions = {}
    # vLLM 0.33's __init__ also keeps the peers' layouts it learned, and whether its caches were
    # unregistered for sleep mode (0.32 has neither; setting them there is harmless).
    worker._layout_by_peer, worker._acked_layout_peers = OrderedDict(), set()
    worker._kv_layout_id, worker._kv_unregistered = 0, False
    worker._layer_specs = {}
    for group in config.transfer_groups:  # as __init__
        per_layer = getattr(group.kv_cache_spec, "kv_cache_specs", {})
        for name in group.layer_names:
            worker._layer_specs[name] = per_layer.get(name, group.kv_cache_spec)
    worker.transfer_topo = TransferTopology(
        tp_rank=0,
        tp_size=1,
        block_size=worker.block_size,
        engine_id=engine_id,
        is_mla=worker.use_mla,
        is_mamba=config.has_mamba_layers,
        total_num_kv_heads=1 if shape.mla_latent_dim else shape.num_kv_heads,
        attn_backends=[],
    )
    worker.register_kv_caches(caches.views)
    return worker


def xfer_metadata(d_worker: Any, req_blocks: dict[str, tuple[str, list[list[int]]]]) -> Any:
    """The ``MooncakeXferMetadata`` D sends P (``receive_kv_from_single_worker``), decoded."""
    import msgspec
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
        MooncakeXferMetadata,
    )

    meta = MooncakeXferMetadata(
        remote_hostname=d_worker.hostname,
        remote_port=d_worker.rpc_port,
        remote_tp_size=d_worker.tp_size,
        remote_tp_rank=d_worker.tp_rank,
        remote_pp_size=d_worker.pp_size,
        req_blocks=req_blocks,
        kv_caches_base_addr=d_worker.kv_caches_base_addr,
        block_lens=d_worker.block_len_per_layer,
        kv_block_lens=d_worker.kv_block_len_per_layer,
        registered_layer_names=d_worker.registered_layer_names,
        registered_layer_indices=d_worker.registered_layer_indices,
        registered_group_indices=d_worker.registered_group_indices,
        registered_shared_group_ids=[list(g) for g in d_worker.region_shared_groups],
        registered_row_offsets=d_worker.region_row_offsets,
    )
    wire = msgspec.msgpack.Encoder().encode(meta)
    return msgspec.msgpack.Decoder(MooncakeXferMetadata).decode(wire)


def _run_coroutine(coro: Any) -> Any:
    """Drive a coroutine that awaits nothing to its result (no event loop)."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("vLLM's planning coroutine awaited something; it cannot run here")


@dataclass
class VllmRequest:
    """One request as P's Mooncake worker sees it when D's pull message arrives."""

    p_worker: Any
    meta: Any  # MooncakeXferMetadata with this request's D block ids
    ready: list[tuple[str, Any]]  # [(d_req_id, SendBlockMeta with P's block ids)]

    def plan(self) -> tuple[list[int], list[int], list[int]]:
        """What ``send_kv_to_decode`` computes per message before calling the engine."""
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
            _validate_asymmetric_region_lengths,
        )

        worker = self.p_worker
        local, remote, err = worker._prepare_transfer_regions(self.meta)  # per-peer cache
        if err is not None:
            raise VllmRefused(f"vLLM Mooncake: {err}")
        err = _validate_asymmetric_region_lengths(
            local_regions=local,
            remote_regions=remote,
            local_tp_size=worker.tp_size,
            remote_tp_size=self.meta.remote_tp_size,
            producer_cache_replicated=worker._producer_cache_is_replicated(),
            total_num_kv_heads=(
                None
                if worker.use_mla or worker.kv_cache_config.has_mamba_layers
                else worker.transfer_topo.total_num_kv_heads
            ),
        )
        if err is not None:
            raise VllmRefused(f"vLLM Mooncake: {err}")
        src, dst, lengths, err_reqs, err_msg = _run_coroutine(
            worker._build_transfer_params(self.ready, self.meta, local, remote)
        )
        if err_reqs:
            raise VllmRefused(f"vLLM Mooncake: {err_msg}")
        return src, dst, lengths


def vllm_request(
    p_worker: Any, d_worker: Any, p_ids: GroupBlockIds, d_ids: GroupBlockIds
) -> VllmRequest:
    """Block ids per group index, as vLLM's scheduler hands them to both workers."""
    import asyncio

    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
        SendBlockMeta,
    )

    count = len(p_worker.kv_cache_config.transfer_groups)
    p_lists = [list(p_ids.get(g, [])) for g in range(count)]
    d_lists = [list(d_ids.get(g, [])) for g in range(count)]
    meta = xfer_metadata(d_worker, {"d-req": ("xfer-0", d_lists)})
    send = SendBlockMeta(
        p_req_id="p-req", transfer_id="xfer-0", local_block_ids=p_lists, ready=asyncio.Event()
    )
    return VllmRequest(p_worker, meta, [("d-req", send)])


# --- block ids ---------------------------------------------------------------------------------


def pool_order(pattern: str, pool_size: int, rng: np.random.Generator) -> list[int]:
    """Free block ids ``1 .. pool_size-1`` (0 is vLLM's null block) in allocation order."""
    ids = np.arange(1, pool_size)
    if pattern == "contiguous":
        order = ids
    elif pattern == "runs":
        runs = [ids[i : i + RUN_LENGTH] for i in range(0, ids.size, RUN_LENGTH)]
        order = np.concatenate([runs[i] for i in rng.permutation(len(runs))])
    elif pattern == "random":
        order = rng.permutation(ids)
    else:
        raise ValueError(f"unknown pattern {pattern!r}; choose from {', '.join(VLLM_PATTERNS)}")
    return [int(b) for b in order]


def request_ids(
    layout: Layout, prompt_tokens: int, pattern: str, rng: np.random.Generator
) -> GroupBlockIds:
    """A request's block ids per group, drawn from this benchmark's patterns."""
    return cases.request_ids(layout, prompt_tokens, pattern, rng, order=pool_order)


def pool_blocks(shape: ModelShape, prompt_tokens: int) -> int:
    """Blocks per worker: the request's attention blocks, state slots and some slack."""
    block, _ = block_sizes(shape)
    tokens = remote_prefill_token_count(prompt_tokens, shape.is_hybrid)
    return blocks_for_tokens(tokens, block) + 24


# --- comparing what both sides move --------------------------------------------------------------


def merged_ranges(
    src: Sequence[int] | npt.NDArray[Any],
    dst: Sequence[int] | npt.NDArray[Any],
    lengths: Sequence[int] | npt.NDArray[Any],
) -> Ranges:
    """Descriptors sorted by source, those that continue one another on both sides merged
    (the planner's own ``merge_descriptors``, applied to vLLM's transfers too)."""
    merged = merge_descriptors(
        np.asarray(src, dtype=np.uint64),
        np.asarray(dst, dtype=np.uint64),
        np.asarray(lengths, dtype=np.uint64),
    )
    s, d, n = (a.astype(np.int64) for a in merged)
    return s, d, n


def covers(outer: Ranges, inner: Ranges) -> bool:
    """Whether every byte of ``inner`` lies in a range of ``outer`` with the same src->dst shift."""
    os_, od, on = outer
    is_, id_, in_ = inner
    if is_.size == 0:
        return True
    if os_.size == 0:
        return False
    at = np.searchsorted(os_, is_, side="right") - 1
    inside = at >= 0
    at = np.maximum(at, 0)
    inside &= is_ + in_ <= os_[at] + on[at]
    inside &= id_ - is_ == od[at] - os_[at]
    return bool(np.all(inside))


# --- timing --------------------------------------------------------------------------------------


def _median_ms(
    fns: dict[str, Callable[[], object]], runs: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Median and fastest milliseconds of each function, calls interleaved (order flipped every
    round).

    As ``timeit``, the garbage collector is off while timing (it runs once before), so neither
    side is charged for a collection the other's garbage triggered.
    """
    for fn in fns.values():
        fn()  # warm: lazy imports, allocator growth, the per-peer caches
    times: dict[str, list[float]] = {name: [] for name in fns}
    items = list(fns.items())
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        for i in range(runs):
            for name, fn in items if i % 2 == 0 else items[::-1]:
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    finally:
        if enabled:
            gc.enable()
    median = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    return median, {name: min(t) * 1e3 for name, t in times.items()}


def _once_ms(fn: Callable[[], object], runs: int = 3) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


@dataclass
class LayerSetup:
    """What setting up one layer count's two workers cost (it keeps no reference to caches)."""

    layers: int
    model_layers: int
    layout_build_ms: float
    vllm_register_ms: float


@dataclass
class Workers:
    """P's and D's caches at one layer count, as kvbridge layouts and as vLLM Mooncake workers."""

    shape: ModelShape
    layout: str
    p: VllmCaches
    d: VllmCaches
    p_layout: Layout
    d_layout: Layout
    p_worker: Any
    d_worker: Any
    setup: LayerSetup


def build_workers(shape: ModelShape, layout: str, layers: int, num_blocks: int) -> Workers:
    """Allocate P's and D's caches with vLLM (two allocations) and give the same views to both
    planners: ``Layout(build_layout_spec(...))`` and ``register_kv_caches``, each timed once."""
    from kvbridge.adapters.vllm.layout import build_layout_spec
    from kvbridge.core.errors import KvbridgeError

    gc.collect()  # the previous cell's caches
    config = kv_cache_config(shape, layout, layers, num_blocks)
    p = allocate(config, layout)
    d = allocate(config, layout)
    try:
        p_layout = Layout(build_layout_spec(config, p.views, engine_layout=layout))
        d_layout = Layout(build_layout_spec(config, d.views, engine_layout=layout))
    except KvbridgeError as err:
        raise VllmRefused(f"kvbridge: {_refusal(err)}") from err
    build_ms = _once_ms(lambda: Layout(build_layout_spec(config, p.views, engine_layout=layout)))
    try:
        p_worker = mooncake_worker(shape, p, "prefill")
        d_worker = mooncake_worker(shape, d, "decode")
        register_ms = _once_ms(lambda: p_worker.register_kv_caches(p.views))
    except (RuntimeError, AssertionError, ValueError) as err:
        raise VllmRefused(f"vLLM Mooncake: {_refusal(err)}") from err
    setup = LayerSetup(layers, shape.num_layers, build_ms, register_ms)
    return Workers(shape, layout, p, d, p_layout, d_layout, p_worker, d_worker, setup)


@dataclass
class Measured:
    """One request planned by both sides: their results and median (and fastest) times."""

    kvbridge_ms: float
    kvbridge_nocheck_ms: float
    vllm_ms: float
    plan: TransferPlan  # kvbridge's
    vllm: tuple[list[int], list[int], list[int]]  # vLLM's (src_ptrs, dst_ptrs, lengths)
    vllm_prepare_ms: float
    fastest_ms: dict[str, float]
    kvbridge_first_ms: float  # the first request to a new peer (per-pair templates built)


def _forget_peers(*layouts: Layout) -> None:
    """Drop what the planner keeps per pair of layouts, as for a peer never planned with."""
    for layout in layouts:
        for regions in layout.group_regions.values():
            regions.memo.clear()


def measure_pattern(
    sets: Sequence[Workers], prompt_tokens: int, pattern: str, runs: int, seed: int
) -> list[Measured]:
    """Both planners on one request, for every layer count in ``sets``, all calls interleaved in
    the same rounds (so a full-model estimate from two layer counts sees the same machine)."""
    fns: dict[str, Callable[[], object]] = {}
    results = []
    for i, w in enumerate(sets):
        rng_p, rng_d = np.random.default_rng([seed, 0]), np.random.default_rng([seed, 1])
        p_ids = request_ids(w.p_layout, prompt_tokens, pattern, rng_p)
        d_ids = request_ids(w.d_layout, prompt_tokens, pattern, rng_d)
        request = vllm_request(w.p_worker, w.d_worker, p_ids, d_ids)
        p_worker, meta = w.p_worker, request.meta

        def prepare_uncached(p_worker: Any = p_worker, meta: Any = meta) -> object:
            p_worker._prepared_transfer_regions.clear()
            return p_worker._prepare_transfer_regions(meta)

        prepare_ms = _once_ms(prepare_uncached)
        p, d = w.p_layout, w.d_layout

        def plan_new_peer(
            p: Layout = p, d: Layout = d, p_ids: GroupBlockIds = p_ids, d_ids: GroupBlockIds = d_ids
        ) -> object:
            _forget_peers(p, d)
            return plan_transfers(p, d, p_ids, d_ids)

        first_ms = _once_ms(plan_new_peer)
        try:
            vllm_out = request.plan()  # also fills the per-peer cache again
        except (AssertionError, RuntimeError, ValueError, IndexError) as err:
            raise VllmRefused(f"vLLM Mooncake: {_refusal(err)}") from err
        results.append((plan_transfers(p, d, p_ids, d_ids), vllm_out, prepare_ms, first_ms))
        fns[f"kvbridge{i}"] = functools.partial(plan_transfers, p, d, p_ids, d_ids)
        fns[f"kvbridge_nocheck{i}"] = functools.partial(
            plan_transfers, p, d, p_ids, d_ids, check=False
        )
        fns[f"vllm{i}"] = request.plan
    ms, fastest = _median_ms(fns, runs)
    return [
        Measured(
            ms[f"kvbridge{i}"],
            ms[f"kvbridge_nocheck{i}"],
            ms[f"vllm{i}"],
            plan,
            vllm_out,
            prepare_ms,
            {k: fastest[f"{k}{i}"] for k in ("kvbridge", "kvbridge_nocheck", "vllm")},
            first_ms,
        )
        for i, (plan, vllm_out, prepare_ms, first_ms) in enumerate(results)
    ]


def measure_layers(
    shape: ModelShape,
    layout: str,
    layers: int,
    num_blocks: int,
    prompt_tokens: int,
    patterns: Sequence[str],
    runs: int,
    seed: int,
) -> tuple[LayerSetup, list[Measured]]:
    """One layer count, every pattern; the caches are freed on return."""
    workers = build_workers(shape, layout, layers, num_blocks)
    measured = [measure_pattern([workers], prompt_tokens, p, runs, seed)[0] for p in patterns]
    return workers.setup, measured


# --- cells ---------------------------------------------------------------------------------------


def layers_that_fit(
    shape: ModelShape,
    layout: str,
    num_blocks: int,
    memory_bytes: int,
    cap: int | None,
    estimate: bool,
) -> int:
    """Most layers (whole units, at most the model's and ``cap``) whose caches fit the budget,
    beside one more unit where the full model's time is to be estimated."""
    unit = layer_unit(shape)
    per_unit = int(kv_cache_config(shape, layout, unit, num_blocks).kv_cache_tensors[0].size)
    wanted = min(shape.num_layers, cap or shape.num_layers) // unit * unit
    fit = memory_bytes // per_unit * unit
    layers = min(wanted, fit)
    if estimate and unit < layers < shape.num_layers and layers + unit > fit:
        layers -= unit  # room for the one-unit caches of the estimate
    if layers < unit:
        raise VllmRefused(
            f"the memory budget ({memory_bytes / 2**30:.1f} GiB) holds no {unit}-layer unit of "
            f"{per_unit / 2**30:.2f} GiB"
        )
    return layers


def _extrapolate(x0: int, y0: float, x1: int, y1: float, x: int) -> float:
    """The line through ``(x0, y0)`` and ``(x1, y1)`` at ``x > x1``: fixed cost plus cost per
    layer. A slope below 0 (noise: planning more layers never costs less) counts as 0."""
    return y1 + max(0.0, (y1 - y0) / (x1 - x0)) * (x - x1)


def measure_cells(
    shape_name: str,
    layout: str,
    prompt_tokens: int,
    patterns: Sequence[str],
    *,
    runs: int = 5,
    memory_bytes: int = 6 << 30,
    max_layers: int | None = None,
    estimate: bool = True,
    seed: int = 0,
    advance: Callable[[str], None] | None = None,
) -> list[VllmPlanningRow]:
    """Every pattern of one shape, layout and request size, on one pair of allocations (and a
    one-unit pair beside it where fewer layers than the model's are measured and ``estimate``)."""
    shape = VLLM_SHAPES[shape_name]
    rows = [
        VllmPlanningRow(shape_name, layout, pattern, prompt_tokens, shape.num_layers)
        for pattern in patterns
    ]
    num_blocks = pool_blocks(shape, prompt_tokens)
    unit = layer_unit(shape)
    try:
        layers = layers_that_fit(shape, layout, num_blocks, memory_bytes, max_layers, estimate)
        sets = [build_workers(shape, layout, layers, num_blocks)]
        if estimate and unit < layers < shape.num_layers:
            sets.append(build_workers(shape, layout, unit, num_blocks))
        for row in rows:
            if advance is not None:
                advance(
                    f"vllm-planning {shape_name} {layout} {prompt_tokens:,} tokens, "
                    f"{row.pattern} ids"
                )
            measured = measure_pattern(sets, prompt_tokens, row.pattern, runs, seed)
            m = measured[0]
            _fill(row, sets[0].setup, m, runs)
            if len(measured) > 1:
                small = measured[1]
                row.fit_layers = unit
                row.kvbridge_ms_model = _extrapolate(
                    unit, small.kvbridge_ms, layers, m.kvbridge_ms, shape.num_layers
                )
                row.vllm_ms_model = _extrapolate(
                    unit, small.vllm_ms, layers, m.vllm_ms, shape.num_layers
                )
    except VllmRefused as err:
        for row in rows:
            row.refused = str(err)
    return rows


def _fill(row: VllmPlanningRow, setup: LayerSetup, m: Measured, runs: int) -> None:
    src, dst, lengths = m.vllm
    kv = merged_ranges(m.plan.src, m.plan.dst, m.plan.lengths)
    vl = merged_ranges(src, dst, lengths)
    same = all(np.array_equal(a, b) for a, b in zip(kv, vl, strict=True))
    row.layers = setup.layers
    row.blocks = sum(g.blocks for g in m.plan.groups)
    row.kvbridge_ms, row.kvbridge_nocheck_ms, row.vllm_ms = (
        m.kvbridge_ms,
        m.kvbridge_nocheck_ms,
        m.vllm_ms,
    )
    row.kvbridge_descriptors, row.kvbridge_descriptors_before = m.plan.count, m.plan.unmerged
    row.vllm_transfers = len(lengths)
    row.kvbridge_bytes, row.vllm_bytes = m.plan.nbytes, int(sum(lengths))
    row.same_ranges = same
    row.vllm_covers_kvbridge = same or covers(vl, kv)
    row.layout_build_ms = setup.layout_build_ms
    row.vllm_register_ms = setup.vllm_register_ms
    row.vllm_prepare_ms = m.vllm_prepare_ms
    row.kvbridge_first_ms = m.kvbridge_first_ms
    row.runs = runs
    row.kvbridge_fastest_ms = m.fastest_ms["kvbridge"]
    row.vllm_fastest_ms = m.fastest_ms["vllm"]
    if setup.layers == setup.model_layers:
        row.kvbridge_ms_model, row.vllm_ms_model = m.kvbridge_ms, m.vllm_ms


def run_vllm_planning(
    shapes: Sequence[str],
    tokens: Sequence[int],
    patterns: Sequence[str],
    layouts: Sequence[str],
    *,
    runs: int = 5,
    memory_gib: float = 6.0,
    max_layers: int | None = None,
    estimate: bool = True,
    advance: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Every shape x layout x request size x pattern: the results document's ``vllm_planning``."""
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import mooncake_connector  # noqa: F401

    rows: list[VllmPlanningRow] = []
    gc.collect()
    gc.freeze()  # vLLM's import leaves ~600k objects: keep collections from rescanning them
    try:
        for shape in shapes:
            for layout in layouts:
                for size in tokens:
                    rows += measure_cells(
                        shape,
                        layout,
                        size,
                        patterns,
                        runs=runs,
                        memory_bytes=int(memory_gib * 2**30),
                        max_layers=max_layers,
                        estimate=estimate,
                        advance=advance,
                    )
    finally:
        gc.unfreeze()
    return {
        "settings": {
            "shapes": list(shapes),
            "prompt_tokens": list(tokens),
            "patterns": list(patterns),
            "layouts": list(layouts),
            "runs": runs,
            "memory_gib": memory_gib,
            "max_layers": max_layers,
            "estimate": estimate,
            "vllm": vllm.__version__,
        },
        "results": [r.to_dict() for r in rows],
    }


# --- the table -----------------------------------------------------------------------------------


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else f"{n:,}"


def _same_bytes(r: dict[str, Any]) -> str:
    """How the two planners' byte ranges compare: ``=``, vLLM's extra bytes, or ``✗``."""
    if r["same_ranges"]:
        return "="
    if r["vllm_covers_kvbridge"]:
        return f"vLLM +{r['vllm_bytes'] - r['kvbridge_bytes']:,} B"
    return "✗"


def _speedup(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}x"


def vllm_planning_grid(doc: dict[str, Any]) -> Grid:
    """One row per shape, layout, request size and block-id pattern; refusals as notes."""
    rows = []
    reasons: dict[str, int] = {}
    for r in doc["results"]:
        head = [r["shape"], r["layout"], r["pattern"], _tokens(r["tokens"])]
        if r["refused"]:
            mark = reasons.setdefault(r["refused"], len(reasons) + 1)
            rows.append([*head, "-", "-", f"refused ({mark})", *["-"] * 11])
            continue
        layers = str(r["layers"]) + (
            "" if r["layers"] == r["model_layers"] else f"/{r['model_layers']}"
        )
        rows.append(
            [
                *head,
                layers,
                f"{r['blocks']:,}",
                _num(r["kvbridge_ms"], 3),
                _num(r["vllm_ms"], 3),
                _speedup(r["speedup"]),
                f"{r['kvbridge_descriptors']:,}",
                f"{r['vllm_transfers']:,}",
                _same_bytes(r),
                _num(r["layout_build_ms"], 2),
                _num(r.get("kvbridge_first_ms"), 2),
                _num(r["vllm_prepare_ms"], 2),
                _num(r["kvbridge_ms_model"], 2),
                _num(r["vllm_ms_model"], 2),
                _speedup(r["speedup_model"]),
            ]
        )
    s = doc["settings"]
    notes = [
        f"Same vLLM-allocated caches (vLLM {s['vllm']}, CPU) and block ids for both planners. "
        f"kvbridge: median `plan_transfers` (checks on); vLLM: median of what its Mooncake "
        "connector's P worker runs per request (`_prepare_transfer_regions` cache hit, "
        "`_validate_asymmetric_region_lengths`, `_build_transfer_params`), both over "
        f"{s['runs']} interleaved runs. speedup: vLLM ms / kvbridge ms. desc./transfers: "
        "(src, dst, length) entries each hands the engine. bytes: = identical byte ranges "
        "after merging; vLLM +N B: vLLM's ranges hold kvbridge's and N more (a GDN page's "
        "padding). layout ms: `Layout(build_layout_spec(...))`, once per worker. Once per peer: "
        "kvbridge 1st ms, the first request's `plan_transfers` (it builds what it keeps per "
        "pair of layouts); vLLM prep. ms, its uncached `_prepare_transfer_regions` (alignment "
        "and coalescing of regions), before the request's own planning.",
        f"layers: measured/model layers where a worker's caches would exceed "
        f"{s['memory_gib']:g} GiB; there the model's time (model ms) is estimated from a "
        "second run at one layer unit, as fixed cost plus cost per layer.",
        *[f"({n}) {reason}" for reason, n in reasons.items()],
    ]
    headers = [
        "shape",
        "layout",
        "ids",
        "tokens",
        "layers",
        "blocks",
        "kvbridge ms",
        "vLLM ms",
        "speedup",
        "kvbridge desc.",
        "vLLM transfers",
        "bytes",
        "layout ms",
        "kvbridge 1st ms",
        "vLLM prep. ms",
        "kvbridge model ms",
        "vLLM model ms",
        "model speedup",
    ]
    title = "Planning one request: kvbridge beside vLLM's Mooncake connector"
    return Grid(title, headers, rows, notes, left=(0, 1, 2))


# --- the command line ----------------------------------------------------------------------------


class UsageError(ValueError):
    """Options that cannot run; printed as one line, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="benchmarks/vllm_planning.py",
        description=(__doc__ or "").split("\n\n")[0].replace("``", ""),
    )
    p.add_argument(
        "--shapes",
        nargs="+",
        choices=list(VLLM_SHAPES),
        default=list(VLLM_SHAPES),
        metavar="SHAPE",
        help=f"model shapes (default: all): {', '.join(VLLM_SHAPES)}",
    )
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        metavar="N",
        help="measure at most the first N layers of each model (quicker, smaller runs)",
    )
    p.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=list(DEFAULT_TOKENS),
        metavar="N",
        help="prompt lengths to plan (default: 1k 8k 32k 128k)",
    )
    p.add_argument(
        "--patterns",
        nargs="+",
        choices=list(VLLM_PATTERNS),
        default=list(VLLM_PATTERNS),
        help=f"{VLLM_PATTERN_HELP} (default: these three)",
    )
    p.add_argument(
        "--layouts",
        nargs="+",
        choices=ALL_VLLM_LAYOUTS,
        default=list(VLLM_LAYOUTS),
        help=f"vLLM KV cache layouts (default: {' '.join(VLLM_LAYOUTS)})",
    )
    p.add_argument(
        "--vllm-runs",
        type=int,
        default=5,
        metavar="N",
        help="timed runs per planner and cell, median reported (default 5)",
    )
    p.add_argument(
        "--memory-gib",
        type=float,
        default=6.0,
        metavar="GIB",
        help="most cache memory per worker (P and D each); bigger cells measure fewer layers and "
        "estimate the model's time from two layer counts (default 6)",
    )
    p.add_argument(
        "--no-estimate",
        action="store_true",
        help="measure cells cut to fewer layers once only, without the full-model estimate",
    )
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the results as JSON, no table")
    out.add_argument("--output", type=Path, default=None, help="also write the JSON to a file")
    out.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    return p


def _check(args: argparse.Namespace) -> None:
    if args.vllm_runs < 1 or args.memory_gib <= 0:
        raise UsageError("--vllm-runs and --memory-gib must be positive")
    if any(t < 1 for t in args.tokens):
        raise UsageError("--tokens must be positive")
    if args.layers is not None and args.layers < 1:
        raise UsageError("--layers must be positive")


def command_line(args: argparse.Namespace) -> str:
    """The command that repeats this run, every option spelled out."""
    words = ["python", "benchmarks/vllm_planning.py", "--shapes", *args.shapes]
    if args.layers is not None:
        words += ["--layers", str(args.layers)]
    words += ["--tokens", *map(str, args.tokens), "--patterns", *args.patterns]
    words += ["--layouts", *args.layouts, "--vllm-runs", str(args.vllm_runs)]
    words += ["--memory-gib", f"{args.memory_gib:g}"]
    if args.no_estimate:
        words.append("--no-estimate")
    return shlex.join(words)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run what ``args`` asks for; the results document (what ``--json`` prints)."""
    _check(args)
    doc: dict[str, Any] = {
        "kvbridge": kvbridge.__version__,
        "command": command_line(args),
        "machine": machine_info(),
    }
    total = len(args.shapes) * len(args.layouts) * len(args.tokens) * len(args.patterns)
    with progress(total, enabled=True) as advance:
        try:
            doc["vllm_planning"] = run_vllm_planning(
                args.shapes,
                args.tokens,
                args.patterns,
                args.layouts,
                runs=args.vllm_runs,
                memory_gib=args.memory_gib,
                max_layers=args.layers,
                estimate=not args.no_estimate,
                advance=advance,
            )
        except ModuleNotFoundError as err:
            if (err.name or "").split(".")[0] not in ("vllm", "torch"):
                raise
            raise UsageError(
                f"needs vLLM (and torch) installed: {err}; see docs/results/vllm-planning.md"
            ) from None
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    from rich.console import Console

    args = build_parser().parse_args(argv)
    try:
        doc = run(args)
    except UsageError as err:
        print(f"vllm_planning: error: {err}", file=sys.stderr)
        return 2
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(doc, indent=1) + "\n")
    if args.json:
        print(json.dumps(doc))
        return 0
    grid = vllm_planning_grid(doc["vllm_planning"])
    if args.markdown:
        print(grid.markdown())
    else:
        Console().print(grid.rich())
    return 0


if __name__ == "__main__":
    sys.exit(main())
