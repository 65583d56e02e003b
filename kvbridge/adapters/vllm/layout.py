"""vLLM's KV cache (``KVCacheConfig`` plus the registered tensors) as a core ``LayoutSpec``.

vLLM 0.32 allocates one int8 backing buffer for every cache group and hands the connector one
view per layer, shaped ``[B*ratio, H, N, C]`` (kernel blocks, head slots, tokens per kernel
block, content). Attention views are cast to the cache dtype, so ``C`` is ``head_size +
head_size_v`` elements; Mamba/GDN views stay int8 ``[B, 1, 1, page]`` with the layer's states
(conv, ssm, ...) one after the other in each page, each starting at a multiple of the spec's
``state_alignment`` (vLLM 0.34; 1 before). Groups overlay the same buffer: a block
id is owned by one group at a time. Everything below is read from the tensors' ``data_ptr()``,
``stride()`` and ``shape``, never assumed from a layout name.

vLLM 0.32 has six physical layouts (``KVCacheLayout``: LBHNC, LBNHC, LHBNC, BLHNC, BLNHC,
BHLNC). Whatever the layout, what moves is read from the strides: a layer's kernel block when
its ``H x N x C`` bytes are one dense run, else each head's ``N x C`` slice of it. Blocks move
whole, K and V together, so a transfer is byte-exact whatever the backend means by the bytes,
provided both sides agree on the order inside a block: that order (``[H,N,C]``, ``[N,H,C]`` or
per head ``[N,C]``) and how the backend reads ``C`` (``split``) form the layout's
``block_format``. LBHNC and BLHNC (or LBNHC and BLNHC) differ only in where a layer's block
sits, so they pair; ``[H,N,C]`` and per-head ``[N,C]`` formats (LBHNC/BLHNC and LHBNC/BHLNC)
hold each head's bytes as one run, so the unit planner moves them head by head
(``kvbridge.core.compat.heads_differ_only``); a head-major and a token-major side of equal TP
size move in the source's order and the destination permutes the received blocks
(``kvbridge.core.transpose``, ``kvbridge.adapters.vllm.transpose``).

How ``C`` divides into K and V is the attention backend's business. vLLM's CPU backend reads a
head's slice of a kernel block ``[N, C]`` as K for its N tokens, then V for them
(``split="head_kv"``), and keeps that K column-major, ``[D, N]`` (its ``vec`` kernels; other
ISAs tile it their own way), so a token's K is no run of bytes; CUDA FlashAttention reads each
``C`` cell as ``[K | V]`` of one token.
Different kernel block sizes on the two sides need a block split into tokens, which is only
right where tokens are outermost in what moves and the backend keeps a token's bytes together
(MLA, and ``[N,H,C]`` or per-head regions under a backend other than the CPU one); elsewhere the
compatibility check refuses different kernel sizes.

Under tensor parallelism each tensor also says which slice of the model's cache the rank holds
(``CacheTensor.shards``): KV heads as vLLM's ``QKVParallelLinear`` shards them (replicated
when fewer than ranks), MLA's latent on every rank, GDN's ``[q | k | v]`` conv channels and
ssm heads. Only head-major blocks (LBHNC, BLHNC; per head LHBNC, BHLNC) hold a head slice as a
run; ``[N, H, C]`` ones (LBNHC, BLNHC) say so with ``rows``, which ``kvbridge.core.tp``
refuses between different TP sizes with a message naming the head-major layouts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from kvbridge.adapters.vllm.shards import (
    attention_shards,
    gdn_conv_shards,
    gdn_ssm_shards,
    mla_shards,
)
from kvbridge.core.errors import LayoutError
from kvbridge.core.groups import CacheGroup, GroupKind
from kvbridge.core.layout import CacheTensor, KVLayout, LayoutSpec, Shard

#: Head slices of attention blocks hold K, then V, of their N tokens (vLLM's CPU backend; its
#: kernels keep K as ``[D, N]``): never split into tokens.
SPLIT_HEAD_KV = "head_kv"
#: The meaning of a head slice is unknown: move it whole, only between equal kernel sizes.
SPLIT_OPAQUE = "opaque"


def _spec_of(group_spec: Any, layer_name: str) -> Any:
    """The layer's own spec (``UniformTypeKVCacheSpecs`` keeps one per layer)."""
    per_layer = getattr(group_spec, "kv_cache_specs", None)
    if isinstance(per_layer, Mapping):
        return per_layer[layer_name]
    return group_spec


