"""Compatibility of two layouts: can blocks move between them byte for byte?"""

from __future__ import annotations

from kvbridge.core.errors import LayoutMismatchError
from kvbridge.core.groups import CacheGroup, GroupKind
from kvbridge.core.layout import Layout, Region, RegionKey, Shard
from kvbridge.core.memo import PairMemo
from kvbridge.core.stages import stage_pair
from kvbridge.core.transpose import (
    HEAD_MAJOR,
    PER_HEAD,
    is_token_major,
    received_pair,
    replace_in_parts,
)


def _bytes_per_unit(region: Region, group: CacheGroup) -> int:
    """What a region holds per token (paged groups: block sizes may differ) or per state slot."""
    return region.length // group.kernel_size if group.kind.paged else region.length


#: A head-major block, ``[H,N,C]``, is its heads' ``[N,C]`` runs one after the other: a head of
#: it holds the bytes a per-head tensor holds (same backend split), only placed differently. A
#: token-major block, ``[N,H,C]``, holds the same cells, each token's heads together: it is
#: transposed on receive (``kvbridge.core.transpose``).


def unit_format(block_format: str) -> str:
    """The format of one KV head's bytes in a block: the same for ``[H,N,C]`` and per-head
    ``[N,C]`` layouts of one backend (vLLM's LBHNC/BLHNC and LHBNC/BHLNC)."""
    return "; ".join(sorted(replace_in_parts(block_format, HEAD_MAJOR, PER_HEAD)))


def heads_differ_only(a: Layout, b: Layout) -> bool:
    """The two block formats differ only in where each head's ``[N,C]`` sits, and both layouts
    say which heads each paged tensor holds (``shards``): the unit planner
    (``kvbridge.core.tp``) moves them head by head, each side's own strides, exactly."""
    fa, fb = a.spec.block_format, b.spec.block_format
    return fa != fb and unit_format(fa) == unit_format(fb) and _heads_told(a) and _heads_told(b)


def _heads_told(layout: Layout) -> bool:
    """Every tensor of a paged group says which units it holds."""
    paged = [t for t in layout.spec.tensors if layout.groups[t.group_index].kind.paged]
    return bool(paged) and all(t.shards for t in paged)


def layout_differences(a: Layout, b: Layout, names: tuple[str, str] = ("P", "D")) -> list[str]:
    """Every field that differs between two layouts in a way that forbids a transfer.

    Block sizes, logical and kernel, may differ (blocks split into token units then); region
    order, addresses and strides may differ. What must agree is what a token's bytes mean.
    Pipeline stages compare the layers both hold (``kvbridge.core.stages``).
    """
    staged = stage_pair(a, b)
    if staged is None:  # pipeline stages sharing no layer: nothing moves between them
        return []
    if staged[0] is not a or staged[1] is not b:  # pipeline stages: what both hold must agree
        return layout_differences(*staged, names)
    planned = received_pair(a, b)
    if planned != (a, b):  # transposed on receive: what must agree is the pair as planned
        return _transposed_block_sizes(a, b, names) + layout_differences(*planned, names)
    diffs = _differs("dtype", a.spec.dtype, b.spec.dtype, names)
    # Layouts that say which slice each tensor holds may differ in TP size, or in where a head
    # sits in a block: the unit planner (``kvbridge.core.tp``) moves slices; what must agree is
    # what a unit of each axis is.
    heads_only = heads_differ_only(a, b)
    # Kernel blocks of different sizes whose regions do not list tokens in order ([H, N, C])
    # still move where every unit of them does (a head's [N, C]): the unit planner splits them
    # head by head, then into tokens.
    heterogeneous = (
        heads_only
        or (a.spec.tp_size != b.spec.tp_size and _sharded(a) and _sharded(b))
        or (needs_unit_split(a, b) and _units_in_order(a) and _units_in_order(b))
    )
    if heterogeneous:
        diffs.extend(_shard_differences(a, b, names))
    else:
        diffs.extend(_differs("tp_size", a.spec.tp_size, b.spec.tp_size, names))
    if a.spec.block_format != b.spec.block_format and not heads_only:
        diffs.append(_format_difference(a, b, names))
        return diffs  # every region would differ too: the format says it once
    diffs.extend(_differs("group indices", sorted(a.groups), sorted(b.groups), names))
    for index in sorted(set(a.groups) & set(b.groups)):
        diffs.extend(_group_differences(a, b, index, names, heterogeneous))
    return diffs


