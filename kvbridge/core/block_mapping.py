"""Block ids: validation, STATE placeholders, sliding-window clipping, alignment, kernels.

The one owner of block ids: their types (``IdArray``, ``GroupBlockIds``), the rules of each
group kind (range, repeats, null placeholders, sliding window, per-group counts) and the checked
value (``CheckedBlockIds``) that carries ids checked once on to the planner.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvbridge.core.errors import BlockIdError
from kvbridge.core.groups import CacheGroup, GroupKind

#: Block ids (and the addresses computed from them before they become uint64), as an array.
IdArray = npt.NDArray[np.int64]
#: Block ids per cache group index, the one name for them everywhere: logical ids of each group
#: as plain ints or an array (the control plane's messages carry them as ``dict[int, list[int]]``,
#: ``kvbridge.control.messages.BlockIds``, their bounded wire form).
GroupBlockIds = Mapping[int, Sequence[int] | IdArray]


#: Up to this many ids Python's own loops check them faster than numpy calls (a microsecond
#: or two each, whatever their size): the range by ``min``/``max``, repeats by a set.
_SMALL_IDS = 64


def as_block_ids(ids: object, group: CacheGroup, side: str) -> IdArray:
    """Block ids as an int64 array, checked against the group's pool and for repeats."""
    try:
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    except (TypeError, ValueError, OverflowError) as err:
        raise BlockIdError(
            f"{side} block ids of group {group.index} are not integers: {err}"
        ) from None
    if arr.size <= _SMALL_IDS:  # numpy's fixed cost per call outweighs a loop this short
        listed = arr.tolist()
        outside = bool(listed) and (min(listed) < 0 or max(listed) >= group.num_blocks)
    else:  # one comparison finds both ends: a negative id read as unsigned is past any pool
        outside = bool(np.count_nonzero(arr.view(np.uint64) >= group.num_blocks))
    if outside:
        bad = np.flatnonzero((arr < 0) | (arr >= group.num_blocks))
        if bad.size:
            raise BlockIdError(
                f"{side} block id {int(arr[bad[0]])} of group {group.index} is outside "
                f"[0, {group.num_blocks}): the id does not belong to this layout's block pool"
            )
    return arr


def drop_null_blocks(ids: IdArray, null_block_id: int) -> IdArray:
    """Remove the placeholder ids a STATE group holds for slots it does not own."""
    kept: IdArray = ids[ids != null_block_id]
    return kept


def sliding_window_blocks(window: int, block_size: int) -> int:
    """Blocks a sliding-window group keeps: the window may straddle one extra block."""
    return math.ceil(window / block_size) + 1


def clip_sliding_window(ids: IdArray, window: int, block_size: int) -> IdArray:
    """Keep only the last blocks a sliding-window layer can still attend to."""
    keep = sliding_window_blocks(window, block_size)
    return ids[-keep:] if ids.size > keep else ids


def held_block_ids(
    kind: GroupKind, ids: Iterable[int], null_block_id: int, scratch_slots: int = 0
) -> list[int]:
    """The ids of an engine's block list for one group that hold the request's cache.

    The engine's placeholders (``null_block_id``, which the engine names: blocks a sliding
    window dropped, state slots not held) go; a ``STATE`` group keeps only its running slot:
    an engine may append ``scratch_slots`` speculative slots after it and hold superseded states
    before it.
    """
    kept = [int(b) for b in ids if int(b) != null_block_id]
    if kind is GroupKind.STATE and kept:
        scratch = min(scratch_slots, len(kept) - 1)
        kept = kept[: len(kept) - scratch][-1:]
    return kept


def tail_block_ids(ids: Sequence[int], count: int) -> list[int]:
    """The last ``count`` ids (none for 0): a destination's sliding-window blocks that pair with
    a source whose list the window already cut to ``count`` blocks."""
    return list(ids[len(ids) - count :]) if count else []


@dataclass(frozen=True)
class CheckedGroupIds:
    """One group's block ids checked against ``group`` (arrays nobody changes).

    ``given``: the ids as given, each inside the group's pool (the pairing rules compare their
    counts); ``kept``: those the group kind's rule keeps (``STATE``: null placeholders dropped;
    ``SLIDING_WINDOW``: the window's tail), none repeated.
    """

    group: CacheGroup
    given: IdArray
    kept: IdArray


def _repeats(ids: IdArray) -> bool:
    """Whether an id occurs twice."""
    if ids.size <= _SMALL_IDS:
        return len(set(ids.tolist())) < ids.size
    ordered = np.sort(ids)  # several times faster than np.unique on these sizes
    return bool(np.count_nonzero(ordered[1:] == ordered[:-1]))