def group_kind(spec: Any) -> GroupKind:
    """The core group kind of a vLLM cache spec (subclasses are checked before their bases)."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    per_layer = getattr(spec, "kv_cache_specs", None)
    if isinstance(per_layer, Mapping):
        kinds = {group_kind(s) for s in per_layer.values()}
        if len(kinds) != 1:
            raise LayoutError(f"a cache group mixes layer kinds {sorted(k.value for k in kinds)}")
        return kinds.pop()
    if isinstance(spec, MLAAttentionSpec):
        return GroupKind.MLA
    if isinstance(spec, SlidingWindowSpec):
        return GroupKind.SLIDING_WINDOW
    if isinstance(spec, FullAttentionSpec):
        # With the hybrid allocator off, sliding-window layers come as FullAttentionSpec with
        # `sliding_window` set and blocks for every token: move them as full attention.
        return GroupKind.ATTENTION
    if isinstance(spec, MambaSpec):
        return GroupKind.STATE
    raise LayoutError(
        f"vLLM cache spec {type(spec).__name__} is not supported by kvbridge "
        "(supported: FullAttentionSpec, SlidingWindowSpec, MLAAttentionSpec, MambaSpec)"
    )


def state_tensor_names(count: int) -> list[str]:
    """Names of a Mamba/GDN layer's state tensors: ``conv``/``ssm`` for the usual pair."""
    return ["conv", "ssm"] if count == 2 else [f"state{i}" for i in range(count)]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _allocation(tensor: torch.Tensor) -> tuple[int, int]:
    """Address and size of the storage behind a view: the buffer every group shares."""
    storage = tensor.untyped_storage()
    return int(storage.data_ptr()), int(storage.nbytes())


def _byte_strides(tensor: torch.Tensor) -> list[int]:
    return [s * tensor.element_size() for s in tensor.stride()]


@dataclass(frozen=True)
class _View:
    """One attention or MLA layer view ``[B*ratio, H, N, C]`` as ``_paged_tensors`` reads it."""

    layer: str
    group: CacheGroup
    ratio: int
    split: str
    tp_rank: int
    tp_size: int
    total_kv_heads: int | None
    heads: int
    tokens: int
    cell: int  # one token's content in one head, in bytes
    strides: tuple[int, int, int, int]  # byte strides of block, head, token, content
    base: int
    alloc: tuple[int, int]

    @property
    def mla(self) -> bool:
        return self.group.kind is GroupKind.MLA

    @property
    def token_split(self) -> bool:
        """Whether a region may split into tokens: vLLM's CPU backend reads a head's [N, C] as
        K of its N tokens, then V, so not there (MLA's latent has no K and V)."""
        return self.split != SPLIT_HEAD_KV or self.mla

    @property
    def head_bytes(self) -> int:
        """One head's [N, C] of a logical block."""
        return self.tokens * self.cell * self.ratio


