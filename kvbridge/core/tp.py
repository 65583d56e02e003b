"""Planning between TP sizes: which P ranks a D rank talks to, and each one's plan.

``kvbridge.core.rank_slices`` restricts a pair of ranks' layouts to the units that move between
them; the planners here plan the restricted pairs with ``plan_transfers``. With vLLM's sharding
(and the replica rule of ``rank_slices``) D rank ``d`` of ``D`` talks to P ranks ``d // (D/P)``
when ``D >= P``, else ``[d*P/D, (d+1)*P/D)`` (``contact_ranks``), so which ranks talk to which
follows from the TP sizes alone and each P rank knows how many D ranks end its lease
(``reporting_ranks``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from kvbridge.core.block_mapping import GroupBlockIds, only_groups
from kvbridge.core.errors import BlockIdError, LayoutError, LayoutMismatchError
from kvbridge.core.layout import Layout
from kvbridge.core.planning import TransferPlan, plan_transfers
from kvbridge.core.rank_slices import check_coverage, restrict_pair


def plan_tp_pair(
    src: Layout,
    dst: Layout,
    src_block_ids: GroupBlockIds,
    dst_block_ids: GroupBlockIds,
    *,
    merge: bool = True,
    check: bool = True,
    by_layer: bool = False,
    dst_first_token: int | None = None,
) -> TransferPlan | None:
    """The plan moving what source rank ``src`` sends destination rank ``dst``, or ``None``.

    ``dst_first_token``: where the destination's blocks start in the request's tokens, which
    groups of different block sizes need (``plan_transfers``).

    For push (P writes): P rank ``p`` calls it for each D rank. It cannot see the other source
    ranks, so it does not check that every unit of ``dst`` is covered (``plan_tp_transfers``
    does). ``by_layer``: the plan is cut by layer (``plan_transfers``).
    """
    missing = set(src_block_ids) ^ set(dst_block_ids)
    if missing:
        raise BlockIdError(
            f"block ids for group(s) {sorted(missing)} are given for one side only; give both "
            "sides' ids for every group that moves"
        )
    pair = restrict_pair(src, dst)
    if pair is None:
        return None
    groups = [g for g in dst_block_ids if g in pair.groups]
    if not groups:
        return None
    s_layout, d_layout = (
        (src, dst) if pair.src is None or pair.dst is None else (pair.src, pair.dst)
    )
    return plan_transfers(
        s_layout,
        d_layout,
        only_groups(src_block_ids, groups),
        only_groups(dst_block_ids, groups),
        merge=merge,
        check=check,
        by_layer=by_layer,
        dst_first_token=dst_first_token,
    )


def contact_ranks(d_rank: int, d_size: int, p_size: int) -> range:
    """The P ranks D rank ``d_rank`` of ``d_size`` talks to for a request (reads from, or has
    write to it, and releases): ``d // (D/P)`` when ``D >= P``, else ``[d*P/D, (d+1)*P/D)``.

    With vLLM's TP sharding (and the replica rule of this module) every unit a D rank needs
    comes from one of them. Raises ``LayoutMismatchError`` unless one size divides the other.
    """
    _check_sizes(d_size, p_size)
    if not 0 <= d_rank < d_size:
        raise LayoutError(f"decode rank {d_rank} outside TP size {d_size}")
    if d_size >= p_size:
        first = d_rank // (d_size // p_size)
        return range(first, first + 1)
    per = p_size // d_size
    return range(d_rank * per, (d_rank + 1) * per)


def reporting_ranks(p_rank: int, p_size: int, d_size: int) -> range:
    """The D ranks whose ``contact_ranks`` hold P rank ``p_rank``: those that end its lease."""
    _check_sizes(d_size, p_size)
    if not 0 <= p_rank < p_size:
        raise LayoutError(f"prefill rank {p_rank} outside TP size {p_size}")
    if d_size >= p_size:
        per = d_size // p_size
        return range(p_rank * per, (p_rank + 1) * per)
    first = p_rank // (p_size // d_size)
    return range(first, first + 1)


def _check_sizes(d_size: int, p_size: int) -> None:
    if d_size < 1 or p_size < 1 or (d_size % p_size and p_size % d_size):
        raise LayoutMismatchError(
            [
                f"tp_size: prefill={p_size} decode={d_size}; one must divide the other (as in "
                "vLLM's own P/D connectors): choose TP sizes such as 1, 2, 4, 8"
            ]
        )


def plan_tp_reads(
    src_layouts: Mapping[int, Layout],
    dst: Layout,
    src_block_ids: GroupBlockIds,
    dst_block_ids: GroupBlockIds,
    *,
    merge: bool = True,
    check: bool = True,
) -> dict[int, TransferPlan]:
    """Plans per source rank for destination rank ``dst``, from the source ranks given (those
    of ``contact_ranks``, or all); every unit of ``dst`` must come from exactly one of them
    (``check_coverage``). TP ranks share block tables: one mapping of ids serves every rank.
    Ranks with nothing to send get no plan."""
    return _plan_ranks(src_layouts, dst, lambda _: src_block_ids, dst_block_ids, merge, check)


def _plan_ranks(
    src_layouts: Mapping[int, Layout],
    dst: Layout,
    ids_of: Callable[[int], GroupBlockIds],
    dst_block_ids: GroupBlockIds,
    merge: bool,
    check: bool,
) -> dict[int, TransferPlan]:
    """Each source rank's plan to ``dst`` (``ids_of(rank)``: that rank's block ids), once every
    unit of ``dst`` is known to come from exactly one of them."""
    check_coverage(src_layouts, dst)
    plans: dict[int, TransferPlan] = {}
    for rank in sorted(src_layouts):
        plan = plan_tp_pair(
            src_layouts[rank], dst, ids_of(rank), dst_block_ids, merge=merge, check=check
        )
        if plan is not None:
            plans[rank] = plan
    return plans


def plan_tp_transfers(
    src_layouts: Sequence[Layout],
    dst: Layout,
    src_block_ids: GroupBlockIds | Sequence[GroupBlockIds],
    dst_block_ids: GroupBlockIds,
    *,
    merge: bool = True,
    check: bool = True,
) -> dict[int, TransferPlan]:
    """Plans per source rank for destination rank ``dst`` (pull: D reads each plan from P).

    ``src_layouts[p]`` is source rank ``p``'s layout; ``src_block_ids`` one mapping for every
    rank (TP ranks share block tables) or one per rank. Ranks with nothing to send get no plan.
    Raises ``LayoutMismatchError`` naming the units of ``dst`` no source rank holds.
    """
    size = len(src_layouts)
    for rank, layout in enumerate(src_layouts):
        if (layout.spec.tp_rank, layout.spec.tp_size) != (rank, size):
            raise LayoutError(
                f"source layout {rank} says tp_rank {layout.spec.tp_rank} of tp_size "
                f"{layout.spec.tp_size}; give one layout per source rank, in rank order"
            )
    per_rank = [src_block_ids] * size if isinstance(src_block_ids, Mapping) else list(src_block_ids)
    if len(per_rank) != size:
        raise BlockIdError(f"{len(per_rank)} source block-id mappings for {size} source ranks")
    layouts = dict(enumerate(src_layouts))
    return _plan_ranks(layouts, dst, per_rank.__getitem__, dst_block_ids, merge, check)