def _kept(group: CacheGroup, given: IdArray, side: str) -> CheckedGroupIds:
    """Apply the group kind's rule to ids already inside the pool, and refuse repeats."""
    arr = given
    if group.kind is GroupKind.STATE:
        arr = drop_null_blocks(arr, group.null_block_id)
    elif group.kind is GroupKind.SLIDING_WINDOW:
        arr = clip_sliding_window(arr, group.sliding_window or 0, group.block_size)
    if arr.size > 1 and _repeats(arr):
        ordered = np.sort(arr)
        repeated = int(ordered[1:][ordered[1:] == ordered[:-1]][0])
        raise BlockIdError(
            f"{side} block ids of group {group.index} repeat id {repeated}: {arr.tolist()[:32]}"
        )
    return CheckedGroupIds(group, given, arr)


def _given(group: CacheGroup, ids: object, side: str) -> IdArray:
    """The ids as given, inside the pool: from a check against this group when there is one."""
    if isinstance(ids, CheckedGroupIds):
        if ids.group == group:
            return ids.given
        ids = ids.given
    return as_block_ids(ids, group, side)


def check_group_ids(group: CacheGroup, ids: object, side: str) -> CheckedGroupIds:
    """One side's logical block ids of ``group``, checked once: range, rule, repeats.

    Ids checked against an equal group already (a ``CheckedGroupIds``) are not checked again.
    """
    if isinstance(ids, CheckedGroupIds) and ids.group == group:
        return ids
    return _kept(group, _given(group, ids, side), side)


def prepare_block_ids(group: CacheGroup, ids: object, side: str) -> IdArray:
    """Validate one side's logical block ids and apply the group kind's rule."""
    return check_group_ids(group, ids, side).kept


class CheckedBlockIds(dict[int, list[int]]):
    """Block ids per group checked against a layout's groups (``check_group_ids`` per group;
    the control plane's ``checked_ids`` builds them).

    As a mapping it holds each group's ids as given, as plain ints (what messages carry);
    ``checked`` holds the checked arrays, which travel on to the planner so that it does not
    check them again. ``first_token``: the request's token at which a destination's ids start
    (the tokens it held already), which groups of different block sizes pair by
    (``plan_transfers``); ``None`` when not said. Do not change it: build another.
    """

    __slots__ = ("checked", "first_token")

    def __init__(self, first_token: int | None = None) -> None:
        super().__init__()
        self.checked: dict[int, CheckedGroupIds] = {}
        self.first_token = first_token

    def add(self, index: int, ids: CheckedGroupIds) -> None:
        self[index] = ids.given.tolist()
        self.checked[index] = ids

    def only(self, indices: Iterable[int]) -> CheckedBlockIds:
        """The same checked ids for the groups ``indices`` alone."""
        out = CheckedBlockIds(self.first_token)
        for index in indices:
            out.add(index, self.checked[index])
        return out


def group_ids(block_ids: GroupBlockIds, index: int) -> object:
    """Group ``index``'s ids of ``block_ids``: their checked arrays when they were checked."""
    if isinstance(block_ids, CheckedBlockIds):
        return block_ids.checked[index]
    return block_ids[index]


def only_groups(block_ids: GroupBlockIds, indices: Iterable[int]) -> GroupBlockIds:
    """``block_ids`` for the groups ``indices`` alone (checked ones stay checked)."""
    if isinstance(block_ids, CheckedBlockIds):
        return block_ids.only(indices)
    return {g: block_ids[g] for g in indices}


def align_block_ids(src: IdArray, dst: IdArray, group_index: int) -> IdArray:
    """The source blocks that pair with ``dst``: the source's tail when it holds more.

    The destination may already hold a prefix (a local cache hit), so it asks only for the last
    blocks; a source with fewer blocks than asked cannot serve the request.
    """
    if src.size < dst.size:
        raise BlockIdError(
            f"group {group_index}: the source has {src.size} blocks but the destination asks "
            f"for {dst.size}; the prefill side did not compute enough tokens for this request"
        )
    return src[src.size - dst.size :]