def _read_view(
    layer: str,
    view: torch.Tensor,
    group: CacheGroup,
    ratio: int,
    split: str,
    tp_rank: int,
    tp_size: int,
    total_kv_heads: int | None,
) -> _View:
    """The view's geometry, checked: 4-D, one head slot for MLA, a token's content dense."""
    if view.dim() != 4:
        raise LayoutError(f"layer {layer!r}: expected a 4-D [B, H, N, C] view, got {view.shape}")
    if group.kind is GroupKind.MLA and view.shape[1] != 1:
        raise LayoutError(f"MLA layer {layer!r} has {view.shape[1]} head slots, expected 1")
    _, heads, tokens, content = view.shape
    s_block, s_head, s_token, s_content = _byte_strides(view)
    esize = view.element_size()
    if s_content != esize and content > 1:
        raise LayoutError(
            f"layer {layer!r}: a token's content is not one dense run ({_where(view)})"
        )
    return _View(
        layer,
        group,
        ratio,
        split,
        tp_rank,
        tp_size,
        total_kv_heads,
        heads,
        tokens,
        content * esize,
        (s_block, s_head, s_token, s_content),
        int(view.data_ptr()),
        _allocation(view),
    )


def _where(view: torch.Tensor) -> str:
    return f"shape {tuple(view.shape)}, byte strides {tuple(_byte_strides(view))}"


def _block_order(v: _View) -> tuple[list[tuple[str, int, int]], list[bool]]:
    """The axes inside a kernel block other than C, outermost first, and whether each is dense
    (innermost first).

    Size-1 axes take no part, but for a rank's one KV head of several (TP): its blocks must
    read as a slice of the model's [H, N, C], [N, H, C] or per-head blocks, which its strides
    tell (tokens outer on a tie: [N, 1, C] has both strides one cell).
    """
    _, s_head, s_token, _ = v.strides
    one_of_many = (
        not v.mla and v.heads == 1 and v.total_kv_heads is not None and v.total_kv_heads > 1
    )
    axes = (("H", v.heads, s_head), ("N", v.tokens, s_token))
    inner = sorted(
        (axis for axis in axes if axis[1] > 1 or (one_of_many and axis[0] == "H")),
        key=lambda axis: (-axis[2], axis[0] != "N"),
    )
    dense, expected = [], v.cell
    for _, size, stride in reversed(inner):
        dense.append(stride == expected)
        expected *= size
    return inner, dense


def _whole_block_tensor(v: _View, inner: list[tuple[str, int, int]]) -> tuple[CacheTensor, str]:
    """A layer whose kernel block is one dense run: one region, moved whole."""
    s_block, _, s_token, _ = v.strides
    order = "".join(name for name, _, _ in inner) + "C"
    # A whole block lists tokens in order when no head axis of more than one head precedes.
    tokens_first = "".join(name for name, size, _ in inner if size > 1).startswith("N")
    block_bytes = v.heads * v.tokens * v.cell
    shards: list[Shard] | None = None
    if v.mla:
        shards = mla_shards(block_bytes * v.ratio, v.tp_rank, v.tp_size)
    elif v.total_kv_heads is not None:
        # Heads outermost ([H, N, C]): a head's [N, C] is one run of each block. Tokens
        # outermost ([N, H, C]): a head is one cell in each of the N rows (per kernel block).
        rows = v.tokens if "H" in order and order.startswith("N") else 1
        shards = attention_shards(
            v.total_kv_heads,
            v.tp_rank,
            v.tp_size,
            v.cell * v.ratio if rows > 1 else v.head_bytes,
            token_major=v.token_split and rows == 1,
        )
        if rows > 1:
            shards = [
                msgspec.structs.replace(s, rows=rows, row_stride=s_token * v.ratio) for s in shards
            ]
    tensor = CacheTensor(
        v.layer,
        v.group.index,
        v.base,
        s_block * v.ratio,
        block_bytes * v.ratio,
        kv_layout=KVLayout.WHOLE,
        alloc_addr=v.alloc[0],
        alloc_size=v.alloc[1],
        token_major=v.token_split and tokens_first,
        shards=msgspec.UNSET if shards is None else shards,
    )
    return tensor, f"[{','.join(order)}] {v.split}"


