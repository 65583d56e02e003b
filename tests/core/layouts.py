"""Layouts built for tests: small, with addresses that are offsets into a numpy "memory"."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvbridge.core.groups import CacheGroup, GroupKind
from kvbridge.core.layout import CacheTensor, KVLayout, Layout, LayoutSpec

# Addresses start above zero so a stray zero address never looks valid.
BASE = 4096


@dataclass
class Arena:
    """A bump allocator over one numpy byte buffer; addresses are ``BASE + offset``."""

    size: int = 1 << 22
    next: int = BASE
    memory: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint8))

    def allocate(self, nbytes: int, pad: int = 64) -> int:
        addr = self.next
        self.next += nbytes + pad
        return addr

    def materialise(self, rng: np.random.Generator) -> np.ndarray:
        self.memory = rng.integers(0, 256, size=self.next + 64, dtype=np.uint8)
        return self.memory


def attention_tensor(
    arena: Arena,
    name: str,
    group: CacheGroup,
    bytes_per_token: int,
    layout: KVLayout = KVLayout.BLOCKS_FIRST,
) -> CacheTensor:
    """An attention tensor with tightly packed blocks in the given K/V layout."""
    part = group.block_size * bytes_per_token
    if layout is KVLayout.K_FIRST:
        addr = arena.allocate(2 * group.num_blocks * part)
        return CacheTensor(
            name,
            group.index,
            addr,
            part,
            part,
            KVLayout.K_FIRST,
            v_addr=addr + group.num_blocks * part,
        )
    addr = arena.allocate(group.num_blocks * 2 * part)
    if layout is KVLayout.WHOLE:  # each token's K|V together, the block moved whole
        return CacheTensor(name, group.index, addr, 2 * part, 2 * part, KVLayout.WHOLE)
    return CacheTensor(name, group.index, addr, 2 * part, part)


def interleaved_tensors(
    arena: Arena, names: list[str], group: CacheGroup, bytes_per_token: int, layout: KVLayout
) -> list[CacheTensor]:
    """Attention or MLA tensors whose blocks hold every layer's page one after another (a
    block-outermost layout such as vLLM's BLHNC): layer ``l`` of block ``b`` at
    ``base + b * L * page + l * page``. K-first tensors come blocks-first here."""
    attention = group.kind in (GroupKind.ATTENTION, GroupKind.SLIDING_WINDOW)
    part = group.block_size * bytes_per_token
    page = 2 * part if attention else part
    stride = len(names) * page
    base = arena.allocate(group.num_blocks * stride)
    size = group.num_blocks * stride
    tensors = []
    for layer, name in enumerate(names):
        addr = base + layer * page
        if not attention or layout is KVLayout.WHOLE:
            kv = KVLayout.WHOLE if attention else KVLayout.BLOCKS_FIRST
            tensors.append(
                CacheTensor(
                    name, group.index, addr, stride, page, kv, alloc_addr=base, alloc_size=size
                )
            )
        else:
            tensors.append(
                CacheTensor(name, group.index, addr, stride, part, alloc_addr=base, alloc_size=size)
            )
    return tensors


def mla_tensor(arena: Arena, name: str, group: CacheGroup, bytes_per_token: int) -> CacheTensor:
    per_block = group.block_size * bytes_per_token
    return CacheTensor(
        name, group.index, arena.allocate(group.num_blocks * per_block), per_block, per_block
    )


def state_tensors(
    arena: Arena, name: str, group: CacheGroup, conv: int, ssm: int, pad: int = 0
) -> list[CacheTensor]:
    """A GDN layer: conv and ssm state sharing one page per slot."""
    page = conv + ssm + pad
    base = arena.allocate(group.num_blocks * page)
    size = group.num_blocks * page
    return [
        CacheTensor(
            name, group.index, base, page, conv, tensor="conv", alloc_addr=base, alloc_size=size
        ),
        CacheTensor(
            name,
            group.index,
            base + conv,
            page,
            ssm,
            tensor="ssm",
            alloc_addr=base,
            alloc_size=size,
        ),
    ]


def hybrid_layout(
    arena: Arena,
    num_blocks: int = 16,
    block_size: int = 16,
    kernel_block_size: int | None = None,
    attention_layers: int = 2,
    gdn_layers: int = 3,
    kv_layout: KVLayout = KVLayout.BLOCKS_FIRST,
    reverse_tensors: bool = False,
) -> Layout:
    """Full attention (group 0) + GDN (group 1) with small sizes."""
    groups = [
        CacheGroup(0, GroupKind.ATTENTION, block_size, num_blocks, kernel_block_size),
        CacheGroup(1, GroupKind.STATE, block_size, num_blocks),
    ]
    tensors = [
        attention_tensor(arena, f"layers.{i}.attn", groups[0], 8, kv_layout)
        for i in range(attention_layers)
    ]
    for i in range(gdn_layers):
        tensors += state_tensors(arena, f"layers.{i}.gdn", groups[1], 48, 200)
    if reverse_tensors:
        tensors.reverse()
    return Layout(LayoutSpec(groups, tensors))


def apply_plan(memory_src: np.ndarray, memory_dst: np.ndarray, src, dst, lengths) -> None:
    """Copy each descriptor's bytes (addresses are BASE-relative offsets into the arrays)."""
    for s, d, n in zip(src.tolist(), dst.tolist(), lengths.tolist(), strict=True):
        memory_dst[d : d + n] = memory_src[s : s + n]
