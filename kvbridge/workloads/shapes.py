"""Cache shapes of real models, turned into layout specs for examples, the demo and benchmarks.

The numbers come from the models' public ``config.json`` files; the cache grouping follows what
vLLM's hybrid allocator does with them (one group per layer kind, GDN layers split into groups of
the attention group's size, each shared tensor backing one layer of every group).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from kvbridge.core.groups import CacheGroup, GroupKind
from kvbridge.core.layout import CacheTensor, KVLayout, LayoutSpec

Allocator = Callable[[int], int]


@dataclass(frozen=True)
class ModelShape:
    """What decides a model's KV-cache bytes."""

    name: str
    source: str  # the public config the numbers come from
    num_layers: int
    dtype_bytes: int = 2
    # attention
    num_kv_heads: int = 0
    head_dim: int = 0
    full_attention_interval: int = 1  # every n-th layer is full attention (hybrids)
    sliding_window: int | None = None  # alternate layers use this window
    # MLA
    mla_latent_dim: int = 0
    # GDN (gated delta net)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    kv_layout: KVLayout = KVLayout.BLOCKS_FIRST

    @property
    def attention_bytes_per_token(self) -> int:
        """Bytes of K (or of V) per token of one attention layer."""
        return self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def conv_state_bytes(self) -> int:
        conv_dim = 2 * self.linear_num_key_heads * self.linear_key_head_dim + (
            self.linear_num_value_heads * self.linear_value_head_dim
        )
        return (self.linear_conv_kernel_dim - 1) * conv_dim * self.dtype_bytes

    @property
    def ssm_state_bytes(self) -> int:
        return (
            self.linear_num_value_heads
            * self.linear_key_head_dim
            * self.linear_value_head_dim
            * self.dtype_bytes
        )

    @property
    def is_hybrid(self) -> bool:
        return self.linear_conv_kernel_dim > 0


QWEN35_HYBRID = ModelShape(
    name="qwen3.5-hybrid",
    source="Qwen/Qwen3-Next-80B-A3B-Instruct config.json",
    num_layers=48,
    num_kv_heads=2,
    head_dim=256,
    full_attention_interval=4,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
)
DEEPSEEK_MLA = ModelShape(
    name="deepseek-mla",
    source="deepseek-ai/DeepSeek-V3 config.json (kv_lora_rank 512 + qk_rope_head_dim 64)",
    num_layers=61,
    mla_latent_dim=576,
)
GPT_OSS_SLIDING = ModelShape(
    name="gpt-oss-sliding",
    source="openai/gpt-oss-20b config.json (sliding_window 128 on alternate layers)",
    num_layers=24,
    num_kv_heads=8,
    head_dim=64,
    sliding_window=128,
)
LLAMA3_DENSE = ModelShape(
    name="llama3-70b-dense",
    source="meta-llama/Meta-Llama-3-70B config.json",
    num_layers=80,
    num_kv_heads=8,
    head_dim=128,
    kv_layout=KVLayout.K_FIRST,
)
SHAPES = {s.name: s for s in (QWEN35_HYBRID, DEEPSEEK_MLA, GPT_OSS_SLIDING, LLAMA3_DENSE)}


def bump_allocator(base: int = 0x7F00_0000_0000, align: int = 1 << 21) -> Allocator:
    """Hand out fake, non-overlapping, aligned addresses (for examples that move nothing)."""
    state = {"next": base}

    def allocate(size: int) -> int:
        addr = state["next"]
        state["next"] = addr + math.ceil(size / align) * align
        return addr

    return allocate


def hybrid_block_size(shape: ModelShape, kernel_block_size: int) -> int:
    """vLLM's rule: the attention block grows until its page holds one GDN state slot."""
    state = shape.conv_state_bytes + shape.ssm_state_bytes
    tokens = math.ceil(state / (2 * shape.attention_bytes_per_token))
    return math.ceil(tokens / kernel_block_size) * kernel_block_size


