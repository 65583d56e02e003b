"""Blocks transposed on receive: one side keeps each token's heads together, the other each head's
tokens (vLLM's LBNHC/BLNHC against LBHNC/BLHNC/LHBNC/BHLNC).

Moving every ``(token, head)`` cell to its place would take ``N x H`` descriptors of ``C`` bytes
per block and layer (128 of 256 bytes for 16 tokens, 8 heads, head size 128 in bf16); engines pay
per descriptor (a Mooncake TCP task each, a UCX request each). Instead the bytes move in the
source's order, whole blocks (or a head's run) at a time, exactly where the destination's block
lies, and the destination permutes each received block in its own memory after the transfer
ended: a copy at memory bandwidth, on the device (vLLM's NIXL connector does the same,
``kv_postprocess_layout_on_receive``).

For planning, the token-major side is described as head-major: its ``[N,H,C]`` block is cut into
``H`` pieces of ``N x C`` bytes, piece ``j`` in place of head ``j`` (the same shards, one run
each), so that the planners (``kvbridge.core.planning``, ``kvbridge.core.tp``) place piece ``j``
of the source where head ``j`` of the destination lies, at each side's own strides and at the
minimum descriptor count of that placement. Concatenating the destination's heads of a block then
gives the source's block byte for byte, which ``received_transposes`` tells the destination to
permute. Only pairs of equal TP size and kernel block size are transposed (a head slice of a
token-major block is one run per token, which the TP planner refuses to move).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import msgspec

from kvbridge.core.block_mapping import (
    GroupBlockIds,
    IdArray,
    group_ids,
    logical_to_kernel,
    pair_block_ids,
)
from kvbridge.core.groups import GroupKind
from kvbridge.core.layout import CacheTensor, Layout

#: How a block format names a head-major block (``[H,N,C]``), a per-head run (``per head [N,C]``)
#: and a token-major block (``[N,H,C]``) of one format part (``"ATTENTION [N,H,C] head_kv"``).
HEAD_MAJOR, PER_HEAD, TOKEN_MAJOR = " [H,N,C] ", " per head [N,C] ", " [N,H,C] "


def replace_in_parts(block_format: str, old: str, new: str) -> list[str]:
    """Each part of a block format (``"; "``-separated) with ``old`` replaced by ``new``."""
    return [f"{part} ".replace(old, new).strip() for part in block_format.split("; ")]


def is_token_major(layout: Layout) -> bool:
    """Whether the layout's attention blocks keep each token's heads together (``[N,H,C]``)."""
    return any(TOKEN_MAJOR in f"{part} " for part in layout.spec.block_format.split("; "))


def _as_pieces(tensor: CacheTensor, paged: bool) -> CacheTensor | None:
    """A token-major tensor described as head-major: its shard of ``count`` heads, one cell in
    each of ``rows`` token rows, as ``count`` pieces of ``rows`` cells (``None``: not dense)."""
    if not paged or not tensor.shards or all(s.rows == 1 for s in tensor.shards):
        return tensor
    shards = []
    for s in tensor.shards:
        if s.offset or s.stride != s.unit_bytes or s.row_stride != s.count * s.unit_bytes:
            return None
        shards.append(
            msgspec.structs.replace(
                s, unit_bytes=s.rows * s.unit_bytes, rows=1, row_stride=0, token_major=False
            )
        )
    return msgspec.structs.replace(tensor, shards=shards, token_major=False)


#: Token-major layouts described as head-major (``None``: they cannot be), built once each.
_AS_HEAD_MAJOR: weakref.WeakKeyDictionary[Layout, Layout | None] = weakref.WeakKeyDictionary()


def as_head_major(layout: Layout) -> Layout | None:
    """The token-major ``layout`` with each block cut into per-head pieces (module docstring),
    or ``None`` when a tensor's heads are not dense rows of each block."""
    if layout in _AS_HEAD_MAJOR:
        return _AS_HEAD_MAJOR[layout]
    spec = layout.spec
    tensors: list[CacheTensor] = []
    for tensor in spec.tensors:
        piece = _as_pieces(tensor, layout.groups[tensor.group_index].kind.paged)
        if piece is None:
            _AS_HEAD_MAJOR[layout] = None
            return None
        tensors.append(piece)
    fmt = "; ".join(replace_in_parts(spec.block_format, TOKEN_MAJOR, HEAD_MAJOR))
    found = Layout(msgspec.structs.replace(spec, tensors=tensors, block_format=fmt))
    _AS_HEAD_MAJOR[layout] = found
    return found


def received_pair(src: Layout, dst: Layout) -> tuple[Layout, Layout]:
    """The pair as planned: where exactly one side is token-major and both have equal TP
    sizes, that side described as head-major; otherwise the layouts themselves."""
    s_token, d_token = is_token_major(src), is_token_major(dst)
    if s_token == d_token or src.spec.tp_size != dst.spec.tp_size:
        return src, dst
    s_planned = as_head_major(src) if s_token else src
    d_planned = as_head_major(dst) if d_token else dst
    if s_planned is None or d_planned is None:
        return src, dst
    return s_planned, d_planned


@dataclass(frozen=True)
class Transpose:
    """Kernel blocks of one destination group whose bytes landed in the source's order.

    ``to_head_major``: each block's bytes, read over the destination's heads in order (each head's
    ``[N, C]`` run, one after the other), are the source's ``[N, H, C]`` block; they become the
    destination's heads. Otherwise the destination is token-major and its block's bytes are the
    source's ``[H, N, C]``; they become ``[N, H, C]``. A block of one head or one token is the
    same in both orders.
    """

    group_index: int
    kernel_block_ids: IdArray
    to_head_major: bool


def received_transposes(
    src: Layout,
    dst: Layout,
    src_block_ids: GroupBlockIds,
    dst_block_ids: GroupBlockIds,
) -> list[Transpose]:
    """What the destination permutes once the bytes of these block ids moved from ``src`` to
    ``dst`` (empty when the two keep a block's cells in the same order)."""
    if received_pair(src, dst) == (src, dst):  # the same order on both sides, or refused
        return []
    out: list[Transpose] = []
    for index in sorted(dst_block_ids):
        group = dst.groups.get(index)
        if group is None or index not in src.groups or not group.kind.paged:
            continue
        if group.kind is GroupKind.MLA:
            continue  # one latent head: the same bytes in every layout
        _, d_ids = pair_block_ids(
            src.groups[index],
            group,
            group_ids(src_block_ids, index),
            group_ids(dst_block_ids, index),
        )
        if d_ids.size:
            kernels = logical_to_kernel(d_ids, group.ratio)
            out.append(Transpose(index, kernels, to_head_major=is_token_major(src)))
    return out


__all__ = [
    "HEAD_MAJOR",
    "PER_HEAD",
    "TOKEN_MAJOR",
    "Transpose",
    "as_head_major",
    "is_token_major",
    "received_pair",
    "received_transposes",
    "replace_in_parts",
]