def _per_head_tensors(v: _View) -> list[CacheTensor]:
    """A layer where only each head's [N, C] is one dense run: one tensor per head, named by
    its global head, a count-1 shard each."""
    s_block, s_head, _, _ = v.strides
    per_head: list[tuple[str, list[Shard] | msgspec.UnsetType]] = [
        (f"h{h}", msgspec.UNSET) for h in range(v.heads)
    ]
    if v.total_kv_heads is not None:
        [rank_shard] = attention_shards(
            v.total_kv_heads, v.tp_rank, v.tp_size, v.head_bytes, token_major=v.token_split
        )
        per_head = [
            (
                f"h{rank_shard.start + h}",
                [msgspec.structs.replace(rank_shard, start=rank_shard.start + h, count=1)],
            )
            for h in range(v.heads)
        ]
    return [
        CacheTensor(
            v.layer,
            v.group.index,
            v.base + h * s_head,
            s_block * v.ratio,
            v.head_bytes,
            kv_layout=KVLayout.WHOLE,
            tensor=name,
            alloc_addr=v.alloc[0],
            alloc_size=v.alloc[1],
            token_major=v.token_split,
            shards=head_shards,
        )
        for h, (name, head_shards) in enumerate(per_head)
    ]


def _paged_tensors(
    layer: str,
    view: torch.Tensor,
    group: CacheGroup,
    ratio: int,
    split: str,
    tp_rank: int = 0,
    tp_size: int = 1,
    total_kv_heads: int | None = None,
) -> tuple[list[CacheTensor], str]:
    """Cache tensors of one attention or MLA layer view ``[B*ratio, H, N, C]``, and their format.

    Read from the view's strides, whatever vLLM's physical layout: when a kernel block's
    ``H x N x C`` bytes are one dense run (LBHNC, LBNHC, BLHNC, BLNHC) the layer is one region
    moved whole; when only each head's ``N x C`` bytes are (LHBNC, BHLNC), one region per head.
    The format names the order of the bytes inside what moves, so two sides agree on it or are
    refused. A region is token-major (splittable into tokens, which different kernel block
    sizes need) when its tokens are outermost and the backend keeps a token's bytes together.

    ``total_kv_heads`` (the model's KV heads, all ranks together) makes each tensor say which
    KV heads of TP rank ``tp_rank`` of ``tp_size`` it holds (``CacheTensor.shards``); MLA's
    latent is replicated on every rank. Per-head tensors are named by their global head
    (``h{global}``, which is ``h{local}`` at TP 1) so that names match across TP sizes. Where
    tokens are outermost (``[N, H, C]`` with several heads) a head is one cell in each token's
    row: such shards have ``rows``, which the TP planner refuses to slice.
    """
    v = _read_view(layer, view, group, ratio, split, tp_rank, tp_size, total_kv_heads)
    inner, dense = _block_order(v)
    if all(dense):
        tensor, fmt = _whole_block_tensor(v, inner)
        return [tensor], fmt
    _, _, s_token, _ = v.strides
    if s_token == v.cell or v.tokens == 1:
        return _per_head_tensors(v), f"per head [N,C] {v.split}"
    raise LayoutError(
        f"layer {layer!r}: neither a kernel block nor a head's slice of it is one dense run "
        f"({_where(view)}); kvbridge cannot move this layout"
    )


def _spans_beyond_stride(tensors: list[CacheTensor]) -> bool:
    """Whether one block of these tensors (a layer) covers more bytes than a block stride."""
    low = min(t.addr for t in tensors)
    high = max(t.addr + t.block_bytes for t in tensors)
    return high - low > max(t.block_stride for t in tensors)


def _extent(tensors: list[CacheTensor], num_blocks: int) -> tuple[int, int]:
    return (
        min(t.addr for t in tensors),
        max(t.addr + (num_blocks - 1) * t.block_stride + t.block_bytes for t in tensors),
    )


