"""vLLM objects for the adapter tests: specs, configs, caches allocated by vLLM's own code."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (see the README: vLLM on the CPU)")

import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import NewRequestData
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.request import Request
from vllm.v1.worker.utils import allocate_kv_cache

from tests.vllm_triton_cpu import allow_x86_without_triton

allow_x86_without_triton()  # vLLM 0.34's configs on an x86 CPU without triton-cpu (test-only)

NUM_BLOCKS = 16
BLOCK = 64  # logical block size; CPU attention kernels need a multiple of 32


def attn_spec(**kw: Any) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.bfloat16, **kw
    )


def hybrid_config(kernel: int = 32, spec_blocks: int = 0) -> tuple[KVCacheConfig, list[int]]:
    """Two full-attention layers and two GDN layers overlaying the same pages (as vLLM's HMA)."""
    attn = attn_spec()
    page = attn.page_size_bytes
    gdn = MambaSpec(
        block_size=BLOCK,
        shapes=((3, 16), (2, 8, 8)),
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=page,
        mamba_cache_mode="align",
        num_speculative_blocks=spec_blocks,
    )
    size = page * NUM_BLOCKS * 2
    tensors = [
        KVCacheTensor(size, [name], page * NUM_BLOCKS, page, offset=(i % 2) * page * NUM_BLOCKS)
        for i, name in enumerate(["a0", "a1", "m0", "m1"])
    ]
    groups = [KVCacheGroupSpec(["a0", "a1"], attn), KVCacheGroupSpec(["m0", "m1"], gdn)]
    return KVCacheConfig(NUM_BLOCKS, tensors, groups), [kernel, BLOCK]


def single_group_config(spec: Any, layers: int = 2) -> tuple[KVCacheConfig, list[int]]:
    page = spec.page_size_bytes
    size = page * NUM_BLOCKS * layers
    tensors = [
        KVCacheTensor(size, [f"l{i}"], page * NUM_BLOCKS, page, offset=i * page * NUM_BLOCKS)
        for i in range(layers)
    ]
    groups = [KVCacheGroupSpec([f"l{i}" for i in range(layers)], spec)]
    return KVCacheConfig(NUM_BLOCKS, tensors, groups), [spec.block_size]


def mla_spec() -> MLAAttentionSpec:
    return MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)


def sliding_spec(window: int = 128) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.bfloat16, sliding_window=window
    )


def allocate(
    config: KVCacheConfig, kernels: list[int], layout: str = "LBHNC"
) -> dict[str, torch.Tensor]:
    """The per-layer views vLLM's model runner registers with a connector (vLLM's own
    allocation, in one of its physical layouts)."""
    return allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout[layout], kernels)


def make_request(
    request_id: str, prompt_len: int, params: dict[str, Any] | None, max_tokens: int = 16
) -> Request:
    extra = {"kv_transfer_params": params} if params is not None else None
    sp = SamplingParams(max_tokens=max_tokens, extra_args=extra)
    return Request(request_id, list(range(1, prompt_len + 1)), sp, None)


def new_request_data(request: Request, block_ids: tuple[list[int], ...]) -> NewRequestData:
    """vLLM's ``NewRequestData.from_request`` for a scheduled request (0.34 requires the
    tokens to prefill, ``request.prefill_token_ids``; 0.32 and 0.33 take them optionally)."""
    prefill = getattr(request, "prefill_token_ids", None)
    if prefill is None:
        return NewRequestData.from_request(request, block_ids)
    return NewRequestData.from_request(request, block_ids, prefill)


def blocks_of(ids_per_group: list[list[int]], hashed: int = 0) -> KVCacheBlocks:
    """vLLM allocation result; the first ``hashed`` blocks of each group count as cached."""
    groups = []
    for ids in ids_per_group:
        group = []
        for j, b in enumerate(ids):
            blk = KVCacheBlock(b)
            blk.is_null = b == 0
            if j < hashed and b != 0:
                blk.set_block_hash(b"h%d" % j)  # a cached block: hash set
            group.append(blk)
        groups.append(group)
    return KVCacheBlocks(tuple(groups))
