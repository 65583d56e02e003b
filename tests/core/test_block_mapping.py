"""Block-id rules: validation, placeholders, sliding windows, alignment, kernel expansion."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.core import (
    BlockIdError,
    CacheGroup,
    GroupKind,
    align_block_ids,
    clip_sliding_window,
    drop_null_blocks,
    logical_to_kernel,
    pair_block_ids,
    prepare_block_ids,
)


def ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def test_logical_to_kernel_expands_each_block_by_its_ratio():
    assert logical_to_kernel(ids(3, 7), 4).tolist() == [12, 13, 14, 15, 28, 29, 30, 31]
    assert logical_to_kernel(ids(3, 7), 1).tolist() == [3, 7]
    assert logical_to_kernel(ids(), 4).tolist() == []


def test_state_groups_drop_null_placeholders_and_never_expand():
    group = CacheGroup(1, GroupKind.STATE, 16, 10, kernel_block_size=4, null_block_id=0)
    assert group.ratio == 1
    assert prepare_block_ids(group, [0, 0, 0, 5], "D").tolist() == [5]
    assert drop_null_blocks(ids(0, 3, 0, 4), 0).tolist() == [3, 4]


def test_sliding_window_keeps_ceil_window_over_block_plus_one():
    # window 40 tokens, blocks of 16: ceil(40/16) + 1 = 4 blocks
    group = CacheGroup(0, GroupKind.SLIDING_WINDOW, 16, 20, sliding_window=40)
    assert prepare_block_ids(group, list(range(1, 11)), "P").tolist() == [7, 8, 9, 10]
    assert prepare_block_ids(group, [1, 2], "P").tolist() == [1, 2]
    assert clip_sliding_window(ids(1, 2, 3, 4, 5), 16, 16).tolist() == [4, 5]


def test_attention_ids_are_kept_as_given():
    group = CacheGroup(0, GroupKind.ATTENTION, 16, 10)
    assert prepare_block_ids(group, [0, 9, 3], "P").tolist() == [0, 9, 3]


@pytest.mark.parametrize("bad", [[10], [-1], [1, 2, 99]])
def test_out_of_range_ids_are_refused_with_the_id_and_pool(bad):
    group = CacheGroup(0, GroupKind.ATTENTION, 16, 10)
    with pytest.raises(BlockIdError, match=r"outside \[0, 10\)"):
        prepare_block_ids(group, bad, "P")


def test_repeated_or_non_integer_ids_are_refused():
    group = CacheGroup(0, GroupKind.ATTENTION, 16, 10)
    with pytest.raises(BlockIdError, match="repeat"):
        prepare_block_ids(group, [1, 2, 1], "P")
    with pytest.raises(BlockIdError, match="not integers"):
        prepare_block_ids(group, ["a"], "P")


def test_alignment_takes_the_source_tail_or_fails_clearly():
    assert align_block_ids(ids(1, 2, 3, 4), ids(8, 9), 0).tolist() == [3, 4]
    assert align_block_ids(ids(1, 2), ids(8, 9), 0).tolist() == [1, 2]
    with pytest.raises(BlockIdError, match="source has 1 blocks but the destination asks for 2"):
        align_block_ids(ids(1), ids(8, 9), 0)


def test_sliding_window_source_with_fewer_blocks_is_refused_before_clipping():
    # P [1,2,3], D [4,5,6,7], window 4, block 4: clipping first would give D block 7 P's
    # tokens 8-11 (block 3) for its tokens 12-15.
    group = CacheGroup(0, GroupKind.SLIDING_WINDOW, 4, 10, sliding_window=4)
    with pytest.raises(BlockIdError, match="source has 3 blocks but the destination asks for 4"):
        pair_block_ids(group, group, [1, 2, 3], [4, 5, 6, 7])
    s, d = pair_block_ids(group, group, [1, 2, 3, 8, 9], [4, 5, 6, 7])
    assert (s.tolist(), d.tolist()) == ([8, 9], [6, 7])


def test_state_groups_must_name_as_many_slots_on_both_sides():
    group = CacheGroup(1, GroupKind.STATE, 16, 10, null_block_id=0)
    with pytest.raises(BlockIdError, match=r"2 state slot.*destination 1"):
        pair_block_ids(group, group, [0, 3, 4], [0, 0, 5])
    s, d = pair_block_ids(group, group, [0, 0, 3], [0, 5])
    assert (s.tolist(), d.tolist()) == ([3], [5])
