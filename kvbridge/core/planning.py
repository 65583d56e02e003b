"""Transfer planning: from two layouts and block ids to merged descriptor arrays.

For every pair of regions (same layer, tensor and part) and every aligned pair of blocks the
planner emits one descriptor per common unit, vectorised over regions, blocks and units; a
generic pass then merges descriptors adjacent on both sides. When both sides use the same kernel
block size the unit is one kernel block; when they differ it is their greatest common divisor in
tokens, which assumes token-major blocks (``[tokens, heads, head_dim]``), the layout of every
paged kernel kvbridge supports.

The merged plan is defined as that pass leaves it: maximal runs sorted by source. Getting there
costs time linear in the request in the common cases, because an address is affine in the block
id: units that every block moves contiguously are fused before any per-block array exists, runs
of consecutive blocks are found once per group on the block ids rather than per region, each
region's runs are listed by address so regions laid out in order need no sort, and destination
overlap is ruled out from per-region extents when they are disjoint. Whatever these shortcuts
cannot decide falls back to building every descriptor, sorting and checking them one by one.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvbridge.core.batches import AddrArray, TransferOp
from kvbridge.core.block_mapping import (
    CheckedBlockIds,
    GroupBlockIds,
    IdArray,
    TokenSpan,
    different_block_sizes,
    group_ids,
    only_groups,
    pair_block_ids,
    pair_token_blocks,
)
from kvbridge.core.compat import check_compatible, heads_differ_only, needs_unit_split
from kvbridge.core.errors import BlockIdError, PlanError
from kvbridge.core.groups import CacheGroup, GroupKind
from kvbridge.core.layout import GroupRegions, Layout, Part
from kvbridge.core.memo import PairMemo
from kvbridge.core.rank_slices import restrict_pair
from kvbridge.core.stages import stage_pair
from kvbridge.core.transpose import received_pair

#: One group's regions on both sides, the aligned block ids to move between them and, where
#: the two sides' block sizes differ, the tokens they share (``None``: blocks pair 1:1).
_GroupPair = tuple[GroupRegions, GroupRegions, IdArray, IdArray, TokenSpan | None]
_NO_EXTENTS = np.empty((0, 2), dtype=np.int64)


@dataclass(frozen=True)
class GroupPlanStats:
    """What one group contributes to a plan."""

    group_index: int
    kind: GroupKind
    regions: int
    blocks: int
    descriptors: int
    nbytes: int


@dataclass(frozen=True)
class TransferPlan:
    """Descriptors that move a request's blocks from ``src`` to ``dst`` memory.

    ``unmerged`` is the descriptor count before merging; ``groups`` breaks the plan down.

    A plan made ``by_layer`` is cut by layer: ``layers`` names them in the layout's order and
    ``layer_starts`` (one more entry than ``layers``) says where each one's descriptors begin;
    each layer's run is sorted by source and merged within the layer only, so it can be sent
    on its own as soon as that layer is computed (``for_layers``).
    """

    src: AddrArray
    dst: AddrArray
    lengths: AddrArray
    unmerged: int
    groups: tuple[GroupPlanStats, ...]
    layers: tuple[str, ...] = ()
    layer_starts: IdArray | None = None

    @property
    def count(self) -> int:
        return int(self.lengths.shape[0])

    @functools.cached_property
    def layer_index(self) -> dict[str, int]:
        """Each layer's position in ``layers`` (built once: a request's layers are cut one by
        one while the engine computes them)."""
        return {name: i for i, name in enumerate(self.layers)}

    def for_layers(self, names: Iterable[str]) -> TransferPlan:
        """The descriptors of these layers only (views where one layer is asked for).

        Layers this plan does not name move nothing (a layer of a group the request does not
        transfer); a plan not made ``by_layer`` cannot be cut and raises ``PlanError``.
        """
        if self.layer_starts is None:
            raise PlanError("this plan was not made by_layer: plan_transfers(..., by_layer=True)")
        index = self.layer_index
        picked = sorted({index[n] for n in names if n in index})
        starts = self.layer_starts
        cuts = [slice(int(starts[i]), int(starts[i + 1])) for i in picked]
        if len(cuts) == 1:
            s, d, n = self.src[cuts[0]], self.dst[cuts[0]], self.lengths[cuts[0]]
        elif cuts:
            s, d, n = (
                np.concatenate([a[c] for c in cuts]) for a in (self.src, self.dst, self.lengths)
            )
        else:
            s = d = n = np.empty(0, dtype=np.uint64)
        bounds = np.cumsum([0, *(c.stop - c.start for c in cuts)], dtype=np.int64)
        layers = tuple(self.layers[i] for i in picked)
        return TransferPlan(s, d, n, int(n.shape[0]), (), layers, bounds)

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum(dtype=np.uint64))

    def local_remote(self, op: TransferOp) -> tuple[AddrArray, AddrArray, AddrArray]:
        """``(local, remote, lengths)`` for the agent that submits ``op``.

        A READ is submitted by the destination (it pulls), a WRITE by the source (it pushes).
        """
        if op is TransferOp.READ:
            return self.dst, self.src, self.lengths
        return self.src, self.dst, self.lengths


def _unit_tokens(src: CacheGroup, dst: CacheGroup) -> int:
    return math.gcd(src.kernel_size, dst.kernel_size) if src.kind.paged else 1


@dataclass(frozen=True)
class _Axes:
    """Shapes that broadcast per-region, per-block and per-unit values into one address array.

    With ``parts_inner`` the order is ``[tensor, block, unit, part]``: K|V halves of a kernel
    block and consecutive kernel blocks come out next to each other (blocks-first layouts).
    Otherwise it is ``[tensor, part, block, unit]``: consecutive blocks of one part come out next
    to each other (K-first layouts). Either way the common cases merge in one linear pass.
    """

    parts: int
    parts_inner: bool

    def region(self, values: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        shape = (-1, 1, 1, self.parts) if self.parts_inner else (-1, self.parts, 1, 1)
        return values.reshape(shape)

    def block(self, values: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        return values.reshape((1, -1, 1, 1) if self.parts_inner else (1, 1, -1, 1))

    def unit(self, values: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        return values.reshape((1, 1, -1, 1) if self.parts_inner else (1, 1, 1, -1))

    def blocks_by_units(self, table: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """A ``[block, unit]`` table placed on its axes."""
        blocks, units = table.shape
        return table.reshape((1, blocks, units, 1) if self.parts_inner else (1, 1, blocks, units))


@dataclass(frozen=True)
class _GroupDescriptors:
    """One group's descriptors, possibly merged in part already, and what they prove.

    ``count`` is the number before any merging. ``dst_extents`` (``[rows, 2]``: start, end),
    when set, bounds each region's destination bytes, and each region's blocks are known not to
    overlap one another: extents that do not overlap then prove the destinations disjoint.
    """

    src: IdArray
    dst: IdArray
    lengths: IdArray
    count: int
    dst_extents: IdArray | None = None
    #: when set, the arrays are rows of this many descriptors, each row merged already: sorted
    #: by source, sources disjoint, no two neighbours joinable (only row boundaries may be)
    row_length: int | None = None
    #: the bytes all the descriptors move, when known without summing ``lengths``
    nbytes: int | None = None


def _side_offsets(
    group: CacheGroup, arrays: dict[str, npt.NDArray[np.int64]], unit: int, axes: _Axes
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """One side's addresses as ``offsets + block_id * step``.

    ``offsets`` is the address of every unit of every region for block id 0 (block axis of size
    one) and ``step`` the bytes from one logical block to the next, per region. An address is
    affine in the block id, so the units' pattern can be examined (and collapsed) once for every
    block before any per-block array is built.
    """
    base, stride = axes.region(arrays["base"]), axes.region(arrays["stride"])
    if not group.kind.paged:
        return base, stride
    kernel = group.kernel_size
    tokens = np.arange(0, group.block_size, unit, dtype=np.int64)
    first_kernel = axes.blocks_by_units((tokens // kernel)[None, :])
    within = axes.unit(tokens % kernel) * axes.region(arrays["length"] // kernel)
    offsets: npt.NDArray[np.int64] = base + first_kernel * stride + within
    step: npt.NDArray[np.int64] = stride * group.ratio
    return offsets, step


def _kv_in_one_block(arrays: dict[str, npt.NDArray[np.int64]]) -> bool:
    """Whether K and V of each attention tensor share kernel blocks (a blocks-first layout)."""
    pairs = arrays["base"].reshape(-1, 2)
    lengths = arrays["length"].reshape(-1, 2)
    return bool(np.all(pairs[:, 1] == pairs[:, 0] + lengths[:, 0]))


def _collapse_units(
    arrays: tuple[npt.NDArray[np.int64], ...], inner: int
) -> tuple[npt.NDArray[np.int64], ...]:
    """Fuse the trailing ``inner`` axes (those after the block axis) where they are contiguous.

    ``arrays`` are ``(src offsets, src step, dst offsets, dst step, lengths)`` of one shape.
    When every unit (and K|V part) of a block follows the previous one on both sides, and each
    side moves them from block to block by the same step (so what holds for block 0 holds for
    every block), the in-order merge would join them anyway; fusing them here, once for every
    block, spares building and merging descriptors that cannot survive. Tries all trailing axes
    first, then fewer; returns the arrays unchanged when none is contiguous everywhere.
    """
    shape = arrays[0].shape
    for k in range(inner, 0, -1):
        outer, fused = shape[:-k], math.prod(shape[-k:])
        if fused <= 1:
            continue
        s, s_step, d, d_step, n = (a.reshape(*outer, fused) for a in arrays)
        ends = n[..., :-1]
        if (
            np.array_equal(s[..., 1:], s[..., :-1] + ends)
            and np.array_equal(d[..., 1:], d[..., :-1] + ends)
            and bool(np.all(s_step[..., 1:] == s_step[..., :1]))
            and bool(np.all(d_step[..., 1:] == d_step[..., :1]))
        ):
            keep = (*outer, *([1] * k))
            total = n.sum(axis=-1, keepdims=True, dtype=np.int64)
            return tuple(a[..., :1].reshape(keep) for a in (s, s_step, d, d_step, total))
    return arrays


def _fuse_regions(arrays: tuple[npt.NDArray[np.int64], ...]) -> tuple[npt.NDArray[np.int64], ...]:
    """Fuse consecutive regions (rows) that continue one another on both sides in every block.

    ``arrays`` hold one value per region (every other axis has size one). Where region
    ``r + 1`` starts where region ``r`` ends on both sides and both step alike from block to
    block (a block-outermost layout: a block holds every layer's page, one after another), the
    merge would join them in every block: one row stands for them all, as ``_collapse_units``
    does for the units inside a block.
    """
    s, s_step, d, d_step, n = (a.reshape(-1) for a in arrays)
    if s.size <= 1:
        return arrays
    ends = s[:-1] + n[:-1]
    joins = (
        (s[1:] == ends)
        & (d[1:] == d[:-1] + n[:-1])
        & (s_step[1:] == s_step[:-1])
        & (d_step[1:] == d_step[:-1])
    )
    if not joins.any():
        return arrays
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    shape = (-1, *arrays[0].shape[1:])
    fused = [a[starts].reshape(shape) for a in (s, s_step, d, d_step)]
    return (*fused, np.add.reduceat(n, starts).reshape(shape))


@dataclass(frozen=True)
class _Rows:
    """A group pair whose blocks are one descriptor per region, every region stepping alike:
    per-region offsets for block id 0 and the common steps and length."""

    s_off: IdArray
    d_off: IdArray
    s_step: int
    d_step: int
    length: int


def _rows_of(arrays: tuple[npt.NDArray[np.int64], ...]) -> _Rows | None:
    """``_Rows`` from per-region offsets, steps and lengths, or ``None`` if regions step
    differently (then every descriptor is built)."""
    s_off, s_step, d_off, d_step, lengths = (a.reshape(-1) for a in arrays)
    keys = set(zip(s_step.tolist(), d_step.tolist(), lengths.tolist(), strict=True))
    if len(keys) != 1:
        return None
    ss, ds, length = keys.pop()
    return _Rows(s_off.copy(), d_off.copy(), ss, ds, length)


#: Up to this many block ids a group's runs are found on Python ints (``_runs_listed``): a
#: loop over a few dozen ids costs less than the numpy calls (a microsecond or two each,
#: whatever their size) that find them in a long request.
_LISTED_RUNS = 64


@dataclass(frozen=True)
class _Runs:
    """A group's block ids as maximal runs: each run's first source and destination id and its
    length in blocks (``blocks``), and what ``_merge_rows`` concludes from them.

    ``row_length`` is set when the runs are sorted by source and joined where they meet (a row
    merged already, see ``_merge_rows``); ``dst_low``/``dst_high`` are the lowest and highest
    destination ids.
    """

    first_src: IdArray
    first_dst: IdArray
    blocks: IdArray
    row_length: int | None
    dst_low: int
    dst_high: int


def _runs_listed(src_ids: IdArray, dst_ids: IdArray, rows: _Rows, sort_runs: bool) -> _Runs | None:
    """``_runs_vectorised`` on Python ints, for a few dozen ids; ``None`` for one run.

    Id ``s`` continues the run that starts at ``fs`` and holds ``b`` blocks exactly when
    ``(s - fs) * step == b * length`` on both sides: the same test joins the next block of a
    run and, once sorted, two runs that meet.
    """
    ss, ds, length = rows.s_step, rows.d_step, rows.length
    src, dst = src_ids.tolist(), dst_ids.tolist()
    runs: list[tuple[int, int, int]] = []  # first source id, first destination id, blocks
    fs, fd, blocks = src[0], dst[0], 0
    for s, d in zip(src, dst, strict=True):
        span = blocks * length
        if (s - fs) * ss != span or (d - fd) * ds != span:
            runs.append((fs, fd, blocks))
            fs, fd, blocks = s, d, 0
        blocks += 1
    if not runs:
        return None
    runs.append((fs, fd, blocks))
    row_length = None
    if sort_runs and ss > 0:
        runs.sort()  # ids are distinct: by first source id alone
        if 0 < length <= ss:
            joined = runs[:1]
            fs, fd, blocks = joined.pop()
            for s, d, b in runs[1:]:
                span = blocks * length
                if (s - fs) * ss == span and (d - fd) * ds == span:
                    blocks += b
                else:
                    joined.append((fs, fd, blocks))
                    fs, fd, blocks = s, d, b
            joined.append((fs, fd, blocks))
            runs = joined
            row_length = len(runs)
    first_src, first_dst, blocks = np.array(runs, dtype=np.int64).T
    return _Runs(first_src, first_dst, blocks, row_length, min(dst), max(dst))


def _runs_vectorised(
    src_ids: IdArray, dst_ids: IdArray, rows: _Rows, sort_runs: bool
) -> _Runs | None:
    """The maximal runs of a group's block ids (``_Runs``), ``None`` for one run.

    Block ``b+1`` continues block ``b`` when both ids step by one block's bytes. With
    ``sort_runs`` (and a positive source step) runs are listed by first source id, and where
    each block is no longer than the step those that meet once sorted (a request that holds
    blocks 5-6 before 1-2 and then 7) are joined: the row is then merged already.
    """
    ss, ds, length = rows.s_step, rows.d_step, rows.length
    size = int(src_ids.size)
    # Dense blocks (a block's bytes end where the next id's begin, on both sides): a block
    # continues another exactly when both ids are one more, no product needed.
    dense = 0 < length == ss == ds
    s_gap, d_gap = src_ids[1:] - src_ids[:-1], dst_ids[1:] - dst_ids[:-1]
    if dense:
        joins = (s_gap == 1) & (d_gap == 1)
    else:
        joins = (s_gap * ss == length) & (d_gap * ds == length)
    if joins.all():
        return None
    heads = np.flatnonzero(np.concatenate(((True,), ~joins)))
    first_src, first_dst = src_ids[heads], dst_ids[heads]
    blocks = np.empty_like(heads)
    blocks[:-1] = heads[1:] - heads[:-1]
    blocks[-1] = size - heads[-1]
    row_length = None
    if sort_runs and ss > 0:
        order = np.argsort(first_src)  # ids are distinct: one sorting permutation
        first_src, first_dst, blocks = first_src[order], first_dst[order], blocks[order]
        if 0 < length <= ss:
            # Distinct ids a step apart, blocks no longer than the step: sorted runs never
            # overlap, so joining those that continue each other leaves the row merged.
            s_gap, d_gap = first_src[1:] - first_src[:-1], first_dst[1:] - first_dst[:-1]
            if dense:
                meet = (s_gap == blocks[:-1]) & (d_gap == blocks[:-1])
            else:
                span = blocks[:-1] * length
                meet = (s_gap * ss == span) & (d_gap * ds == span)
            if meet.any():
                keep = np.flatnonzero(np.concatenate(((True,), ~meet)))
                first_src, first_dst = first_src[keep], first_dst[keep]
                blocks = np.add.reduceat(blocks, keep)
            row_length = int(first_src.size)
    return _Runs(first_src, first_dst, blocks, row_length, int(dst_ids.min()), int(dst_ids.max()))


def _merge_rows(
    rows: _Rows,
    src_ids: npt.NDArray[np.int64],
    dst_ids: npt.NDArray[np.int64],
    sort_runs: bool,
    count: int = 0,
) -> _GroupDescriptors:
    """The in-order merge of a group whose blocks are one descriptor each, done on block ids.

    Every row steps from block to block alike, so whether block ``b+1`` continues block ``b``
    depends on the ids alone: the runs are found once for all rows (``_Runs``), and only each
    run's first descriptor is ever built.

    With ``sort_runs`` each row lists its runs by source address instead of request order. The
    merged plan is the same (maximal runs sorted by source, which are unique when sources do
    not overlap), but regions laid out one after another then come out sorted already, which
    spares ``merge_descriptors`` its sort. Runs that meet once sorted are joined on the ids,
    once for all rows: each row is then merged already, and only the boundaries between rows
    are left to check.

    ``count``: the group's descriptors before merging, carried into the result. Most requests
    are a handful of runs, so the numpy calls are kept few: a short request's runs are found on
    Python ints, and one run, the common case, builds no runs at all.
    """
    ss, ds, length = rows.s_step, rows.d_step, rows.length
    size = int(src_ids.size)
    runs = None
    if size > 1:
        find = _runs_listed if size <= _LISTED_RUNS else _runs_vectorised
        runs = find(src_ids, dst_ids, rows, sort_runs)
    regions = int(rows.s_off.size)
    nbytes = regions * size * length
    if runs is None:  # one run: every row is one descriptor
        s = rows.s_off + int(src_ids[0]) * ss if size else rows.s_off[:0]
        d = rows.d_off + int(dst_ids[0]) * ds if size else rows.d_off[:0]
        n = np.full(s.size, size * length, dtype=np.int64)
        row_length = (1 if size else 0) if sort_runs and ss > 0 and 0 < length <= ss else None
        extents = None
        if size and 0 < length <= ds:  # one run of distinct ids: it is the extent
            low = int(dst_ids[0]) * ds
            extents = rows.d_off[:, None] + np.array((low, low + size * length), dtype=np.int64)
        return _GroupDescriptors(s, d, n, count, extents, row_length, nbytes)
    s = (rows.s_off[:, None] + runs.first_src * ss).reshape(-1)
    d = (rows.d_off[:, None] + runs.first_dst * ds).reshape(-1)
    n = runs.blocks * length
    if regions > 1:  # every row moves the same runs
        n = np.broadcast_to(n, (regions, n.size)).reshape(-1)
    extents = None
    if 0 < length <= ds:
        # Distinct ids (checked) a step apart, each block no longer than the step: a region's
        # blocks never overlap, and all of them lie between its lowest and highest block.
        low, high = runs.dst_low * ds, runs.dst_high * ds + length
        extents = rows.d_off[:, None] + np.array((low, high), dtype=np.int64)
    return _GroupDescriptors(s, d, n, count, extents, runs.row_length, nbytes)


@dataclass(frozen=True)
class _PairTemplate:
    """What planning a group pair needs before any block id: built once per pair of layouts.

    ``arrays`` are offsets, steps and lengths broadcast over ``[region, block, unit(, part)]``
    (collapsed where ``collapse`` allows), ``per_block`` the descriptors one block needs
    before merging, ``rows`` the fast path where blocks are one descriptor per region.
    """

    axes: _Axes
    arrays: tuple[npt.NDArray[np.int64], ...]
    per_block: int
    rows: _Rows | None


def _paired_arrays(
    src: GroupRegions, dst: GroupRegions
) -> tuple[dict[str, npt.NDArray[np.int64]], dict[str, npt.NDArray[np.int64]]]:
    """Both sides' per-region arrays (``GroupRegions.arrays``), the source's in the
    destination's region order: the two sides may list layers in different orders."""
    order = {key: i for i, key in enumerate(src.keys)}
    pick = np.array([order[key] for key in dst.keys], dtype=np.int64)
    return {name: values[pick] for name, values in src.arrays().items()}, dst.arrays()


def _build_template(
    src: GroupRegions, dst: GroupRegions, collapse: bool, fuse: bool = True
) -> _PairTemplate:
    """The pair's template (``_TEMPLATES`` keeps it: layouts never change once built).

    ``fuse`` lets regions that continue one another merge into one row (``_fuse_regions``);
    a plan cut by layer keeps one row per tensor, so no descriptor spans two layers."""
    src_arrays, dst_arrays = _paired_arrays(src, dst)
    unit = _unit_tokens(src.group, dst.group)
    # Regions come as [K, V] per attention tensor split into its parts, one region per tensor
    # otherwise (a group describes all its tensors one way, and both sides' keys agree).
    parts = 2 if src.regions and src.regions[0].part is not Part.WHOLE else 1
    inner = parts == 2 and _kv_in_one_block(src_arrays) and _kv_in_one_block(dst_arrays)
    axes = _Axes(parts, inner)
    s_off, s_step = _side_offsets(src.group, src_arrays, unit, axes)
    d_off, d_step = _side_offsets(dst.group, dst_arrays, unit, axes)
    if src.group.kind.paged:
        unit_len = dst_arrays["length"] // dst.group.kernel_size * unit
    else:
        unit_len = dst_arrays["length"]
    lengths = axes.region(unit_len)
    shape = np.broadcast_shapes(s_off.shape, d_off.shape, lengths.shape)
    arrays = tuple(np.broadcast_to(a, shape) for a in (s_off, s_step, d_off, d_step, lengths))
    rows = None
    if collapse:
        # Axes after the block axis: [unit, part] with parts inner, else [unit].
        inner_axes = 2 if inner else 1
        arrays = _collapse_units(arrays, inner_axes)
        if math.prod(arrays[0].shape[-inner_axes:]) == 1:
            rows = _rows_of(_fuse_regions(arrays) if fuse else arrays)
    return _PairTemplate(axes, arrays, math.prod(shape), rows)


#: Templates per pair of group regions, by ``(collapse, fuse)``.
_TEMPLATES: dict[tuple[bool, bool], PairMemo[GroupRegions, GroupRegions, _PairTemplate]] = {
    (collapse, fuse): PairMemo(functools.partial(_build_template, collapse=collapse, fuse=fuse))
    for collapse in (False, True)
    for fuse in (False, True)
}


def _plan_group(
    src: GroupRegions,
    dst: GroupRegions,
    src_ids: npt.NDArray[np.int64],
    dst_ids: npt.NDArray[np.int64],
    *,
    collapse: bool,
    sort_runs: bool = False,
    fuse: bool = True,
) -> _GroupDescriptors:
    """One group's descriptors and how many there are before any merging.

    With ``collapse`` units that the in-order merge would join anyway are fused first, and
    blocks too when that can be done on block ids (``_merge_rows``), so the arrays may be
    shorter than the count; ``sort_runs`` then lists each region's runs by address.
    """
    template = _TEMPLATES[collapse, collapse and fuse](src, dst)
    count = template.per_block * int(dst_ids.size)
    if template.rows is not None:
        return _merge_rows(template.rows, src_ids, dst_ids, sort_runs, count)
    axes = template.axes
    s_off, s_step, d_off, d_step, lengths = template.arrays
    s = s_off + axes.block(src_ids) * s_step
    d = d_off + axes.block(dst_ids) * d_step
    lengths = np.broadcast_to(lengths, d.shape)
    return _GroupDescriptors(s.reshape(-1), d.reshape(-1), lengths.reshape(-1), count)


def _plan_token_group(
    src: GroupRegions,
    dst: GroupRegions,
    src_ids: npt.NDArray[np.int64],
    dst_ids: npt.NDArray[np.int64],
    span: TokenSpan,
) -> _GroupDescriptors:
    """One group's descriptors where the two sides' block sizes differ: one per region and
    unit of tokens (the gcd of the kernel block sizes, which divides both block sizes), each
    side's unit found from its own block list; the merge joins them into runs afterwards.

    Rows are regions in the destination's order (tensor-major, as ``_plan_layered`` needs).
    """
    src_arrays, dst_arrays = _paired_arrays(src, dst)
    unit = _unit_tokens(src.group, dst.group)
    axes = _Axes(1, False)  # every region a row of its own: [region, 1, 1, unit]
    tokens = np.arange(span.first, span.end, unit, dtype=np.int64)
    rows: list[npt.NDArray[np.int64]] = []
    for group, arrays, ids, start in (
        (src.group, src_arrays, src_ids, 0),
        (dst.group, dst_arrays, dst_ids, span.first),
    ):
        offsets, step = _side_offsets(group, arrays, unit, axes)
        at = tokens - start
        blocks = ids[at // group.block_size]
        units = (at % group.block_size) // unit
        regions = len(dst.regions)
        rows.append(offsets.reshape(regions, -1)[:, units] + step.reshape(-1, 1) * blocks)
    s, d = rows
    lengths = np.broadcast_to(
        (dst_arrays["length"] // dst.group.kernel_size * unit)[:, None], d.shape
    )
    count = int(d.size)
    return _GroupDescriptors(s.reshape(-1), d.reshape(-1), lengths.reshape(-1), count)


def _group_descriptors(
    pair: _GroupPair, *, collapse: bool, sort_runs: bool = False, fuse: bool = True
) -> _GroupDescriptors:
    """One group pair's descriptors: by block (``_plan_group``) or, between different block
    sizes, by token unit (``_plan_token_group``)."""
    sg, dg, s_ids, d_ids, span = pair
    if span is not None:
        return _plan_token_group(sg, dg, s_ids, d_ids, span)
    return _plan_group(sg, dg, s_ids, d_ids, collapse=collapse, sort_runs=sort_runs, fuse=fuse)


def merge_descriptors(
    src: npt.NDArray[np.integer], dst: npt.NDArray[np.integer], lengths: npt.NDArray[np.integer]
) -> tuple[AddrArray, AddrArray, AddrArray]:
    """Merge descriptors adjacent in both source and destination into maximal runs.

    Sorting by source puts every descriptor next to the only one that can extend it (sources do
    not overlap), so one linear pass yields the minimum number of descriptors.
    """
    s: AddrArray = np.asarray(src, dtype=np.uint64)
    d: AddrArray = np.asarray(dst, dtype=np.uint64)
    n: AddrArray = np.asarray(lengths, dtype=np.uint64)
    if s.size <= 1:
        return s.copy(), d.copy(), n.copy()
    # Merging in the given order first is cheap and usually leaves few runs to sort.
    s, d, n = _merge_in_order(s, d, n)
    if not bool(np.all(s[1:] >= s[:-1])):
        order = _argsort(s)
        s, d, n = _merge_in_order(s[order], d[order], n[order])
    return s, d, n


def _argsort(values: AddrArray) -> npt.NDArray[np.intp]:
    """The stable sorting permutation of ``values``, found with numpy's fastest sort.

    Distinct keys have only one sorting permutation, so the unstable (vectorised) sort gives
    the stable result then, several times faster; ties, which plans do not have unless two
    descriptors read the same bytes, fall back to the stable sort.
    """
    order = np.argsort(values)
    ordered = values[order]
    if bool(np.any(ordered[1:] == ordered[:-1])):
        order = np.argsort(values, kind="stable")
    return order


def _merge_in_order(
    src: AddrArray, dst: AddrArray, lengths: AddrArray
) -> tuple[AddrArray, AddrArray, AddrArray]:
    """Merge each descriptor into its predecessor when both sides continue it."""
    if src.size <= 1:
        return src, dst, lengths
    joins = (src[1:] == src[:-1] + lengths[:-1]) & (dst[1:] == dst[:-1] + lengths[:-1])
    if not joins.any():
        return src, dst, lengths
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return src[starts], dst[starts], np.add.reduceat(lengths, starts).astype(np.uint64, copy=False)


def _disjoint_extents(extents: IdArray) -> bool:
    """Whether no two ``[start, end)`` rows overlap (a few hundred regions: cheap)."""
    if extents.shape[0] <= 1:
        return True
    ordered = extents[np.argsort(extents[:, 0], kind="stable")]
    return bool(np.all(ordered[1:, 0] >= ordered[:-1, 1]))


def _check_disjoint(addrs: AddrArray, lengths: AddrArray, side: str) -> None:
    a, n = addrs, lengths
    if not bool(np.all(a[1:] >= a[:-1])):
        # Ranges of positive length are disjoint exactly when, with starts and ends sorted
        # separately, no end passes the next start: two plain sorts, no permutation to apply.
        # Only a plan that fails this pays for the stable sort that names the first overlap.
        if bool(np.all(n > 0)):
            starts, ends = np.sort(a), np.sort(a + n)
            if bool(np.all(ends[:-1] <= starts[1:])):
                return
        order = np.argsort(a, kind="stable")
        a, n = a[order], n[order]
    overlap = np.flatnonzero(a[:-1] + n[:-1] > a[1:])
    if overlap.size:
        i = int(overlap[0])
        raise PlanError(
            f"the plan writes {side} range [{int(a[i]):#x}, +{int(n[i])}) and "
            f"[{int(a[i + 1]):#x}, +{int(n[i + 1])}) which overlap: two groups or layers share "
            "blocks, so the block ids or the layout are wrong"
        )


@dataclass(frozen=True)
class _PlannedPair:
    """Two layouts as the planner plans them (``_planned_pair``): ``None`` for a side planned
    as given (kept in the destination's memo, a value must not hold the layouts themselves, or
    a gone peer's layout would live on); ``shared``, for pipeline stages, the groups of the
    layers both hold (block ids of other groups do not move)."""

    src: Layout | None
    dst: Layout | None
    shared: frozenset[int] | None


def _planned_pair(src: Layout, dst: Layout) -> _PlannedPair | None:
    """What ``plan_transfers`` plans instead of ``src`` and ``dst`` (``None``: two pipeline
    stages that share no layer). It depends on the two layouts alone: built once per pair."""
    staged = stage_pair(src, dst)  # pipeline stages: the layers both hold
    if staged is None:
        return None
    s, d = staged
    shared = None
    if s is not src or d is not dst:
        shared = frozenset(s.groups) & frozenset(d.groups)
    # A token-major side facing a head-major one is planned as head-major (transposed on receive).
    s, d = received_pair(s, d)
    if heads_differ_only(s, d) or needs_unit_split(s, d):
        # Heads stored whole on one side, per head on the other, or blocks of different kernel
        # sizes that hold heads' tokens in order only per head: plan the units both hold.
        pair = restrict_pair(s, d)
        if pair is not None and pair.src is not None and pair.dst is not None:
            s, d = pair.src, pair.dst
    return _PlannedPair(None if s is src else s, None if d is dst else d, shared)


_PLANNED_PAIRS: PairMemo[Layout, Layout, _PlannedPair | None] = PairMemo(_planned_pair)


def plan_transfers(
    src: Layout,
    dst: Layout,
    src_block_ids: GroupBlockIds,
    dst_block_ids: GroupBlockIds,
    *,
    merge: bool = True,
    check: bool = True,
    by_layer: bool = False,
    dst_first_token: int | None = None,
) -> TransferPlan:
    """Plan moving a request's blocks from the ``src`` layout to the ``dst`` layout.

    Block ids are logical ids per group index. A group absent from both mappings moves nothing;
    a group given on one side only is an error. Ids checked already against an equal group
    (``CheckedBlockIds``) are not checked again. With ``check`` the layouts' compatibility is
    verified first and destination ranges are checked not to overlap. With ``by_layer`` the one
    plan is cut by layer (``TransferPlan.layers``, ``for_layers``): merged within each layer,
    never across two (a layout whose block holds every layer then needs more descriptors).

    Groups whose block sizes differ pair tokens, not blocks (``pair_token_blocks``): the
    source's list starts at the request's first token, the destination's at
    ``dst_first_token`` (required for them, a multiple of the destination's block size: the
    tokens it held already; by default what ``CheckedBlockIds.first_token`` of
    ``dst_block_ids`` says). Groups of equal block sizes ignore it: the destination's list
    pairs with the source's tail.
    """
    if dst_first_token is None and isinstance(dst_block_ids, CheckedBlockIds):
        dst_first_token = dst_block_ids.first_token
    if check:
        check_compatible(src, dst, ("source", "destination"))
    planned = _PLANNED_PAIRS(src, dst)
    if planned is None:
        raise PlanError(
            "the two pipeline stages hold no layer in common: nothing moves between them "
            "(plan_tp_pair answers None for such a pair)"
        )
    if planned.shared is not None:  # pipeline stages: the groups of the layers both hold
        shared = planned.shared
        src_block_ids = only_groups(src_block_ids, [g for g in src_block_ids if g in shared])
        dst_block_ids = only_groups(dst_block_ids, [g for g in dst_block_ids if g in shared])
    src = src if planned.src is None else planned.src
    dst = dst if planned.dst is None else planned.dst
    pairs = _group_pairs(src, dst, src_block_ids, dst_block_ids, dst_first_token)
    plan, extents = _plan_group_pairs(pairs, merge, by_layer)
    if check and plan.count > 1 and not (extents is not None and _disjoint_extents(extents)):
        _check_disjoint(plan.dst, plan.lengths, "destination")
    return plan


def _group_pairs(
    src: Layout,
    dst: Layout,
    src_block_ids: GroupBlockIds,
    dst_block_ids: GroupBlockIds,
    dst_first_token: int | None,
) -> list[_GroupPair]:
    """Each group's regions on both sides with the block ids that pair (``plan_transfers``)."""
    missing = set(src_block_ids) ^ set(dst_block_ids)
    if missing:
        raise BlockIdError(
            f"block ids for group(s) {sorted(missing)} are given for one side only; give both "
            "sides' ids for every group that moves"
        )
    unknown = set(dst_block_ids) - set(dst.groups)
    if unknown:
        raise BlockIdError(f"block ids name group(s) {sorted(unknown)}, which the layout lacks")
    pairs: list[_GroupPair] = []
    for index in sorted(dst_block_ids):
        sg, dg = src.group_regions[index], dst.group_regions[index]
        s_given, d_given = group_ids(src_block_ids, index), group_ids(dst_block_ids, index)
        span: TokenSpan | None = None
        if different_block_sizes(sg.group, dg.group):
            s_ids, d_ids, span = pair_token_blocks(
                sg.group, dg.group, s_given, d_given, dst_first_token
            )
        else:
            s_ids, d_ids = pair_block_ids(sg.group, dg.group, s_given, d_given)
        pairs.append((sg, dg, s_ids, d_ids, span))
    return pairs


def _plan_group_pairs(
    pairs: list[_GroupPair], merge: bool, by_layer: bool
) -> tuple[TransferPlan, IdArray | None]:
    """The plan of the paired groups, with its destination extents when known."""
    if by_layer:
        return _plan_layered(pairs, merge)
    plan, extents, disjoint = _plan_pairs(pairs, merge, sort_runs=merge)
    if (
        merge
        and not disjoint
        and plan.count > 1
        and bool(np.any(plan.src[:-1] + plan.lengths[:-1] > plan.src[1:]))
    ):
        # Sources that overlap (two groups reading the same block) make the result depend on
        # the order runs are merged in: redo it in plain emission order, as defined.
        plan, extents, _ = _plan_pairs(pairs, merge, sort_runs=False)
    return plan, extents


def _writable(values: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    return values if values.flags.writeable else values.copy()


def _row_starts(parts: list[_GroupDescriptors]) -> npt.NDArray[np.int64] | None:
    """Where each row of already merged rows begins in the concatenated arrays (the first
    excepted), or ``None`` unless every part is such rows."""
    starts: list[int] = []  # a few hundred rows at most (regions), so a list is quickest
    offset = 0
    for part in parts:
        if part.row_length is None:
            return None
        size = int(part.src.size)
        if part.row_length:
            starts.extend(range(offset, offset + size, part.row_length))
        offset += size
    return np.array(starts[1:] if starts and starts[0] == 0 else starts, dtype=np.int64)


def _rows_are_merged(
    s: AddrArray, d: AddrArray, n: AddrArray, row_starts: npt.NDArray[np.int64]
) -> bool:
    """Whether rows, each merged already, are merged together too: every row starts past the
    end of the one before (sorted, sources disjoint) and does not continue it on both sides."""
    if not row_starts.size:
        return True
    before = row_starts - 1
    end_s, end_d = s[before] + n[before], d[before] + n[before]
    starts_s = s[row_starts]
    return bool(np.all(starts_s >= end_s)) and not bool(
        np.any((starts_s == end_s) & (d[row_starts] == end_d))
    )


def _extents_proof(parts: list[_GroupDescriptors]) -> IdArray | None:
    """Every region's destination extent when each group could give one (else ``None``)."""
    extents = [p.dst_extents for p in parts if p.dst_extents is not None]
    if len(extents) != len(parts):
        return None
    return extents[0] if len(extents) == 1 else np.concatenate([_NO_EXTENTS, *extents])


def _group_stats(dst: GroupRegions, dst_ids: IdArray, part: _GroupDescriptors) -> GroupPlanStats:
    """What one group contributes to a plan (before the merge across groups)."""
    return GroupPlanStats(
        dst.group.index,
        dst.group.kind,
        len(dst.regions),
        int(dst_ids.size),
        part.count,
        int(part.lengths.sum()) if part.nbytes is None else part.nbytes,
    )


def _plan_pairs(
    pairs: list[_GroupPair],
    merge: bool,
    *,
    sort_runs: bool,
) -> tuple[TransferPlan, IdArray | None, bool]:
    """Descriptors of every group, concatenated and (with ``merge``) merged.

    Also every region's destination extent when each group could give one (else ``None``), and
    whether the plan's sources are known to be disjoint (rows merged on their ids, whose
    boundaries were checked: then ``merge_descriptors`` and the overlap check have nothing
    left to find).
    """
    parts: list[_GroupDescriptors] = []
    stats: list[GroupPlanStats] = []
    for pair in pairs:
        part = _group_descriptors(pair, collapse=merge, sort_runs=sort_runs)
        parts.append(part)
        stats.append(_group_stats(pair[1], pair[3], part))
    if parts:
        # Addresses are computed in int64 (numpy's index type) and reinterpreted, not copied.
        # One group's arrays need no concatenation (a copy), unless they are read-only views.
        s_all, d_all, n_all = (
            (_writable(arrays[0]) if len(parts) == 1 else np.concatenate(arrays)).view(np.uint64)
            for arrays in zip(*((p.src, p.dst, p.lengths) for p in parts), strict=True)
        )
    else:
        s_all = d_all = n_all = np.empty(0, dtype=np.uint64)
    disjoint = False
    if merge:
        row_starts = _row_starts(parts)
        disjoint = row_starts is not None and _rows_are_merged(s_all, d_all, n_all, row_starts)
        if not disjoint:
            s_all, d_all, n_all = merge_descriptors(s_all, d_all, n_all)
    unmerged = sum(p.count for p in parts)
    plan = TransferPlan(s_all, d_all, n_all, unmerged, tuple(stats))
    return plan, _extents_proof(parts), disjoint


def _tensor_layers(dst: GroupRegions) -> list[str]:
    """The layer of each tensor (planning row) of a group, in its regions' order: an attention
    tensor gives a K and a V region, every other tensor one."""
    parts = 2 if dst.regions and dst.regions[0].part is not Part.WHOLE else 1
    return [r.layer_name for r in dst.regions[::parts]]


def _plan_layered(pairs: list[_GroupPair], merge: bool) -> tuple[TransferPlan, IdArray | None]:
    """Every group's descriptors, each tagged with its layer, merged within a layer only and
    ordered by layer (in the layouts' order), then by source.

    A group's descriptor arrays are tensor-major (the planner broadcasts regions on the first
    axis, and only the axes after it are fused), so descriptor ``i`` of a part with ``T``
    tensors belongs to tensor ``i // (size / T)``: the tags cost a ``repeat``, not a search.
    """
    layer_index: dict[str, int] = {}
    parts: list[_GroupDescriptors] = []
    tags: list[npt.NDArray[np.int64]] = []
    stats: list[GroupPlanStats] = []
    for pair in pairs:
        dg, d_ids = pair[1], pair[3]
        part = _group_descriptors(pair, collapse=merge, fuse=False)
        layers = _tensor_layers(dg)
        codes = np.array([layer_index.setdefault(n, len(layer_index)) for n in layers], np.int64)
        size = int(part.src.size)
        if layers and size % len(layers):
            raise PlanError(f"group {dg.group.index}: {size} descriptors for {len(layers)} tensors")
        per_tensor = size // len(layers) if layers else 0
        parts.append(part)
        tags.append(np.repeat(codes, per_tensor))
        stats.append(_group_stats(dg, d_ids, part))
    if parts:
        s, d, n, t = (
            np.concatenate(arrays)
            for arrays in zip(
                *((p.src, p.dst, p.lengths, tg) for p, tg in zip(parts, tags, strict=True)),
                strict=True,
            )
        )
        s, d, n = (a.view(np.uint64) for a in (s, d, n))  # int64 addresses, reinterpreted
    else:
        s = d = n = np.empty(0, dtype=np.uint64)
        t = np.empty(0, dtype=np.int64)
    # Stable: descriptors of one layer that read the same bytes keep their emission order.
    order = np.lexsort((s, t))
    s, d, n, t = s[order], d[order], n[order], t[order]
    if merge and s.size > 1:
        joins = (t[1:] == t[:-1]) & (s[1:] == s[:-1] + n[:-1]) & (d[1:] == d[:-1] + n[:-1])
        if joins.any():
            keep = np.flatnonzero(np.concatenate(([True], ~joins)))
            s, d, t = s[keep], d[keep], t[keep]
            n = np.add.reduceat(n, keep).astype(np.uint64, copy=False)
    starts = np.searchsorted(t, np.arange(len(layer_index) + 1)).astype(np.int64)
    unmerged = sum(p.count for p in parts)
    plan = TransferPlan(s, d, n, unmerged, tuple(stats), tuple(layer_index), starts)
    return plan, _extents_proof(parts)
