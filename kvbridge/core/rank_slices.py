"""What one rank holds of another's cache: TP slices as regions of both layouts.

A layout whose tensors carry ``shards`` (``kvbridge.core.layout.Shard``) says which units of
the model's cache each tensor holds: KV heads, MLA's replicated latent, a GDN conv state's
channels per sub-projection, ssm heads. For one source (P) rank and one destination (D) rank
``restrict_pair`` finds the units D needs that P holds and is chosen to send, and restricts both
layouts to them: one derived tensor per contiguous run of units (per row), with the same key on
both sides. The ordinary planner (``kvbridge.core.planning``) then plans the restricted pair
unchanged: block mapping, kernel ratios, merging into maximal runs and the overlap checks.
``check_coverage`` says whether a set of source ranks gives every unit of a destination once.

Selection: a unit held by several source ranks (``Shard.replicas`` > 1) is read from the source
replica ``d.replica * p.replicas // d.replicas``, where ``d.replica`` is the destination's
replica index of that unit of ``d.replicas``. The rule is local to a pair, so a P rank pushing to
a D rank can decide it alone.

Pairs of layouts with equal TP size, equal rank and identical shards (or none) that the planner
accepts are not restricted: they plan exactly as it plans them. (Others go through restriction:
different kernel block sizes with ``Shard.token_major`` units, say.) This module plans nothing:
the planner uses it, and ``kvbridge.core.tp`` plans with both.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import msgspec
import numpy as np

from kvbridge.core.compat import (
    layout_differences,
    needs_unit_split,
    shard_unit_bytes,
    unit_format,
)
from kvbridge.core.errors import LayoutError, LayoutMismatchError
from kvbridge.core.groups import CacheGroup
from kvbridge.core.layout import CacheTensor, KVLayout, Layout, LayoutSpec, Shard, expand_tensor
from kvbridge.core.memo import PairMemo
from kvbridge.core.stages import stage_pair
from kvbridge.core.transpose import is_token_major, received_pair

#: ``(layer_name, tensor, axis)``: one axis of one tensor; axis ``""`` for a tensor without shards.
UnitKey = tuple[str, str, str]


@dataclass(frozen=True)
class TPPair:
    """One source rank and one destination rank restricted to what moves between them.

    ``src`` and ``dst`` are the restricted layouts the ordinary planner plans, or ``None`` when
    nothing needs restricting (equal TP, same rank, same shards: the originals plan as today;
    not kept here, so that the cache below holds no layout alive); ``groups`` the group indices
    that have anything to move; ``units`` the global units of each destination axis this pair
    moves, as ``[start, end)`` intervals.
    """

    src: Layout | None
    dst: Layout | None
    groups: frozenset[int]
    units: dict[UnitKey, list[tuple[int, int]]]


def _where(t: CacheTensor) -> str:
    return f"tensor {t.layer_name!r}{'/' + t.tensor if t.tensor else ''}"


def shard_problems(tensor: CacheTensor) -> list[str]:
    """What is wrong with a tensor's shards on their own (empty when consistent)."""
    problems: list[str] = []
    where = _where(tensor)
    axes = [s.axis for s in tensor.shards or ()]
    if len(set(axes)) != len(axes):
        problems.append(f"{where}: an axis appears in several shards: {axes}")
    for s in tensor.shards or ():
        what = f"{where} shard {s.axis!r}"
        if s.count < 1 or s.start < 0 or s.unit_bytes < 1 or s.offset < 0:
            problems.append(f"{what}: start, offset must be >= 0, count and unit_bytes > 0")
            continue
        if s.stride < s.unit_bytes:
            problems.append(f"{what}: unit_stride {s.unit_stride} is below unit_bytes")
        if s.rows < 1 or (s.rows > 1 and s.row_stride < 1):
            problems.append(f"{what}: rows must be >= 1, and row_stride > 0 when rows > 1")
        if not (s.replicas >= 1 and 0 <= s.replica < s.replicas):
            problems.append(f"{what}: replica {s.replica} outside replicas {s.replicas}")
        end = s.offset + (s.count - 1) * s.stride + s.unit_bytes + (s.rows - 1) * s.row_stride
        if end > tensor.block_bytes:
            problems.append(
                f"{what}: its units reach byte {end} of a block of {tensor.block_bytes} bytes"
            )
    return problems


def _same_shards(src: Layout, dst: Layout) -> bool:
    ts = {(t.layer_name, t.tensor): t.shards or None for t in src.spec.tensors}
    td = {(t.layer_name, t.tensor): t.shards or None for t in dst.spec.tensors}
    return ts == td


