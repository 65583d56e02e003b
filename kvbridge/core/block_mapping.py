"""Block ids: validation, STATE placeholders, sliding-window clipping, alignment, kernels."""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from kvbridge.core.errors import BlockIdError
from kvbridge.core.groups import CacheGroup, GroupKind

IdArray = npt.NDArray[np.int64]


def as_block_ids(ids: object, group: CacheGroup, side: str) -> IdArray:
    """Block ids as an int64 array, checked against the group's pool and for repeats."""
    try:
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    except (TypeError, ValueError, OverflowError) as err:
        raise BlockIdError(
            f"{side} block ids of group {group.index} are not integers: {err}"
        ) from None
    if arr.size:
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


def prepare_block_ids(group: CacheGroup, ids: object, side: str) -> IdArray:
    """Validate one side's logical block ids and apply the group kind's rule."""
    arr = as_block_ids(ids, group, side)
    if group.kind is GroupKind.STATE:
        arr = drop_null_blocks(arr, group.null_block_id)
    elif group.kind is GroupKind.SLIDING_WINDOW:
        arr = clip_sliding_window(arr, group.sliding_window or 0, group.block_size)
    if arr.size > 1:
        ordered = np.sort(arr)  # several times faster than np.unique on these sizes
        repeats = ordered[1:][ordered[1:] == ordered[:-1]]
        if repeats.size:
            raise BlockIdError(
                f"{side} block ids of group {group.index} repeat id {int(repeats[0])}: "
                f"{arr.tolist()[:32]}"
            )
    return arr


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
    d = prepare_block_ids(dst_group, dst_ids, "destination")
    if src_group.kind is GroupKind.STATE:
        s = prepare_block_ids(src_group, src_ids, "source")
        if s.size != d.size:
            raise BlockIdError(
                f"group {index} (state): the source names {s.size} state slot(s) and the "
                f"destination {d.size}; each slot is one whole recurrent state, so both sides "
                "must name the same slots (check both engines' Mamba cache mode)"
            )
        return s, d
    if src_group.kind is GroupKind.SLIDING_WINDOW:
        s_all = as_block_ids(src_ids, src_group, "source")
        d_all = as_block_ids(dst_ids, dst_group, "destination")
        if s_all.size < d_all.size:
            raise BlockIdError(
                f"group {index} (sliding window): the source has {s_all.size} blocks but the "
                f"destination asks for {d_all.size}; the prefill side did not compute enough "
                "tokens for this request"
            )
    s = prepare_block_ids(src_group, src_ids, "source")
    return align_block_ids(s, d, index), d


def logical_to_kernel(ids: IdArray, ratio: int) -> IdArray:
    """Kernel block ids of logical blocks: ``b`` becomes ``b*ratio ... b*ratio+ratio-1``."""
    if ratio == 1:
        return ids
    expanded: IdArray = ids[:, None] * ratio + np.arange(ratio, dtype=np.int64)[None, :]
    return expanded.reshape(-1)
