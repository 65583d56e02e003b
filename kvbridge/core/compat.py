"""Compatibility of two layouts: can blocks move between them byte for byte?"""

from __future__ import annotations

from kvbridge.core.errors import LayoutMismatchError
from kvbridge.core.groups import GroupKind
from kvbridge.core.layout import Layout, Region, RegionKey
from kvbridge.core.memo import PairMemo
from kvbridge.core.transpose import (
    HEAD_MAJOR,
    PER_HEAD,
    is_token_major,
    received_pair,
    replace_in_parts,
)


def _bytes_per_block(region: Region, ratio: int) -> int:
    return region.length * ratio


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

    Kernel block sizes may differ (each side maps logical blocks with its own ratio); region
    order, addresses and strides may differ. What must agree is what a token's bytes mean.
    """
    planned = received_pair(a, b)
    if planned != (a, b):  # transposed on receive: what must agree is the pair as planned
        return layout_differences(*planned, names)
    na, nb = names
    diffs: list[str] = []

    def differ(what: str, va: object, vb: object) -> None:
        if va != vb:
            diffs.append(f"{what}: {na}={va!r} {nb}={vb!r}")

    differ("dtype", a.spec.dtype, b.spec.dtype)
    # Layouts that say which slice each tensor holds may differ in TP size, or in where a head
    # sits in a block: the unit planner (``kvbridge.core.tp``) moves slices; what must agree is
    # what a unit of each axis is.
    heads_only = heads_differ_only(a, b)
    heterogeneous = heads_only or (a.spec.tp_size != b.spec.tp_size and _sharded(a) and _sharded(b))
    if heterogeneous:
        diffs.extend(_shard_differences(a, b, names))
    else:
        differ("tp_size", a.spec.tp_size, b.spec.tp_size)
    if a.spec.block_format != b.spec.block_format and not heads_only:
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
        diffs.append(
            f"block format: {na}={a.spec.block_format!r}{_engine(a)} "
            f"{nb}={b.spec.block_format!r}{_engine(b)} ({why})"
        )
        return diffs  # every region would differ too: the format says it once
    differ("group indices", sorted(a.groups), sorted(b.groups))
    for index in sorted(set(a.groups) & set(b.groups)):
        ga, gb = a.groups[index], b.groups[index]
        differ(f"group {index} kind", ga.kind.value, gb.kind.value)
        differ(f"group {index} block_size", ga.block_size, gb.block_size)
        if GroupKind.SLIDING_WINDOW in (ga.kind, gb.kind):
            differ(f"group {index} sliding_window", ga.sliding_window, gb.sliding_window)
        ra = {r.key: r for r in a.group_regions[index].regions}
        rb = {r.key: r for r in b.group_regions[index].regions}
        only_a, only_b = sorted(set(ra) - set(rb)), sorted(set(rb) - set(ra))
        if (only_a or only_b) and not heterogeneous:  # per-head regions differ across TP
            diffs.append(
                f"group {index} regions: only on {na}: {_names(only_a)}, "
                f"only on {nb}: {_names(only_b)}"
            )
        for key in sorted(set(ra) & set(rb)) if not heterogeneous else ():
            differ(
                f"group {index} region {_fmt(key)} bytes per block",
                _bytes_per_block(ra[key], ga.ratio),
                _bytes_per_block(rb[key], gb.ratio),
            )
        if ga.kind.paged and ga.kernel_size != gb.kernel_size:
            # Different kernel blocks are split into token units: only right where every
            # region lists tokens in order.
            scattered = [
                key
                for key in sorted(set(ra) & set(rb))
                if not (ra[key].token_major and rb[key].token_major)
            ]
            if scattered:
                diffs.append(
                    f"group {index} kernel block size: {na}={ga.kernel_size} "
                    f"{nb}={gb.kernel_size}, and its blocks do not hold tokens in order "
                    f"({_names(scattered)}), so they only move between equal kernel block "
                    "sizes (use the same attention backend and block size on both sides)"
                )
    return diffs


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
        sa = {s.axis: (s.unit_bytes, s.rows) for s in ta.shards or ()}
        sb = {s.axis: (s.unit_bytes, s.rows) for s in other.shards or ()}
        if sa != sb:
            where = f"{ta.layer_name}{'/' + ta.tensor if ta.tensor else ''}"
            diffs.append(f"tensor {where} shards (axis: unit_bytes, rows): {na}={sa} {nb}={sb}")
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
