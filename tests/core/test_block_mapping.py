"""Block-id rules: validation, placeholders, sliding windows, alignment, kernel expansion."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.core import (
    BlockIdError,
    CacheGroup,
    GroupKind,
    align_block_ids,
    block_mapping,
    clip_sliding_window,
    drop_null_blocks,
    logical_to_kernel,
    pair_block_ids,
    plan_transfers,
    prepare_block_ids,
)
from kvbridge.core.block_mapping import (
    CheckedBlockIds,
    check_group_ids,
    held_block_ids,
    only_groups,
    tail_block_ids,
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


def test_held_block_ids_drop_the_engines_placeholders_and_keep_the_running_state():
    assert held_block_ids(GroupKind.ATTENTION, [0, 3, 0, 4], 0) == [3, 4]
    assert held_block_ids(GroupKind.SLIDING_WINDOW, [0, 0, 5, 6], 0) == [5, 6]
    assert held_block_ids(GroupKind.STATE, [0, 2, 3, 7, 8], 0, scratch_slots=2) == [3]
    assert held_block_ids(GroupKind.STATE, [0, 0, 5], 0, scratch_slots=2) == [5]
    assert held_block_ids(GroupKind.STATE, [0, 0], 0) == []
    assert held_block_ids(GroupKind.ATTENTION, [9, 1], 9) == [1]
    assert tail_block_ids([1, 2, 3, 4], 2) == [3, 4]
    assert tail_block_ids([1, 2], 0) == []


def test_checked_ids_carry_their_arrays_and_are_not_checked_again(monkeypatch):
    from .layouts import Arena, hybrid_layout

    p, d = hybrid_layout(Arena(next=4096)), hybrid_layout(Arena(next=1 << 20))
    src, dst = {0: [1, 2, 3], 1: [0, 4]}, {0: [8, 9], 1: [0, 3]}
    expected = plan_transfers(p, d, src, dst)
    s = check_ids(p, src, "published")
    t = check_ids(d, dst, "destination")
    assert s == {0: [1, 2, 3], 1: [0, 4]} and t == dst  # plain ints, as given
    assert s.checked[1].kept.tolist() == [4]  # the STATE rule, applied once
    assert only_groups(s, [1]).checked[1] is s.checked[1]

    def refuse(*_: object) -> None:
        raise AssertionError("checked ids checked again")

    monkeypatch.setattr(block_mapping, "as_block_ids", refuse)
    plan = plan_transfers(p, d, s, t)
    assert plan.count == expected.count and plan.src.tolist() == expected.src.tolist()
    assert plan.dst.tolist() == expected.dst.tolist()


def test_checked_ids_of_another_group_are_checked_again():
    small = CacheGroup(0, GroupKind.ATTENTION, 16, 4)
    large = CacheGroup(0, GroupKind.ATTENTION, 16, 64)
    checked = check_group_ids(large, [1, 10], "P")
    assert check_group_ids(large, checked, "P") is checked
    with pytest.raises(BlockIdError, match="outside"):
        check_group_ids(small, checked, "P")


def check_ids(layout, ids, side):
    out = CheckedBlockIds()
    for index, values in ids.items():
        out.add(index, check_group_ids(layout.groups[index], values, side))
    return out


def test_the_control_planes_checked_ids_return_what_they_checked():
    from kvbridge.control.requests import checked_ids
    from kvbridge.core.errors import MessageError

    from .layouts import Arena, hybrid_layout

    layout = hybrid_layout(Arena(next=4096))
    ids = checked_ids(layout, {"1": np.array([0, 5]), 0: (2, 3)}, "published")
    assert isinstance(ids, CheckedBlockIds) and ids == {1: [0, 5], 0: [2, 3]}
    assert type(ids[1][0]) is int and ids.checked[1].kept.tolist() == [5]
    with pytest.raises(MessageError, match="published block ids name unknown group 7"):
        checked_ids(layout, {7: [1]}, "published")
    with pytest.raises(MessageError, match="repeat id 2"):
        checked_ids(layout, {0: [2, 2]}, "destination")