def _aliased_layer(by_group: dict[int, list[list[CacheTensor]]], num_blocks: int) -> str | None:
    """A layer whose blocks overlay other block ids of another group, if any.

    vLLM's groups overlay one buffer and a block id belongs to one group at a time, which keeps
    their bytes apart when each block of a layer stays inside its own block stride (or two
    overlapping layers place their blocks identically). A layer spread over head slices far
    apart (LHBNC) beside a group laid out otherwise (a GDN state page) breaks that: vLLM 0.32
    allows it, and a transfer of one request's blocks would then write another request's bytes.
    """
    # Per layer, once: its group, name, whether it spreads, its extent, where its blocks lie.
    layers = [
        (
            g,
            tensors[0].layer_name,
            _spans_beyond_stride(tensors),
            _extent(tensors, num_blocks),
            sorted((t.addr, t.block_stride, t.block_bytes) for t in tensors),
        )
        for g, per_layer in by_group.items()
        for tensors in per_layer
    ]
    for i, (g, a_name, a_wide, (a0, a1), a_blocks) in enumerate(layers):
        for h, b_name, b_wide, (b0, b1), b_blocks in layers[i + 1 :]:
            if g != h and (a_wide or b_wide) and a0 < b1 and b0 < a1 and a_blocks != b_blocks:
                return a_name if a_wide else b_name
    return None


def _local_kv_heads(total: int, tp_size: int) -> int | None:
    """KV heads per rank as vLLM's ``QKVParallelLinear`` gives them (``None``: vLLM refuses)."""
    if total >= tp_size:
        return total // tp_size if total % tp_size == 0 else None
    return 1 if tp_size % total == 0 else None


def _total_kv_heads(local: int, total: int | None, tp_size: int) -> int | None:
    """The model's KV heads behind a layer with ``local`` heads per rank, or ``None`` when
    they cannot be told: the count given when it yields ``local`` per rank; else one rank's
    count at TP 1, or ``local * tp_size`` when a rank holds several heads (vLLM replicates
    heads only when each rank holds one)."""
    if total is not None and total > 0 and _local_kv_heads(total, tp_size) == local:
        return total
    if tp_size == 1 or local > 1:
        return local * tp_size
    return None


def _state_shards(
    spec: Any, sizes: list[int], tp_rank: int, tp_size: int, conv_layout: str | None
) -> list[list[Shard]] | None:
    """Shards of each state of a Mamba layer, or ``None`` for kinds they cannot describe.

    A ``tp_replicated`` state is the same on every rank. GDN (``[q | k | v]`` conv channels,
    each sub-projection sharded evenly, and ``(v_heads, v_dim, k_dim)`` ssm heads) decomposes
    as vLLM's own connector does (``ssm_conv_transfer_utils.derive_mamba_conv_split``): the
    value dim from the ssm state's shape, the key dim from what remains of the conv dim.
    Mamba1/Mamba2 and other kinds carry none: Mamba2's ``[x | B | C]`` groups are extended
    when ``n_groups`` does not divide over the ranks, which its spec does not say.
    """
    if getattr(spec, "tp_replicated", False):
        return [[Shard("state", 0, 1, size, replicas=tp_size, replica=tp_rank)] for size in sizes]
    if getattr(getattr(spec, "mamba_type", None), "name", None) != "GDN_ATTN":
        return None
    shapes = [tuple(int(d) for d in shape) for shape in spec.shapes]
    if len(shapes) != 2 or len(shapes[0]) != 2 or len(shapes[1]) != 3:
        return None
    if conv_layout is None:
        from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

        conv_layout = get_conv_state_layout()
    conv, (v_heads, v_dim, k_dim) = shapes
    dim, state_len = conv if conv_layout == "DS" else conv[::-1]
    key2 = dim - v_heads * v_dim
    if key2 <= 0 or key2 % 2:
        return None
    conv_bytes = torch.empty((), dtype=spec.dtypes[0]).element_size()
    ssm_bytes = torch.empty((), dtype=spec.dtypes[1]).element_size()
    return [
        gdn_conv_shards(
            key2 // 2 * tp_size,
            v_heads * v_dim * tp_size,
            state_len,
            conv_bytes,
            tp_rank,
            tp_size,
            conv_layout,
        ),
        gdn_ssm_shards(v_heads * tp_size, tp_rank, tp_size, v_dim * k_dim * ssm_bytes),
    ]


