"""Layouts of every TP rank of the test models (``tp_reference.TPModel``), with shards as vLLM
shards their caches; over the tests' address arena or over real memory (engine processes)."""

from __future__ import annotations

from typing import Any

from kvbridge.adapters.vllm.shards import (
    attention_shards,
    gdn_conv_shards,
    gdn_ssm_shards,
    mla_shards,
)
from kvbridge.core import CacheGroup, CacheTensor, GroupKind, KVLayout, Layout, LayoutSpec

from .layouts import Arena
from .tp_reference import CHANNEL, TPModel, conv_bytes, local_heads

NUM_BLOCKS = 6


def tp_groups(m: TPModel, kernel: int, blocks: int = NUM_BLOCKS) -> list[CacheGroup]:
    if m.kind == "mla":
        return [CacheGroup(0, GroupKind.MLA, m.block, blocks, kernel)]
    groups = [CacheGroup(0, GroupKind.ATTENTION, m.block, blocks, kernel)]
    if m.kind == "swa":
        groups.append(CacheGroup(1, GroupKind.SLIDING_WINDOW, m.block, blocks, kernel, m.window))
    if m.kind == "gdn":
        groups.append(CacheGroup(1, GroupKind.STATE, m.block, blocks))
    return groups


def _attention(m: TPModel, arena: Arena, name: str, g: CacheGroup, rank: int, tp: int, blocks: int):
    ratio = m.block // g.kernel_size
    part = local_heads(m, tp) * (g.kernel_size * m.head_bytes + m.head_pad)  # K of a kernel block
    head = m.block * m.head_bytes
    head_stride = m.block * m.head_bytes + ratio * m.head_pad if m.head_pad else 0
    shards = attention_shards(
        m.kv_heads, rank, tp, head, token_major=m.units_token_major, head_stride=head_stride
    )
    if m.kv_layout is KVLayout.K_FIRST:
        stride = (part + m.pad) * ratio
        addr = arena.allocate(2 * blocks * stride)
        return CacheTensor(
            name,
            g.index,
            addr,
            stride,
            part * ratio,
            KVLayout.K_FIRST,
            v_addr=addr + blocks * stride,
            token_major=False,
            shards=shards,
        )
    stride = (2 * part + m.pad) * ratio
    addr = arena.allocate(blocks * stride)
    if m.kv_layout is KVLayout.WHOLE:  # [K heads | V heads] moved as one part: an axis each
        k_heads, v_heads = (
            attention_shards(
                m.kv_heads,
                rank,
                tp,
                head,
                axis=axis,
                offset=at,
                token_major=m.units_token_major,
                head_stride=head_stride,
            )
            for axis, at in (("k_heads", 0), ("v_heads", part * ratio))
        )
        return CacheTensor(
            name,
            g.index,
            addr,
            stride,
            2 * part * ratio,
            KVLayout.WHOLE,
            token_major=False,
            shards=k_heads + v_heads,
        )
    return CacheTensor(name, g.index, addr, stride, part * ratio, token_major=False, shards=shards)


def build_rank(
    m: TPModel, rank: int, tp: int, kernel: int, arena: Any, blocks: int = NUM_BLOCKS
) -> Layout:
    """Rank ``rank`` of ``tp``: the layout ``tp_reference.TPModel`` describes, over ``arena``
    (anything with ``allocate(nbytes) -> address``: this module's, or real memory)."""
    groups = tp_groups(m, kernel, blocks)
    tensors: list[CacheTensor] = []
    for layer in range(m.layers):
        for g in groups:
            name = f"l{layer}.g{g.index}"
            if g.kind is GroupKind.MLA:
                ratio = m.block // g.kernel_size
                stride = (g.kernel_size * m.latent_bytes + m.pad) * ratio
                addr = arena.allocate(blocks * stride)
                per_block = m.block * m.latent_bytes
                tensors.append(
                    CacheTensor(
                        name,
                        g.index,
                        addr,
                        stride,
                        per_block,
                        shards=mla_shards(per_block, rank, tp),
                    )
                )
            elif g.kind is GroupKind.STATE:
                conv = conv_bytes(m, tp)
                ssm = m.v_heads // tp * m.ssm_head_bytes
                page = conv + ssm + m.pad
                base = arena.allocate(blocks * page)
                size = blocks * page
                conv_shards = gdn_conv_shards(
                    m.key_dim, m.value_dim, m.state_len, CHANNEL, rank, tp, m.conv_layout
                )
                ssm_shards = gdn_ssm_shards(m.v_heads, rank, tp, m.ssm_head_bytes)
                tensors += [
                    CacheTensor(
                        name,
                        g.index,
                        base,
                        page,
                        conv,
                        tensor="conv",
                        alloc_addr=base,
                        alloc_size=size,
                        shards=conv_shards,
                    ),
                    CacheTensor(
                        name,
                        g.index,
                        base + conv,
                        page,
                        ssm,
                        tensor="ssm",
                        alloc_addr=base,
                        alloc_size=size,
                        shards=ssm_shards,
                    ),
                ]
            else:
                tensors.append(_attention(m, arena, name, g, rank, tp, blocks))
    return Layout(LayoutSpec(groups, tensors, tp_rank=rank, tp_size=tp))


def build_side(m: TPModel, tp: int, kernel: int) -> tuple[list[Layout], list[Arena]]:
    arenas = [Arena() for _ in range(tp)]
    return [build_rank(m, r, tp, kernel, arenas[r]) for r in range(tp)], arenas