def _allocation(t: CacheTensor, group: CacheGroup) -> tuple[int, int]:
    start, end = Layout._allocation(t, group, expand_tensor(t, group))
    return start, end - start


def _piece(
    t: CacheTensor, group: CacheGroup, offset: int, length: int, name: str, in_order: bool = False
) -> CacheTensor:
    """The part of ``t`` at ``[offset, offset + length)`` of each block (per part), as a tensor;
    ``in_order``: the slice is one unit whose tokens lie in order (``Shard.token_major``)."""
    ratio = group.ratio
    if offset % ratio or length % ratio:
        raise LayoutError(
            f"{_where(t)}: a slice at byte {offset} of {length} bytes per block is not divisible "
            f"by the kernel ratio {ratio}, so it is no run of each kernel block"
        )
    shift = offset // ratio
    alloc_addr, alloc_size = _allocation(t, group)
    v_addr, v_offset = t.v_addr, t.v_offset
    if t.kv_layout is KVLayout.K_FIRST and v_addr is not None:
        v_addr += shift
    elif t.kv_layout is KVLayout.BLOCKS_FIRST:
        v_offset = t.block_bytes if v_offset is None else v_offset
    whole = offset == 0 and length == t.block_bytes
    return msgspec.structs.replace(
        t,
        addr=t.addr + shift,
        block_bytes=length,
        v_addr=v_addr,
        v_offset=v_offset,
        tensor=name,
        alloc_addr=alloc_addr,
        alloc_size=alloc_size,
        token_major=(t.token_major and whole) or in_order,
        shards=msgspec.UNSET,
    )


def _all_units(layout: Layout) -> dict[UnitKey, list[tuple[int, int]]]:
    units: dict[UnitKey, list[tuple[int, int]]] = {}
    for t in layout.spec.tensors:
        if not t.shards:
            units[(t.layer_name, t.tensor, "")] = [(0, 1)]
        for s in t.shards or ():
            units[(t.layer_name, t.tensor, s.axis)] = [(s.start, s.end)]
    return units


def _check_sharded(src: Layout, dst: Layout) -> None:
    problems = [p for layout in (src, dst) for t in layout.spec.tensors for p in shard_problems(t)]
    if problems:
        raise LayoutError("invalid shards: " + "; ".join(problems))
    if src.spec.tp_size == dst.spec.tp_size:
        return
    bare = [_where(t) for layout in (src, dst) for t in layout.spec.tensors if not t.shards]
    if bare:
        more = f" and {len(bare) - 4} more" if len(bare) > 4 else ""
        raise LayoutMismatchError(
            [
                f"tp_size: source={src.spec.tp_size} destination={dst.spec.tp_size}, and "
                f"{', '.join(bare[:4])}{more} carry no shards (which slice of the model's "
                "cache they hold), so they move only between equal TP sizes"
            ]
        )


def _restricted(layout: Layout, tensors: list[CacheTensor], block_format: str) -> Layout:
    spec = layout.spec
    return Layout(
        LayoutSpec(spec.groups, tensors, spec.dtype, 0, 1, block_format, spec.engine_layout)
    )


def _sources_of(
    dt: CacheTensor,
    by_key: Mapping[tuple[str, str], CacheTensor],
    by_layer: Mapping[str, list[CacheTensor]],
) -> list[CacheTensor]:
    """The source tensors that may hold units of ``dt``: the one of its name, else (a layer
    stored whole on one side and per head on the other) those of its layer sharing an axis."""
    same = by_key.get((dt.layer_name, dt.tensor))
    if same is not None:
        return [same]
    axes = {s.axis for s in dt.shards or ()}
    return [t for t in by_layer.get(dt.layer_name, []) if axes & {s.axis for s in t.shards or ()}]