def _state_tensors(
    layer: str,
    view: torch.Tensor,
    spec: Any,
    group: CacheGroup,
    tp_rank: int = 0,
    tp_size: int = 1,
    conv_layout: str | None = None,
) -> list[CacheTensor]:
    """One cache tensor per state (conv, ssm, ...) in each page of a Mamba/GDN layer, with its
    shards where the kind has them (``_state_shards``).

    Each state lies where vLLM's ``MambaBase.bind_kv_cache`` binds it: the states follow one
    another, each starting at the previous one's end rounded up to ``state_alignment`` (vLLM
    0.34; 0.32 and 0.33 have no such field and pack them at alignment 1). A tensor covers its
    state's own bytes, not the padding after it, so sides of different alignments pair state by
    state."""
    pages = view.reshape(view.shape[0], -1) if view.dim() != 2 else view
    if view.dim() == 4 and view.shape[1:3] != (1, 1):
        raise LayoutError(
            f"Mamba layer {layer!r}: expected a [B, 1, 1, page] view, got {view.shape}"
        )
    if view.element_size() != 1:
        raise LayoutError(f"Mamba layer {layer!r}: expected a raw int8 page view, got {view.dtype}")
    page_stride = _byte_strides(view)[0]
    sizes = [
        math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True)
    ]
    alignment = int(getattr(spec, "state_alignment", 1))
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + -(-size // alignment) * alignment)
    content = offsets.pop()  # vLLM's state_content_size_bytes: the last state padded too
    if content > pages.shape[1] * pages.element_size():
        raise LayoutError(
            f"Mamba layer {layer!r}: states of {content} bytes (each padded to {alignment}) "
            f"exceed its page of {pages.shape[1]} bytes"
        )
    alloc_addr, alloc_size = _allocation(view)
    shards: list[list[Shard] | msgspec.UnsetType] = [msgspec.UNSET] * len(sizes)
    shards = list(_state_shards(spec, sizes, tp_rank, tp_size, conv_layout) or shards)
    tensors = []
    for name, size, offset, state_shards in zip(
        state_tensor_names(len(sizes)), sizes, offsets, shards, strict=True
    ):
        tensors.append(
            CacheTensor(
                layer,
                group.index,
                int(view.data_ptr()) + offset,
                page_stride,
                size,
                tensor=name,
                alloc_addr=alloc_addr,
                alloc_size=alloc_size,
                shards=state_shards,
            )
        )
    return tensors


def _cache_group(
    index: int, spec: Any, kind: GroupKind, first: torch.Tensor, first_name: str, num_blocks: int
) -> tuple[CacheGroup, int]:
    """A vLLM cache group as a core ``CacheGroup``, and its kernel ratio (kernel blocks per
    block), read from the group's first registered view: its dim 0 counts kernel blocks."""
    ratio = 1
    if kind.paged:
        if first.shape[0] % num_blocks:
            raise LayoutError(
                f"layer {first_name!r}: {first.shape[0]} kernel blocks are not a multiple "
                f"of the {num_blocks} blocks of the pool"
            )
        ratio = first.shape[0] // num_blocks
    block_size = int(spec.block_size)
    group = CacheGroup(
        index=index,
        kind=kind,
        block_size=block_size,
        num_blocks=num_blocks,
        kernel_block_size=block_size // ratio if kind.paged else None,
        sliding_window=int(spec.sliding_window) if kind is GroupKind.SLIDING_WINDOW else None,
    )
    return group, ratio


def _refuse_aliased(
    by_group: dict[int, list[list[CacheTensor]]], num_blocks: int, engine_layout: str | None
) -> None:
    """Refuse a layout where one group's block ids overlay other block ids of another group."""
    scattered = _aliased_layer(by_group, num_blocks)
    if scattered is not None:
        raise LayoutError(
            f"the KV cache layout {engine_layout or '(unnamed)'} spreads each block of layer "
            f"{scattered!r} over head slices further apart than a block, where another cache "
            "group lays out the same bytes differently: a block id of one group then holds "
            "bytes of other block ids of the other group (they overlay the same buffer), so no "
            "transfer can be right; use LBHNC (kv_layout 'auto') or a block-outermost layout"
        )


def build_layout_spec(
    kv_cache_config: Any,
    kv_caches: Mapping[str, torch.Tensor],
    *,
    split: str = SPLIT_HEAD_KV,
    tp_rank: int = 0,
    tp_size: int = 1,
    engine_layout: str | None = None,
    total_num_kv_heads: int | Mapping[str, int] | None = None,
    conv_state_layout: str | None = None,
    pp_rank: int = 0,
    pp_size: int = 1,
) -> LayoutSpec:
    """The core layout of what a vLLM worker registered.

    ``pp_rank`` of ``pp_size``: the worker's pipeline stage; vLLM gives a stage's worker its
    own layers alone (globally indexed names), which is what ``kv_caches`` holds then.

    ``kv_cache_config`` is vLLM's ``KVCacheConfig``; ``kv_caches`` the dict the model runner
    passes to ``register_kv_caches`` (layer name → view). A group's index is its index in
    ``kv_cache_config.kv_cache_groups``, so block-id tuples index it directly; groups that take
    no part in transfers (``enable_kv_transfer=False``) and layers without a registered view are
    left out. ``split`` says how the backend reads a head's content (see the module doc);
    ``engine_layout`` is vLLM's name of the physical layout, kept for messages (the regions and
    the block format are read from the views themselves).

    Every tensor says which slice of the model's cache TP rank ``tp_rank`` of ``tp_size``
    holds (``CacheTensor.shards``, what ``kvbridge.core.tp`` moves between TP sizes), at TP 1
    too: attention's KV heads (``total_num_kv_heads``: vLLM's
    ``model_config.get_total_num_kv_heads()``, or a count per layer name; without it, or for a
    layer it does not fit, a rank's heads times ``tp_size`` where a rank holds several, else
    none), MLA's replicated latent, a ``tp_replicated`` Mamba state, GDN's conv channels and
    ssm heads (``conv_state_layout``: ``"SD"`` or ``"DS"``, vLLM's ``get_conv_state_layout()``
    by default). Tensors whose slice cannot be told (Mamba1/Mamba2 states, a single KV head
    per rank without ``total_num_kv_heads``) carry none, and so move only between equal TP
    sizes. Between equal TP sizes and ranks shards change nothing: the plans stay the same.
    """
    if split not in (SPLIT_HEAD_KV, SPLIT_OPAQUE):
        raise ValueError(f"split must be {SPLIT_HEAD_KV!r} or {SPLIT_OPAQUE!r}, got {split!r}")
    found = _Found()
    num_blocks = int(kv_cache_config.num_blocks)
    for index, spec, kind, layers in _moved_groups(kv_cache_config, kv_caches, pp_rank, pp_size):
        group, ratio = _cache_group(index, spec, kind, kv_caches[layers[0]], layers[0], num_blocks)
        found.groups.append(group)
        for layer in layers:
            view, layer_spec = kv_caches[layer], _spec_of(spec, layer)
            if kind is GroupKind.STATE:
                state = _state_tensors(
                    layer, view, layer_spec, group, tp_rank, tp_size, conv_state_layout
                )
                found.add(index, state)
                found.dtypes.extend(_dtype_name(d) for d in layer_spec.dtypes)
                continue
            if view.shape[0] != num_blocks * ratio:
                raise LayoutError(
                    f"layer {layer!r}: {view.shape[0]} kernel blocks, the group's first "
                    f"layer has {num_blocks * ratio}"
                )
            given = (
                total_num_kv_heads.get(layer)
                if isinstance(total_num_kv_heads, Mapping)
                else total_num_kv_heads
            )
            total = _total_kv_heads(int(view.shape[1]), given, tp_size)
            found.add_paged(
                index,
                _paged_tensors(layer, view, group, ratio, split, tp_rank, tp_size, total),
                kind,
                _dtype_name(layer_spec.dtype),
            )
    if not found.groups:
        raise LayoutError("vLLM registered no cache tensor that kvbridge can transfer")
    _refuse_aliased(found.by_group, num_blocks, engine_layout)
    # The layout's dtype names what the attention caches hold (a STATE-only model: its first
    # state dtype); mixed attention precisions would need per-tensor dtypes in the core.
    dtype = next(iter(found.paged_dtypes or found.dtypes), "bfloat16")
    return LayoutSpec(
        groups=found.groups,
        tensors=found.tensors,
        dtype=dtype,
        tp_rank=tp_rank,
        tp_size=tp_size,
        block_format="; ".join(sorted(found.formats)),
        engine_layout=engine_layout or "",
        pp_rank=pp_rank,
        pp_size=pp_size,
        vram_device=vram_device_of(kv_caches.values()),
    )


@dataclass
class _Found:
    """What ``build_layout_spec`` found so far, group by group."""

    groups: list[CacheGroup] = field(default_factory=list)
    tensors: list[CacheTensor] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)  # of state tensors
    paged_dtypes: list[str] = field(default_factory=list)
    formats: set[str] = field(default_factory=set)
    #: group index -> each layer's tensors
    by_group: dict[int, list[list[CacheTensor]]] = field(default_factory=dict)

    def add(self, index: int, layer_tensors: list[CacheTensor]) -> None:
        self.tensors.extend(layer_tensors)
        self.by_group.setdefault(index, []).append(layer_tensors)

    def add_paged(
        self, index: int, paged: tuple[list[CacheTensor], str], kind: GroupKind, dtype: str
    ) -> None:
        """A paged layer's tensors with its block format and dtype."""
        self.add(index, paged[0])
        self.formats.add(f"{kind.value} {paged[1]}")
        self.paged_dtypes.append(dtype)