def pair_block_ids(
    src_group: CacheGroup, dst_group: CacheGroup, src_ids: object, dst_ids: object
) -> tuple[IdArray, IdArray]:
    """Both sides' logical ids of one group, validated and paired position by position.

    The rules are checked on the lists as given, before any clipping, so that a pair whose ids
    mean different token positions (or different states) is refused instead of moved:

    * ``STATE``: after dropping null placeholders both sides must name the same number of state
      slots; a slot is a whole recurrent state, so "P's last ones" would be a different state.
    * ``SLIDING_WINDOW``: the source must hold at least as many blocks as the destination asks
      for *before* both are clipped to the window; clipping first would pair the source's last
      blocks with later token positions on the destination.
    * other paged groups: the source's tail pairs with the destination (``align_block_ids``).
    """
    index = dst_group.index
    checked_dst = check_group_ids(dst_group, dst_ids, "destination")
    d = checked_dst.kept
    if src_group.kind is GroupKind.STATE:
        s = check_group_ids(src_group, src_ids, "source").kept
        if s.size != d.size:
            raise BlockIdError(
                f"group {index} (state): the source names {s.size} state slot(s) and the "
                f"destination {d.size}; each slot is one whole recurrent state, so both sides "
                "must name the same slots (check both engines' Mamba cache mode)"
            )
        return s, d
    if src_group.kind is GroupKind.SLIDING_WINDOW:
        s_all = _given(src_group, src_ids, "source")
        d_all = checked_dst.given
        if s_all.size < d_all.size:
            raise BlockIdError(
                f"group {index} (sliding window): the source has {s_all.size} blocks but the "
                f"destination asks for {d_all.size}; the prefill side did not compute enough "
                "tokens for this request"
            )
        if not (isinstance(src_ids, CheckedGroupIds) and src_ids.group == src_group):
            src_ids = _kept(src_group, s_all, "source")
    s = check_group_ids(src_group, src_ids, "source").kept
    return align_block_ids(s, d, index), d


@dataclass(frozen=True)
class TokenSpan:
    """The tokens two block lists of different block sizes share, which move unit by unit.

    Source block list position ``i`` holds tokens ``[i*B_s, (i+1)*B_s)`` (P's list starts at
    the request's first token); destination position ``j`` holds ``[first + j*B_d, ...)``
    (``first``: the tokens D held already, its local prefix hit). Tokens ``[first, end)`` move.
    """

    first: int
    end: int


def different_block_sizes(src: CacheGroup, dst: CacheGroup) -> bool:
    """Whether a paged group's logical blocks hold different token counts on the two sides
    (then tokens pair, not blocks: ``pair_token_blocks``)."""
    return src.kind.paged and src.block_size != dst.block_size


def pair_token_blocks(
    src_group: CacheGroup,
    dst_group: CacheGroup,
    src_ids: object,
    dst_ids: object,
    dst_first_token: int | None,
) -> tuple[IdArray, IdArray, TokenSpan]:
    """Both sides' ids of a paged group whose block sizes differ, and the tokens they share.

    Blocks of different sizes cannot pair position by position, and the tail rule of equal
    sizes (D's list is P's last blocks) has no meaning in tokens: the destination must say
    which token its first block starts at (``dst_first_token``, a multiple of its block size).
    The source must reach into the destination's last block. A sliding window is refused: its
    clipped lists do not start at a token either side names.
    """
    index = dst_group.index
    bs, bd = src_group.block_size, dst_group.block_size
    sizes = f"block size: source={bs} destination={bd}"
    if src_group.kind is GroupKind.SLIDING_WINDOW:
        raise BlockIdError(
            f"group {index} (sliding window), {sizes}: a sliding window moves only between "
            "equal block sizes; configure the same --block-size on both sides"
        )
    if dst_first_token is None:
        raise BlockIdError(
            f"group {index}, {sizes}: between different block sizes the destination must say "
            "at which token its blocks start (dst_first_token: the tokens it holds already)"
        )
    if dst_first_token < 0 or dst_first_token % bd:
        raise BlockIdError(
            f"group {index}, {sizes}: the destination's first token {dst_first_token} is not "
            "at the start of one of its blocks"
        )
    s = check_group_ids(src_group, src_ids, "source").kept
    d = check_group_ids(dst_group, dst_ids, "destination").kept
    source_end, dest_end = s.size * bs, dst_first_token + d.size * bd
    if d.size and source_end <= dest_end - bd:
        raise BlockIdError(
            f"group {index}, {sizes}: the source holds tokens [0, {source_end}) but the "
            f"destination asks for [{dst_first_token}, {dest_end}); the prefill side did not "
            "compute enough tokens for this request"
        )
    end = min(source_end, dest_end) if d.size else dst_first_token
    return s, d, TokenSpan(dst_first_token, max(end, dst_first_token))


def logical_to_kernel(ids: IdArray, ratio: int) -> IdArray:
    """Kernel block ids of logical blocks: ``b`` becomes ``b*ratio ... b*ratio+ratio-1``."""
    if ratio == 1:
        return ids
    expanded: IdArray = ids[:, None] * ratio + np.arange(ratio, dtype=np.int64)[None, :]
    return expanded.reshape(-1)