def _differs(what: str, va: object, vb: object, names: tuple[str, str]) -> list[str]:
    """``[what: P=va D=vb]`` when the two differ, else nothing."""
    return [f"{what}: {names[0]}={va!r} {names[1]}={vb!r}"] if va != vb else []


def _transposed_block_sizes(a: Layout, b: Layout, names: tuple[str, str]) -> list[str]:
    """Paged groups of different block sizes between a pair transposed on receive."""
    return [
        f"group {i} block size: {names[0]}={a.groups[i].block_size}/"
        f"{a.groups[i].kernel_size} {names[1]}={b.groups[i].block_size}/"
        f"{b.groups[i].kernel_size} (logical/kernel), and the blocks are transposed on "
        "receive (one side keeps each token's heads together), which works block by block: "
        "use one block size on both sides, or head-major layouts on both"
        for i in sorted(set(a.groups) & set(b.groups))
        if (a.groups[i].block_size, a.groups[i].kernel_size)
        != (b.groups[i].block_size, b.groups[i].kernel_size)
        and a.groups[i].kind.paged
    ]


def _format_difference(a: Layout, b: Layout, names: tuple[str, str]) -> str:
    """Why two block formats cannot exchange blocks, one line."""
    fa, fb = unit_format(a.spec.block_format), unit_format(b.spec.block_format)
    if fa == fb:  # head order only, but a side does not say which heads its tensors hold
        why = (
            "the blocks hold the same heads in another order, and a side's attention "
            "tensors do not say which KV heads they hold (shards); pass the model's KV head "
            "count to the layout (vLLM: total_num_kv_heads) or use one layout on both"
        )
    elif is_token_major(a) != is_token_major(b):
        why = (
            "one side keeps each token's heads together, the other each head's tokens: "
            "kvbridge transposes such blocks on receive only between equal TP sizes, and "
            "only where a side's tensors say which KV heads they hold (shards), since a "
            "head slice of a token-major block is one run per token; use head-major layouts "
            "on both sides (vLLM's LBHNC, BLHNC, LHBNC, BHLNC) to move between different "
            "TP sizes"
        )
    else:
        why = (
            "a block's bytes mean different things on the two sides; configure the same KV "
            "cache layout and attention backend on both"
        )
    na, nb = names
    return (
        f"block format: {na}={a.spec.block_format!r}{_engine(a)} "
        f"{nb}={b.spec.block_format!r}{_engine(b)} ({why})"
    )


def _group_differences(
    a: Layout, b: Layout, index: int, names: tuple[str, str], heterogeneous: bool
) -> list[str]:
    """What differs in one cache group both layouts hold."""
    na, nb = names
    ga, gb = a.groups[index], b.groups[index]
    diffs = _differs(f"group {index} kind", ga.kind.value, gb.kind.value, names)
    if GroupKind.SLIDING_WINDOW in (ga.kind, gb.kind):
        # a window's clipped lists pair by block: only between equal block sizes
        diffs += _differs(f"group {index} block_size", ga.block_size, gb.block_size, names)
        diffs += _differs(
            f"group {index} sliding_window", ga.sliding_window, gb.sliding_window, names
        )
    if heterogeneous:  # per-head regions differ across TP: the shards were compared
        return diffs
    ra = {r.key: r for r in a.group_regions[index].regions}
    rb = {r.key: r for r in b.group_regions[index].regions}
    only_a, only_b = sorted(set(ra) - set(rb)), sorted(set(rb) - set(ra))
    if only_a or only_b:
        diffs.append(
            f"group {index} regions: only on {na}: {_names(only_a)}, only on {nb}: {_names(only_b)}"
        )
    both = sorted(set(ra) & set(rb))
    unit = "token" if ga.kind.paged else "state slot"
    for key in both:
        diffs += _differs(
            f"group {index} region {_fmt(key)} bytes per {unit}",
            _bytes_per_unit(ra[key], ga),
            _bytes_per_unit(rb[key], gb),
            names,
        )
    if ga.kind.paged and ga.kernel_size != gb.kernel_size:
        # Different kernel blocks are split into token units: only right where every region
        # lists tokens in order.
        scattered = [k for k in both if not (ra[k].token_major and rb[k].token_major)]
        if scattered:
            diffs.append(
                f"group {index} kernel block size: {na}={ga.kernel_size} "
                f"{nb}={gb.kernel_size}, and its blocks do not hold tokens in order "
                f"({_names(scattered)}), so they only move between equal kernel block "
                "sizes (use the same attention backend and block size on both sides)"
            )
    return diffs


