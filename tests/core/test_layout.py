"""Region expansion, registration ranges and layout validation."""

from __future__ import annotations

import pytest

from kvbridge.core import (
    CacheGroup,
    CacheTensor,
    GroupKind,
    KVLayout,
    Layout,
    LayoutError,
    LayoutSpec,
    MemoryRange,
    Part,
)

from .layouts import Arena, hybrid_layout


def _attention(kind: GroupKind = GroupKind.ATTENTION, kernel: int | None = None) -> CacheGroup:
    return CacheGroup(
        0, kind, 16, 10, kernel, sliding_window=32 if kind.value == "SLIDING_WINDOW" else None
    )


def test_blocks_first_attention_gives_k_and_v_halves_of_each_block():
    group = _attention()
    layout = Layout(LayoutSpec([group], [CacheTensor("l0", 0, 0x1000, 256, 128)]))
    k, v = layout.regions
    assert (k.part, v.part) == (Part.K, Part.V)
    assert (k.base_addr, k.stride, k.offset, k.length) == (0x1000, 256, 0, 128)
    assert (v.base_addr, v.stride, v.offset, v.length) == (0x1000, 256, 128, 128)
    assert layout.registration == [MemoryRange(0x1000, 10 * 256)]


def test_k_first_attention_gives_separate_k_and_v_bases():
    group = _attention()
    tensor = CacheTensor("l0", 0, 0x1000, 128, 128, KVLayout.K_FIRST, v_addr=0x1000 + 1280)
    k, v = Layout(LayoutSpec([group], [tensor])).regions
    assert (k.base_addr, k.offset, k.stride, k.length) == (0x1000, 0, 128, 128)
    assert (v.base_addr, v.offset, v.stride, v.length) == (0x1000 + 1280, 0, 128, 128)


def test_k_first_without_v_addr_is_rejected():
    tensor = CacheTensor("l0", 0, 0x1000, 128, 128, KVLayout.K_FIRST)
    with pytest.raises(LayoutError, match="v_addr"):
        Layout(LayoutSpec([_attention()], [tensor]))


def test_kernel_ratio_splits_each_logical_block_into_kernel_pages():
    # Logical block 16 tokens, kernel block 4 tokens: each kernel page holds K then V of 4 tokens,
    # so a region addresses kernel pages of block_bytes/ratio, never a whole logical page.
    group = _attention(kernel=4)
    k, v = Layout(LayoutSpec([group], [CacheTensor("l0", 0, 0, 256, 128)])).regions
    assert group.ratio == 4
    assert (k.stride, k.length, v.offset, v.length) == (64, 32, 32, 32)


def test_mla_and_state_are_kept_whole():
    groups = [
        CacheGroup(0, GroupKind.MLA, 16, 8, 4),
        CacheGroup(1, GroupKind.STATE, 16, 8),
    ]
    arena = Arena()
    base = arena.allocate(8 * 300)
    tensors = [
        CacheTensor("mla", 0, arena.allocate(8 * 576), 576, 576),
        CacheTensor("gdn", 1, base, 300, 100, tensor="conv", alloc_addr=base, alloc_size=2400),
        CacheTensor("gdn", 1, base + 100, 300, 200, tensor="ssm", alloc_addr=base, alloc_size=2400),
    ]
    layout = Layout(LayoutSpec(groups, tensors))
    parts = [(r.layer_name, r.tensor, r.part, r.stride, r.length) for r in layout.regions]
    assert parts == [
        ("mla", "", Part.WHOLE, 144, 144),  # MLA is paged: ratio 4 applies
        ("gdn", "conv", Part.WHOLE, 300, 100),  # STATE: ratio never applies
        ("gdn", "ssm", Part.WHOLE, 300, 200),
    ]
    assert groups[1].ratio == 1


def test_shared_backing_storage_is_registered_once():
    arena = Arena()
    layout = hybrid_layout(arena, gdn_layers=3)
    gdn_allocs = {(t.alloc_addr, t.alloc_size) for t in layout.spec.tensors if t.tensor}
    # 3 GDN layers x 2 tensors share 3 allocations; 2 attention tensors have their own.
    assert len(gdn_allocs) == 3
    assert len(layout.registration) == 3 + 2
    starts = [r.addr for r in layout.registration]
    assert starts == sorted(set(starts))


def test_overlapping_allocations_of_several_groups_merge_into_one_range():
    pool = 0x10000
    groups = [CacheGroup(0, GroupKind.ATTENTION, 16, 4), CacheGroup(1, GroupKind.STATE, 16, 4)]
    tensors = [
        CacheTensor("attn", 0, pool, 512, 256, alloc_addr=pool, alloc_size=2048),
        CacheTensor("gdn", 1, pool, 512, 400, alloc_addr=pool, alloc_size=2048),
        CacheTensor("gdn2", 1, pool + 1024, 256, 100),  # inside the pool, no allocation given
    ]
    assert Layout(LayoutSpec(groups, tensors)).registration == [MemoryRange(pool, 2048)]


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (CacheTensor("l0", 7, 0, 256, 128), "group 7"),
        (CacheTensor("l0", 0, 0, 256, 200), "do not fit"),
        (CacheTensor("l0", 0, 0, 0, 128), "positive"),
        (CacheTensor("l0", 0, 0, 256, 128, alloc_addr=0, alloc_size=100), "outside its allocation"),
        (CacheTensor("l0", 0, 0, 256, 128, alloc_addr=0), "both alloc_addr and alloc_size"),
    ],
)
def test_inconsistent_tensors_are_rejected_with_the_reason(tensor, message):
    with pytest.raises(LayoutError, match=message):
        Layout(LayoutSpec([_attention()], [tensor]))


def test_inconsistent_groups_are_rejected():
    groups = [
        CacheGroup(0, GroupKind.ATTENTION, 16, 10, kernel_block_size=5),
        CacheGroup(0, GroupKind.SLIDING_WINDOW, 16, 0),
    ]
    with pytest.raises(LayoutError) as err:
        Layout(LayoutSpec(groups, []))
    text = str(err.value)
    for needle in ("must divide", "appears twice", "num_blocks", "sliding_window"):
        assert needle in text


def test_region_defined_twice_is_rejected():
    tensor = CacheTensor("l0", 0, 0, 256, 128)
    with pytest.raises(LayoutError, match="twice"):
        Layout(LayoutSpec([_attention()], [tensor, tensor]))


def test_json_round_trip_and_clear_decode_errors():
    layout = hybrid_layout(Arena())
    again = Layout.from_json(layout.to_json())
    assert again.spec == layout.spec
    assert [r.key for r in again.regions] == [r.key for r in layout.regions]
    with pytest.raises(LayoutError, match="not valid JSON"):
        Layout.from_json(b"{")
    with pytest.raises(LayoutError, match="groups"):
        Layout.from_json(b'{"tensors": []}')
    with pytest.raises(LayoutError, match=r"Expected `int`"):
        Layout.from_json(
            b'{"groups": [{"index": "x", "kind": "STATE", "block_size": 1, "num_blocks": 1}],'
            b' "tensors": []}'
        )