@dataclass
class _Pieces:
    """What moves between one source and one destination rank, found tensor pair by pair: the
    pieces of each side (same order, same meaning), the units per tensor axis, the groups."""

    same_rank: bool  # the two ranks' TP rank is equal
    s: list[CacheTensor] = field(default_factory=list)
    d: list[CacheTensor] = field(default_factory=list)
    units: dict[UnitKey, list[tuple[int, int]]] = field(default_factory=dict)
    groups: set[int] = field(default_factory=set)
    diffs: list[str] = field(default_factory=list)

    def add(self, st: CacheTensor, dt: CacheTensor, sg: CacheGroup, dg: CacheGroup) -> None:
        """The pieces of destination tensor ``dt`` that source tensor ``st`` holds."""
        if not dt.shards or not st.shards:
            if dt.shards or st.shards:
                self.diffs.append(f"{_where(dt)}: shards on one side only")
            elif self.same_rank:  # equal TP sizes (checked)
                self.s.append(_piece(st, sg, 0, st.block_bytes, st.tensor))
                self.d.append(_piece(dt, dg, 0, dt.block_bytes, dt.tensor))
                self.units[(dt.layer_name, dt.tensor, "")] = [(0, 1)]
                self.groups.add(dt.group_index)
            return
        p_axes = {s.axis: s for s in st.shards}
        for ds in dt.shards:
            ps = p_axes.get(ds.axis)
            if (
                ps is None
                or shard_unit_bytes(ps.unit_bytes, sg) != shard_unit_bytes(ds.unit_bytes, dg)
                or ps.rows != ds.rows
            ):
                self.diffs.append(
                    f"{_where(dt)} axis {ds.axis!r}: source "
                    + (f"unit_bytes={ps.unit_bytes} rows={ps.rows}" if ps else "lacks it")
                    + f", destination unit_bytes={ds.unit_bytes} rows={ds.rows}"
                )
                continue
            if ps.replica != ds.replica * ps.replicas // ds.replicas:
                continue  # another replica of these units serves this destination rank
            a, b = max(ds.start, ps.start), min(ds.end, ps.end)
            if a >= b:
                continue
            if dg.kind.paged and ds.rows > 1:
                raise LayoutError(
                    f"{_where(dt)}: the units of axis {ds.axis!r} lie in {ds.rows} rows of "
                    "each block (heads interleaved per token), so a slice of them is one "
                    "run per token; configure a head-major KV cache layout on both sides "
                    "(vLLM's LBHNC or LHBNC) to move caches between different TP sizes"
                )
            self._add_units(st, dt, ps, ds, sg, dg, (a, b))

    def _add_units(
        self,
        st: CacheTensor,
        dt: CacheTensor,
        ps: Shard,
        ds: Shard,
        sg: CacheGroup,
        dg: CacheGroup,
        span: tuple[int, int],
    ) -> None:
        """Units ``span`` of one shard axis, both sides holding them, as pieces."""
        a, b = span
        # Different kernel block sizes split blocks into tokens: a slice must then list its
        # tokens in order, which a unit does when its shard says so (a head of [H, N, C]).
        split = dg.kind.paged and sg.kernel_size != dg.kernel_size
        by_unit = split and ds.token_major and ps.token_major
        packed = ds.stride == ds.unit_bytes and ps.stride == ps.unit_bytes and not by_unit
        runs = [(a, b)] if packed else [(u, u + 1) for u in range(a, b)]
        self.units.setdefault((dt.layer_name, dt.tensor, ds.axis), []).append((a, b))
        self.groups.add(dt.group_index)
        for row in range(ds.rows):
            for u0, u1 in runs:
                name = f"{dt.tensor}|{ds.axis}[{u0}:{u1}]" + (f"@{row}" if ds.rows > 1 else "")
                # each side's own bytes per block (block sizes may differ)
                s_len, d_len = (u1 - u0) * ps.unit_bytes, (u1 - u0) * ds.unit_bytes
                s_off = ps.offset + (u0 - ps.start) * ps.stride + row * ps.row_stride
                d_off = ds.offset + (u0 - ds.start) * ds.stride + row * ds.row_stride
                whole = s_off == d_off == 0 and s_len == st.block_bytes and d_len == dt.block_bytes
                if split and not (whole or by_unit):
                    raise LayoutError(
                        f"{_where(dt)} axis {ds.axis!r}: kernel block size source="
                        f"{sg.kernel_size} destination={dg.kernel_size}, and its units do "
                        "not list their tokens in order (Shard.token_major), so a slice of "
                        "a block's units moves only between equal kernel block sizes (use "
                        "the same attention backend and block size on both sides)"
                    )
                self.s.append(_piece(st, sg, s_off, s_len, name, by_unit))
                self.d.append(_piece(dt, dg, d_off, d_len, name, by_unit))