def shard_unit_bytes(unit_bytes: int, group: CacheGroup) -> int:
    """A shard unit's size as two sides of different block sizes can compare it: per token in
    paged groups (``Shard.unit_bytes`` counts a logical block), per slot in state groups."""
    return unit_bytes // group.block_size if group.kind.paged else unit_bytes


def needs_unit_split(a: Layout, b: Layout) -> bool:
    """Whether a paged group's kernel block sizes differ while a tensor of it does not list
    its tokens in order: its blocks can then only be split unit by unit (``kvbridge.core.tp``),
    never into tokens whole."""
    split = {
        index
        for index, ga in a.groups.items()
        if index in b.groups and ga.kind.paged and ga.kernel_size != b.groups[index].kernel_size
    }
    tensors = (*a.spec.tensors, *b.spec.tensors)
    return bool(split) and any(t.group_index in split and not t.token_major for t in tensors)


def _units_in_order(layout: Layout) -> bool:
    """Every paged tensor says which units it holds, each listing its tokens in order."""
    paged = [t for t in layout.spec.tensors if layout.groups[t.group_index].kind.paged]
    return bool(paged) and all(t.shards and all(s.token_major for s in t.shards) for t in paged)


def _unit_shape(shard: Shard, group: CacheGroup) -> tuple[int, int]:
    return shard_unit_bytes(shard.unit_bytes, group), shard.rows


def _sharded(layout: Layout) -> bool:
    return bool(layout.spec.tensors) and all(t.shards for t in layout.spec.tensors)


def _shard_differences(a: Layout, b: Layout, names: tuple[str, str]) -> list[str]:
    """Per tensor: the same axes, and per axis the same unit size and rows, on both sides."""
    na, nb = names
    diffs: list[str] = []
    tb = {(t.layer_name, t.tensor): t for t in b.spec.tensors}
    for ta in a.spec.tensors:
        other = tb.get((ta.layer_name, ta.tensor))
        if other is None:
            continue  # the region comparison names it
        ga, gb = a.groups.get(ta.group_index), b.groups.get(other.group_index)
        if ga is None or gb is None:
            continue  # the group comparison names it
        sa = {s.axis: _unit_shape(s, ga) for s in ta.shards or ()}
        sb = {s.axis: _unit_shape(s, gb) for s in other.shards or ()}
        if sa != sb:
            where = f"{ta.layer_name}{'/' + ta.tensor if ta.tensor else ''}"
            per = "per token" if ga.kind.paged else "per slot"
            diffs.append(
                f"tensor {where} shards (axis: unit bytes {per}, rows): {na}={sa} {nb}={sb}"
            )
    return diffs


#: Region names listed in one message at most: a model has thousands.
_LISTED = 4


def _names(keys: list[RegionKey]) -> str:
    names = [_fmt(k) for k in keys]
    more = f" and {len(names) - _LISTED} more" if len(names) > _LISTED else ""
    return "[" + ", ".join(names[:_LISTED]) + more + "]"


def _engine(layout: Layout) -> str:
    return f" (engine layout {layout.spec.engine_layout})" if layout.spec.engine_layout else ""


def _fmt(key: tuple[str, str, object]) -> str:
    layer, tensor, part = key
    part_name = getattr(part, "value", part)
    return f"{layer}{'/' + tensor if tensor else ''}:{part_name}"


#: Pairs of layouts found compatible: a peer's layout is checked once, not per request (layouts
#: do not change after they are built; the entries go with the layouts).
_COMPATIBLE: PairMemo[Layout, Layout, bool] = PairMemo()


def check_compatible(a: Layout, b: Layout, names: tuple[str, str] = ("P", "D")) -> None:
    """Raise ``LayoutMismatchError`` naming every differing field, or return silently."""
    _COMPATIBLE(a, b, lambda: _compatible(a, b, names))


def _compatible(a: Layout, b: Layout, names: tuple[str, str]) -> bool:
    diffs = layout_differences(a, b, names)
    if diffs:
        raise LayoutMismatchError(diffs)
    return True
