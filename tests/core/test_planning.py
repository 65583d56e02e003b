"""Transfer planning: exact bytes against the slow reference, and the minimum descriptor count."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.core import (
    BlockIdError,
    CacheGroup,
    CacheTensor,
    GroupKind,
    KVLayout,
    Layout,
    LayoutMismatchError,
    LayoutSpec,
    PlanError,
    TransferOp,
    merge_descriptors,
    plan_transfers,
)

from .layouts import (
    Arena,
    apply_plan,
    attention_tensor,
    hybrid_layout,
    interleaved_tensors,
    mla_tensor,
)
from .reference import minimum_descriptor_count, reference_copy, reference_descriptors


def check_plan(p_arena, p, d_arena, d, p_ids, d_ids, seed=0):
    """Plan, apply to random memory, compare every byte of D with the reference; return plan."""
    rng = np.random.default_rng(seed)
    src = p_arena.materialise(rng)
    dst = d_arena.materialise(rng)
    expected = dst.copy()
    reference = reference_descriptors(p, d, p_ids, d_ids)
    reference_copy(reference, src, expected)
    plan = plan_transfers(p, d, p_ids, d_ids)
    apply_plan(src, dst, plan.src, plan.dst, plan.lengths)
    np.testing.assert_array_equal(dst, expected)
    assert plan.nbytes == sum(n for _, _, n in reference)
    assert plan.count == minimum_descriptor_count(reference)
    return plan


def test_hybrid_with_null_placeholders_on_both_sides_moves_only_the_last_state_slot():
    pa, da = Arena(), Arena(next=1 << 20)
    p, d = hybrid_layout(pa), hybrid_layout(da)
    p_ids = {0: [3, 4, 9], 1: [0, 0, 7]}
    d_ids = {0: [5, 6, 2], 1: [0, 0, 11]}
    plan = check_plan(pa, p, da, d, p_ids, d_ids)
    state = next(g for g in plan.groups if g.kind is GroupKind.STATE)
    assert state.blocks == 1
    # 3 GDN layers x (conv 48 + ssm 200) bytes for one slot
    assert state.nbytes == 3 * (48 + 200)
    # conv and ssm sit next to each other in a slot: one descriptor per layer after merging;
    # attention: blocks 3,4 -> 5,6 form a run, 9 -> 2 another, K|V merge, for 2 layers
    assert plan.count == 3 + 2 * 2


def test_region_order_differs_from_group_order():
    pa, da = Arena(), Arena(next=1 << 20)
    p = hybrid_layout(pa)
    d = hybrid_layout(da, reverse_tensors=True)
    assert [r.key for r in p.regions] != [r.key for r in d.regions]
    check_plan(pa, p, da, d, {0: [1, 2], 1: [0, 4]}, {0: [8, 9], 1: [0, 3]})


@pytest.mark.parametrize("kv_layout", list(KVLayout))
def test_kernel_ratio_four_on_attention_leaves_state_untouched(kv_layout):
    pa, da = Arena(), Arena(next=1 << 20)
    p = hybrid_layout(pa, kernel_block_size=4, kv_layout=kv_layout)
    d = hybrid_layout(da, kernel_block_size=4, kv_layout=kv_layout)
    assert p.groups[0].ratio == 4 and p.groups[1].ratio == 1
    plan = check_plan(pa, p, da, d, {0: [2, 5], 1: [0, 6]}, {0: [7, 3], 1: [0, 9]})
    attention = plan.groups[0]
    # each logical block is 4 kernel pages, each page a K and a V descriptor (or one, whole)
    assert attention.descriptors == 2 * 2 * 4 * (1 if kv_layout is KVLayout.WHOLE else 2)
    # every kernel page moves block_bytes/ratio, so the group moves exactly its blocks' bytes
    assert attention.nbytes == 2 * 2 * 2 * (16 * 8)


@pytest.mark.parametrize(
    ("p_kernel", "d_kernel", "p_layout", "d_layout"),
    [
        (4, 8, KVLayout.BLOCKS_FIRST, KVLayout.BLOCKS_FIRST),
        (16, 2, KVLayout.BLOCKS_FIRST, KVLayout.K_FIRST),
        (8, 4, KVLayout.K_FIRST, KVLayout.K_FIRST),
    ],
)
def test_p_and_d_with_different_kernel_ratios(p_kernel, d_kernel, p_layout, d_layout):
    pa, da = Arena(), Arena(next=1 << 20)
    p = hybrid_layout(pa, kernel_block_size=p_kernel, kv_layout=p_layout)
    d = hybrid_layout(da, kernel_block_size=d_kernel, kv_layout=d_layout)
    check_plan(pa, p, da, d, {0: [1, 2, 3, 9], 1: [0, 0, 0, 4]}, {0: [4, 5, 6, 7], 1: [0, 0, 0, 8]})


def test_contiguous_blocks_in_blocks_first_layout_merge_to_one_descriptor_per_tensor():
    pa, da = Arena(), Arena(next=1 << 20)
    p, d = hybrid_layout(pa, kernel_block_size=4), hybrid_layout(da, kernel_block_size=4)
    plan = check_plan(pa, p, da, d, {0: [3, 4, 5, 6]}, {0: [8, 9, 10, 11]})
    assert plan.unmerged == 2 * 4 * 4 * 2
    assert plan.count == 2


@pytest.mark.parametrize(
    ("p_ids", "d_ids", "runs"),
    [
        # blocks 5-6 come before 1-2 and 7 in the request: 5-6 and 7 meet only once sorted
        ([5, 6, 1, 2, 7], [10, 11, 20, 21, 12], 2),
        # the reverse order of one run: every block meets the next once sorted
        ([4, 3, 2, 1], [9, 8, 7, 6], 1),
        # sorted, they meet on P's side only: no join
        ([3, 1, 2], [5, 10, 11], 2),
        # one run on both sides (the planner's one-run path), one block, no block
        ([3, 4, 5, 6], [8, 9, 10, 11], 1),
        ([7], [2], 1),
        ([], [], 0),
    ],
)
def test_runs_that_meet_once_sorted_are_joined_in_every_region(p_ids, d_ids, runs):
    pa, da = Arena(), Arena(next=1 << 20)
    p = hybrid_layout(pa, num_blocks=24, kernel_block_size=4)
    d = hybrid_layout(da, num_blocks=24, kernel_block_size=4)
    plan = check_plan(pa, p, da, d, {0: p_ids}, {0: d_ids})
    assert plan.count == runs * 2  # one descriptor per run in each of the 2 attention tensors
    assert bool(np.all(plan.src[1:] > plan.src[:-1]))  # the merged form: sorted by source
    # the same as merging every unmerged descriptor
    unmerged = plan_transfers(p, d, {0: p_ids}, {0: d_ids}, merge=False)
    merged = merge_descriptors(unmerged.src, unmerged.dst, unmerged.lengths)
    for mine, theirs in zip((plan.src, plan.dst, plan.lengths), merged, strict=True):
        assert mine.tolist() == theirs.tolist()


def test_mla_moves_one_whole_region_per_layer():
    pa, da = Arena(), Arena(next=1 << 20)

    def layout(arena: Arena) -> Layout:
        group = CacheGroup(0, GroupKind.MLA, 16, 8, kernel_block_size=8)
        return Layout(
            LayoutSpec([group], [mla_tensor(arena, f"l{i}", group, 12) for i in range(3)])
        )

    p, d = layout(pa), layout(da)
    plan = check_plan(pa, p, da, d, {0: [1, 5]}, {0: [2, 7]})
    assert plan.groups[0].regions == 3
    assert plan.count == 3 * 2


def test_sliding_window_is_clipped_on_both_sides():
    def layout(arena: Arena) -> Layout:
        groups = [
            CacheGroup(0, GroupKind.ATTENTION, 8, 16),
            CacheGroup(1, GroupKind.SLIDING_WINDOW, 8, 16, sliding_window=12),
        ]
        tensors = [
            attention_tensor(arena, "full", groups[0], 4),
            attention_tensor(arena, "local", groups[1], 4),
        ]
        return Layout(LayoutSpec(groups, tensors))

    pa, da = Arena(), Arena(next=1 << 20)
    p, d = layout(pa), layout(da)
    # ceil(12/8)+1 = 3 blocks kept of 6 on P and of 5 on D
    plan = check_plan(
        pa,
        p,
        da,
        d,
        {0: [1, 2, 3, 4, 5, 6], 1: [1, 2, 3, 4, 5, 6]},
        {0: [9, 10, 11, 12, 13, 14], 1: [0, 10, 11, 12, 13]},
    )
    assert plan.groups[1].blocks == 3


def test_d_with_a_prefix_hit_takes_p_tail():
    pa, da = Arena(), Arena(next=1 << 20)
    p, d = hybrid_layout(pa), hybrid_layout(da)
    check_plan(pa, p, da, d, {0: [1, 2, 3, 4], 1: [0, 0, 0, 9]}, {0: [12, 13], 1: [0, 14]})


def test_p_with_fewer_blocks_than_d_needs_fails_clearly():
    p, d = hybrid_layout(Arena()), hybrid_layout(Arena(next=1 << 20))
    with pytest.raises(BlockIdError, match="source has 1 blocks"):
        plan_transfers(p, d, {0: [1]}, {0: [2, 3]})


def test_group_on_one_side_only_and_unknown_groups_are_refused():
    p, d = hybrid_layout(Arena()), hybrid_layout(Arena(next=1 << 20))
    with pytest.raises(BlockIdError, match="one side only"):
        plan_transfers(p, d, {0: [1], 1: [2]}, {0: [1]})
    with pytest.raises(BlockIdError, match="lacks"):
        plan_transfers(p, d, {5: [1]}, {5: [1]})


def test_out_of_range_block_id_is_refused():
    p, d = hybrid_layout(Arena()), hybrid_layout(Arena(next=1 << 20), num_blocks=4)
    with pytest.raises(
        BlockIdError, match=r"destination block id 4 of group 0 is outside \[0, 4\)"
    ):
        plan_transfers(p, d, {0: [1]}, {0: [4]})


def test_negative_and_repeated_ids_are_refused_in_short_and_long_lists():
    """A negative id is outside the pool (one unsigned comparison finds both ends); a repeat
    is found by a set in a short list, by a sort in a long one."""
    p, d = (
        hybrid_layout(Arena(), num_blocks=200),
        hybrid_layout(Arena(next=1 << 20), num_blocks=200),
    )
    with pytest.raises(BlockIdError, match=r"source block id -1 of group 0 is outside"):
        plan_transfers(p, d, {0: [3, -1]}, {0: [1, 2]})
    for count in (5, 150):
        ids = [*range(count), count // 2]
        with pytest.raises(BlockIdError, match=f"repeat id {count // 2}"):
            plan_transfers(p, d, {0: ids}, {0: list(range(count + 1))})


def test_incompatible_layouts_are_refused_before_planning():
    p = hybrid_layout(Arena())
    d = hybrid_layout(Arena(next=1 << 20), gdn_layers=2)
    with pytest.raises(LayoutMismatchError, match="only on source"):
        plan_transfers(p, d, {0: [1]}, {0: [1]})


def test_overlapping_destinations_are_refused():
    # Two groups whose tensors share one pool, given the same block id, would overwrite each other.
    pool = Arena().allocate(0)
    groups = [CacheGroup(0, GroupKind.ATTENTION, 4, 8), CacheGroup(1, GroupKind.STATE, 4, 8)]
    tensors = [
        CacheTensor("attn", 0, pool, 64, 32, alloc_addr=pool, alloc_size=512),
        CacheTensor("gdn", 1, pool, 64, 64, alloc_addr=pool, alloc_size=512),
    ]
    layout = Layout(LayoutSpec(groups, tensors))
    with pytest.raises(PlanError, match="overlap"):
        plan_transfers(layout, layout, {0: [2], 1: [3]}, {0: [2], 1: [2]})


def test_local_remote_follows_who_submits():
    pa, da = Arena(), Arena(next=1 << 20)
    plan = plan_transfers(hybrid_layout(pa), hybrid_layout(da), {0: [1]}, {0: [2]})
    local, remote, _ = plan.local_remote(TransferOp.READ)
    assert local is plan.dst and remote is plan.src  # D pulls
    local, remote, _ = plan.local_remote(TransferOp.WRITE)
    assert local is plan.src and remote is plan.dst  # P pushes


def test_empty_request_plans_nothing():
    p, d = hybrid_layout(Arena()), hybrid_layout(Arena(next=1 << 20))
    plan = plan_transfers(p, d, {}, {})
    assert plan.count == 0 and plan.nbytes == 0
    plan = plan_transfers(p, d, {0: [], 1: [0, 0]}, {0: [], 1: [0]})
    assert plan.count == 0


def test_merge_descriptors_finds_runs_in_any_order():
    src = np.array([300, 0, 100, 200, 500], dtype=np.uint64)
    dst = np.array([1300, 1000, 1100, 1200, 9000], dtype=np.uint64)
    lengths = np.array([100, 100, 100, 100, 100], dtype=np.uint64)
    s, d, n = merge_descriptors(src, dst, lengths)
    assert s.tolist() == [0, 500] and d.tolist() == [1000, 9000] and n.tolist() == [400, 100]
    # adjacent on one side only: no merge
    s, d, n = merge_descriptors(
        np.array([0, 100], dtype=np.uint64),
        np.array([0, 500], dtype=np.uint64),
        np.array([100, 100], dtype=np.uint64),
    )
    assert len(s) == 2


@pytest.mark.parametrize("kernel", [8, 4])
@pytest.mark.parametrize("seed", range(6))
def test_hybrid_with_storage_shared_across_groups_matches_reference(seed, kernel):
    # As vLLM lays out a hybrid model: layer i of every group shares one tensor, and the groups
    # draw their block ids from one pool, so pages of different groups sit side by side.
    from kvbridge.workloads.layouts import fragmented_pool
    from kvbridge.workloads.shapes import ModelShape, layout_spec

    shape = ModelShape(
        name="small-hybrid",
        source="test",
        num_layers=8,
        num_kv_heads=1,
        head_dim=8,
        full_attention_interval=4,
        linear_num_key_heads=1,
        linear_num_value_heads=1,
        linear_key_head_dim=4,
        linear_value_head_dim=4,
        linear_conv_kernel_dim=2,
    )
    pa, da = Arena(), Arena(next=1 << 20)
    p = Layout(layout_spec(shape, 40, pa.allocate, block_size=8, kernel_block_size=kernel))
    d = Layout(layout_spec(shape, 40, da.allocate, block_size=8, kernel_block_size=kernel))
    rng = np.random.default_rng(seed)
    p_ids, d_ids = {}, {}
    for layout, ids in ((p, p_ids), (d, d_ids)):
        pool = fragmented_pool(40, rng, max_run=4)
        for index, group in sorted(layout.groups.items()):
            if group.kind is GroupKind.STATE:
                ids[index] = [0, 0, pool.pop()]
            else:
                ids[index] = [pool.pop() for _ in range(3)]
    check_plan(pa, p, da, d, p_ids, d_ids, seed=seed)


@pytest.mark.parametrize("kv", [KVLayout.WHOLE, KVLayout.BLOCKS_FIRST])
def test_block_outermost_layers_move_as_one_descriptor_per_run(kv):
    # vLLM's BLHNC: a block holds every layer's page; a run of blocks is one descriptor.
    pa, da = Arena(), Arena(next=1 << 20)
    layouts = []
    for arena in (pa, da):
        group = CacheGroup(0, GroupKind.ATTENTION, 4, 16)
        names = [f"l{i}" for i in range(5)]
        tensors = interleaved_tensors(arena, names, group, 8, kv)
        layouts.append(Layout(LayoutSpec([group], tensors)))
    p, d = layouts
    plan = check_plan(pa, p, da, d, {0: [3, 4, 5, 9, 1]}, {0: [6, 7, 8, 2, 12]})
    assert plan.count == 3  # runs 3-5 → 6-8, 9 → 2, 1 → 12
    assert plan.unmerged == 5 * 5 * (1 if kv is KVLayout.WHOLE else 2)


def test_a_peer_layout_built_again_is_planned_from_its_own_regions():
    # The planner keeps per-peer templates; a new peer layout (a restarted prefill, possibly at
    # the same object id) must never be planned with the template of the old one.
    da = Arena(next=1 << 20)
    d = hybrid_layout(da)
    for shift in (0, 4096, 8192):
        pa = Arena(next=4096 + shift)
        p = hybrid_layout(pa, reverse_tensors=bool(shift % 8192))
        check_plan(pa, p, da, d, {0: [1, 2], 1: [0, 4]}, {0: [8, 9], 1: [0, 3]})
        del p
    assert len(d.group_regions[0].memo) <= 1  # templates of gone peers are dropped