def _build_pair(src: Layout, dst: Layout) -> TPPair | None:
    given = (src, dst)
    staged = stage_pair(src, dst)  # pipeline stages move the layers both hold
    if staged is None:
        return None
    src, dst = received_pair(*staged)  # a token-major side facing a head-major one
    if is_token_major(src) != is_token_major(dst):  # not transposable (across TP sizes)
        raise LayoutMismatchError(layout_differences(src, dst, ("source", "destination")))
    _check_sharded(src, dst)
    if (
        src.spec.tp_size == dst.spec.tp_size
        and src.spec.tp_rank == dst.spec.tp_rank
        and _same_shards(src, dst)
        and not layout_differences(src, dst)
        and not needs_unit_split(src, dst)
    ):
        if src is given[0] and dst is given[1]:
            return TPPair(None, None, frozenset(dst.groups), _all_units(dst))
        return TPPair(src, dst, frozenset(dst.groups), _all_units(dst))
    by_key = {(t.layer_name, t.tensor): t for t in src.spec.tensors}
    by_layer: dict[str, list[CacheTensor]] = {}
    for t in src.spec.tensors:
        by_layer.setdefault(t.layer_name, []).append(t)
    pieces = _Pieces(same_rank=src.spec.tp_rank == dst.spec.tp_rank)
    for dt in dst.spec.tensors:
        if dt.group_index not in src.groups:
            continue  # no unit of a tensor without a source here: the coverage check names it
        for st in _sources_of(dt, by_key, by_layer):
            pieces.add(st, dt, src.groups[dt.group_index], dst.groups[dt.group_index])
    if pieces.diffs:
        raise LayoutMismatchError(pieces.diffs)
    if not pieces.d:
        return None
    # Pieces are units (or whole tensors) meaning the same on both sides: where the block formats
    # differ only in where heads sit, a head of either is a per-head piece.
    fs, fd = src.spec.block_format, dst.spec.block_format
    formats = (fs, fd) if fs == fd else (unit_format(fs), unit_format(fd))
    return TPPair(
        _restricted(src, pieces.s, formats[0]),
        _restricted(dst, pieces.d, formats[1]),
        frozenset(pieces.groups),
        pieces.units,
    )


#: Restricted pairs per pair of layouts: built once, like the planner's templates (which are
#: kept per restricted layout, so rebuilding them per request would lose them).
_PAIRS: PairMemo[Layout, Layout, TPPair | None] = PairMemo(_build_pair)


def restrict_pair(src: Layout, dst: Layout) -> TPPair | None:
    """The pair of layouts restricted to what moves from source rank ``src`` to destination
    rank ``dst``, or ``None`` when nothing does. Raises ``LayoutMismatchError`` when the two
    describe units differently and ``LayoutError`` for slices that are no runs of a block."""
    return _PAIRS(src, dst)


def _coverage(pairs: Sequence[TPPair | None], dst: Layout) -> None:
    """Every unit of the destination comes from exactly one source rank."""
    problems: list[str] = []
    for key, [(start, end)] in _all_units(dst).items():
        hits = np.zeros(end - start, dtype=np.int64)
        for pair in pairs:
            for a, b in pair.units.get(key, []) if pair else []:
                hits[a - start : b - start] += 1
        layer, tensor, axis = key
        where = f"tensor {layer!r}{'/' + tensor if tensor else ''} axis {axis or '(whole)'!r}"
        for what, bad in (("held by no source rank", hits == 0), ("read twice", hits > 1)):
            missing = np.flatnonzero(bad) + start
            if missing.size:
                problems.append(f"{where}: units {_ranges(missing.tolist())} {what}")
    if problems:
        raise LayoutMismatchError(problems)


def _ranges(values: list[int]) -> str:
    runs: list[list[int]] = []
    for v in values:
        if runs and runs[-1][1] == v:
            runs[-1][1] = v + 1
        else:
            runs.append([v, v + 1])
    return ", ".join(f"[{a}, {b})" for a, b in runs)


#: Destination layouts whose coverage by a set of source layouts was checked (weak both ways).
_COVERED: weakref.WeakKeyDictionary[Layout, list[tuple[weakref.ref[Layout], ...]]] = (
    weakref.WeakKeyDictionary()
)


def check_coverage(src_layouts: Mapping[int, Layout], dst: Layout) -> None:
    """Raise ``LayoutMismatchError`` unless every unit of ``dst`` comes from exactly one of
    these source ranks (by rank: ``src_layouts[p]`` is rank ``p``'s layout, ``p`` its
    ``LayoutSpec.flat_rank``: the TP rank, stage-major across pipeline stages); memoised."""
    for rank, layout in src_layouts.items():
        if layout.spec.flat_rank != rank:
            spec = layout.spec
            raise LayoutError(
                f"source layout given as rank {rank} says tp_rank {spec.tp_rank}"
                + (f" of pipeline stage {spec.pp_rank}" if spec.pp_size > 1 else "")
            )
    ordered = tuple(src_layouts[r] for r in sorted(src_layouts))
    seen = _COVERED.setdefault(dst, [])
    if any(
        len(refs) == len(ordered) and all(r() is s for r, s in zip(refs, ordered, strict=True))
        for refs in seen
    ):
        return
    _coverage([restrict_pair(layout, dst) for layout in ordered], dst)
    seen[:] = [refs for refs in seen if all(r() is not None for r in refs)][-7:]
    seen.append(tuple(weakref.ref(s) for s in ordered))