def _moved_groups(
    kv_cache_config: Any, kv_caches: Mapping[str, torch.Tensor], pp_rank: int, pp_size: int
) -> Iterator[tuple[int, Any, GroupKind, list[str]]]:
    """(index, spec, kind, registered layer names) of each group that takes part in transfers."""
    for index, group_spec in enumerate(kv_cache_config.kv_cache_groups):
        if not getattr(group_spec, "enable_kv_transfer", True) or getattr(
            group_spec, "host_resident", False
        ):
            continue
        spec = group_spec.kv_cache_spec
        kind = group_kind(spec)
        layers = [name for name in group_spec.layer_names if name in kv_caches]
        if not layers and pp_size > 1:
            # Every stage shares the engine's block ids of every group: a stage without a
            # group's layers could not tell its peers which of them it ignores.
            raise LayoutError(
                f"pipeline stage {pp_rank} of {pp_size} holds no layer of KV cache group "
                f"{index} ({kind.value}); kvbridge moves a model split into pipeline stages "
                "only where every stage holds layers of every group: choose a "
                "pipeline_parallel_size (or VLLM_PP_LAYER_PARTITION) that gives each stage some"
            )
        if layers:
            yield index, spec, kind, layers


def vram_device_of(views: Iterable[torch.Tensor]) -> int:
    """The CUDA device holding every cache view (-1: host memory): the transport registers the
    caches as that GPU's memory. Raises ``LayoutError`` for views on several devices."""
    devices = {(v.device.type, v.device.index) for v in views}
    if len(devices) > 1:
        raise LayoutError(
            f"the KV cache views lie on several devices ({sorted(map(str, devices))}); a worker "
            "registers one device's caches"
        )
    kind, index = next(iter(devices), ("cpu", None))
    if kind != "cuda":
        return -1
    return int(index if index is not None else torch.cuda.current_device())
