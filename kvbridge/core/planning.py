"""Transfer planning: from two layouts and block ids to merged descriptor arrays.

For every pair of regions (same layer, tensor and part) and every aligned pair of blocks the
planner emits one descriptor per common unit, vectorised over regions, blocks and units; a
generic pass then merges descriptors adjacent on both sides. When both sides use the same kernel
block size the unit is one kernel block; when they differ it is their greatest common divisor in
tokens, which assumes token-major blocks (``[tokens, heads, head_dim]``), the layout of every
paged kernel kvbridge supports.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvbridge.core.block_mapping import align_block_ids, prepare_block_ids
from kvbridge.core.compat import check_compatible
from kvbridge.core.errors import BlockIdError, PlanError
from kvbridge.core.groups import CacheGroup, GroupKind
from kvbridge.core.layout import GroupRegions, Layout
from kvbridge.core.transport import AddrArray, TransferOp

BlockIds = Mapping[int, object]


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
    """

    src: AddrArray
    dst: AddrArray
    lengths: AddrArray
    unmerged: int
    groups: tuple[GroupPlanStats, ...]

    @property
    def count(self) -> int:
        return int(self.lengths.shape[0])

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


def _side_addresses(
    group: CacheGroup,
    arrays: dict[str, npt.NDArray[np.int64]],
    ids: npt.NDArray[np.int64],
    unit: int,
    axes: _Axes,
) -> npt.NDArray[np.int64]:
    """Addresses of every unit of every block of every region on one side."""
    base, stride = axes.region(arrays["base"]), axes.region(arrays["stride"])
    if not group.kind.paged:
        slots: npt.NDArray[np.int64] = base + axes.block(ids) * stride
        return slots
    kernel = group.kernel_size
    tokens = np.arange(0, group.block_size, unit, dtype=np.int64)
    kernel_ids = axes.blocks_by_units(ids[:, None] * group.ratio + (tokens // kernel)[None, :])
    within = axes.unit(tokens % kernel) * axes.region(arrays["length"] // kernel)
    addrs: npt.NDArray[np.int64] = base + kernel_ids * stride + within
    return addrs


def _kv_in_one_block(arrays: dict[str, npt.NDArray[np.int64]]) -> bool:
    """Whether K and V of each attention tensor share kernel blocks (a blocks-first layout)."""
    pairs = arrays["base"].reshape(-1, 2)
    lengths = arrays["length"].reshape(-1, 2)
    return bool(np.all(pairs[:, 1] == pairs[:, 0] + lengths[:, 0]))


def _plan_group(
    src: GroupRegions,
    dst: GroupRegions,
    src_ids: npt.NDArray[np.int64],
    dst_ids: npt.NDArray[np.int64],
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    # Pair regions by key: the two sides may list layers in different orders.
    order = {key: i for i, key in enumerate(src.keys)}
    pick = np.array([order[key] for key in dst.keys], dtype=np.int64)
    src_arrays = {name: values[pick] for name, values in src.arrays().items()}
    dst_arrays = dst.arrays()
    unit = _unit_tokens(src.group, dst.group)
    # Regions come as [K, V] per attention tensor, one region per tensor otherwise.
    parts = 2 if src.group.kind in (GroupKind.ATTENTION, GroupKind.SLIDING_WINDOW) else 1
    inner = parts == 2 and _kv_in_one_block(src_arrays) and _kv_in_one_block(dst_arrays)
    axes = _Axes(parts, inner)
    s = _side_addresses(src.group, src_arrays, src_ids, unit, axes)
    d = _side_addresses(dst.group, dst_arrays, dst_ids, unit, axes)
    if src.group.kind.paged:
        unit_len = dst_arrays["length"] // dst.group.kernel_size * unit
    else:
        unit_len = dst_arrays["length"]
    lengths = np.broadcast_to(axes.region(unit_len), d.shape)
    return s.reshape(-1), d.reshape(-1), lengths.reshape(-1)


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
        order = np.argsort(s, kind="stable")
        s, d, n = _merge_in_order(s[order], d[order], n[order])
    return s, d, n


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
    return src[starts], dst[starts], np.add.reduceat(lengths, starts).astype(np.uint64)


def _check_disjoint(addrs: AddrArray, lengths: AddrArray, side: str) -> None:
    order = np.argsort(addrs, kind="stable")
    a, n = addrs[order], lengths[order]
    overlap = np.flatnonzero(a[:-1] + n[:-1] > a[1:])
    if overlap.size:
        i = int(overlap[0])
        raise PlanError(
            f"the plan writes {side} range [{int(a[i]):#x}, +{int(n[i])}) and "
            f"[{int(a[i + 1]):#x}, +{int(n[i + 1])}) which overlap: two groups or layers share "
            "blocks, so the block ids or the layout are wrong"
        )


def plan_transfers(
    src: Layout,
    dst: Layout,
    src_block_ids: BlockIds,
    dst_block_ids: BlockIds,
    *,
    merge: bool = True,
    check: bool = True,
) -> TransferPlan:
    """Plan moving a request's blocks from the ``src`` layout to the ``dst`` layout.

    Block ids are logical ids per group index. A group absent from both mappings moves nothing;
    a group given on one side only is an error. With ``check`` the layouts' compatibility is
    verified first and destination ranges are checked not to overlap.
    """
    if check:
        check_compatible(src, dst, ("source", "destination"))
    missing = set(src_block_ids) ^ set(dst_block_ids)
    if missing:
        raise BlockIdError(
            f"block ids for group(s) {sorted(missing)} are given for one side only; give both "
            "sides' ids for every group that moves"
        )
    unknown = set(dst_block_ids) - set(dst.groups)
    if unknown:
        raise BlockIdError(f"block ids name group(s) {sorted(unknown)}, which the layout lacks")

    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    stats: list[GroupPlanStats] = []
    for index in sorted(dst_block_ids):
        sg, dg = src.group_regions[index], dst.group_regions[index]
        d_ids = prepare_block_ids(dg.group, dst_block_ids[index], "destination")
        s_ids = align_block_ids(
            prepare_block_ids(sg.group, src_block_ids[index], "source"), d_ids, index
        )
        s, d, n = _plan_group(sg, dg, s_ids, d_ids)
        parts.append((s, d, n))
        stats.append(
            GroupPlanStats(
                index, dg.group.kind, len(dg.regions), int(d_ids.size), int(n.size), int(n.sum())
            )
        )
    if parts:
        # Addresses are computed in int64 (numpy's index type) and reinterpreted, not copied.
        s_all = np.concatenate([p[0] for p in parts]).view(np.uint64)
        d_all = np.concatenate([p[1] for p in parts]).view(np.uint64)
        n_all = np.concatenate([p[2] for p in parts]).view(np.uint64)
    else:
        s_all = d_all = n_all = np.empty(0, dtype=np.uint64)
    unmerged = int(n_all.size)
    if merge:
        s_all, d_all, n_all = merge_descriptors(s_all, d_all, n_all)
    if check and n_all.size > 1:
        _check_disjoint(d_all, n_all, "destination")
    return TransferPlan(s_all, d_all, n_all, unmerged, tuple(stats))