def layout_spec(
    shape: ModelShape,
    num_blocks: int,
    allocate: Allocator,
    *,
    block_size: int | None = None,
    kernel_block_size: int | None = None,
    num_layers: int | None = None,
) -> LayoutSpec:
    """A layout spec for ``shape`` whose tensors live at addresses ``allocate`` returns.

    ``num_layers`` keeps only the first layers (to fit a small machine).
    """
    layers = num_layers or shape.num_layers
    if shape.is_hybrid:
        return _hybrid_spec(shape, num_blocks, allocate, layers, block_size, kernel_block_size)
    block = block_size or 16
    if shape.mla_latent_dim:
        group = CacheGroup(0, GroupKind.MLA, block, num_blocks, kernel_block_size)
        per_block = block * shape.mla_latent_dim * shape.dtype_bytes
        tensors = []
        for i in range(layers):
            addr = allocate(num_blocks * per_block)
            tensors.append(
                CacheTensor(f"model.layers.{i}.self_attn", 0, addr, per_block, per_block)
            )
        return LayoutSpec([group], tensors)
    part = block * shape.attention_bytes_per_token
    groups = [CacheGroup(0, GroupKind.ATTENTION, block, num_blocks, kernel_block_size)]
    if shape.sliding_window:
        groups.append(
            CacheGroup(
                1,
                GroupKind.SLIDING_WINDOW,
                block,
                num_blocks,
                kernel_block_size,
                sliding_window=shape.sliding_window,
            )
        )
    tensors = []
    shared: dict[int, int] = {}
    for i in range(layers):
        index = i % len(groups)
        slot = i // len(groups)  # layer `slot` of every group shares one tensor, as in vLLM
        if slot not in shared:
            shared[slot] = allocate(num_blocks * 2 * part)
        addr = shared[slot]
        name = f"model.layers.{i}.self_attn"
        if shape.kv_layout is KVLayout.K_FIRST:
            tensors.append(
                CacheTensor(
                    name, index, addr, part, part, KVLayout.K_FIRST, v_addr=addr + num_blocks * part
                )
            )
        else:
            tensors.append(CacheTensor(name, index, addr, 2 * part, part))
    return LayoutSpec(groups, tensors)


def _hybrid_spec(
    shape: ModelShape,
    num_blocks: int,
    allocate: Allocator,
    layers: int,
    block_size: int | None,
    kernel_block_size: int | None,
) -> LayoutSpec:
    kernel = kernel_block_size or 16
    block = block_size or hybrid_block_size(shape, kernel)
    part = block * shape.attention_bytes_per_token
    page = max(2 * part, shape.conv_state_bytes + shape.ssm_state_bytes)
    interval = shape.full_attention_interval
    attention = [i for i in range(layers) if (i + 1) % interval == 0]
    linear = [i for i in range(layers) if (i + 1) % interval != 0]
    per_group = max(1, len(attention))
    num_state_groups = math.ceil(len(linear) / per_group)
    groups = [CacheGroup(0, GroupKind.ATTENTION, block, num_blocks, kernel)]
    groups += [
        CacheGroup(1 + g, GroupKind.STATE, block, num_blocks) for g in range(num_state_groups)
    ]
    pool = [allocate(num_blocks * page) for _ in range(per_group)]
    tensors = []
    for slot, i in enumerate(attention):
        tensors.append(
            CacheTensor(
                f"model.layers.{i}.self_attn",
                0,
                pool[slot],
                page,
                part,
                alloc_addr=pool[slot],
                alloc_size=num_blocks * page,
            )
        )
    for n, i in enumerate(linear):
        group, slot = 1 + n // per_group, n % per_group
        name = f"model.layers.{i}.linear_attn"
        base = pool[slot]
        tensors.append(
            CacheTensor(
                name,
                group,
                base,
                page,
                shape.conv_state_bytes,
                tensor="conv",
                alloc_addr=base,
                alloc_size=num_blocks * page,
            )
        )
        tensors.append(
            CacheTensor(
                name,
                group,
                base + shape.conv_state_bytes,
                page,
                shape.ssm_state_bytes,
                tensor="ssm",
                alloc_addr=base,
                alloc_size=num_blocks * page,
            )
        )
    return LayoutSpec(groups, tensors)
